"""`kvfleet bench throughput` (offline batch) and `kvfleet bench latency` (batch-1 decode) on a
model of a named shape with random weights, against `transformers` on the same weights and
workload (`--peer transformers`) and the roofline from ceilings measured at the start.

    kvfleet bench latency --shape llama-3.1-8b --peer transformers
    kvfleet bench throughput --shape llama-3.1-8b --num-prompts 512 --input-len 64:512 \\
        --output-len 256 --peer transformers
    kvfleet bench latency --shape llama-3.1-8b --quantization none,fp8,int8,awq,gptq

`--quantization` takes a comma-separated list, run one after the other in one process on the
same random weights: fp8 / int8 quantize the bf16 checkpoint at load; awq / gptq load a random
int4 checkpoint of the shape in that layout (group 128). Each has its own roofline, which
counts the packed bytes (fp8 / int8: 1 B per weight + a scale per channel; int4: 0.5 B + a
float16 scale and offset per group).
"""

from __future__ import annotations

import argparse
import gc
import logging
import random
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int
from kvfleet_engine.bench.shapes import SHAPES

log = logging.getLogger(__name__)

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


def _quantizations(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in QUANTIZATIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--quantization takes a comma-separated list of {', '.join(QUANTIZATIONS)}, "
            f"got {text!r}"
        )
    return names


def _input_len(text: str) -> tuple[int, int]:
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


def _common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES), help="model shape")
    parser.add_argument(
        "--peer", choices=("none", "transformers"), default="none", help="also run this peer"
    )
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "fp8"), default="auto", help="KV cache element type"
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule step n+1 while the GPU computes step n",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    parser.add_argument(
        "--quantization",
        type=_quantizations,
        default=["none"],
        help="weights, a comma-separated list run one after the other: "
        + " | ".join(QUANTIZATIONS),
    )
    parser.add_argument(
        "--host-trace",
        type=int,
        default=0,
        metavar="N",
        help="after the timed run, profile N more steps of the workload and print the host calls",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=Path("bench/results"), help="where the JSON goes"
    )


@dataclass
class Setup:
    """What both commands share: device, ceilings, the saved random checkpoints and costs."""

    device: Any
    dtype: Any
    ceilings: Any
    costs: dict[str, Any]  # quantization -> roofline.ModelCosts
    checkpoints: dict[str, Path]  # quantization -> checkpoint directory (bf16 unless int4)
    hf_model: Any  # the transformers model on the device (the peer), until released

    def release_peer(self) -> None:
        import torch

        self.hf_model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _scratch_dir() -> Path:
    """RAM-backed if it has room (a checkpoint of an 8B shape is 16 GB)."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > 40 << 30:
        return shm
    return Path(tempfile.gettempdir())


def missing_gpu(command: str, shape: str) -> bool:
    """Real shapes need a GPU; says so (the caller exits 2)."""
    import torch

    if shape == "tiny" or torch.cuda.is_available():
        return False
    print(f"kvfleet bench {command}: --shape {shape} needs a CUDA GPU (--shape tiny runs on CPU)")
    return True


@contextmanager
def setup(args: argparse.Namespace) -> Iterator[Setup]:
    import torch

    from kvfleet_engine.bench import roofline, shapes

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print("measuring copy bandwidth and matmul rate ...", flush=True)
    ceilings = roofline.measure_ceilings(device)
    print(
        f"  copy {ceilings.bandwidth / 1e12:.2f} TB/s, "
        f"matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    print(f"building a random {args.shape} model ...", flush=True)
    torch.manual_seed(args.seed)
    model = shapes.build_random_model(args.shape, dtype, device)
    kv_bytes_per_token = shapes.kv_bytes_per_token(args.shape, dtype.itemsize)
    if args.kv_cache_dtype == "fp8":  # e4m3 codes and a 2-byte scale per head_dim of them
        head_dim = shapes.SHAPES[args.shape][1]["head_dim"]
        kv_bytes_per_token = shapes.kv_bytes_per_token(args.shape, 1) * (head_dim + 2) // head_dim
    group_size = int4_group_size(args.shape)
    costs = {
        name: roofline.ModelCosts(
            weight_bytes=shapes.weight_bytes_per_step(model, name, group_size),
            kv_bytes_per_token=kv_bytes_per_token,
            weights_per_token=shapes.matmul_weights_per_token(model),
        )
        for name in args.quantization
    }
    with tempfile.TemporaryDirectory(prefix="kvfleet-bench-", dir=_scratch_dir()) as tmp:
        start = time.perf_counter()
        checkpoints = {}
        if set(args.quantization) - {"awq", "gptq"}:
            shapes.save_checkpoint(model, Path(tmp) / "bf16")
        for name in args.quantization:
            if name in ("awq", "gptq"):
                checkpoints[name] = shapes.save_random_int4_checkpoint(
                    model, Path(tmp) / name, name, group_size, seed=args.seed
                )
            else:
                checkpoints[name] = Path(tmp) / "bf16"
        print(f"  saved to {tmp} in {time.perf_counter() - start:.0f} s", flush=True)
        yield Setup(device, dtype, ceilings, costs, checkpoints, model)


def _llm(args: argparse.Namespace, s: Setup, max_model_len: int, quantization: str) -> Any:
    from kvfleet_engine.llm import LLM

    return LLM(
        str(s.checkpoints[quantization]),
        quantization=None if quantization == "none" else quantization,
        dtype="bfloat16" if s.device.type == "cuda" else "float32",
        device=s.device.type,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def _label(source: str, quantization: str) -> str:
    """Row source of one quantization's figures: kvfleet, kvfleet-fp8, roofline-awq, ..."""
    return source if quantization == "none" else f"{source}-{quantization}"


def _free_device_memory(s: Setup) -> None:
    import torch

    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()


def _ceiling_rows(s: Setup) -> list[Any]:
    from kvfleet_engine.bench.results import Row

    return [
        Row("roofline", "copy_bandwidth", s.ceilings.bandwidth / 1e9, "GB/s"),
        Row("roofline", "matmul_rate", s.ceilings.matmul_flops / 1e12, "TFLOP/s"),
        *(
            Row(_label("roofline", name), "weight_bytes_per_step", costs.weight_bytes / 1e9, "GB")
            for name, costs in s.costs.items()
        ),
    ]


def _finish(
    args: argparse.Namespace,
    argv: list[str],
    what: str,
    s: Setup,
    workload: dict[str, Any],
    rows: list[Any],
) -> int:
    from kvfleet_engine.bench.results import format_table, gpu_name, write_results

    command = f"kvfleet bench {what} {shlex.join(argv)}"
    quantized = [name for name in args.quantization if name != "none"]
    path = write_results(
        args.output_dir,
        "-".join([what, args.shape, *quantized]),
        gpu_name(s.device),
        command,
        args.shape,
        workload,
        rows,
    )
    print(f"\n{command}\n{format_table(rows)}\nwrote {path}")
    return 0


def _try_peer(name: str, workload: dict[str, Any], run: Callable[[], list[Any]]) -> list[Any]:
    """A failing peer is reported in the results, not fatal to our own figures."""
    print(f"running {name} ...", flush=True)
    try:
        return run()
    except Exception as error:  # the peer's own bugs are not ours to crash on
        log.exception("%s failed", name)
        workload.setdefault("peer_errors", {})[name] = repr(error)
        return []


# ---- throughput ---------------------------------------------------------------------------


def throughput(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench throughput",
        description="Offline throughput: generate for all prompts at once (greedy, ignore EOS).",
    )
    _common_args(parser)
    parser.add_argument("--num-prompts", type=positive_int, default=512)
    parser.add_argument("--input-len", type=_input_len, default=(64, 512), help="N or LOW:HIGH")
    parser.add_argument("--output-len", type=positive_int, default=256)
    parser.add_argument(
        "--peer-num-prompts",
        type=positive_int,
        default=None,
        help="run the peer on the first N prompts only (default: all)",
    )
    args = parser.parse_args(argv)
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
        "cuda_graphs": not args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "quantization": args.quantization,
    }
    if args.peer == "transformers":
        workload["peer_num_prompts"] = len(peer_prompts)
    if missing_gpu("throughput", args.shape):
        return 2
    with setup(args) as s:
        from kvfleet_engine.bench import peers, roofline
        from kvfleet_engine.bench.results import Row

        rows = _ceiling_rows(s)
        if args.peer == "transformers":

            def run_peer() -> list[Any]:
                rate, _ = peers.generate_batch_throughput(s.hf_model, peer_prompts, args.output_len)
                return [Row("transformers-generate_batch", "output_tokens_per_s", rate, "tokens/s")]

            rows += _try_peer("transformers generate_batch", workload, run_peer)
        s.release_peer()
        for name in args.quantization:
            rows += _kvfleet_throughput(args, s, prompts, name)
            _free_device_memory(s)
            ideal = roofline.offline_seconds(
                s.costs[name], s.ceilings, lens, args.output_len, args.max_num_seqs
            )
            rate = args.num_prompts * args.output_len / ideal
            rows.append(Row(_label("roofline", name), "output_tokens_per_s", rate, "tokens/s"))
        return _finish(args, argv, "throughput", s, workload, rows)


def _kvfleet_throughput(
    args: argparse.Namespace, s: Setup, prompts: list[list[int]], quantization: str
) -> list[Any]:
    from kvfleet_engine.bench.host_trace import trace_steps
    from kvfleet_engine.bench.results import Row
    from kvfleet_engine.bench.step_timing import StepTimer
    from kvfleet_engine.sampling import SamplingParams

    print(f"running {_label('kvfleet', quantization)} ...", flush=True)
    max_input = max(len(p) for p in prompts)
    llm = _llm(args, s, max_input + args.output_len, quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[: min(len(prompts), 64)], sampling_params=warm)
    # Host time launching steps and waiting for their tokens (the rest is host work per step:
    # scheduling, bookkeeping, outputs), and the device's busy and idle time per kind of step.
    with StepTimer(llm.engine.model_runner) as timer:
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    device = timer.device_seconds()
    if args.host_trace:
        print("\n".join(trace_steps(llm.engine, prompts, params, args.host_trace)))
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    source = _label("kvfleet", quantization)
    rows = [
        Row(source, "output_tokens_per_s", num_out / elapsed, "tokens/s"),
        Row(source, "total_tokens_per_s", (num_in + num_out) / elapsed, "tokens/s"),
        Row(source, "elapsed_s", elapsed, "s"),
        Row(source, "engine_steps", timer.steps, "steps"),
        Row(source, "preemptions", llm.engine.stats().num_preemptions_total, "requests"),
        Row(source, "kv_cache_tokens", llm.engine.kv_cache.num_blocks * args.block_size, "tokens"),
        Row(source, "launch_s", timer.launch_s, "s"),
        Row(source, "wait_for_tokens_s", timer.wait_s, "s"),
        Row(source, "host_other_s", elapsed - timer.launch_s - timer.wait_s, "s"),
        *(
            Row(source, f"device_{name}", value, "steps" if name.endswith("steps") else "s")
            for name, value in device.items()
        ),
    ]
    return rows


# ---- latency ------------------------------------------------------------------------------


def latency(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet bench latency",
        description="Decode speed of a small batch (default 1 sequence; greedy, ignore EOS).",
    )
    _common_args(parser)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--input-len", type=positive_int, default=128)
    parser.add_argument("--output-len", type=positive_int, default=256)
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (a decode rate needs two tokens)")
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
    }
    if missing_gpu("latency", args.shape):
        return 2
    with setup(args) as s:
        from kvfleet_engine.bench import peers, roofline
        from kvfleet_engine.bench.results import Row

        rows = _ceiling_rows(s)
        if args.peer == "transformers" and args.batch_size == 1:

            def run_peer() -> list[Any]:
                rate = peers.generate_decode_rate(s.hf_model, prompts[0], args.output_len)
                return [Row("transformers-generate", "decode_tokens_per_s", rate, "tokens/s")]

            rows += _try_peer("transformers generate", workload, run_peer)
        s.release_peer()
        for name in args.quantization:
            rows += _kvfleet_latency(args, s, prompts, name)
            _free_device_memory(s)
            step = roofline.decode_step_seconds(
                s.costs[name], s.ceilings, args.batch_size, args.input_len + args.output_len / 2
            )
            source = _label("roofline", name)
            rows.append(Row(source, "decode_tokens_per_s", 1 / step, "tokens/s"))
            rows.append(Row(source, "inter_token_latency_ms", step * 1e3, "ms"))
        return _finish(args, argv, "latency", s, workload, rows)


def _kvfleet_latency(
    args: argparse.Namespace, s: Setup, prompts: list[list[int]], quantization: str
) -> list[Any]:
    """Per-sequence decode rate from the engine's step loop: the time from the first generated
    token to the last, over the tokens in between."""
    from tqdm.auto import tqdm

    from kvfleet_engine.bench.results import Row
    from kvfleet_engine.sampling import SamplingParams

    source = _label("kvfleet", quantization)
    print(f"running {source} ...", flush=True)
    llm = _llm(args, s, args.input_len + args.output_len, quantization)
    engine = llm.engine
    engine.stream_outputs = True  # an output per token (with its text), as the server streams
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    def run(tag: str) -> tuple[float, float]:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        first_token = None
        with tqdm(total=args.output_len, desc=tag, unit="tok") as bar:
            while engine.has_unfinished_requests():
                if engine.step():
                    bar.update(1)
                    if first_token is None:
                        first_token = time.perf_counter()
        assert first_token is not None
        return first_token - start, time.perf_counter() - first_token

    run("warm-up")
    # The device's own time per step (upload, graph, download) and its idle time between steps.
    from kvfleet_engine.bench.step_timing import StepTimer

    with StepTimer(engine.model_runner) as timer:
        ttft, decode = run("timed")
    device = timer.device_seconds()
    if args.host_trace:
        from kvfleet_engine.bench.host_trace import trace_steps

        lines = trace_steps(engine, prompts, params, args.host_trace, skip_steps=1)  # decode only
        print("\n".join(lines))
    rate = (args.output_len - 1) / decode
    rows = [
        Row(source, "decode_tokens_per_s", rate, "tokens/s"),
        Row(source, "inter_token_latency_ms", 1e3 / rate, "ms"),
        Row(source, "time_to_first_token_ms", ttft * 1e3, "ms"),
    ]
    if device.get("decode_steps"):
        steps = device["decode_steps"] + device["prompt_steps"]
        busy_ms = device["decode_steps_busy_s"] / device["decode_steps"] * 1e3
        rows.append(Row(source, "device_decode_step_ms", busy_ms, "ms"))
        rows.append(Row(source, "device_idle_per_step_ms", device["idle_s"] / steps * 1e3, "ms"))
    graphs = engine.model_runner.decode_graphs
    if graphs is not None:
        from kvfleet_engine.bench.roofline import back_to_back_seconds

        # the step's CUDA graph alone, replayed back to back
        graph = graphs.graphs[next(s for s in graphs.sizes if s >= args.batch_size)]
        replay_ms = back_to_back_seconds(graph.replay) * 1e3
        rows.append(Row(source, "decode_graph_replay_ms", replay_ms, "ms"))
    return rows
