"""`kvfleet bench accuracy`: the engine's teacher-forced perplexity equals transformers' on the
same windows, and the command prints and writes the comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet_engine.bench import accuracy, accuracy_config
from kvfleet_engine.bench.perplexity import evaluation_tokens, perplexity, windows


def test_windows_score_every_token_but_the_first_once():
    for num_tokens, window, stride in [(10, 4, 2), (10, 4, 3), (9, 4, 3), (3, 8, 4), (17, 5, 1)]:
        scored = [
            p for _, end, first in windows(num_tokens, window, stride) for p in range(first, end)
        ]
        assert scored == list(range(1, num_tokens)), (num_tokens, window, stride)
        for begin, end, first in windows(num_tokens, window, stride):
            assert end - begin <= window
            assert first - begin >= min(window - stride, first)  # context of each scored token
    with pytest.raises(ValueError, match="stride"):
        list(windows(10, 4, 4))


@torch.no_grad()
def _transformers_perplexity(model: Any, token_ids: list[int], window: int, stride: int) -> float:
    total, count = 0.0, 0
    for begin, end, first in windows(len(token_ids), window, stride):
        ids = torch.tensor([token_ids[begin:end]])
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
        for position in range(first, end):
            total -= float(logprobs[position - 1 - begin, token_ids[position]])
            count += 1
    return math.exp(total / count)


@pytest.mark.parametrize("chunk", [512, 7])
def test_engine_perplexity_matches_transformers(checkpoints: Any, make_llm: Any, chunk: int):
    llm = make_llm("qwen2", dtype="float32", max_model_len=64)
    token_ids = evaluation_tokens(llm.get_tokenizer(), 150)  # byte tokenizer: 150 characters
    result = perplexity(llm, token_ids, window=64, stride=24, chunk=chunk)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoints.path("qwen2"), dtype=torch.float32)
    expected = _transformers_perplexity(model.eval(), token_ids, 64, 24)
    assert result.num_scored == 149
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks  # blocks back


def test_command_prints_table_and_writes_json(checkpoints: Any, tmp_path: Path, capsys: Any):
    path = checkpoints.path("llama3")
    argv = [
        "--config", f"base={path}:dtype=float32",
        "--config", f"again={path}:dtype=float32,block_size=8",
        "--bound", "again=0.01",
        "--device", "cpu", "--max-tokens", "96", "--window", "64", "--stride", "32",
        "--prompts", "3", "--new-tokens", "4", "--output", str(tmp_path),
    ]  # fmt: skip
    assert accuracy.main(argv) == 0
    out = capsys.readouterr().out
    assert "perplexity" in out and "again" in out and "ok 0.01%" in out
    (written,) = tmp_path.glob("*-cpu-accuracy.json")
    document = json.loads(written.read_text())
    base, again = document["results"]
    assert document["workload"]["baseline"] == "base"
    assert base["num_scored"] == again["num_scored"] == 95
    assert again["perplexity"] == pytest.approx(base["perplexity"], rel=1e-5)
    assert again["agreement"] == 1.0 and again["mean_matched_prefix"] == 4.0
    assert again["options"] == {"dtype": "float32", "block_size": 8}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nopath", "NAME=PATH"),
        ("x=/m:kv_cache_dtyp=fp8", "unknown option 'kv_cache_dtyp'"),
        ("x=/m:dtype", "not KEY=VALUE"),
    ],
)
def test_bad_config_is_rejected_with_its_problem(text: str, message: str):
    with pytest.raises(ValueError, match=message):
        accuracy_config.parse_config(text)


def test_config_options_are_typed():
    config = accuracy_config.parse_config(
        "sdpa=/models/x:attention_backend=sdpa,block_size=32,enforce_eager=true"
    )
    assert config == accuracy_config.Config(
        "sdpa", "/models/x", {"attention_backend": "sdpa", "block_size": 32, "enforce_eager": True}
    )


@pytest.mark.parametrize(
    ("flags", "message", "usage"),
    [
        (["--config", "a=/nonexistent"], "--config a: model: ", False),
        (["--config", "a={path}:block_size=abc"], "--config a: block_size takes an integer", True),
        (["--config", "a={path}:block_size=3"], "--config a: block_size", False),
        (["--config", "a={path}", "--window", "100000"], "--window (100000) must be <=", False),
        (["--config", "a={path}", "--device", "gpu"], "argument --device: expected auto", True),
        (
            ["--config", "a={path}", "--window", "16", "--stride", "8"],
            "--window (16) must be >",
            False,
        ),
    ],
)
def test_bad_config_or_flag_exits_2_before_a_model_loads(
    checkpoints: Any, monkeypatch: Any, capsys: Any, flags: list[str], message: str, usage: bool
):
    """Flag syntax errors come with argparse's usage line; what the model's files refuse is the
    error line alone."""
    import kvfleet_engine

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built before the flags were checked")

    monkeypatch.setattr(kvfleet_engine, "LLM", no_model)
    path = checkpoints.path("llama3")
    with pytest.raises(SystemExit) as exit_info:
        accuracy.main([flag.format(path=path) for flag in flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert ("usage:" in err) == usage


def test_unwritable_output_exits_2(checkpoints: Any, capsys: Any):
    with pytest.raises(SystemExit) as exit_info:
        accuracy.main(["--config", f"a={checkpoints.path('llama3')}", "--output", "/proc/x"])
    assert exit_info.value.code == 2
    assert "argument --output: cannot write to '/proc/x'" in capsys.readouterr().err
