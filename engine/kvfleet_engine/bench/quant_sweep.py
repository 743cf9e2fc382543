"""Every quantized-product kernel variant × config on one decoder layer's products (qkv, o,
gate_up, down), at each row count, beside bf16: each (kind, rows, config) is first checked
against the float reference on layer 0's weights, then timed over all layers in a CUDA graph;
the table gives the best config per (kind, rows, product), the layer's time as the sum of those
bests, its fraction of the measured copy bandwidth and its ratio to bf16, against issue 13's
targets. The winners are written as plan-table entries (`int_plan.install_plans`; the file
$KVFLEET_QUANT_PLANS names is loaded at start-up) beside the full results.

Compiles are the slow part: worker processes first run every config once (Triton's on-disk cache
then serves the main process's compiles).

    python -m kvfleet_engine.bench.quant_sweep --rows 1,2,4,8,16,64,256 --output-dir /tmp/out
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvfleet_engine.bench.gemv import copy_bandwidth, graph_seconds, layer_shapes
from kvfleet_engine.bench.quant_candidates import (
    KINDS,
    LABELS,
    Config,
    config_name,
    configs,
    product,
    resolve,
)
from kvfleet_engine.bench.quant_gemv import INT4_GROUP, Weights, make_weights
from kvfleet_engine.bench.results import Row, gpu_name, write_results
from kvfleet_engine.bench.shapes import SHAPES


def reference(kind: str, w: Weights, x: torch.Tensor, w8a8: bool) -> torch.Tensor:
    """float32 [M, N]: x times the dequantized weight (W8A8: x rounded to e4m3 per token)."""
    xf = x.float()
    if kind == "bf16":
        return xf @ w[0].float().t()
    if kind == "fp8":
        weight = w[0].float() * w[1][:, None]
        if w8a8:
            scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
            xf = (xf / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
        return xf @ weight.t()
    qweight, scales = w[0], w[1]
    group = x.shape[1] // scales.shape[0]
    if kind == "int8":
        codes = qweight.float()
    else:
        shifts = 4 * torch.arange(8, device=x.device, dtype=torch.int32)
        codes = (
            ((qweight[:, None, :] >> shifts[None, :, None]) & 0xF)
            .reshape(-1, qweight.shape[1])
            .float()
        )
    weight = codes * scales.float().repeat_interleave(group, dim=0)
    if len(w) == 3:
        weight += w[2].float().repeat_interleave(group, dim=0)
    return xf @ weight


def _all_layers(run: Callable, x: torch.Tensor, layers: list[Weights]) -> None:
    for w in layers:
        run(x, w)


def jobs(rows: list[int], kinds: tuple[str, ...] = KINDS) -> list[tuple[str, int, Config]]:
    return [(kind, m, c) for m in rows for kind in kinds for c in configs(kind, m)]


def _warm(shape: str, part: list[tuple[str, int, Config]]) -> int:
    """Worker: run each job once on every product (compiles into Triton's on-disk cache)."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    shapes = layer_shapes(shape)
    kinds = {kind for kind, _, _ in part}
    weights = {kind: [make_weights(kind, n, k, device) for _, n, k in shapes] for kind in kinds}
    done = 0
    for kind, m, config in part:
        for index, (_, _, k) in enumerate(shapes):
            try:
                product(config)(
                    torch.randn(m, k, device=device, dtype=torch.bfloat16), weights[kind][index]
                )
            except Exception:  # the main process reports it
                pass
        done += 1
    torch.cuda.synchronize()
    return done


def prewarm(shape: str, todo: list[tuple[str, int, Config]], workers: int, budget: float) -> None:
    """Compile every job in `workers` processes (at most `budget` seconds; what is left then
    compiles in this process)."""
    if workers <= 1:
        return
    started = time.time()
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
    futures = [pool.submit(_warm, shape, todo[i::workers]) for i in range(workers)]
    finished, waiting = concurrent.futures.wait(futures, timeout=budget)
    done = sum(f.result() for f in finished if f.exception() is None)
    failed = [f.exception() for f in finished if f.exception() is not None]
    if waiting:
        for process in list(pool._processes.values()):  # stuck past the budget: stop them
            process.terminate()
    pool.shutdown(wait=not waiting, cancel_futures=True)
    print(
        f"compiled {done} of {len(todo)} configs in {workers} processes in "
        f"{time.time() - started:.0f} s" + (f"; worker errors: {failed[:2]}" if failed else "")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.quant_sweep")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", default="1,2,4,8,16,64,256", help="comma-separated rows of x")
    parser.add_argument("--workers", type=int, default=min(12, max(1, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--compile-budget-s", type=float, default=100.0)
    parser.add_argument(
        "--budget-s", type=float, default=200.0, help="stop timing new jobs after this long"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS} (bf16 always)"
    )
    parser.add_argument("--output-dir", type=Path)
    args = parser.parse_args(argv)
    asked = set(args.kinds.split(","))
    kinds = tuple(k for k in KINDS if k == "bf16" or k in asked)
    unknown = sorted(asked - set(KINDS))
    if unknown:
        parser.error(f"--kinds: {unknown} unknown; choose from {list(KINDS)}")
    if not torch.cuda.is_available():
        print("quant_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = [int(r) for r in args.rows.split(",")]
    todo = jobs(rows, kinds)
    print(f"{len(todo)} (kind, rows, config) jobs over {len(kinds)} kinds, rows {rows}")
    start = time.time()
    prewarm(args.shape, todo, args.workers, args.compile_budget_s)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth()
    shapes = layer_shapes(args.shape)
    torch.manual_seed(0)
    weights = {
        kind: [[make_weights(kind, n, k, device) for _, n, k in shapes] for _ in range(args.layers)]
        for kind in kinds
    }
    print(f"copy bandwidth {bandwidth / 1e9:.0f} GB/s; {args.layers} layers")
    results: list[dict[str, Any]] = []
    started, skipped, last_rows = time.time(), 0, 0
    for kind, m, config in todo:
        if time.time() - start > args.budget_s:
            skipped += 1
            continue
        if m != last_rows:
            print(f"rows {m} ({time.time() - start:.0f} s)", flush=True)
            last_rows = m
        name = config_name(config)
        entry: dict[str, Any] = {"kind": kind, "rows": m, "config": name, "spec": config}
        entry["products"] = {}
        run = product(config)
        for index, (pname, n, k) in enumerate(shapes):
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w8a8 = config["family"] in ("fp8-scaled_mm", "fp8-w8a8-triton")
            try:
                out = run(x, weights[kind][0][index])
                expected = reference(kind, weights[kind][0][index], x, w8a8)
                error = float((out.float() - expected).norm() / expected.norm())
                layers = [layer[index] for layer in weights[kind]]
                seconds = graph_seconds(partial(_all_layers, run, x, layers)) / args.layers
            except Exception as failure:  # a failing config is a result
                entry["products"][pname] = {
                    "error": f"{type(failure).__name__}: {str(failure)[:200]}"
                }
                continue
            moved = sum(t.numel() * t.element_size() for t in weights[kind][0][index])
            moved += 2 * m * (k + n)
            entry["products"][pname] = {
                "us": seconds * 1e6, "rel_error": error, "ok": error < 2e-2,
                "bytes": moved, "of_copy": moved / seconds / bandwidth,
            }  # fmt: skip
        results.append(entry)
    print(f"timed {len(results)} jobs in {time.time() - started:.0f} s; {skipped} skipped (budget)")
    best, plans = summarize(results, rows, shapes, bandwidth)
    if args.output_dir:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        plans_path = args.output_dir / "quant-plans.json"
        plans_path.write_text(json.dumps({"plans": plans}, indent=1))
        report = [Row("roofline", "copy_bandwidth", bandwidth / 1e9, "GB/s")]
        for (kind, m), b in best.items():
            metric = f"layer_products_us_t{m}_{LABELS[kind]}"
            report.append(Row("kvfleet", metric, b["layer_us"], "us"))
            report.append(
                Row("kvfleet", metric.replace("_us_", "_of_copy_"), b["of_copy"], "fraction")
            )
        workload = {"layers": args.layers, "rows": rows, "results": results, "plans": plans}
        workload["best"] = {f"{LABELS[k]} m{m}": b for (k, m), b in best.items()}
        path = write_results(
            args.output_dir, f"quant-sweep-{args.shape}", gpu_name(device),
            "python -m kvfleet_engine.bench.quant_sweep " + shlex.join(argv or sys.argv[1:]),
            args.shape, workload, report,
        )  # fmt: skip
        print(f"wrote {path} and {plans_path}")
    return 0


TARGETS = {  # (kind, rows) -> (what, bound): of_copy >= bound, or x_bf16 <= bound
    **{
        ("int4", 1): ("of_copy", 0.70),
        ("int8", 1): ("of_copy", 0.75),
        ("fp8", 1): ("of_copy", 0.80),
    },
}


def target(kind: str, m: int) -> tuple[str, float] | None:
    if (kind, m) in TARGETS:
        return TARGETS[kind, m]
    if kind in ("int4", "int8") and 2 <= m <= 16:
        return ("x_bf16", 0.6)
    if kind in ("int4", "int8") and 17 <= m <= 256:
        return ("x_bf16", 1.1)
    return None


def summarize(
    results: list[dict[str, Any]],
    rows: list[int],
    shapes: list[tuple[str, int, int]],
    bandwidth: float,
) -> tuple[dict[tuple[str, int], dict[str, Any]], list[dict[str, Any]]]:
    """Print the table; return the best per (kind, rows) and the plan-table entries."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    plans: list[dict[str, Any]] = []
    bad = [
        f"{LABELS[r['kind']]} m{r['rows']} {r['config']} {p}: "
        + (v["error"] if "error" in v else f"rel error {v['rel_error']:.3g}")
        for r in results for p, v in r["products"].items() if "error" in v or not v["ok"]
    ]  # fmt: skip
    print(f"{len(bad)} (config, product) pairs failed or were wrong" + (":" if bad else ""))
    for line in bad[:40]:
        print("  " + line)
    header = f"{'kind':10}{'rows':>5}{'us/layer':>10}{'of copy':>9}{'x bf16':>8}  {'target':22}"
    print(header + "best config per product (qkv | o | gate_up | down)")
    kinds = [kind for kind in KINDS if any(r["kind"] == kind for r in results)]
    for m in rows:
        for kind in kinds:
            mine = [r for r in results if r["kind"] == kind and r["rows"] == m]
            chosen = {}
            for pname, _, _ in shapes:
                timed = [(r["products"][pname]["us"], r) for r in mine
                         if pname in r["products"] and r["products"][pname].get("ok")]  # fmt: skip
                if timed:
                    chosen[pname] = min(timed, key=lambda t: t[0])
            if len(chosen) < len(shapes):
                print(f"{LABELS[kind]:10}{m:>5}  no correct config for every product")
                continue
            layer_us = sum(us for us, _ in chosen.values())
            moved = sum(r["products"][p]["bytes"] for p, (_, r) in chosen.items())
            of_copy = moved / (layer_us / 1e6) / bandwidth
            bf16 = best.get(("bf16", m))
            ratio = layer_us / bf16["layer_us"] if bf16 else 1.0  # bf16 itself comes first
            goal, verdict = target(kind, m), ""
            if goal:
                value = of_copy if goal[0] == "of_copy" else ratio
                met = value >= goal[1] if goal[0] == "of_copy" else value <= goal[1]
                sign = ">=" if goal[0] == "of_copy" else "<="
                verdict = f"{'MET ' if met else 'MISS'} {goal[0]} {sign} {goal[1]}"
            best[kind, m] = {
                "layer_us": layer_us, "of_copy": of_copy, "x_bf16": ratio, "target": verdict,
                "per_product": {p: {"config": r["config"], "us": us}
                                for p, (us, r) in chosen.items()},
            }  # fmt: skip
            names = " | ".join(f"{r['config']} {us:.1f}" for us, r in chosen.values())
            line = f"{LABELS[kind]:10}{m:>5}{layer_us:>10.1f}{of_copy:>9.2f}{ratio:>8.2f}"
            print(f"{line}  {verdict:22}{names}")
            for pname, n, k in shapes:
                spec = chosen[pname][1]["spec"]
                if spec["family"] == "int":
                    group = INT4_GROUP if kind == "int4" else k
                    plan = resolve(spec, m, n, k, group)
                    plans.append({"kind": kind, "group_size": group, "rows": m, "n": n, "k": k,
                                  "plan": asdict(plan)})  # fmt: skip
                elif spec["family"] == "fp8-gemv":
                    plan = resolve(spec, m, n, k, k)
                    plans.append({"kind": "fp8", "rows": m, "n": n, "k": k, "plan": asdict(plan)})
                elif spec["family"] in ("fp8-scaled_mm", "fp8-w8a8-triton"):
                    w8a8: dict[str, Any] = {"backend": "scaled_mm"}
                    if spec["family"] == "fp8-w8a8-triton":
                        w8a8 = {"backend": "triton", "blocks": list(spec["plan"]["blocks"])}
                    plans.append({"kind": "fp8-w8a8", "rows": m, "n": n, "k": k, "plan": w8a8})
    return best, plans


if __name__ == "__main__":
    raise SystemExit(main())
