"""The offline benchmarks' runs: the random model and its checkpoints, then kvfleet on them
(throughput or batch-1 latency) and the transformers peer."""

from __future__ import annotations

import argparse
import gc
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.bench.offline_report import label
from kvfleet_engine.bench.offline_workloads import int4_group_size

log = logging.getLogger(__name__)


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
        self.hf_model = None
        free_device_memory(self)


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
    from kvfleet_engine.layers.attention_torch import KV_CODES

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    print("measuring copy bandwidth and matmul rate ...", flush=True)
    ceilings = roofline.measure_ceilings(device)
    fp8 = ceilings.fp8_matmul_flops
    print(
        f"  copy {ceilings.bandwidth / 1e12:.2f} TB/s, "
        f"matmul {ceilings.matmul_flops / 1e12:.0f} TFLOP/s bf16"
        + (f", {fp8 / 1e12:.0f} fp8" if fp8 else ""),
        flush=True,
    )
    print(f"building a random {args.shape} model ...", flush=True)
    torch.manual_seed(args.seed)
    model = shapes.build_random_model(args.shape, dtype, device)
    kv_bytes_per_token = shapes.kv_bytes_per_token(args.shape, dtype.itemsize)
    if args.kv_cache_dtype in KV_CODES:  # 8-bit codes and a 2-byte scale per head_dim
        head_dim = shapes.SHAPES[args.shape][1]["head_dim"]
        kv_bytes_per_token = shapes.kv_bytes_per_token(args.shape, 1) * (head_dim + 2) // head_dim
    group_size = int4_group_size(args.shape)
    costs = {
        name: roofline.ModelCosts(
            weight_bytes=shapes.weight_bytes_per_step(model, name, group_size),
            kv_bytes_per_token=kv_bytes_per_token,
            weights_per_token=shapes.matmul_weights_per_token(model),
            fp8_products=name == "fp8",
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
        kv_cache_calibration=args.kv_cache_calibration,
    )


def free_device_memory(s: Setup) -> None:
    """Collect what the last run left and give the CUDA allocator's cache back."""
    import torch

    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()


def try_peer(name: str, workload: dict[str, Any], run: Callable[[], list[Any]]) -> list[Any]:
    """A failing peer is reported in the results, not fatal to our own figures."""
    print(f"running {name} ...", flush=True)
    try:
        return run()
    except Exception as error:  # the peer's own bugs are not ours to crash on
        log.exception("%s failed", name)
        workload.setdefault("peer_errors", {})[name] = repr(error)
        return []


def kvfleet_throughput(
    args: argparse.Namespace, s: Setup, prompts: list[list[int]], quantization: str
) -> list[Any]:
    from kvfleet_engine.bench.host_trace import trace_steps
    from kvfleet_engine.bench.results import Row
    from kvfleet_engine.bench.step_timing import StepTimer
    from kvfleet_engine.sampling import SamplingParams

    print(f"running {label('kvfleet', quantization)} ...", flush=True)
    max_input = max(len(p) for p in prompts)
    llm = _llm(args, s, max_input + args.output_len, quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # Warm up on the prompts reversed: the same lengths (so the same kernels compile), but no
    # block in common with the timed prompts, which would otherwise find them in the prefix cache.
    warm_prompts = [p[::-1] for p in prompts[: min(len(prompts), 64)]]
    llm.generate(prompt_token_ids=warm_prompts, sampling_params=warm)
    # Host time launching steps and waiting for their tokens (the rest is host work per step:
    # scheduling, bookkeeping, outputs), and the device's busy and idle time per kind of step.
    with StepTimer(llm.engine) as timer:
        start = time.perf_counter()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - start
    device = timer.device_seconds()
    if args.host_trace:
        skip = args.host_trace_skip
        print("\n".join(trace_steps(llm.engine, prompts, params, args.host_trace, skip_steps=skip)))
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    source = label("kvfleet", quantization)
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


def kvfleet_latency(
    args: argparse.Namespace, s: Setup, prompts: list[list[int]], quantization: str
) -> list[Any]:
    """Per-sequence decode rate from the engine's step loop: the time from the first generated
    token to the last, over the tokens in between."""
    from tqdm.auto import tqdm

    from kvfleet_engine.bench.results import Row
    from kvfleet_engine.sampling import SamplingParams

    source = label("kvfleet", quantization)
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

    with StepTimer(engine) as timer:
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
        graph = graphs.graphs[next(s for s in graphs.sizes if s >= args.batch_size), False]
        replay_ms = back_to_back_seconds(graph.replay) * 1e3
        rows.append(Row(source, "decode_graph_replay_ms", replay_ms, "ms"))
    return rows
