"""Bad input raises an error that names the problem."""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from engine_checkpoints import Checkpoints

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.config import EngineConfig


def test_empty_prompt(make_llm: Callable[..., Any]) -> None:
    engine = make_llm("llama3").engine
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        make_llm("llama3").generate(prompts=[""], use_tqdm=False)


def test_max_tokens_below_one() -> None:
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0)


def test_prompt_longer_than_the_model_allows(make_llm: Callable[..., Any]) -> None:
    engine = make_llm("llama3", max_model_len=64).engine
    with pytest.raises(ValueError, match="prompt is too long: 64 tokens, but max_model_len is 64"):
        engine.add_request("a", [1] * 64, SamplingParams())
    engine.add_request("b", [1] * 63, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        outputs = engine.step()
    assert outputs[0].outputs[0].finish_reason == "length"
    assert len(outputs[0].outputs[0].token_ids) == 1  # the model's length limit, not max_tokens


def test_unknown_architecture(checkpoints: Checkpoints, tmp_path: Path) -> None:
    shutil.copytree(checkpoints.path("llama3"), tmp_path / "m")
    config_file = tmp_path / "m" / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unknown architecture 'GPT2LMHeadModel'.*LlamaForCausal"):
        LLM(str(tmp_path / "m"))


def test_not_a_model_directory(tmp_path: Path) -> None:
    with pytest.raises(
        ValueError, match=r"is neither a model directory \(no config.json\) nor a GGUF file"
    ):
        LLM(str(tmp_path))


def test_token_outside_the_vocabulary_and_duplicate_ids(make_llm: Callable[..., Any]) -> None:
    engine = make_llm("llama3").engine
    with pytest.raises(ValueError, match=r"contains 999, outside the vocabulary \[0, 260\)"):
        engine.add_request("a", [1, 999], SamplingParams())
    engine.add_request("a", [1], SamplingParams())
    with pytest.raises(ValueError, match="request_id 'a' is already in use"):
        engine.add_request("a", [1], SamplingParams())
    with pytest.raises(ValueError, match="n=2"):
        engine.add_request("b", [1], SamplingParams(n=2))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size=3 does not divide the model's"),
        ({"pipeline_parallel_size": 3}, "pipeline_parallel_size=3 is larger than the model.s 2"),
        ({"quantization": "int3"}, "quantization must be auto"),
        ({"block_size": 12}, "block_size must be a power of two"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens must be >="),
        ({"max_model_len": 100000}, "max_model_len must be in"),
        ({"dtype": "int4"}, "dtype must be"),
        ({"device": "tpu"}, "device must be"),
        ({"kv_cache_blocks": 3}, "the KV cache holds 3 blocks"),
    ],
)
def test_bad_engine_settings(
    checkpoints: Checkpoints, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(checkpoints.path("llama3")), **{"device": "cpu", **kwargs})


def test_unknown_llm_keyword(checkpoints: Checkpoints) -> None:
    with pytest.raises(TypeError, match=r"unknown keyword.*max_batch"):
        LLM(str(checkpoints.path("llama3")), max_batch=3)


def test_cli_flags_round_trip(checkpoints: Checkpoints) -> None:
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    ns = parser.parse_args(
        [
            "--model",
            str(checkpoints.path("llama3")),
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--max-model-len",
            "256",
            "--kv-cache-blocks",
            "40",
        ]
    )
    config = EngineConfig.from_cli_args(ns)
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.num_blocks == 40 and config.model.max_model_len == 256
    assert config.model.architecture == "LlamaForCausalLM" and config.model.dtype == "float32"
    bad = parser.parse_args(
        ["--model", str(checkpoints.path("llama3")), "--tensor-parallel-size", "3"]
    )
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):
        EngineConfig.from_cli_args(bad)
