"""Would one persistent kernel streaming a layer's products beat a kernel per product at batch 1?
(bench/NOTES.md section 25: the one-row quantized steps spend 0.9-1.4 ms beyond their weights'
bytes, ≈ 5 µs of ramp and tail per product kernel, four a layer; the issue's 1.8x / 3.0x targets
need that overlapped, not tuned.)

The probe times the four fp8 products of Llama-3.1-8B's layers, chained as a decode step chains
them (qkv -> o -> gate_up -> SiLU * up -> down -> the next layer's qkv; attention and norms left
out: the first 4,096 of qkv's outputs stand for attention's; down adds to the residual stream,
the next layer's input), for 32 layers in a CUDA graph:

  kernels     the engine's one-row fp8 GEMV per product, its silu_and_mul and a residual add,
              as a step runs them (PDL on where the GPU has it)
  persistent  one launch for all 32 layers: programs_per_sm x SMs programs walk one list of
              tiles (layer, product, 64 output rows, a slice of K) in order, each tile waiting
              only for the product whose outputs it reads (a counter per product, released by
              the last slice of each row block as it sums the slices), with the first weight
              tile of its slice loaded before that wait; so the next product's weights stream
              while the last tiles of the one before finish

Each as ms per step, µs per layer, and the weights' bytes over that time against copy bandwidth.
A program waits only on tiles earlier in the list, and the earliest unfinished tile waits on
nothing unfinished, so the walk cannot deadlock while every program is resident (the grid is
sized to be); under TRITON_INTERPRET=1 the grid is one program, which walks the list in order.

    python -m kvfleet_engine.bench.persistent_chain [--programs-per-sm 4] [--output probe.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from kvfleet_engine.bench.gemv import graph_seconds, layer_shapes
from kvfleet_engine.bench.roofline import measure_ceilings
from kvfleet_engine.kernels.activation import _silu_mul
from kvfleet_engine.kernels.int_plan import INTERPRETED


@dataclass(frozen=True)
class Product:
    """One product of the chain: [n, k] e4m3 weights, k split `splits` ways."""

    name: str
    n: int
    k: int
    splits: int


# K splits as the engine's one-row fp8 plans choose them for the 8B shape (quant_plans.json).
SPLITS = {"qkv": 4, "o": 8, "gate_up": 1, "down": 8}


def llama_8b_products() -> list[Product]:
    return [Product(name, n, k, SPLITS[name]) for name, n, k in layer_shapes("llama-3.1-8b")]


@triton.jit
def _tile_dot(w, x_ptr, offs_k, K, gated, acc, BF16: tl.constexpr):
    """acc + row 0 of [x; zeros] (16 rows, the dot's least) times w [BLOCK_N, BLOCK_K]ᵀ; x from
    x_ptr at offs_k, or where `gated` the SiLU of it times the value K further. The dot's
    operands are bf16 (BF16) or float32 (the interpreter, whose dot takes bf16 as raw bits)."""
    x = tl.load(x_ptr + offs_k, cache_modifier=".cg")
    if gated:
        x = _silu_mul(x, tl.load(x_ptr + K + offs_k, cache_modifier=".cg"))
    offs_m = tl.arange(0, 16)
    x16 = tl.where((offs_m == 0)[:, None], x[None, :], 0.0)
    w = w.to(tl.float32)
    if BF16:
        x16, w = x16.to(tl.bfloat16), w.to(tl.bfloat16)
    return tl.dot(x16, tl.trans(w), acc)


@triton.jit
def _wait_for(counter_ptr, target):
    """Spin until *counter_ptr reaches target (acquire: what the counter's releases wrote is
    seen after)."""
    ready = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while ready < target:
        ready = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile_product(
    w_ptr, scale_ptr, in_ptr, part_ptr, y_ptr, res_ptr, arrive_ptr, wait_ptr, wait_target,
    need_wait, res_wait_ptr, res_target, need_res_wait, post_ptr, post_mod, post_span,
    post_limit, N, K, S, row_block, split, gated,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, BF16: tl.constexpr,
):  # fmt: skip
    """One tile: rows [row_block * BLOCK_N, +BLOCK_N) of w over K slice `split` of S, times the
    input (the SiLU of its two halves where `gated`), into the partials; the slice that
    arrives last sums the row block's partials into y (plus the residual stream's rows at
    res_ptr where `gated`: the down projection adds to it, once its rows are written) and
    counts the block in its consumer's counter: post_ptr[(row % post_mod) // post_span] for
    rows below post_limit (the rows its consumer reads). The slice's first weight tile is
    loaded before waiting for the input (`need_wait`: until *wait_ptr reaches wait_target)."""
    row0 = row_block * BLOCK_N
    offs_n = row0 + tl.arange(0, BLOCK_N)
    span = K // S
    # A whole number of BLOCK_K (Chain checks it): said, so the loads are 16-byte vectors (the
    # compiler cannot see it through the division, and would load the weights byte by byte).
    k_start = tl.multiple_of(split * span, BLOCK_K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * K
    offs_k = k_start + tl.arange(0, BLOCK_K)
    first = tl.load(w_rows + offs_k[None, :])  # weights: no tile writes them
    if need_wait:
        _wait_for(wait_ptr, wait_target)
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    acc = _tile_dot(first, in_ptr, offs_k, K, gated, acc, BF16)
    for k0 in tl.range(k_start + BLOCK_K, k_start + span, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        acc = _tile_dot(tl.load(w_rows + offs_k[None, :]), in_ptr, offs_k, K, gated, acc, BF16)
    out = tl.sum(acc, axis=0) * tl.load(scale_ptr + offs_n)  # [BLOCK_N]: row 0's
    tl.store(part_ptr + split * N + offs_n, out)
    tl.debug_barrier()  # every thread's partial is written before the release below
    arrived = tl.atomic_add(arrive_ptr + row_block, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        total = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for s in range(S):
            total += tl.load(part_ptr + s * N + offs_n, cache_modifier=".cg")
        if gated:
            if need_res_wait:
                _wait_for(res_wait_ptr, res_target)
            total += tl.load(res_ptr + offs_n, cache_modifier=".cg")
        tl.store(y_ptr + offs_n, total)
        tl.debug_barrier()
        if row0 < post_limit:
            segment = (row0 % post_mod) // post_span
            tl.atomic_add(post_ptr + segment, 1, sem="release", scope="gpu")


@triton.jit
def _counted(K, S, gated, SEGMENTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """For a product reading K inputs (2 K, its gate and up, where `gated`) in S slices:
    how its producer counts finished row blocks for it (rows below `limit`, counter
    (row % K) // span), and how many blocks fill one counter. SEGMENTS: a counter per slice
    (a tile waits for the rows it reads); else one counter (it waits for the whole product)."""
    limit = K * (2 if gated else 1)
    span = K // S if SEGMENTS else K
    return limit, span, limit // K * span // BLOCK_N


@triton.jit
def _chain_kernel(
    w0, w1, w2, w3, sc0, sc1, sc2, sc3, y0, y1, y2, y3, p0, p1, p2, p3, arrive_ptr, done_ptr,
    N0, K0, S0, N1, K1, S1, N2, K2, S2, N3, K3, S3, layers, num_programs,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, BF16: tl.constexpr,
    WAIT: tl.constexpr = True, SEGMENTS: tl.constexpr = False,
):  # fmt: skip
    """Walk the tiles of `layers` layers in list order, every num_programs-th from this
    program's id. Every buffer has a row per layer, so no tile overwrites what a later one
    reads: y_i [layers, N_i] (y3 [layers + 1, N3]: the chain's input, then each layer's
    output), the partials p_i [layers, S_i, N_i], the slices' arrivals [layers, row blocks];
    done_ptr [layers + 1, 4, SMAX] counts, for product c of a layer, its producer's finished
    row blocks (all zeroed before the launch).

    SEGMENTS=False: a product's tiles go row block by row block, each tile waiting for the
    whole product before it. SEGMENTS=True: slice by slice (the first slice of every row block,
    then the second...), each tile waiting only for the rows of its slice, and gate_up's row
    blocks alternate gate and up, so down's first slice is ready early; the rows that complete
    first are the ones the next product's first tiles read."""
    SMAX = tl.maximum(tl.maximum(S0, S1), tl.maximum(S2, S3))
    B0 = N0 // BLOCK_N
    B1 = N1 // BLOCK_N
    B2 = N2 // BLOCK_N
    B3 = N3 // BLOCK_N
    per_layer = B0 * S0 + B1 * S1 + B2 * S2 + B3 * S3
    lim0, span0, target0 = _counted(K0, S0, False, SEGMENTS, BLOCK_N)
    lim1, span1, target1 = _counted(K1, S1, False, SEGMENTS, BLOCK_N)
    lim2, span2, target2 = _counted(K2, S2, False, SEGMENTS, BLOCK_N)
    lim3, span3, target3 = _counted(K3, S3, True, SEGMENTS, BLOCK_N)
    for item in range(tl.program_id(0), layers * per_layer, num_programs):
        layer = item // per_layer
        t = item % per_layer
        done = done_ptr + layer * 4 * SMAX  # this layer's four products' counters
        arrive = arrive_ptr + layer * (B0 + B1 + B2 + B3)
        # which product (qkv, o, gate_up, down), and the tile's index within it
        E0 = B0 * S0
        E1 = E0 + B1 * S1
        E2 = E1 + B2 * S2
        c = (t >= E0).to(tl.int32) + (t >= E1).to(tl.int32) + (t >= E2).to(tl.int32)
        t -= tl.where(c == 0, 0, tl.where(c == 1, E0, tl.where(c == 2, E1, E2)))
        B = tl.where(c == 0, B0, tl.where(c == 1, B1, tl.where(c == 2, B2, B3)))
        S = tl.where(c == 0, S0, tl.where(c == 1, S1, tl.where(c == 2, S2, S3)))
        if SEGMENTS:
            split = t // B
            block = t % B
            # gate and up blocks alternate: gate_up's tile 2i is gate's i-th, 2i + 1 up's
            block = tl.where(c == 2, block // 2 + (block % 2) * (B // 2), block)
        else:
            split = t % S
            block = t // S
        wait_at = split if SEGMENTS else 0
        if c == 0:
            _tile_product(
                w0 + layer.to(tl.int64) * N0 * K0, sc0 + layer * N0, y3 + layer * N3,
                p0 + layer * S0 * N0, y0 + layer * N0, y0, arrive, done + wait_at, target0,
                (layer > 0) if WAIT else False, done, 0, False, done + SMAX, K1, span1, lim1,
                N0, K0, S0, block, split, False, BLOCK_N, BLOCK_K, STAGES, BF16,
            )  # fmt: skip
        elif c == 1:
            _tile_product(
                w1 + layer.to(tl.int64) * N1 * K1, sc1 + layer * N1, y0 + layer * N0,
                p1 + layer * S1 * N1, y1 + layer * N1, y1, arrive + B0,
                done + SMAX + wait_at, target1, WAIT, done, 0, False, done + 2 * SMAX, K2,
                span2, lim2, N1, K1, S1, block, split, False, BLOCK_N, BLOCK_K, STAGES, BF16,
            )  # fmt: skip
        elif c == 2:
            _tile_product(
                w2 + layer.to(tl.int64) * N2 * K2, sc2 + layer * N2, y1 + layer * N1,
                p2 + layer * S2 * N2, y2 + layer * N2, y2, arrive + B0 + B1,
                done + 2 * SMAX + wait_at, target2, WAIT, done, 0, False, done + 3 * SMAX,
                K3, span3, lim3, N2, K2, S2, block, split, False, BLOCK_N, BLOCK_K, STAGES,
                BF16,
            )  # fmt: skip
        else:  # adds to the residual stream y3[layer], once the layer before wrote its rows
            res_at = (block * BLOCK_N) // span0 if SEGMENTS else 0
            _tile_product(
                w3 + layer.to(tl.int64) * N3 * K3, sc3 + layer * N3, y2 + layer * N2,
                p3 + layer * S3 * N3, y3 + (layer + 1) * N3, y3 + layer * N3,
                arrive + B0 + B1 + B2, done + 3 * SMAX + wait_at, target3, WAIT,
                done + res_at, target0, (layer > 0) if WAIT else False, done + 4 * SMAX, K0, span0,
                lim0, N3, K3, S3, block, split, True, BLOCK_N, BLOCK_K, STAGES, BF16,
            )  # fmt: skip


class Chain:
    """Random e4m3 weights (scaled to keep activations near 1) for `layers` layers of
    `products`, and both ways of running them."""

    def __init__(
        self, products: list[Product], layers: int, device: torch.device, block_n: int = 64,
        block_k: int = 256,
    ) -> None:  # fmt: skip
        qkv, o, gate_up, down = products
        if not (o.k <= qkv.n and gate_up.k == o.n and down.k * 2 == gate_up.n and qkv.k == down.n):
            raise ValueError("products do not chain: qkv -> o -> gate_up -> down -> qkv")
        self.products, self.layers, self.device = products, layers, device
        self.block_n, self.block_k = block_n, block_k
        self._check_tiles(products)
        gen = torch.Generator(device=device).manual_seed(0)
        self.weights = [
            torch.randn(layers, p.n, p.k, device=device, generator=gen).to(torch.float8_e4m3fn)
            for p in products
        ]
        self.scales = [
            torch.full((layers, p.n), 1 / math.sqrt(p.k), device=device) for p in products
        ]
        self.input = torch.randn(qkv.k, device=device, generator=gen)

    def _check_tiles(self, products: list[Product]) -> None:
        """Each product's slices are whole BLOCK_Ks and whole BLOCK_Ns (so a row block of the
        product before falls in one slice), and its rows whole BLOCK_Ns."""
        for p in products:
            span = p.k // p.splits
            if p.n % self.block_n or p.k % p.splits or span % self.block_k or span % self.block_n:
                raise ValueError(f"{p.name}: {p.n} x {p.k} / {p.splits} does not tile by blocks")

    @property
    def weight_bytes(self) -> int:
        return sum(w.numel() for w in self.weights)

    def reference(self) -> torch.Tensor:
        """The chain in float32 torch."""
        x = self.input
        for layer in range(self.layers):
            w = [
                t[layer].float() * s[layer][:, None]
                for t, s in zip(self.weights, self.scales, strict=True)
            ]
            y0 = w[0] @ x
            y1 = w[1] @ y0[: self.products[1].k]
            y2 = w[2] @ y1
            gate, up = y2.chunk(2)
            x = x + w[3] @ (torch.nn.functional.silu(gate) * up)
        return x

    def kernels(self) -> Callable[[], torch.Tensor]:
        """The engine's kernels, one per product plus silu_and_mul and the residual add (where
        the engine's norm adds it), bf16 between them (float32 in the interpreter)."""
        from kvfleet_engine.kernels.activation import silu_and_mul
        from kvfleet_engine.kernels.fp8_gemv import fp8_gemv

        dtype = torch.float32 if INTERPRETED else torch.bfloat16  # as _tile_dot's BF16
        x0 = self.input.to(dtype)[None, :]
        k_o = self.products[1].k

        def step() -> torch.Tensor:
            x = x0
            for layer in range(self.layers):
                w, s = [t[layer] for t in self.weights], [t[layer] for t in self.scales]
                y0 = fp8_gemv(x, w[0], s[0], dtype)
                y1 = fp8_gemv(y0[:, :k_o], w[1], s[1], dtype)
                y2 = fp8_gemv(y1, w[2], s[2], dtype)
                x = x + fp8_gemv(silu_and_mul(y2), w[3], s[3], dtype)
            return x[0].float()

        return step

    def persistent(
        self, programs_per_sm: int, stages: int = 3, wait: bool = True, segments: bool = False,
        splits: dict[str, int] | None = None,
    ) -> tuple[Callable[[], torch.Tensor], int]:  # fmt: skip
        """One launch of `_chain_kernel` (float32 between the products), as (step, programs):
        programs_per_sm per SM, fewer where fewer fit (a program that never becomes resident
        would leave the others waiting on its tiles forever); one program in the interpreter.
        `segments`: each tile waits only for the rows it reads (else for the whole product);
        `splits`: K splits by product name instead of the products' own."""
        p = [Product(q.name, q.n, q.k, (splits or {}).get(q.name, q.splits)) for q in self.products]
        self._check_tiles(p)
        dev, bn, layers = self.device, self.block_n, self.layers
        ys = [torch.empty(layers + (q.name == "down"), q.n, device=dev) for q in p]
        parts = [torch.empty(layers, q.splits, q.n, device=dev) for q in p]
        arrive = torch.zeros(layers, sum(q.n for q in p) // bn, dtype=torch.int32, device=dev)
        smax = max(q.splits for q in p)
        done = torch.zeros(layers + 1, 4, smax, dtype=torch.int32, device=dev)
        sizes = [v for q in p for v in (q.n, q.k, q.splits)]
        args = (*self.weights, *self.scales, *ys, *parts, arrive, done, *sizes, layers)
        options = dict(
            BLOCK_N=bn,
            BLOCK_K=self.block_k,
            STAGES=stages,
            BF16=not INTERPRETED,
            WAIT=wait,
            SEGMENTS=segments,
            num_warps=4,
        )
        if INTERPRETED:
            programs = 1
        else:
            compiled = _chain_kernel.warmup(*args, 1, grid=(1,), **options)
            programs = min(programs_per_sm, resident_per_sm(compiled, dev, 4))
            programs *= torch.cuda.get_device_properties(dev).multi_processor_count

        def step() -> torch.Tensor:
            done.zero_()
            arrive.zero_()
            ys[3][0].copy_(self.input)
            _chain_kernel[(programs,)](*args, programs, **options)
            return ys[3][-1]

        return step, programs


def resident_per_sm(compiled: Any, device: torch.device, num_warps: int) -> int:
    """How many programs of a compiled Triton kernel fit on one SM at once (registers, shared
    memory, warps)."""
    props = torch.cuda.get_device_properties(device)
    compiled._init_handles()  # loads the module: sets n_regs
    regs_per_warp = -(-compiled.n_regs * 32 // 256) * 256  # allocated in units of 256
    regs: int = props.regs_per_multiprocessor  # type: ignore[attr-defined]  # not in the stubs
    by_regs = regs // (regs_per_warp * num_warps)
    shared = compiled.metadata.shared + 1024  # the runtime reserves 1 KiB a block
    by_shared = props.shared_memory_per_multiprocessor // shared
    by_warps = props.max_threads_per_multi_processor // (32 * num_warps)
    return max(1, min(by_regs, by_shared, by_warps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--output", default=None, help="JSON results to this file")
    parser.add_argument(
        "--segments", type=int, nargs="*", default=[], metavar="GATE_UP_SPLITS",
        help="also time the launch whose tiles wait only for the rows they read, slice by "
        "slice, once per gate_up K split given (the engine's plan has 1)",
    )  # fmt: skip
    parser.add_argument(
        "--no-wait", action="store_true", help="also time the tiles without their waits"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    chain = Chain(llama_8b_products(), args.layers, device)
    check = Chain(llama_8b_products(), 2, device)
    expected = check.reference()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    bandwidth = measure_ceilings(device).bandwidth / 1e9  # the bench's copy bandwidth
    gb = chain.weight_bytes / 1e9
    rows = []

    def record(name: str, step: Callable[[], torch.Tensor], probe: Callable[[], torch.Tensor]):
        got = probe()
        error = ((got - expected).norm() / expected.norm()).item()
        ms = graph_seconds(step, replays=20) * 1e3
        rows.append({"variant": name, "ms_per_step": ms, "us_per_layer": ms * 1e3 / args.layers,
                     "weight_gb_per_s": gb / ms * 1e3, "of_copy": gb / ms * 1e3 / bandwidth,
                     "error_2_layers": error})  # fmt: skip

    record("kernels", chain.kernels(), check.kernels())
    for per_sm in args.programs_per_sm:
        step, programs = chain.persistent(per_sm)
        record(f"persistent-{programs // sms}/sm", step, check.persistent(per_sm)[0])
    for gate_up_splits in args.segments:
        split = {"gate_up": gate_up_splits}
        for per_sm in args.programs_per_sm:
            step, programs = chain.persistent(per_sm, segments=True, splits=split)
            label = f"segments-{programs // sms}/sm-gu{gate_up_splits}"
            record(label, step, check.persistent(per_sm, segments=True, splits=split)[0])
    if args.no_wait:  # the tiles' own speed: no tile waits for its input (wrong results)
        step, programs = chain.persistent(2, wait=False)
        record(f"no-wait-{programs // sms}/sm", step, check.persistent(2, wait=False)[0])
    name = torch.cuda.get_device_name(device)
    print(f"{name}: copy {bandwidth:.0f} GB/s, weights {gb:.2f} GB")
    print(f"{'variant':<22} {'ms/step':>8} {'us/layer':>9} {'GB/s':>7} {'of copy':>8} {'error':>9}")
    for r in rows:
        print(
            f"{r['variant']:<22} {r['ms_per_step']:>8.3f} {r['us_per_layer']:>9.1f} "
            f"{r['weight_gb_per_s']:>7.0f} {r['of_copy']:>8.1%} {r['error_2_layers']:>9.2e}"
        )
    if args.output:
        result = {"gpu": name, "copy_gb_per_s": bandwidth, "weight_gb": gb, "rows": rows}
        with open(args.output, "w") as f:
            json.dump({**result, "layers": args.layers, "command": " ".join(sys.argv)}, f, indent=1)


if __name__ == "__main__":
    main()
