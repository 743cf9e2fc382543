"""Where a short prompt step's time goes on the GPU: the model's prefill forward for one sequence
of T tokens, eager (host time to launch it, wall time to finish it, device time) against the same
forward replayed from a CUDA graph, the four bf16 products alone through cuBLAS at M = T (the
floor), and a torch.profiler table of the eager forward at 512 tokens.

Usage: python bench/prefill_probe.py CKPT OUT.json [T ...]; prints a table, writes the JSON."""

import json
import statistics
import sys
import time

import torch
from offline_serve_requests import served_settings_llm

from kvfleet_engine.layers.attention import AttentionMetadata


def prefill_inputs(ex, num_tokens: int):  # type: ignore[no-untyped-def]
    """One sequence of num_tokens tokens from position 0, stored in blocks 1.. (the cache is
    otherwise idle here)."""
    dev, bs = ex.device, ex.block_size
    blocks = list(range(1, 1 + -(-num_tokens // bs)))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(
            [blocks[p // bs] * bs + p % bs for p in range(num_tokens)], device=dev
        ),
        block_tables=torch.tensor([blocks], dtype=torch.int32, device=dev),
        context_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
        cu_query_lens=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
        is_decode=False,
    )
    ids = torch.randint(1000, 100000, (num_tokens,), device=dev)
    positions = torch.arange(num_tokens, device=dev)
    last = torch.tensor([num_tokens - 1], device=dev)
    return ids, positions, meta, last


def forward(model, ids, positions, meta, last):  # type: ignore[no-untyped-def]
    hidden = model(ids, positions, meta)
    logits = model.compute_logits(hidden[last]).float()
    return logits, logits.argmax(dim=-1)


def timed(fn, reps: int = 10) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Median host launch time (until fn returns), wall (until the device finishes) and device
    time (CUDA events), ms."""
    launch, wall, device = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        fn()
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append((t1 - t0) * 1e3)
        wall.append((t2 - t0) * 1e3)
        device.append(start.elapsed_time(end))
    return {
        "launch_ms": round(statistics.median(launch), 3),
        "wall_ms": round(statistics.median(wall), 3),
        "device_ms": round(statistics.median(device), 3),
    }


def gemm_floor(cfg: dict, num_tokens: int) -> float:  # type: ignore[type-arg]
    """One layer's four products at M = num_tokens through cuBLAS (bf16), times the layers, ms."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    shapes = [(h, (heads + 2 * kv) * hd), (heads * hd, h), (h, 2 * inter), (inter, h)]
    x = {k: torch.randn(num_tokens, k, device="cuda", dtype=torch.bfloat16) for k, _ in shapes}
    w = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for k, n in shapes]

    def layer() -> None:
        for (k, _), weight in zip(shapes, w, strict=True):
            torch.nn.functional.linear(x[k], weight)

    layer()
    return round(timed(layer)["device_ms"] * cfg["num_hidden_layers"], 3)


def main() -> None:
    ckpt, out_path = sys.argv[1:3]
    sizes = [int(t) for t in sys.argv[3:]] or [128, 512, 2048]
    llm, res = served_settings_llm(ckpt, 4096)
    ex = llm.engine.model_runner.executor
    model, cfg = ex.model, ex.config.model.hf_config
    rows = []
    with torch.inference_mode():
        for t in sizes:
            args = prefill_inputs(ex, t)
            forward(model, *args)  # compile
            eager = timed(lambda a=args: forward(model, *a))
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = forward(model, *args)
            replay = timed(graph.replay)
            ref = forward(model, *args)[0]
            graph.replay()
            torch.cuda.synchronize()
            rows.append(
                {
                    "tokens": t,
                    "eager": eager,
                    "graph": replay,
                    "graph_max_abs_diff": float((out[0] - ref).abs().max()),
                    "cublas_4_products_ms": gemm_floor(cfg, t),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
            del graph, out
        args = prefill_inputs(ex, int(__import__("os").environ.get("PROFILE_TOKENS", "512")))
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            forward(model, *args)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    kernels = sum(
        e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    res.update({"rows": rows, "profile_512": table, "device_ops_512": kernels})
    print(
        f"{'tokens':>7} {'eager launch':>13} {'eager wall':>11} {'eager dev':>10} "
        f"{'graph wall':>11} {'graph dev':>10} {'cuBLAS':>8}"
    )
    for r in rows:
        e, g = r["eager"], r["graph"]
        print(
            f"{r['tokens']:>7} {e['launch_ms']:>13} {e['wall_ms']:>11} {e['device_ms']:>10} "
            f"{g['wall_ms']:>11} {g['device_ms']:>10} {r['cublas_4_products_ms']:>8}"
        )
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
