"""`kvfleet bench chat`: the systems take turns within every round (background load on a shared
machine hits each alike), each figure is the median over rounds and each ratio the median of the
rounds' own ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvfleet_cli.main import main
from kvfleet_engine.bench.chat import KVFLEET, TRANSFORMERS, Contestant, take_turns


def test_rounds_interleave_the_systems_and_every_call_is_timed() -> None:
    calls: list[tuple[str, int, int]] = []

    def contestant(system: str, seconds_per_token: float) -> Contestant:
        def generate(prompts: list[list[int]], num_tokens: int) -> float:
            calls.append((system, len(prompts), num_tokens))
            return seconds_per_token * num_tokens * len(prompts) ** 0.5

        return Contestant(system, generate)

    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    rates = take_turns(
        [contestant(KVFLEET, 0.01), contestant(TRANSFORMERS, 0.02)], prompts, 9, 2, "c4"
    )
    warm_up = [(KVFLEET, 1, 4), (KVFLEET, 4, 4), (TRANSFORMERS, 1, 4), (TRANSFORMERS, 4, 4)]
    one_round = [
        *[(KVFLEET, 1, 1), (KVFLEET, 1, 9), (TRANSFORMERS, 1, 1), (TRANSFORMERS, 1, 9)],
        *[(KVFLEET, 4, 9), (TRANSFORMERS, 4, 9)],
    ]
    assert calls == warm_up + one_round * 2
    # decode: 8 tokens over the 9-token answer's time beyond the 1-token one's
    assert rates[KVFLEET]["decode_tokens_per_s"] == pytest.approx([100.0, 100.0])
    assert rates[TRANSFORMERS]["decode_tokens_per_s"] == pytest.approx([50.0, 50.0])
    # concurrent: 4 x 9 tokens over 0.01 * 9 * 2 s
    assert rates[KVFLEET]["c4"] == pytest.approx([200.0, 200.0])


@pytest.mark.slow
def test_bench_chat_on_a_tiny_model_reports_medians_and_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfleet_engine.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny")
    argv = ["--model", str(model), "--concurrency", "3", "--output-len", "3", "--rounds", "3"]
    assert main(["bench", "chat", *argv, "--output", str(tmp_path)]) == 0
    [path] = tmp_path.glob("*-cpu-chat-tiny.json")
    result = json.loads(path.read_text())
    per_round = result["workload"]["per_round"]
    for system in (KVFLEET, TRANSFORMERS):
        for metric in ("decode_tokens_per_s", "c3_output_tokens_per_s"):
            assert len(per_round[system][metric]) == 3
            [row] = [r for r in result["results"] if (r["system"], r["metric"]) == (system, metric)]
            assert row["value"] == sorted(per_round[system][metric])[1]  # the median
    ratios = result["workload"]["ratios_kvfleet_over_transformers"]
    assert set(ratios) == {"decode_tokens_per_s", "c3_output_tokens_per_s"}
    assert all(ratio > 0 for ratio in ratios.values())
    out = capsys.readouterr().out
    assert "kvfleet / transformers, decode_tokens_per_s:" in out
