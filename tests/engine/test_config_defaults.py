"""Every engine setting has one default: `kvfleet serve` without the flag, LLM(...) without the
keyword and the README's settings table agree."""

import argparse
import re
from pathlib import Path

from kvfleet_engine.config import EngineConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _parsed_defaults() -> dict[str, object]:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    ns = parser.parse_args(["--model", "m"])
    return {name: value for name, value in vars(ns).items() if name != "model"}


def test_every_keyword_is_a_flag_with_the_same_default() -> None:
    defaults = EngineConfig.keyword_defaults()
    parsed = _parsed_defaults()
    # the flag's name, less the unit suffix of the one timeout
    by_keyword = {
        "parallel_join_timeout_s" if name == "parallel_join_timeout" else name: value
        for name, value in parsed.items()
    }
    assert by_keyword == defaults
    assert set(defaults) == EngineConfig.keyword_names() - {"model"}


def _readme_rows() -> dict[str, str]:
    text = README.read_text()
    table = text.split("| setting | default | meaning |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, str] = {}
    for line in table.strip().splitlines()[1:]:
        names, default = (cell.strip() for cell in line.strip("|").split("|")[:2])
        names_list = re.findall(r"`(\w+)`", names)
        values = [value.strip().strip("`") for value in default.split(",")]
        if len(values) != len(names_list):
            values = [default.strip("`")] * len(names_list)
        rows.update(zip(names_list, values, strict=True))
    return rows


def _spelled(value: object) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def test_the_readme_table_shows_the_code_defaults() -> None:
    defaults = EngineConfig.keyword_defaults()
    rows = _readme_rows()
    assert len(rows) >= 15 and set(rows) <= set(defaults), sorted(set(rows) - set(defaults))
    shown = {name: rows[name] for name in rows if defaults[name] is not None}
    assert shown == {name: _spelled(defaults[name]) for name in shown}


def test_the_crds_engine_defaults_are_the_engines() -> None:
    """spec.engine of an InferenceDeployment (what `kubectl explain` shows) defaults to what
    `kvfleet serve` does without the flag; the operator cannot import the engine, so this holds
    the two spellings together."""
    from kvfleet_operator.kinds.serving import EngineSpec

    engine = EngineConfig.keyword_defaults()
    crd = {name: f.default for name, f in EngineSpec.model_fields.items() if name in engine}
    assert set(crd) == {
        "block_size",
        "gpu_memory_utilization",
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_prefix_caching",
    }
    assert crd == {name: engine[name] for name in crd}
