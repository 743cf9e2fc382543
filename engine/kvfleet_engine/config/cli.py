"""`kvfleet serve`'s engine flags: one row per EngineConfig.create keyword. A flag's default is
the keyword's (given by the caller), and its value goes back to that keyword."""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvfleet_engine.argtypes import positive_float
from kvfleet_engine.config.cache import KV_CACHE_DTYPES
from kvfleet_engine.config.model import DTYPES
from kvfleet_engine.config.runner import ATTENTION_BACKENDS
from kvfleet_engine.quant.config import ALIASES as QUANTIZATION_ALIASES
from kvfleet_engine.quant.config import METHODS as QUANTIZATION_METHODS

QUANTIZATION_CHOICES = ("auto", *QUANTIZATION_METHODS, *QUANTIZATION_ALIASES)


@dataclass(frozen=True)
class Flag:
    # EngineConfig.create's keyword this flag sets.
    keyword: str
    help: str
    # argparse.add_argument's other keywords (type, choices, action); never `default`.
    options: dict[str, Any] = field(default_factory=dict)
    # The flag when it is not the keyword with dashes.
    name: str | None = None

    @property
    def flag(self) -> str:
        return self.name or "--" + self.keyword.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


_SWITCH = {"action": argparse.BooleanOptionalAction}

FLAGS = (
    Flag(
        "dtype",
        "weights/activations dtype (auto: the checkpoint's)",
        {"choices": DTYPES},
    ),
    Flag("device", "auto | cpu | cuda | cuda:N"),
    Flag("block_size", "tokens per KV block", {"type": int}),
    Flag(
        "kv_cache_blocks",
        "number of KV blocks (default: sized from free memory)",
        {"type": int},
    ),
    Flag(
        "gpu_memory_utilization",
        "fraction of GPU memory the engine may use",
        {"type": float},
    ),
    Flag("max_num_seqs", "most requests per step", {"type": int}),
    Flag(
        "max_num_batched_tokens",
        "most tokens per step (decodes + prefill chunks)",
        {"type": int},
    ),
    Flag(
        "max_model_len",
        "longest prompt + output (default: the model's)",
        {"type": int},
    ),
    Flag("enable_prefix_caching", "reuse KV of shared prompt prefixes", _SWITCH),
    Flag(
        "kv_cache_dtype",
        "KV cache element type (auto: the model's dtype; fp8: e4m3, int8: integers, each with a "
        "scale per token and kv head)",
        {"choices": KV_CACHE_DTYPES},
    ),
    Flag(
        "kv_cache_calibration",
        "fp8 cache: round K toward the queries, by this file of query moments (python -m "
        "kvfleet_engine.bench.calibrate_kv)",
    ),
    Flag(
        "attention_backend",
        "paged attention implementation",
        {"choices": ATTENTION_BACKENDS},
    ),
    Flag("seed", "seed for unseeded sampling", {"type": int}),
    Flag("enforce_eager", "never capture CUDA graphs", {"action": "store_true"}),
    Flag(
        "shared_prefix_attention",
        "decode steps read a prefix all their sequences share once per 16 sequences",
        _SWITCH,
    ),
    Flag("async_scheduling", "schedule step n+1 while the GPU computes step n", _SWITCH),
    Flag(
        "tensor_parallel_size",
        "ranks that split every layer (heads, MLP, vocabulary); one process each",
        {"type": int},
    ),
    Flag(
        "pipeline_parallel_size",
        "stages that split the layers (each of tensor-parallel-size ranks)",
        {"type": int},
    ),
    Flag("nnodes", "hosts the ranks span (one kvfleet serve each)", {"type": int}),
    Flag(
        "node_rank",
        "this host's index (0: the leader, which serves HTTP; others only compute)",
        {"type": int},
    ),
    Flag(
        "master_addr",
        "the leader's address (torch.distributed and the step channel meet there)",
    ),
    Flag(
        "master_port",
        "torch.distributed's port on the leader (the step channel uses the next one)",
        {"type": int},
    ),
    Flag(
        "parallel_join_timeout_s",
        "seconds every rank may take to reach the leader, join and load its weights "
        "(then start-up fails: the leader, or the node that cannot reach it, exits 1)",
        {"type": positive_float},
        name="--parallel-join-timeout",
    ),
    Flag(
        "quantization",
        "weight quantization (default auto: the checkpoint's quantization_config, or a "
        "GGUF file's Q8_0/Q4 blocks kept quantized on CUDA; fp8 and int8 also quantize a "
        "float checkpoint at load; gguf keeps GGUF blocks quantized on the CPU too)",
        {"choices": QUANTIZATION_CHOICES},
    ),
)


def add_engine_args(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    """The `engine` flag group; `defaults` maps each keyword to its default."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        help="Hugging Face model directory, or a GGUF file (default: the embedded "
        "SmolLM2-135M-Instruct, fetched once: `kvfleet fetch-model`)",
    )
    for flag in FLAGS:
        default = defaults[flag.keyword]
        group.add_argument(flag.flag, default=default, help=flag.help, **flag.options)


def engine_keywords(ns: argparse.Namespace) -> dict[str, Any]:
    """The parsed flags as EngineConfig.create's keywords (all but `model`)."""
    return {flag.keyword: getattr(ns, flag.dest) for flag in FLAGS}


def in_flag_words(message: str) -> str:
    """An EngineConfig error as the command line reads it: each keyword of a flag in it
    (`max_num_batched_tokens must be >= max_num_seqs (256)`) spelled as the flag
    (`--max-num-batched-tokens must be >= --max-num-seqs (256)`). Keywords of one word
    (`device`, `dtype`) only where they open the message, as the setting it names."""
    for flag in sorted(FLAGS, key=lambda f: -len(f.keyword)):
        if "_" in flag.keyword:
            message = re.sub(rf"(?<![\w-]){flag.keyword}(?!\w)", flag.flag, message)
        elif re.match(rf"{flag.keyword}\b[=: ]", message):
            message = flag.flag + message[len(flag.keyword) :]
    return message
