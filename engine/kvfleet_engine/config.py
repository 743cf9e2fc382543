"""Typed engine settings, read once at the edge (CLI flags or LLM(...) keywords), then split into
small sub-configs; each component receives only its own. No torch here."""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_float
from kvfleet_engine.loaders.gguf_metadata import find_gguf_file, gguf_eos_token_ids, gguf_hf_config
from kvfleet_engine.loaders.gguf_names import gguf_linear_types
from kvfleet_engine.models.registry import check_architecture
from kvfleet_engine.quant.config import ALIASES as QUANTIZATION_ALIASES
from kvfleet_engine.quant.config import METHODS as QUANTIZATION_METHODS
from kvfleet_engine.quant.config import (
    QuantConfig,
    resolve_gguf_quantization,
    resolve_quantization,
)

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "float": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
}
ATTENTION_BACKENDS = ("auto", "sdpa", "torch", "triton")
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class ModelConfig:
    # A Hugging Face directory (config.json, *.safetensors, tokenizer files) or a GGUF file.
    path: str
    # "safetensors" | "gguf": where the config, tokenizer and tensors come from.
    format: str
    # Hugging Face architecture name, e.g. "LlamaForCausalLM".
    architecture: str
    # Weight and activation dtype: float32 | bfloat16 | float16; "auto" only for a GGUF file
    # (quantized tensors: the runner picks float32 on the CPU, bfloat16 on a GPU).
    dtype: str
    # Longest sequence (prompt + generated tokens) the engine accepts.
    max_model_len: int
    # Token ids that end generation (config.json / generation_config.json / GGUF metadata).
    eos_token_ids: frozenset[int]
    # The model's config in config.json's keys (parsed, or built from the GGUF metadata).
    hf_config: dict[str, Any] = field(repr=False, compare=False)
    # Quantized weights: the `quantization` setting checked against the checkpoint's
    # quantization_config (None: plain weights in `dtype`).
    quantization: QuantConfig | None = None

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        quantization: str | None = None,
    ) -> ModelConfig:
        gguf_file = find_gguf_file(path)
        if gguf_file is not None:
            hf_config = gguf_hf_config(str(gguf_file))
            return cls(
                path=str(gguf_file),
                format="gguf",
                architecture=hf_config["architectures"][0],
                dtype=_resolve_dtype(dtype, None),  # "auto" stays: the runner picks by device
                max_model_len=_resolve_max_model_len(max_model_len, hf_config),
                eos_token_ids=gguf_eos_token_ids(str(gguf_file)),
                hf_config=hf_config,
                quantization=resolve_gguf_quantization(
                    quantization, gguf_linear_types(str(gguf_file)), gguf_file.name
                ),
            )
        directory = Path(path)
        config_file = directory / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"model: {path!r} is neither a model directory (no config.json) nor a GGUF file"
            )
        hf_config = json.loads(config_file.read_text())
        architectures = hf_config.get("architectures") or [None]
        check_architecture(architectures[0])
        return cls(
            path=str(directory),
            format="safetensors",
            architecture=architectures[0],
            dtype=_resolve_dtype(dtype, hf_config),
            max_model_len=_resolve_max_model_len(max_model_len, hf_config),
            eos_token_ids=_eos_token_ids(directory, hf_config),
            hf_config=hf_config,
            quantization=resolve_quantization(quantization, hf_config),
        )

    @property
    def quantization_name(self) -> str:
        """The quantization method ("none" for plain weights), as metrics label it."""
        return "none" if self.quantization is None else self.quantization.method

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_kv_heads(self) -> int:
        return int(
            self.hf_config.get("num_key_value_heads") or self.hf_config["num_attention_heads"]
        )

    @property
    def head_dim(self) -> int:
        head_dim = self.hf_config.get("head_dim")
        if head_dim:
            return int(head_dim)
        return int(self.hf_config["hidden_size"]) // int(self.hf_config["num_attention_heads"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


@dataclass(frozen=True)
class CacheConfig:
    # Tokens per KV block.
    block_size: int = 16
    # Number of KV blocks; None sizes the cache from free memory.
    num_blocks: int | None = None
    # Fraction of GPU memory the engine may use (weights + activations + KV cache).
    gpu_memory_utilization: float = 0.9
    # Reuse the KV of full blocks shared with earlier prompts.
    enable_prefix_caching: bool = True
    # KV cache element type: auto (the model's dtype) | fp8 (e4m3 values with a scale per token
    # and kv head: about twice the tokens in the same memory).
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    # Most requests computed in one step.
    max_num_seqs: int = 256
    # Most tokens computed in one step (decodes plus prefill chunks).
    max_num_batched_tokens: int = 8192
    # Schedule and launch step n+1 while the GPU computes step n: each decode's input token is
    # taken on the device from step n's samples, and the host bookkeeping of step n overlaps
    # step n+1 (a request that stops at step n costs one discarded token).
    async_scheduling: bool = True


@dataclass(frozen=True)
class RunnerConfig:
    # "auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N".
    device: str = "auto"
    # Paged attention implementation: auto (triton on cuda, sdpa on cpu) | sdpa | torch
    # (the plain reference) | triton.
    attention_backend: str = "auto"
    # Never capture CUDA graphs.
    enforce_eager: bool = False
    # Seed of the global generator (requests without their own seed).
    seed: int = 0


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks that split every layer's heads, MLP and vocabulary (one process each).
    tensor_parallel_size: int = 1
    # Stages that split the layers between them (each stage is tensor_parallel_size ranks).
    pipeline_parallel_size: int = 1
    # Hosts the ranks span; each runs `kvfleet serve` with its own node_rank (0: the leader,
    # which schedules and serves HTTP; the others only compute).
    nnodes: int = 1
    # This host's index in [0, nnodes).
    node_rank: int = 0
    # The leader's address and port: torch.distributed meets there, and the leader's step
    # channel listens on master_port + 1.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Seconds every rank may take to join and load its weights before start-up fails.
    join_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this host runs."""
        return range(
            self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node
        )


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    runner: RunnerConfig
    parallel: ParallelConfig = ParallelConfig()

    @classmethod
    def create(
        cls,
        model: str,
        *,
        dtype: str = "auto",
        device: str = "auto",
        block_size: int = 16,
        kv_cache_blocks: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        async_scheduling: bool = True,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int = 29500,
        parallel_join_timeout_s: float = 600.0,
        quantization: str | None = None,
    ) -> EngineConfig:
        """Validate the settings and read the model's config.json (the only I/O)."""
        parallel = ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            nnodes=nnodes,
            node_rank=node_rank,
            master_addr=master_addr,
            master_port=master_port,
            join_timeout_s=parallel_join_timeout_s,
        )
        _check_parallel(parallel)
        _check(
            quantization in (None, "auto", *QUANTIZATION_METHODS, *QUANTIZATION_ALIASES),
            "quantization",
            quantization,
            "auto (None: the checkpoint's) | " + " | ".join(QUANTIZATION_METHODS),
        )
        _check(
            isinstance(block_size, int)
            and 1 <= block_size <= 256
            and block_size & (block_size - 1) == 0,
            "block_size",
            block_size,
            "a power of two in [1, 256]",
        )
        _check(
            kv_cache_blocks is None or kv_cache_blocks >= 1,
            "kv_cache_blocks",
            kv_cache_blocks,
            "an integer >= 1 or None (size from memory)",
        )
        _check(
            0.0 < gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            gpu_memory_utilization,
            "in (0, 1]",
        )
        _check(max_num_seqs >= 1, "max_num_seqs", max_num_seqs, "an integer >= 1")
        _check(
            max_num_batched_tokens >= max_num_seqs,
            "max_num_batched_tokens",
            max_num_batched_tokens,
            f">= max_num_seqs ({max_num_seqs})",
        )
        _check(
            device == "auto" or device == "cpu" or device.startswith("cuda"),
            "device",
            device,
            "auto, cpu, cuda or cuda:N",
        )
        _check(
            attention_backend in ATTENTION_BACKENDS,
            "attention_backend",
            attention_backend,
            " | ".join(ATTENTION_BACKENDS),
        )
        _check(
            kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            kv_cache_dtype,
            " | ".join(KV_CACHE_DTYPES),
        )
        model_config = ModelConfig.from_pretrained(
            model, dtype=dtype, max_model_len=max_model_len, quantization=quantization
        )
        check_model_split(model_config, parallel)
        return cls(
            model=model_config,
            cache=CacheConfig(
                block_size=block_size,
                num_blocks=kv_cache_blocks,
                gpu_memory_utilization=gpu_memory_utilization,
                enable_prefix_caching=enable_prefix_caching,
                kv_cache_dtype=kv_cache_dtype,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                async_scheduling=async_scheduling,
            ),
            runner=RunnerConfig(
                device=device,
                attention_backend=attention_backend,
                enforce_eager=enforce_eager,
                seed=seed,
            ),
            parallel=parallel,
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("engine")
        group.add_argument(
            "--model", required=True, help="Hugging Face model directory, or a GGUF file"
        )
        group.add_argument(
            "--dtype",
            default="auto",
            choices=DTYPES,
            help="weights/activations dtype (auto: the checkpoint's)",
        )
        group.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        group.add_argument(
            "--kv-cache-blocks",
            type=int,
            default=None,
            help="number of KV blocks (default: sized from free memory)",
        )
        group.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=0.9,
            help="fraction of GPU memory the engine may use",
        )
        group.add_argument("--max-num-seqs", type=int, default=256, help="most requests per step")
        group.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=8192,
            help="most tokens per step (decodes + prefill chunks)",
        )
        group.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="longest prompt + output (default: the model's)",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="reuse KV of shared prompt prefixes",
        )
        group.add_argument(
            "--kv-cache-dtype",
            default="auto",
            choices=KV_CACHE_DTYPES,
            help="KV cache element type (auto: the model's dtype; fp8: e4m3 with per-token scales)",
        )
        group.add_argument(
            "--attention-backend",
            default="auto",
            choices=ATTENTION_BACKENDS,
            help="paged attention implementation",
        )
        group.add_argument("--seed", type=int, default=0, help="seed for unseeded sampling")
        group.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
        group.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="schedule step n+1 while the GPU computes step n",
        )
        group.add_argument(
            "--tensor-parallel-size",
            type=int,
            default=1,
            help="ranks that split every layer (heads, MLP, vocabulary); one process each",
        )
        group.add_argument(
            "--pipeline-parallel-size",
            type=int,
            default=1,
            help="stages that split the layers (each of tensor-parallel-size ranks)",
        )
        group.add_argument(
            "--nnodes", type=int, default=1, help="hosts the ranks span (one kvfleet serve each)"
        )
        group.add_argument(
            "--node-rank",
            type=int,
            default=0,
            help="this host's index (0: the leader, which serves HTTP; others only compute)",
        )
        group.add_argument(
            "--master-addr",
            default="127.0.0.1",
            help="the leader's address (torch.distributed and the step channel meet there)",
        )
        group.add_argument(
            "--master-port",
            type=int,
            default=29500,
            help="torch.distributed's port on the leader (the step channel uses the next one)",
        )
        group.add_argument(
            "--parallel-join-timeout",
            type=positive_float,
            default=600.0,
            help="seconds every rank may take to reach the leader, join and load its weights "
            "(then start-up fails: the leader, or the node that cannot reach it, exits 1)",
        )
        group.add_argument(
            "--quantization",
            default=None,
            choices=("auto", *QUANTIZATION_METHODS, *QUANTIZATION_ALIASES),
            help="weight quantization (default auto: the checkpoint's quantization_config, or a "
            "GGUF file's Q8_0/Q4 blocks kept quantized on CUDA; fp8 and int8 also quantize a "
            "float checkpoint at load; gguf keeps GGUF blocks quantized on the CPU too)",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineConfig:
        return cls.create(
            ns.model,
            dtype=ns.dtype,
            device=ns.device,
            block_size=ns.block_size,
            kv_cache_blocks=ns.kv_cache_blocks,
            gpu_memory_utilization=ns.gpu_memory_utilization,
            max_num_seqs=ns.max_num_seqs,
            max_num_batched_tokens=ns.max_num_batched_tokens,
            max_model_len=ns.max_model_len,
            enable_prefix_caching=ns.enable_prefix_caching,
            kv_cache_dtype=ns.kv_cache_dtype,
            attention_backend=ns.attention_backend,
            enforce_eager=ns.enforce_eager,
            async_scheduling=ns.async_scheduling,
            seed=ns.seed,
            tensor_parallel_size=ns.tensor_parallel_size,
            pipeline_parallel_size=ns.pipeline_parallel_size,
            nnodes=ns.nnodes,
            node_rank=ns.node_rank,
            master_addr=ns.master_addr,
            master_port=ns.master_port,
            parallel_join_timeout_s=ns.parallel_join_timeout,
            quantization=ns.quantization,
        )

    @classmethod
    def keyword_names(cls) -> frozenset[str]:
        """The keywords create() accepts (LLM(**kwargs) checks against them)."""
        return frozenset(inspect.signature(cls.create).parameters)


def _check_parallel(parallel: ParallelConfig) -> None:
    tp, pp, nnodes = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.nnodes
    _check(isinstance(tp, int) and tp >= 1, "tensor_parallel_size", tp, "an integer >= 1")
    _check(isinstance(pp, int) and pp >= 1, "pipeline_parallel_size", pp, "an integer >= 1")
    _check(isinstance(nnodes, int) and nnodes >= 1, "nnodes", nnodes, "an integer >= 1")
    _check(
        parallel.world_size % nnodes == 0,
        "nnodes",
        nnodes,
        f"a divisor of the world size tensor_parallel_size x pipeline_parallel_size = "
        f"{tp} x {pp} = {parallel.world_size} (every node runs as many ranks)",
    )
    _check(0 <= parallel.node_rank < nnodes, "node_rank", parallel.node_rank, f"in [0, {nnodes})")
    _check(1 <= parallel.master_port <= 65534, "master_port", parallel.master_port, "in [1, 65534]")
    timeout = parallel.join_timeout_s
    _check(
        isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout),
        "parallel_join_timeout_s",
        timeout,
        "a finite number of seconds > 0",
    )


def check_model_split(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The model's heads, MLP and layers must split evenly over the ranks."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    cfg = model.hf_config
    heads, kv_heads = int(cfg["num_attention_heads"]), model.num_kv_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={heads}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's num_key_value_heads={kv_heads}: one "
            "must divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    inner = int(cfg.get("intermediate_size") or 0)
    if inner % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's intermediate_size={inner}"
        )
    if pp > model.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is larger than the model's {model.num_layers} layers"
        )


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _resolve_dtype(dtype: str, hf_config: dict[str, Any] | None) -> str:
    """The dtype setting, with `auto` replaced by the checkpoint's dtype (hf_config None: a GGUF
    file, whose quantized tensors have none)."""
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    _check(dtype in DTYPES, "dtype", dtype, " | ".join(DTYPES))
    if dtype != "auto" or hf_config is None:
        return dtype
    saved = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return (
        _DTYPE_ALIASES.get(saved, saved) if saved in DTYPES + tuple(_DTYPE_ALIASES) else "float32"
    )


def _resolve_max_model_len(requested: int | None, hf_config: dict[str, Any]) -> int:
    limit = int(hf_config.get("max_position_embeddings") or 2048)
    window = int(hf_config.get("sliding_window") or 0)
    if window and hf_config.get("use_sliding_window", True) and window < limit:
        # We compute full attention, which equals sliding-window attention up to the window.
        log.info("capping max_model_len at the sliding window (%d tokens)", window)
        limit = window
    if requested is None:
        return limit
    _check(
        1 < requested <= limit,
        "max_model_len",
        requested,
        f"in [2, {limit}] (the model's maximum length)",
    )
    return requested


def _eos_token_ids(directory: Path, hf_config: dict[str, Any]) -> frozenset[int]:
    value = hf_config.get("eos_token_id")
    generation_file = directory / "generation_config.json"
    if generation_file.is_file():
        value = json.loads(generation_file.read_text()).get("eos_token_id", value)
    if value is None:
        return frozenset()
    return frozenset([value] if isinstance(value, int) else value)
