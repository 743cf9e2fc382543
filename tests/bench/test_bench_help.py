"""The benchmarks' `--help` states what each one does in whole sentences (the first paragraph of
its docstring), not cut after the docstring's first line."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvfleet_engine.bench import accuracy, chat, quantize_smollm2


def _help(main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_bench_chat_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        "a real model answering chat prompts, kvfleet against `transformers` on the same file, "
        "device and prompts (default: the embedded SmolLM2 on the CPU)."
    ) in _help(chat.main, capsys)


def test_bench_accuracy_help(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(accuracy.main, capsys)
    assert (
        "perplexity and greedy agreement of several engine configurations (checkpoints, "
        "quantizations, KV-cache dtypes) against a baseline, all through kvfleet's engine."
    ) in text
    assert "exits 1 when a --bound" in text  # the rest of the docstring still follows


def test_quantize_smollm2_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        "SmolLM2-135M-Instruct checkpoints for the accuracy benchmark, written by the "
        "ecosystem's tools."
    ) in _help(quantize_smollm2.main, capsys)
