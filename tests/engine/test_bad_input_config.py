"""Bad LLM(...) settings and broken checkpoint files: a ValueError naming the setting, or the
file and its key, before anything runs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_checkpoints import Checkpoints

from kvfleet_engine import LLM
from kvfleet_engine.config import EngineConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"device": "cudax"}, "device must be auto, cpu, cuda or cuda:N, got 'cudax'"),
        ({"device": "cuda:-1"}, "device must be auto, cpu, cuda or cuda:N, got 'cuda:-1'"),
        ({"device": None}, "device must be auto, cpu, cuda or cuda:N, got None"),
        ({"seed": 2**70}, r"seed must be an integer in \[0, 2\*\*64 - 1\]"),
        ({"seed": -1}, "seed must be an integer in"),
        ({"seed": "x"}, "seed must be an integer in .*, got 'x'"),
        ({"kv_cache_blocks": "5"}, "kv_cache_blocks must be an integer >= 1 or None"),
        ({"kv_cache_blocks": 1.5}, "kv_cache_blocks must be an integer >= 1 or None"),
        ({"gpu_memory_utilization": "0.5"}, r"gpu_memory_utilization must be a number in \(0, 1"),
        ({"max_num_seqs": "4"}, "max_num_seqs must be an integer >= 1, got '4'"),
        ({"max_num_seqs": 2.5}, "max_num_seqs must be an integer >= 1, got 2.5"),
        ({"max_num_batched_tokens": None}, "max_num_batched_tokens must be an integer, got None"),
        ({"max_model_len": "64"}, "max_model_len must be in .*, got '64'"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False"),
        ({"async_scheduling": 1}, "async_scheduling must be True or False"),
        ({"block_size": True}, "block_size must be a power of two"),
        ({"dtype": ["float32"]}, "dtype must be"),
        ({"master_port": "x"}, r"master_port must be an integer in \[1, 65534\], got 'x'"),
        ({"master_port": 1.5}, r"master_port must be an integer in \[1, 65534\], got 1.5"),
        ({"master_addr": 5}, "master_addr must be a host name or IP, got 5"),
        ({"node_rank": "0"}, r"node_rank must be an integer in \[0, 1\), got '0'"),
        ({"node_rank": None}, r"node_rank must be an integer in \[0, 1\), got None"),
        ({"tensor_parallel_size": True}, "tensor_parallel_size must be an integer >= 1, got True"),
        ({"parallel_join_timeout_s": True}, "parallel_join_timeout_s must be a finite number"),
    ],
)
def test_settings_of_the_wrong_type_or_range(
    checkpoints: Checkpoints, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^{message}"):
        LLM(str(checkpoints.path("llama3")), **{"device": "cpu", **kwargs})


def test_model_must_be_a_path() -> None:
    with pytest.raises(ValueError, match=r"^model must be the path of a model directory"):
        LLM(None)  # type: ignore[arg-type]


def test_the_triton_backend_needs_cuda_unless_interpreted(
    checkpoints: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(checkpoints.path("llama3"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"^attention_backend 'triton' needs a CUDA device"):
        LLM(path, device="cpu", attention_backend="triton")
    # device "auto" on a machine without CUDA: refused when the device is resolved, before the
    # weights load (not a Triton error in the first forward).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"^attention_backend 'triton' needs a CUDA device \(device is 'cpu'\)"
    ):
        LLM(path, device="auto", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # test_triton_backend runs it so on the CPU
    config = EngineConfig.create(path, device="cpu", attention_backend="triton")
    assert config.runner.attention_backend == "triton"


def _edit_config(edit: Callable[[dict[str, Any]], str]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        config_file = directory / "config.json"
        config_file.write_text(edit(json.loads(config_file.read_text())))

    return apply


def _without(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda config: json.dumps({k: v for k, v in config.items() if k != key})


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_edit_config(lambda c: json.dumps([c])), "config.json must hold a JSON object, got list"),
        (_edit_config(_without("num_attention_heads")), "config.json has no 'num_attention_heads'"),
        (
            _edit_config(lambda c: json.dumps({**c, "max_position_embeddings": "abc"})),
            "config.json: 'max_position_embeddings' must be an integer >= 0, got 'abc'",
        ),
        (
            _edit_config(lambda c: json.dumps({**c, "vocab_size": None})),
            "config.json: 'vocab_size' must be an integer >= 1, got None",
        ),
        (_edit_config(lambda c: json.dumps(c)[:-3]), "config.json is not valid JSON"),
        (
            lambda d: (d / "generation_config.json").write_text("{"),
            "generation_config.json is not valid JSON",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
            "model.safetensors is not a readable safetensors file: .*header",
        ),
        (
            lambda d: (d / "model.safetensors").write_bytes(b""),
            "model.safetensors is not a readable safetensors file",
        ),
    ],
)
def test_broken_checkpoint_files_are_named(
    checkpoints: Checkpoints, tmp_path: Path, edit: Callable[[Path], None], message: str
) -> None:
    directory = tmp_path / "m"
    shutil.copytree(checkpoints.path("llama3"), directory)
    edit(directory)
    with pytest.raises(ValueError, match=f"^model: {directory}/{message}"):
        LLM(str(directory), device="cpu")
