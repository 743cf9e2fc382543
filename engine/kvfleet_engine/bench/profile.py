"""Where a decode step's time goes: the engine's model (random weights, named shape) on a full
paged KV cache, one decode step at several batch sizes — replayed back to back as a CUDA graph
(step time) and profiled eagerly (GPU time per kernel kind) — against the roofline of the step.

    python -m kvfleet_engine.bench.profile --shape llama-3.1-8b --batch-sizes 1,64,256

`--prefill-tokens N` also profiles one eager step computing N prompt tokens (sequences of
`--prefill-seq-len`), against the time its matmuls take at the measured matmul rate.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvfleet_engine.bench.shapes import SHAPES


def kernel_kind(name: str) -> str:
    name = name.lower()
    for key, kind in (
        ("gemm", "matmul"),
        ("gemv", "matmul"),
        ("cutlass", "matmul"),
        ("nvjet", "matmul"),
        ("sm90", "matmul"),
        ("_graph_inputs", "graph inputs"),
        ("decode_split", "attention"),
        ("decode_merge", "attention"),
        ("shared_prefix_kernel", "attention"),
        ("_prefill_", "attention"),
        ("_rotary_store_kv", "rotary+kv store"),
        ("_silu_and_mul", "silu*mul"),
        ("_store_kv", "kv store"),
        ("_rms_norm", "rmsnorm+add"),
        ("_rotary", "rotary"),
    ):
        if key in name:
            return kind
    return "other elementwise"


def kernel_seconds(step: Callable[[], object]) -> dict[str, float]:
    """GPU time of one call of `step`, per kind of kernel (torch.profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_kind: dict[str, float] = collections.defaultdict(float)
    others = []
    for event in prof.key_averages():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kernel_kind(event.key)
            by_kind[kind] += event.self_device_time_total / 1e6
            if kind == "other elementwise":
                others.append((event.self_device_time_total, event.count, event.key))
    for micros, count, name in sorted(others, reverse=True)[:4]:  # what "other" is made of
        print(f"  other: {micros / 1e3:.3f} ms in {count} x {name[:90]}")
    return dict(by_kind)


def _kinds_text(by_kind: dict[str, float]) -> str:
    return ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(by_kind.items(), key=lambda x: -x[1]))


def build_model(shape: str, device: torch.device):
    from kvfleet_engine.bench.shapes import hf_config
    from kvfleet_engine.models.registry import model_class

    architecture, _ = SHAPES[shape]
    cfg = hf_config(shape).to_dict()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = model_class(architecture)(cfg, architecture)
    finally:
        torch.set_default_dtype(torch.float32)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.eval()


def main(argv: list[str] | None = None) -> int:
    from kvfleet_engine import kernels
    from kvfleet_engine.bench.results import Row, format_table, gpu_name, write_results
    from kvfleet_engine.bench.roofline import (
        ModelCosts,
        back_to_back_seconds,
        decode_step_seconds,
        measure_ceilings,
        time_median,
    )
    from kvfleet_engine.bench.shapes import kv_bytes_per_token
    from kvfleet_engine.layers.attention import Attention, AttentionMetadata

    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.profile")
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", default="1,64,256")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--prefill-tokens", type=int, default=0, help="0: no prefill step")
    parser.add_argument("--prefill-seq-len", type=int, default=288)
    parser.add_argument("--output-dir", type=Path, default=Path("bench/results"))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    model = build_model(args.shape, device)
    _, fields = SHAPES[args.shape]
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embedding
    weight_bytes = sum(p.numel() * 2 for p in model.parameters()) - (
        0 if tied else embedding.numel() * 2
    )
    costs = ModelCosts(weight_bytes, kv_bytes_per_token(args.shape))
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    block_size, context = 16, args.context
    blocks_per_seq = -(-(context + 1) // block_size)
    prefill_seqs = -(-args.prefill_tokens // args.prefill_seq_len)
    prefill_blocks = prefill_seqs * -(-args.prefill_seq_len // block_size)
    num_blocks = max(max(batch_sizes) * blocks_per_seq, prefill_blocks)
    cache_shape = (num_blocks, block_size, fields["num_key_value_heads"], fields["head_dim"])
    for layer in (m for m in model.modules() if isinstance(m, Attention)):
        k = torch.randn(cache_shape, device=device, dtype=torch.bfloat16)
        layer.bind(k, torch.randn_like(k), kernels)
    rows = [Row("roofline", "copy_bandwidth", ceilings.bandwidth / 1e9, "GB/s")]
    lines = []
    for batch in batch_sizes:
        tables = torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=tables.view(batch, -1)[:, context // block_size].long() * block_size
            + context % block_size,
            block_tables=tables.view(batch, blocks_per_seq),
            context_lens=torch.full((batch,), context + 1, device=device, dtype=torch.int32),
            cu_query_lens=torch.arange(batch + 1, device=device, dtype=torch.int32),
            is_decode=True,
        )
        ids = torch.randint(0, fields["vocab_size"], (batch,), device=device)
        positions = torch.full((batch,), context, device=device, dtype=torch.int64)

        def step(ids=ids, positions=positions, meta=meta) -> torch.Tensor:
            # What the engine's decode graph computes (cuda_graphs.DecodeGraphs).
            logits = model.compute_logits(model(ids, positions, meta)).float()
            return logits.argmax(dim=-1)

        with torch.inference_mode():
            step()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            graph_s = back_to_back_seconds(graph.replay)
            eager_s = time_median(step, device, repeats=5)
            by_kind = kernel_seconds(step)
        ideal = decode_step_seconds(costs, ceilings, batch, context + 1)
        weights_s = costs.weight_bytes / ceilings.bandwidth
        kv_s = batch * (context + 1) * costs.kv_bytes_per_token / ceilings.bandwidth
        gpu_busy = sum(by_kind.values())
        lines.append(
            f"batch {batch:>3} ctx {context}: graph step {graph_s * 1e3:.2f} ms, eager "
            f"{eager_s * 1e3:.2f} ms, ideal {ideal * 1e3:.2f} ms (weights {weights_s * 1e3:.2f} + "
            f"KV {kv_s * 1e3:.2f}); kernels {gpu_busy * 1e3:.2f} ms: " + _kinds_text(by_kind)
        )
        rows.append(Row("kvfleet", f"decode_step_ms_b{batch}", graph_s * 1e3, "ms"))
        rows.append(Row("kvfleet", f"decode_tokens_per_s_b{batch}", batch / graph_s, "tokens/s"))
        rows.append(Row("roofline", f"decode_tokens_per_s_b{batch}", batch / ideal, "tokens/s"))
        for kind, seconds in by_kind.items():
            rows.append(
                Row("kvfleet", f"b{batch}_{kind.replace(' ', '_')}_ms", seconds * 1e3, "ms")
            )
        del graph
    if args.prefill_tokens:
        lines.append(_prefill(model, args, fields, block_size, ceilings, rows))
    print("\n".join(lines))
    command = "python -m kvfleet_engine.bench.profile " + shlex.join(argv or sys.argv[1:])
    workload = {
        "context": context,
        "block_size": block_size,
        "batch_sizes": batch_sizes,
        "prefill_tokens": args.prefill_tokens,
        "prefill_seq_len": args.prefill_seq_len,
    }
    path = write_results(
        args.output_dir,
        f"decode-profile-{args.shape}",
        gpu_name(device),
        command,
        args.shape,
        workload,
        rows,
    )
    print(format_table(rows))
    print(f"wrote {path}")
    return 0


def _prefill(
    model: Any,
    args: argparse.Namespace,
    fields: dict[str, Any],
    block_size: int,
    ceilings: Any,
    rows: list[Any],
) -> str:
    """Profile one eager step of args.prefill_tokens prompt tokens; returns its report line."""
    from kvfleet_engine.bench.results import Row
    from kvfleet_engine.bench.roofline import time_median
    from kvfleet_engine.layers.attention import AttentionMetadata

    device = next(model.parameters()).device
    tokens, seq_len = args.prefill_tokens, args.prefill_seq_len
    lens = [min(seq_len, tokens - start) for start in range(0, tokens, seq_len)]
    blocks_per_seq = -(-seq_len // block_size)
    tables = torch.arange(len(lens) * blocks_per_seq, device=device, dtype=torch.int32)
    tables = tables.view(len(lens), blocks_per_seq)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    rows_of_tokens = torch.repeat_interleave(
        torch.arange(len(lens), device=device), torch.tensor(lens, device=device)
    )
    slots = tables[rows_of_tokens, positions // block_size].long() * block_size
    cu = torch.tensor([0, *itertools.accumulate(lens)], device=device, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=slots + positions % block_size,
        block_tables=tables,
        context_lens=torch.tensor(lens, device=device, dtype=torch.int32),
        cu_query_lens=cu,
        is_decode=False,
    )
    ids = torch.randint(0, fields["vocab_size"], (tokens,), device=device)
    last = cu[1:].long() - 1

    def step() -> torch.Tensor:
        return model.compute_logits(model(ids, positions, meta)[last])

    with torch.inference_mode():
        step()
        step_s = time_median(step, device, repeats=3)
        by_kind = kernel_seconds(step)
    matmul_s = 2 * tokens * _linear_params(model) / ceilings.matmul_flops
    rows.append(Row("kvfleet", f"prefill_step_ms_{tokens}", step_s * 1e3, "ms"))
    rows.append(Row("roofline", f"prefill_step_ms_{tokens}", matmul_s * 1e3, "ms"))
    for kind, seconds in by_kind.items():
        rows.append(Row("kvfleet", f"prefill_{kind.replace(' ', '_')}_ms", seconds * 1e3, "ms"))
    return (
        f"prefill {tokens} tokens ({len(lens)} x {seq_len}): step {step_s * 1e3:.1f} ms, matmuls "
        f"at the matmul rate {matmul_s * 1e3:.1f} ms; kernels {sum(by_kind.values()) * 1e3:.1f} "
        "ms: " + _kinds_text(by_kind)
    )


def _linear_params(model: Any) -> int:
    """Weights multiplied per prompt token: every linear layer but the LM head."""
    return sum(p.numel() for name, p in model.named_parameters() if "proj" in name and p.dim() == 2)


if __name__ == "__main__":
    raise SystemExit(main())
