"""The offline benchmarks' workloads: the flags both commands share, each command's own, and the
random prompts and workload record they make from them."""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import non_negative_int, positive_int, seed
from kvfleet_engine.bench.results import writable_dir
from kvfleet_engine.bench.shapes import SHAPES
from kvfleet_engine.config import KV_CACHE_DTYPES, EngineConfig
from kvfleet_engine.config.cache import is_block_size

QUANTIZATIONS = ("none", "fp8", "int8", "awq", "gptq")


def int4_group_size(shape: str) -> int:
    """128 (the usual int4 group), or the largest of 64 / 32 that divides a small shape's
    input features."""
    fields = SHAPES[shape][1]
    return next(
        group
        for group in (128, 64, 32)
        if fields["hidden_size"] % group == 0 and fields["intermediate_size"] % group == 0
    )


def _existing_file(text: str) -> str:
    if not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text!r}")
    return text


def _quantizations(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in QUANTIZATIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--quantization takes a comma-separated list of {', '.join(QUANTIZATIONS)}, "
            f"got {text!r}"
        )
    return names


def _block_size(text: str) -> int:
    size = positive_int(text)
    if not is_block_size(size):
        raise argparse.ArgumentTypeError(f"expected a power of two in [1, 256], got {size}")
    return size


def length_range(text: str) -> tuple[int, int]:
    """ "N" or "LOW:HIGH" (uniform, inclusive)."""
    try:
        low, _, high = text.partition(":")
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--input-len must be N or LOW:HIGH, got {text!r}"
        ) from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"--input-len needs 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="model shape")
    parser.add_argument(
        "--peer", choices=("none", "transformers"), default="none", help="also run this peer"
    )
    engine = EngineConfig.keyword_defaults()
    parser.add_argument("--max-num-seqs", type=positive_int, default=engine["max_num_seqs"])
    parser.add_argument(
        "--max-num-batched-tokens", type=positive_int, default=engine["max_num_batched_tokens"]
    )
    parser.add_argument("--block-size", type=_block_size, default=engine["block_size"])
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=engine["gpu_memory_utilization"]
    )
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=engine["kv_cache_dtype"],
        help="KV cache element type",
    )
    parser.add_argument(
        "--kv-cache-calibration",
        type=_existing_file,
        metavar="FILE",
        help="fp8 cache: round K toward the queries by this file (python -m "
        "kvfleet_engine.bench.calibrate_kv on a checkpoint of the shape)",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=engine["async_scheduling"],
        help="schedule step n+1 while the GPU computes step n",
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed of weights and prompts")
    parser.add_argument(
        "--quantization",
        type=_quantizations,
        default=["none"],
        help="weights, a comma-separated list run one after the other: "
        + " | ".join(QUANTIZATIONS),
    )
    parser.add_argument(
        "--host-trace",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="after the timed run, profile N more steps of the workload and print the host calls",
    )
    parser.add_argument(
        "--output-dir", type=writable_dir, default="bench/results", help="where the JSON goes"
    )


def check_engine_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, longest_input: int
) -> None:
    """The engine settings' rules that span flags, checked before a model is built."""
    limit = SHAPES[args.shape][1]["max_position_embeddings"]
    if longest_input + args.output_len > limit:
        parser.error(
            f"--input-len + --output-len must be <= {limit} (the {args.shape} shape's longest "
            f"sequence), got {longest_input} + {args.output_len}"
        )
    if args.max_num_batched_tokens < args.max_num_seqs:
        parser.error(f"--max-num-batched-tokens must be >= --max-num-seqs ({args.max_num_seqs})")
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(
            f"--gpu-memory-utilization must be in (0, 1], got {args.gpu_memory_utilization}"
        )
    if args.kv_cache_calibration and args.kv_cache_dtype != "fp8":
        parser.error("--kv-cache-calibration needs --kv-cache-dtype fp8")


def throughput_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench throughput",
        description="Offline throughput: generate for all prompts at once (greedy, ignore EOS).",
    )
    common_args(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=512)
    parser.add_argument("--input-len", type=length_range, default=(64, 512), help="N or LOW:HIGH")
    parser.add_argument("--output-len", type=positive_int, default=256)
    parser.add_argument(
        "--peer-num-prompts",
        type=positive_int,
        default=None,
        help="run the peer on the first N prompts only (default: all)",
    )
    parser.add_argument(
        "--host-trace-skip",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="--host-trace: run K steps of the workload before the N it profiles (past its "
        "prompt steps, to profile decode steps at full batch)",
    )
    args = parser.parse_args(argv)
    check_engine_flags(parser, args, longest_input=args.input_len[1])
    if args.host_trace_skip and not args.host_trace:
        parser.error("--host-trace-skip needs --host-trace N")
    return args


def throughput_workload(
    args: argparse.Namespace,
) -> tuple[list[list[int]], list[list[int]], dict[str, Any]]:
    """(prompts, the peer's prompts, the workload as the results record it)."""
    rng = random.Random(args.seed)
    vocab = SHAPES[args.shape][1]["vocab_size"]
    lens = [rng.randint(*args.input_len) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lens]
    peer_prompts = prompts[: args.peer_num_prompts or len(prompts)]
    workload: dict[str, Any] = {
        "num_prompts": args.num_prompts,
        "input_len": list(args.input_len),
        "output_len": args.output_len,
        "sampling": "greedy, ignore_eos",
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_calibration": args.kv_cache_calibration,
        "cuda_graphs": not args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "quantization": args.quantization,
    }
    if args.peer == "transformers":
        workload["peer_num_prompts"] = len(peer_prompts)
    return prompts, peer_prompts, workload


def latency_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench latency",
        description="Decode speed of a small batch (default 1 sequence; greedy, ignore EOS).",
    )
    common_args(parser)
    parser.add_argument(
        "--batch-size", type=positive_int, default=1, help="sequences decoded together"
    )
    parser.add_argument(
        "--input-len", type=positive_int, default=128, help="prompt tokens of each sequence"
    )
    parser.add_argument("--output-len", type=positive_int, default=256)
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (a decode rate needs two tokens)")
    if args.batch_size > args.max_num_seqs:
        parser.error(
            f"--batch-size ({args.batch_size}) must be <= --max-num-seqs ({args.max_num_seqs}): "
            "the batch is decoded together"
        )
    if args.peer == "transformers" and args.batch_size > 1:
        parser.error("--peer transformers decodes batch 1 only: leave --batch-size at 1")
    check_engine_flags(parser, args, longest_input=args.input_len)
    return args


def latency_workload(args: argparse.Namespace) -> tuple[list[list[int]], dict[str, Any]]:
    """(prompts, the workload as the results record it)."""
    rng = random.Random(args.seed)
    vocab = SHAPES[args.shape][1]["vocab_size"]
    prompts = [
        [rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.batch_size)
    ]
    workload: dict[str, Any] = {
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "sampling": "greedy, ignore_eos",
        "cuda_graphs": not args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_cache_calibration": args.kv_cache_calibration,
    }
    return prompts, workload
