"""The quantized KV caches (fp8: e4m3 codes; int8: integer codes): the quantization rule
(`attention_torch.quantize_kv`), the store kernels that must follow it bit for bit, and every
attention implementation reading a quantized cache against dense attention over the dequantized
K/V (and, more loosely, over the exact K/V). The tests marked with CODES run for both.

Without a GPU the Triton kernels run under the interpreter (set up by test_triton_kernels) on
small sizes; with one, the `gpu` cases run them in bf16 at Llama-like sizes.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools

import numpy as np
import pytest
import torch
from paged_cases import PagedCase, dense_attention, make_paged_case, relative_error
from test_triton_kernels import (  # TRITON_INTERPRET and the interpreter's scalar patch
    ON_GPU,
    _rotary_table,
    _rotate_half_reference,
)

from kvfleet_engine.kernels.checks import to_token_major, token_major
from kvfleet_engine.layers import attention_sdpa, kv_rotation, kv_shaping
from kvfleet_engine.layers import attention_torch as ref
from kvfleet_engine.layers.attention_torch import FP8_DTYPE, dequantize_kv, quantize_kv


def _convert_fp8_like_a_gpu() -> None:
    """The interpreter's own float <-> e4m3 conversion rounds half up and drops the carry into
    the exponent (31.7 becomes 16); convert the way the GPU (and torch) does: to nearest even."""
    from triton.runtime import interpreter

    original = interpreter._convert_float
    if getattr(original, "kvfleet_fp8", False):
        return
    dtypes = {
        "fp32": torch.float32,
        "fp16": torch.float16,
        "bf16": torch.bfloat16,
        "fp8e4nv": FP8_DTYPE,
    }

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if "fp8e4nv" not in (input_dtype.name, output_dtype.name):
            return original(data, input_dtype, output_dtype, rounding_mode)
        flat = np.ascontiguousarray(data).reshape(-1)
        source = torch.from_numpy(flat.view(np.uint8).copy()).view(dtypes[input_dtype.name])
        out = source.to(dtypes[output_dtype.name]).view(torch.uint8).numpy()
        return out.view(f"uint{output_dtype.primitive_bitwidth}").reshape(np.shape(data))

    convert.kvfleet_fp8 = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert


def _kernel_modules():
    """kv_fp8's helpers and the kernel modules calling them, made in this run's mode: a kernel
    module binds the helpers when imported, so a stale kv_fp8 is reloaded before them."""
    names = ["kv_fp8", "hadamard", "kv_shaping", "kv_store", "decode_attention"]
    names += ["prefill_attention", "fused"]
    modules = [importlib.import_module(f"kvfleet_engine.kernels.{name}") for name in names]
    interpreted = type(modules[0].quantize_rows).__name__ == "InterpretedFunction"
    if interpreted == ON_GPU:
        modules = [importlib.reload(module) for module in modules]
    return modules[3:]


if not ON_GPU:
    _convert_fp8_like_a_gpu()
kv_store, decode, prefill, fused = _kernel_modules()

SMALL = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32}
LLAMA = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
# (device, query dtype, tolerance against the dequantized reference, sizes)
TARGETS = [
    pytest.param("cpu", torch.float32, 1e-4, SMALL, id="interpret-fp32"),
    pytest.param("cuda", torch.bfloat16, 1e-2, LLAMA, id="gpu-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, 2e-3, LLAMA, id="gpu-fp16", marks=pytest.mark.gpu),
]
# Attention over e4m3 K/V against attention over the exact K/V, random normal data: measured
# 0.027-0.038 up to 4k tokens of context (e4m3 rounds each element by at most 2^-4).
FP8_ATTENTION_ERROR = 0.05
BACKENDS = pytest.mark.parametrize("backend", [ref, attention_sdpa], ids=["torch", "sdpa"])
# The V cache token major (what the engine allocates for the Triton backend) or in K's row layout.
V_LAYOUTS = pytest.mark.parametrize("v_layout", ["tokens", "rows"])
# The code types of a quantized cache: kv_cache_dtype fp8 and int8.
CODES = pytest.mark.parametrize("codes", [FP8_DTYPE, torch.int8], ids=["e4m3", "int8"])
# A code the int8 rule never writes (codes are -127..127): what an int8 cache starts filled with.
INT8_UNWRITTEN = -128


def _laid_out(cache: torch.Tensor, v_layout: str) -> torch.Tensor:
    return to_token_major(cache) if v_layout == "tokens" else cache


def _skip_if_unavailable(device: str) -> None:
    if (device == "cuda") != ON_GPU:
        pytest.skip(f"this run uses {'cuda' if ON_GPU else 'the interpreter on cpu'}")


@dataclasses.dataclass(frozen=True)
class Fp8Case:
    case: PagedCase  # the float problem, its K/V lists replaced by the dequantized ones
    exact: PagedCase  # the float problem as drawn
    k_cache: torch.Tensor  # e4m3 codes, NaN where unused
    v_cache: torch.Tensor
    k_scales: torch.Tensor  # [num_blocks, num_kv_heads, block_size] bfloat16, NaN where unused
    v_scales: torch.Tensor

    @property
    def cache(self) -> dict[str, torch.Tensor]:
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


def _fp8_case(
    exact: PagedCase, v_layout: str = "tokens", codes: torch.dtype = FP8_DTYPE
) -> Fp8Case:
    """The case's cache quantized slot by slot to `codes` (unused NaN slots stay NaN in the
    scales, and in e4m3 codes), V laid out as v_layout says."""
    k_cache, k_scales = quantize_kv(exact.k_cache, codes)
    v_cache, v_scales = quantize_kv(exact.v_cache, codes)
    case = dataclasses.replace(
        exact,
        keys=[dequantize_kv(*quantize_kv(k, codes)) for k in exact.keys],
        values=[dequantize_kv(*quantize_kv(v, codes)) for v in exact.values],
    )
    return Fp8Case(
        case,
        exact,
        k_cache,
        _laid_out(v_cache, v_layout),
        k_scales.transpose(1, 2).contiguous(),
        v_scales.transpose(1, 2).contiguous(),
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns (NaN equals NaN)."""
    as_int = {1: torch.uint8, 2: torch.int16}[a.element_size()]
    return torch.equal(a.view(as_int), b.view(as_int))


# ---- the quantization rule ---------------------------------------------------------------------


def test_quantize_kv_keeps_each_row_within_e4m3_rounding_and_never_clips() -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]
    rows[0, 0] = 0.0  # an all-zero row
    rows[1, 1, 7] = 1e4  # an outlier coarsens its own row only
    codes, scales = quantize_kv(rows)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == rows.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == rows.shape[:2]
    assert codes.float().abs().max() <= 448 and torch.isfinite(codes.float()).all()
    assert (scales.float() * 448 >= rows.abs().amax(-1)).all(), "a scale below amax / 448 clips"
    back = dequantize_kv(codes, scales)
    assert torch.equal(back[0, 0], torch.zeros(128))
    # Codes of 2^-6 and above are normal e4m3: relative error at most half an ulp, 2^-4 (and
    # the float32 rounding of row * (1 / scale) before it).
    normal = codes.float().abs() >= 2**-6
    error = (back - rows).abs() / rows.abs().clamp(min=1e-30)
    assert error[normal].max() <= 2**-4 * (1 + 1e-6)
    others = torch.ones(64, 4, dtype=torch.bool)
    others[1, 1] = False
    row_error = (back - rows).norm(dim=-1) / rows.norm(dim=-1).clamp(min=1e-30)
    assert row_error[others].max() < 0.05, "every other row keeps e4m3's precision"


def test_quantize_kv_int8_rounds_each_row_to_nearest_even_on_its_own_grid() -> None:
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(64, 4, 128, generator=gen) * torch.logspace(-4, 3, 64)[:, None, None]
    rows[0, 0] = 0.0  # an all-zero row
    rows[1, 1, 7] = 1e4  # an outlier coarsens its own row only
    codes, scales = quantize_kv(rows, torch.int8)
    assert codes.dtype == torch.int8 and codes.shape == rows.shape
    assert scales.dtype == torch.bfloat16 and scales.shape == rows.shape[:2]
    assert codes.abs().max() <= 127, "-128 is never written"
    assert (scales.float() * 127 >= rows.abs().amax(-1)).all(), "a scale below amax / 127 clips"
    back = dequantize_kv(codes, scales)
    assert torch.equal(back[0, 0], torch.zeros(128))
    # Every element within half a step of its row's grid (and float32's rounding before it).
    step = scales.float()[..., None]
    assert ((back - rows).abs() <= step * (0.5 + 1e-5)).all()
    # Ties go to the even code: a row of amax 127 * 2^-3 has scale 2^-3 exactly.
    tie = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5]]) / 8
    assert quantize_kv(tie, torch.int8)[0].tolist() == [[127, 2, 4, -2, 0, 0, 2]]
    others = torch.ones(64, 4, dtype=torch.bool)
    others[1, 1] = False
    row_error = (back - rows).norm(dim=-1) / rows.norm(dim=-1).clamp(min=1e-30)
    assert row_error[others].max() < 0.02, "integers on the row's grid: ~0.6% on normal rows"


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)], ids=["cpu", "gpu"]
)
def test_quantize_kv_scale_is_the_correctly_rounded_quotient_on_every_device(device) -> None:
    """Rows whose largest magnitude is 448 times a bfloat16 get exactly that scale (and a code of
    448): the IEEE quotient, on the CPU and on a GPU alike. (CUDA torch's `tensor / 448.0`
    multiplies by a rounded reciprocal and would round those scales up one bfloat16 step.)"""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(3)
    # bfloat16 scales 2^-20 .. 2^10 with 1..8 significant bits: 448 * b is exact in bfloat16
    # only for the small ones, exact in float32 for all.
    mantissas = torch.randint(128, 256, (512,), generator=gen).float() / 128
    wanted = (mantissas * torch.randint(-20, 10, (512,), generator=gen).float().exp2()).bfloat16()
    rows = torch.rand(512, 64, generator=gen) * wanted.float()[:, None] * 448
    rows[:, 5] = -wanted.float() * 448
    codes, scales = quantize_kv(rows.to(device))
    assert torch.equal(scales.cpu(), wanted)
    assert (codes.float()[:, 5] == -448).all()


# ---- the store kernels ------------------------------------------------------------------------


def _empty_fp8_cache(
    case: PagedCase, v_layout: str = "tokens", codes_dtype: torch.dtype = FP8_DTYPE
) -> dict[str, torch.Tensor]:
    """Codes and scales filled with NaN (int8 codes with INT8_UNWRITTEN), so a skipped or missing
    store shows."""
    num_blocks, block_size, num_kv_heads, _ = case.k_cache.shape
    device = case.k_cache.device
    if codes_dtype == torch.int8:
        codes = torch.full(case.k_cache.shape, INT8_UNWRITTEN, dtype=torch.int8, device=device)
    else:
        codes = torch.full(case.k_cache.shape, float("nan"), device=device).to(FP8_DTYPE)
    scales = torch.full((num_blocks, num_kv_heads, block_size), float("nan"), device=device)
    return {
        "k_cache": codes,
        "v_cache": _laid_out(codes.clone(), v_layout),
        "k_scales": scales.to(torch.bfloat16),
        "v_scales": scales.to(torch.bfloat16),
    }


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@V_LAYOUTS
@CODES
def test_store_kv_writes_the_reference_codes_and_scales(
    device, dtype, tol, sizes, v_layout, codes
) -> None:
    _skip_if_unavailable(device)
    case = make_paged_case([23, 9], [23, 9], **sizes, dtype=dtype, device=device, seed=1)
    key, value = torch.cat(case.keys).to(device), torch.cat(case.values).to(device)
    key[3, 1, 5] = 300.0  # an outlier in one row
    slots = case.slot_mapping.clone()
    slots[::5] = -1
    want, got = _empty_fp8_cache(case, "rows", codes), _empty_fp8_cache(case, v_layout, codes)
    assert token_major(got["v_cache"]) == (v_layout == "tokens")
    ref.store_kv(key, value, want["k_cache"], want["v_cache"], slots,
                 k_scales=want["k_scales"], v_scales=want["v_scales"])  # fmt: skip
    kv_store.store_kv(key, value, got["k_cache"], got["v_cache"], slots,
                      k_scales=got["k_scales"], v_scales=got["v_scales"])  # fmt: skip
    for name in want:
        assert _same_bits(got[name], want[name]), name
    written = (~got["k_scales"].isnan()).sum().item()
    assert written == (slots >= 0).sum().item() * sizes["num_kv_heads"]


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_store_kv_with_a_moment_writes_the_reference_shaped_codes(device, dtype, tol, sizes):
    """`kv_cache_calibration`'s store (`kernels.kv_shaping`) against `layers.kv_shaping`: the same
    scales and V; K's codes the same but where the greedy choice is a near-tie (the gradient's
    sums run in another order), and moved from nearest."""
    _skip_if_unavailable(device)
    case = make_paged_case([23, 9], [23, 9], **sizes, dtype=dtype, device=device, seed=2)
    key, value = torch.cat(case.keys).to(device), torch.cat(case.values).to(device)
    slots = case.slot_mapping.clone()
    slots[::5] = -1
    num_kv_heads, dim = sizes["num_kv_heads"], sizes["head_dim"]
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(num_kv_heads, dim, dim, generator=gen)
    shared = torch.randn(num_kv_heads, dim, 1, generator=gen) * 4  # a direction queries share
    moment = spread @ spread.mT + shared @ shared.mT
    moment = kv_shaping.factor(
        moment / torch.diagonal(moment, dim1=1, dim2=2).sum(-1)[:, None, None]
    )
    moment = moment.to(device)
    want, got = _empty_fp8_cache(case, "rows"), _empty_fp8_cache(case, "tokens")
    nearest = _empty_fp8_cache(case, "rows")
    ref.store_kv(key, value, want["k_cache"], want["v_cache"], slots, k_scales=want["k_scales"],
                 v_scales=want["v_scales"], k_moment=moment)  # fmt: skip
    kv_store.store_kv(key, value, got["k_cache"], got["v_cache"], slots, k_scales=got["k_scales"],
                      v_scales=got["v_scales"], k_moment=moment)  # fmt: skip
    ref.store_kv(key, value, nearest["k_cache"], nearest["v_cache"], slots,
                 k_scales=nearest["k_scales"], v_scales=nearest["v_scales"])  # fmt: skip
    for name in ("k_scales", "v_cache", "v_scales"):
        assert _same_bits(got[name], want[name]), name
    written = ~want["k_cache"].float().isnan()
    differs = got["k_cache"].view(torch.uint8) != want["k_cache"].view(torch.uint8)
    assert int(differs[written].sum()) <= 0.01 * int(written.sum())
    moved = nearest["k_cache"].view(torch.uint8) != got["k_cache"].view(torch.uint8)
    assert int(moved[written].sum()) > 0.05 * int(written.sum())


ODD = {"num_q_heads": 6, "num_kv_heads": 3, "head_dim": 48}  # padded rows and half columns


@pytest.mark.parametrize("sizes", [SMALL, ODD], ids=["small", "odd"])
def test_store_kv_with_a_moment_handles_padding_and_zero_codes(sizes) -> None:
    """Interpreter: padded kv-head rows and half columns (3 heads of 48), keys with exact +0
    and -0 elements. A zero moment moves nothing (the codes are nearest's, bit for bit, -0 kept);
    a real one matches the reference but at near-ties."""
    case = make_paged_case([21], [21], **sizes, dtype=torch.float32, device="cpu", seed=4)
    key, value = torch.cat(case.keys), torch.cat(case.values)
    key[:, :, ::5] = 0.0
    key[:, :, 1::5] = -0.0
    num_kv_heads, dim = sizes["num_kv_heads"], sizes["head_dim"]
    gen = torch.Generator().manual_seed(1)
    spread = torch.randn(num_kv_heads, dim, dim, generator=gen)
    real = kv_shaping.factor(spread @ spread.mT)
    zero = kv_shaping.KMoment(torch.zeros_like(real.factors), torch.zeros_like(real.isotropic))
    stores = {}
    for name, moment in (("nearest", None), ("zero", zero), ("real", real)):
        stores[name] = _empty_fp8_cache(case, "tokens")
        cache = stores[name]
        kv_store.store_kv(key, value, cache["k_cache"], cache["v_cache"], case.slot_mapping,
                          k_scales=cache["k_scales"], v_scales=cache["v_scales"],
                          k_moment=moment)  # fmt: skip
    assert _same_bits(stores["zero"]["k_cache"], stores["nearest"]["k_cache"])
    want = _empty_fp8_cache(case, "rows")
    ref.store_kv(key, value, want["k_cache"], want["v_cache"], case.slot_mapping,
                 k_scales=want["k_scales"], v_scales=want["v_scales"], k_moment=real)  # fmt: skip
    written = ~want["k_cache"].float().isnan()
    got = stores["real"]["k_cache"]
    differs = got.view(torch.uint8) != want["k_cache"].view(torch.uint8)
    assert int(differs[written].sum()) <= 0.01 * int(written.sum())
    moved = got.view(torch.uint8) != stores["nearest"]["k_cache"].view(torch.uint8)
    assert int(moved[written].sum()) > 0.05 * int(written.sum())


def test_store_kv_refuses_a_moment_for_an_int8_cache_or_of_the_wrong_shape() -> None:
    case = make_paged_case([5], [5], **SMALL, dtype=torch.float32, device="cpu", seed=3)
    key, value = torch.cat(case.keys), torch.cat(case.values)
    eye = torch.eye(SMALL["head_dim"]).expand(SMALL["num_kv_heads"], -1, -1)
    moment = kv_shaping.factor(eye)
    one_head = kv_shaping.KMoment(moment.factors[:1], moment.isotropic[:1])
    odd_rank = kv_shaping.KMoment(moment.factors[..., :3].contiguous(), moment.isotropic)
    for codes, bad, says in [
        (torch.int8, moment, "k_moment needs an fp8 cache"),
        (FP8_DTYPE, one_head, r"k_moment must hold factors \[num_kv_heads, head_dim, rank\]"),
        (FP8_DTYPE, odd_rank, r"a power-of-two rank"),
    ]:
        cache = _empty_fp8_cache(case, "rows", codes)
        with pytest.raises(ValueError, match=says):
            kv_store.store_kv(
                key, value, cache["k_cache"], cache["v_cache"], case.slot_mapping,
                k_scales=cache["k_scales"], v_scales=cache["v_scales"], k_moment=bad,
            )  # fmt: skip


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize(("group", "head_dim_scale"), [(None, 1), (3, 1.5)])
@V_LAYOUTS
@CODES
def test_rotary_store_kv_quantizes_the_rotated_key(
    device, dtype, tol, sizes, group, head_dim_scale, v_layout, codes
) -> None:
    _skip_if_unavailable(device)
    kv_heads = sizes["num_kv_heads"]
    heads = group * kv_heads if group else sizes["num_q_heads"]
    dim = int(sizes["head_dim"] * head_dim_scale)
    case = make_paged_case([23, 9], [1, 1], heads, kv_heads, dim, dtype=dtype, device=device)
    slots = case.slot_mapping.clone()
    slots[::4] = -1
    num_tokens = slots.shape[0]
    gen = torch.Generator().manual_seed(10)
    q, k, v = (
        torch.randn(num_tokens, n, dim, generator=gen).to(device, dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    angles = torch.rand(100, dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen).to(device)
    got = _empty_fp8_cache(case, v_layout, codes)
    fused.rotary_store_kv(positions, q, k, v, cos_sin, got["k_cache"], got["v_cache"], slots,
                          k_scales=got["k_scales"], v_scales=got["v_scales"])  # fmt: skip
    want = _empty_fp8_cache(case, "rows", codes)  # what store_kv writes for the key as rotated
    ref.store_kv(k, v, want["k_cache"], want["v_cache"], slots,
                 k_scales=want["k_scales"], v_scales=want["v_scales"])  # fmt: skip
    for name in want:
        assert _same_bits(got[name], want[name]), name


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@V_LAYOUTS
@CODES
def test_rotary_store_kv_with_hadamard_rotates_q_and_k_by_h_and_keeps_the_scores(
    device, dtype, tol, sizes, v_layout, codes
) -> None:
    """hadamard=True: q and k in place are RoPE'd then times H (`kv_rotation.rotate`), the cache
    holds what store_kv writes for that k, v unrotated; q · k of every pair is RoPE's."""
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    case = make_paged_case([23, 9], [1, 1], heads, kv_heads, dim, dtype=dtype, device=device)
    slots = case.slot_mapping.clone()
    slots[::4] = -1
    num_tokens = slots.shape[0]
    gen = torch.Generator().manual_seed(15)
    q, k, v = (
        torch.randn(num_tokens, n, dim, generator=gen).to(device, dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    angles, cos_sin = _rotary_table(dim, seed=16)
    positions = torch.randint(0, 100, (num_tokens,), generator=gen)
    roped_q = _rotate_half_reference(q, angles, positions)
    roped_k = _rotate_half_reference(k, angles, positions)
    got = _empty_fp8_cache(case, v_layout, codes)
    fused.rotary_store_kv(positions.to(device), q, k, v, cos_sin.float().to(device),
                          got["k_cache"], got["v_cache"], slots, k_scales=got["k_scales"],
                          v_scales=got["v_scales"], hadamard=True)  # fmt: skip
    assert relative_error(q, kv_rotation.rotate(roped_q)) < tol
    assert relative_error(k, kv_rotation.rotate(roped_k)) < tol
    scores = torch.einsum("thd,tgd->thg", q.double().cpu(), k.double().cpu())
    assert relative_error(scores, torch.einsum("thd,tgd->thg", roped_q, roped_k)) < tol
    want = _empty_fp8_cache(case, "rows", codes)
    ref.store_kv(k, v, want["k_cache"], want["v_cache"], slots,
                 k_scales=want["k_scales"], v_scales=want["v_scales"])  # fmt: skip
    for name in want:
        assert _same_bits(got[name], want[name]), name


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_rotary_store_kv_with_a_moment_stores_what_store_kv_shapes(device, dtype, tol, sizes):
    """The fused rotary + store with `k_moment` (`kv_cache_calibration`'s decode path) writes
    the reference's shaped codes for the rotated k, but at near-ties (<= 1% of codes)."""
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    case = make_paged_case([23, 9], [1, 1], heads, kv_heads, dim, dtype=dtype, device=device)
    slots = case.slot_mapping.clone()
    slots[::4] = -1
    gen = torch.Generator().manual_seed(17)
    q, k, v = (
        torch.randn(slots.shape[0], n, dim, generator=gen).to(device, dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    _, cos_sin = _rotary_table(dim, seed=18)
    positions = torch.randint(0, 100, (slots.shape[0],), generator=gen)
    spread = torch.randn(kv_heads, dim, dim, generator=gen)
    shared = torch.randn(kv_heads, dim, 1, generator=gen) * 4
    moment = spread @ spread.mT + shared @ shared.mT
    moment = kv_shaping.factor(
        moment / torch.diagonal(moment, dim1=1, dim2=2).sum(-1)[:, None, None]
    )
    moment = moment.to(device)
    got = _empty_fp8_cache(case, "tokens")
    fused.rotary_store_kv(positions.to(device), q, k, v, cos_sin.float().to(device),
                          got["k_cache"], got["v_cache"], slots, k_scales=got["k_scales"],
                          v_scales=got["v_scales"], hadamard=True, k_moment=moment)  # fmt: skip
    want = _empty_fp8_cache(case, "rows")  # k, rotated in place, stored by the reference
    ref.store_kv(k, v, want["k_cache"], want["v_cache"], slots, k_scales=want["k_scales"],
                 v_scales=want["v_scales"], k_moment=moment)  # fmt: skip
    for name in ("k_scales", "v_cache", "v_scales"):
        assert _same_bits(got[name], want[name]), name
    written = ~want["k_cache"].float().isnan()
    differs = got["k_cache"].view(torch.uint8) != want["k_cache"].view(torch.uint8)
    assert int(differs[written].sum()) <= 0.01 * int(written.sum())


def test_rotary_store_kv_rejects_hadamard_for_a_head_size_not_a_power_of_two() -> None:
    q, k = torch.zeros(1, 2, 48), torch.zeros(1, 1, 48)
    cache = torch.zeros(2, 16, 1, 48)
    with pytest.raises(ValueError, match="power-of-two head size, got 48"):
        fused.rotary_store_kv(torch.zeros(1, dtype=torch.int64), q, k, k.clone(),
                              torch.zeros(100, 48), cache, cache.clone(),
                              torch.zeros(1, dtype=torch.int64), hadamard=True)  # fmt: skip


def test_kv_rotation_is_orthonormal_and_only_for_quantized_caches_of_power_of_two_heads() -> None:
    h = kv_rotation.hadamard_matrix(64, torch.device("cpu"))
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    assert kv_rotation.rotates(64, True) and kv_rotation.rotates(128, True)
    assert not kv_rotation.rotates(128, False) and not kv_rotation.rotates(96, True)


# ---- attention over an fp8 cache ---------------------------------------------------------------


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
@V_LAYOUTS
@CODES
def test_decode_reads_the_quantized_cache(
    device, dtype, tol, sizes, num_splits, v_layout, codes
) -> None:
    _skip_if_unavailable(device)
    lens = [1, 17, 64, 130] if device == "cpu" else [1, 17, 300, 2049, 4096]
    exact = make_paged_case(lens, [1] * len(lens), **sizes, dtype=dtype, device=device)
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    out = decode.paged_decode_attention(
        case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, case.scale,
        **fp8.cache, num_splits=num_splits,
    )  # fmt: skip
    assert out.shape == case.query.shape and out.dtype == dtype
    assert relative_error(out, dense_attention(case)) < tol
    assert relative_error(out, dense_attention(fp8.exact)) < FP8_ATTENTION_ERROR


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    ("transpose_scores", "early_v", "prefetch_scales"),
    [(False, True, True), (True, False, True), (False, True, False)],
)
def test_decode_launch_variants_read_the_fp8_cache_alike(
    dtype, tol, transpose_scores, early_v, prefetch_scales
) -> None:
    """16-bit queries take float16 dots (queries rescaled by a power of two per row: the
    bf16 ones here exceed float16's range); the
    benchmark's launch variants (scores as K @ q^T; V converted before shared memory, its
    columns swapped in pairs and swapped back at the store; scales loaded a tile ahead or
    where used) give the same attention."""
    lens = [1, 17, 64, 130]
    exact = make_paged_case(lens, [1] * len(lens), **SMALL, dtype=dtype, device="cpu")
    fp8 = _fp8_case(exact, "rows" if early_v else "tokens")
    case = fp8.case
    big = 1e5 if dtype == torch.bfloat16 else 1.0
    out = decode.paged_decode_attention(
        case.query * big, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens,
        case.scale / big, **fp8.cache, num_splits=2, transpose_scores=transpose_scores,
        early_v=early_v, prefetch_scales=prefetch_scales,
    )  # fmt: skip
    assert out.dtype == dtype
    assert relative_error(out, dense_attention(case)) < tol


@CODES
@pytest.mark.parametrize("num_splits", [1, 2])
def test_lazy_rescale_gives_the_same_attention(codes, num_splits) -> None:
    """One-warp decode programs rescale their accumulator only when a row's max grew: the
    outputs are those of rescaling every tile, bit for bit, and match dense attention. Contexts
    of up to ten 32-token tiles, whole and partial: a row's running max grows again in later
    tiles (over random keys, tile j holds a new max with odds ~1/j)."""
    lens = [1, 31, 64, 97, 300]
    exact = make_paged_case(lens, [1] * len(lens), **SMALL, dtype=torch.float32, device="cpu")
    fp8 = _fp8_case(exact, "tokens", codes)
    case = fp8.case
    cache = (fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens)
    outs = [
        decode.paged_decode_attention(
            case.query, *cache, case.scale, **fp8.cache, num_splits=num_splits, lazy_rescale=lazy
        )
        for lazy in (True, False)
    ]
    assert torch.equal(outs[0], outs[1])
    assert relative_error(outs[0], dense_attention(case)) < 1e-4


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize(
    "variant",
    [
        {"early_v": True},
        {"prefetch_scales": False},
        {"block_n": 32, "early_v": True, "prefetch_scales": False},
    ],
    ids=str,
)
def test_prefill_launch_variants_read_the_fp8_cache_alike(dtype, tol, variant) -> None:
    """The prefill benchmark's launch variants (V converted before shared memory; scales loaded
    where used) give the same attention, over a cached prefix and tiles the context does not
    fill. (f16_dots=False, bf16 dots over e4m3, is left to the GPU: the interpreter's e4m3 ->
    bfloat16 conversion returns garbage.)"""
    exact = make_paged_case([40, 70, 9], [8, 3, 9], **SMALL, dtype=dtype, device="cpu")
    fp8 = _fp8_case(exact, "rows" if variant.get("early_v") else "tokens")
    case = fp8.case
    out = prefill.prefill_attention(
        case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.cu_query_lens,
        case.context_lens, case.scale, **fp8.cache, **{"block_n": 16, **variant},
    )  # fmt: skip
    assert out.dtype == dtype
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(
    ("device", "sizes"),
    [
        pytest.param("cpu", SMALL, id="interpret-fp16"),
        pytest.param("cuda", LLAMA, id="gpu-fp16", marks=pytest.mark.gpu),
    ],
)
def test_fp16_attention_over_small_values_keeps_fp16_precision(device, sizes) -> None:
    """Softmax weights times v's scales (~1/448 of values of 0.01) would be fp16 subnormals;
    the kernels weight by the scales times 2^9 and keep the error of large values."""
    _skip_if_unavailable(device)
    errors = []
    for v_size in (1.0, 0.01):
        exact = make_paged_case(
            [2000, 700], [1, 1], **sizes, dtype=torch.float16, device=device, seed=3
        )
        exact = dataclasses.replace(
            exact, v_cache=exact.v_cache * v_size, values=[v * v_size for v in exact.values]
        )
        fp8 = _fp8_case(exact)
        case = fp8.case
        out = decode.paged_decode_attention(
            case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens,
            case.scale, **fp8.cache,
        )  # fmt: skip
        errors.append(relative_error(out, dense_attention(case)))
    assert errors[1] < 2 * errors[0] < 2e-3, errors  # measured 3e-4 both; 2.5e-3 unboosted


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize(
    ("context_lens", "query_lens", "block_size", "group"),
    [
        ([5, 40, 16], [5, 40, 16], 16, None),  # fresh prompts
        ([40, 70, 9], [8, 1, 9], 16, None),  # cached prefixes, a decode-like token, a prompt
        ([33, 20], [0, 20], 16, None),  # a sequence with no query tokens this step
        ([50, 7], [30, 7], 32, 3),  # an odd group size, block size 32
    ],
)
@V_LAYOUTS
@CODES
def test_prefill_reads_the_quantized_cache(
    device, dtype, tol, sizes, context_lens, query_lens, block_size, group, v_layout, codes
) -> None:
    _skip_if_unavailable(device)
    if device == "cuda":  # long prompts and prefixes on the GPU
        context_lens = [n * 25 for n in context_lens]
        query_lens = [n * 25 if n > 1 else n for n in query_lens]
    if group:
        sizes = {**sizes, "num_q_heads": group * sizes["num_kv_heads"]}
    exact = make_paged_case(
        context_lens, query_lens, **sizes, block_size=block_size, dtype=dtype, device=device
    )
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    out = prefill.prefill_attention(
        case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.cu_query_lens,
        case.context_lens, case.scale, **fp8.cache,
    )  # fmt: skip
    assert relative_error(out, dense_attention(case)) < tol
    assert relative_error(out, dense_attention(exact)) < FP8_ATTENTION_ERROR


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
@V_LAYOUTS
@CODES
def test_rotary_decode_attention_equals_rotary_store_then_decode(
    device, dtype, tol, sizes, num_splits, v_layout, codes
) -> None:
    """One launch stores the new token's codes and scales and attends, as rotary_store_kv then
    paged_decode_attention do, a padding row (length 0, slot -1) included."""
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    lens = [1, 17, 64, 130, 1] if device == "cpu" else [1, 17, 300, 2049, 4096, 1]
    exact = make_paged_case(lens, [1] * len(lens), **sizes, dtype=dtype, device=device)
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    cu = torch.tensor([0, *lens]).cumsum(0)
    slots = case.slot_mapping[cu[1:] - 1].clone()  # each sequence's newest position
    context_lens = case.context_lens.clone()
    context_lens[-1], slots[-1] = 0, -1  # a padding row of a captured batch
    gen = torch.Generator().manual_seed(14)
    q, k, v = (
        torch.randn(len(lens), n, dim, generator=gen).to(device, dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    angles = torch.rand(max(lens), dim // 2, generator=gen, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1).float().to(device)
    positions = (torch.tensor(lens) - 1).to(device)

    def fresh_cache():
        return {
            name: t.clone() for name, t in vars(fp8).items() if name.endswith(("cache", "scales"))
        }

    want = fresh_cache()
    q_rot, k_rot = q.clone(), k.clone()
    fused.rotary_store_kv(positions, q_rot, k_rot, v, cos_sin, want["k_cache"], want["v_cache"],
                          slots, k_scales=want["k_scales"], v_scales=want["v_scales"])  # fmt: skip
    want_out = decode.paged_decode_attention(
        q_rot, want["k_cache"], want["v_cache"], case.block_tables, context_lens, case.scale,
        k_scales=want["k_scales"], v_scales=want["v_scales"], num_splits=num_splits,
    )  # fmt: skip
    got = fresh_cache()
    out = decode.rotary_decode_attention(
        positions, q, k, v, cos_sin, got["k_cache"], got["v_cache"], slots, case.block_tables,
        context_lens, case.scale, k_scales=got["k_scales"], v_scales=got["v_scales"],
        num_splits=num_splits,
    )  # fmt: skip
    # The value is quantized from the same input: the same bits. The rotated key may differ in
    # its last bit between the two kernels (on a GPU the compiler contracts the rotation's
    # multiply-adds differently), and with it a code by one e4m3 step, or its row's scale.
    assert _same_bits(got["v_cache"], want["v_cache"])
    assert _same_bits(got["v_scales"], want["v_scales"])
    rows = slots[:-1]
    num_kv = kv_heads
    got_k = dequantize_kv(got["k_cache"].view(-1, num_kv, dim)[rows],
                          got["k_scales"].transpose(1, 2).reshape(-1, num_kv)[rows])  # fmt: skip
    want_k = dequantize_kv(want["k_cache"].view(-1, num_kv, dim)[rows],
                           want["k_scales"].transpose(1, 2).reshape(-1, num_kv)[rows])  # fmt: skip
    torch.testing.assert_close(got_k, want_k, rtol=2**-3, atol=1e-2)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert relative_error(out, want_out.double().cpu()) < tol


def _graph_shaped(case: PagedCase, rows: int, width: int) -> tuple[torch.Tensor, ...]:
    """The case's query, block tables and context lengths as a captured decode graph sees them:
    padded to `rows` (context 0, zero query) and to `width` table entries, the columns past the
    batch's own width holding stale block ids (the graph's buffer keeps earlier steps' rows)."""
    num_seqs, own_width = case.block_tables.shape
    query = torch.zeros(
        (rows, *case.query.shape[1:]), dtype=case.query.dtype, device=case.query.device
    )
    query[:num_seqs] = case.query
    tables = torch.full((rows, width), 1, dtype=torch.int32, device=case.block_tables.device)
    tables[:num_seqs, :own_width] = case.block_tables
    context_lens = torch.zeros(rows, dtype=torch.int32, device=case.context_lens.device)
    context_lens[:num_seqs] = case.context_lens
    return query, tables, context_lens


# The GPU case is the engine test's (test_fp8_cache_on_the_gpu_in_decode_graphs): its tiny qwen3's
# heads, its prompt lengths, the captured width of max_model_len 1024 and the splits each path
# takes on an H200 (132 SMs: 16 padded rows -> 16 splits; 8 rows, 46 blocks -> 12).
ENGINE_SHAPES = [
    pytest.param("cpu", [1, 5, 70], 16, (6, 12, 8), (2, 1), id="interpret"),
    pytest.param(
        "cuda", [1, 17, 45, 120, 300, 700, 5, 64], 64, (16, 64, 16), (12, 1), id="gpu-engine",
        marks=pytest.mark.gpu,
    ),
]  # fmt: skip


@pytest.mark.parametrize(("device", "lens", "block_n", "graph", "eager_splits"), ENGINE_SHAPES)
@pytest.mark.parametrize("prefetch_scales", [True, False], ids=["prefetch", "where-used"])
def test_decode_reads_the_fp8_cache_alike_in_graph_and_eager_shapes(
    device, lens, block_n, graph, eager_splits, prefetch_scales
) -> None:
    """Padded rows, a wider table with stale entries past each sequence's blocks and more splits
    than a sequence has tiles (the captured graph's inputs) attend as the batch's own inputs do,
    and both as dense attention over the dequantized cache, sequence by sequence (a long context
    with a partial last tile, and contexts of 1 and 5 tokens)."""
    _skip_if_unavailable(device)
    dtype = torch.bfloat16
    fp8 = _fp8_case(make_paged_case(lens, [1] * len(lens), **SMALL, dtype=dtype, device=device))
    case = fp8.case
    want = dense_attention(case)
    rows, width, graph_splits = graph
    common = {**fp8.cache, "block_n": block_n, "prefetch_scales": prefetch_scales}
    outs = {}
    query, tables, context_lens = _graph_shaped(case, rows, width)
    out = decode.paged_decode_attention(
        query, fp8.k_cache, fp8.v_cache, tables, context_lens, case.scale,
        num_splits=graph_splits, **common,
    )  # fmt: skip
    assert torch.equal(out[len(lens) :], torch.zeros_like(out[len(lens) :])), "padding rows"
    outs[f"graph, {graph_splits} splits"] = out[: len(lens)]
    for splits in eager_splits:
        outs[f"eager, {splits} splits"] = decode.paged_decode_attention(
            case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens,
            case.scale, num_splits=splits, **common,
        )  # fmt: skip
    errors = {
        name: [round(relative_error(out[i], want[i]), 4) for i in range(len(lens))]
        for name, out in outs.items()
    }
    assert all(e < 1e-2 for errs in errors.values() for e in errs), (lens, errors)


@pytest.mark.parametrize(
    ("device", "lens"),
    [
        pytest.param("cpu", [1, 5, 70], id="interpret"),
        pytest.param(
            "cuda", [1, 17, 45, 120, 300, 700, 5, 64], id="gpu-engine", marks=pytest.mark.gpu
        ),
    ],
)
@pytest.mark.parametrize("prefetch_scales", [True, False], ids=["prefetch", "where-used"])
def test_prefill_of_fresh_prompts_reads_the_fp8_cache_at_the_engine_shapes(
    device, lens, prefetch_scales
) -> None:
    """The engine test's first step: its prompts in one prefill over the fp8 cache they were
    stored in, at the tiny qwen3's heads (head_dim 32), each prompt against dense attention."""
    _skip_if_unavailable(device)
    fp8 = _fp8_case(make_paged_case(lens, lens, **SMALL, dtype=torch.bfloat16, device=device))
    case = fp8.case
    out = prefill.prefill_attention(
        case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.cu_query_lens,
        case.context_lens, case.scale, **fp8.cache, prefetch_scales=prefetch_scales,
    )  # fmt: skip
    want = dense_attention(case)
    cu = case.cu_query_lens.tolist()
    errors = [round(relative_error(out[a:b], want[a:b]), 4) for a, b in itertools.pairwise(cu)]
    assert all(e < 1e-2 for e in errors), (lens, errors)


@BACKENDS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@V_LAYOUTS
@CODES
def test_backend_stores_then_attends_over_the_quantized_cache(
    backend, dtype, v_layout, codes
) -> None:
    """The reference and CPU backends: store_kv quantizes, decode and prefill read the codes and
    scales (V in either layout); slots past each sequence hold NaN and never count."""
    exact = make_paged_case([30, 7, 64], [5, 1, 64], dtype=dtype, seed=21)
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    cache = _empty_fp8_cache(case, v_layout, codes)
    key, value = torch.cat(exact.keys), torch.cat(exact.values)
    backend.store_kv(key, value, cache["k_cache"], cache["v_cache"], case.slot_mapping,
                     k_scales=cache["k_scales"], v_scales=cache["v_scales"])  # fmt: skip
    num_blocks, block_size = case.k_cache.shape[:2]
    stored = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    stored[case.slot_mapping] = True
    stored = stored.view(num_blocks, block_size)
    for name in cache:  # what the store wrote where the case's cache has data
        wanted = vars(fp8)[name]
        written = stored[:, None, :] if name.endswith("scales") else stored[:, :, None, None]
        written = written.expand(wanted.shape)
        assert _same_bits(cache[name][written], wanted[written]), name
    scales = {"k_scales": cache["k_scales"], "v_scales": cache["v_scales"]}
    tables, lens = case.block_tables, case.context_lens
    out = backend.prefill_attention(
        case.query, cache["k_cache"], cache["v_cache"], tables, case.cu_query_lens, lens,
        case.scale, **scales,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert out.dtype == dtype and relative_error(out, dense_attention(case)) < tol
    assert relative_error(out, dense_attention(exact)) < FP8_ATTENTION_ERROR
    last = case.cu_query_lens[1:].long() - 1  # each sequence's newest token, as a decode step
    out = backend.paged_decode_attention(
        case.query[last], cache["k_cache"], cache["v_cache"], tables, lens, case.scale, **scales
    )
    assert out.dtype == dtype and relative_error(out, dense_attention(case)[last]) < tol


def test_wrappers_reject_an_fp8_cache_without_its_scales() -> None:
    fp8 = _fp8_case(make_paged_case([8], [1]))
    case = fp8.case
    args = (case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, case.scale)
    with pytest.raises(ValueError, match="a quantized cache needs k_scales/v_scales"):
        decode.paged_decode_attention(*args)
    with pytest.raises(
        ValueError, match=r"k_scales must be \[num_blocks, num_kv_heads, block_size\]"
    ):
        decode.paged_decode_attention(
            *args, k_scales=fp8.k_scales.transpose(1, 2), v_scales=fp8.v_scales.transpose(1, 2)
        )
    with pytest.raises(ValueError, match=r"k_scales/v_scales must be torch\.bfloat16"):
        decode.paged_decode_attention(
            *args, k_scales=fp8.k_scales.float(), v_scales=fp8.v_scales.float()
        )
    num_blocks, block_size, heads, dim = fp8.v_cache.shape
    misaligned = torch.zeros(num_blocks * (block_size * heads * dim + 1), dtype=FP8_DTYPE)
    misaligned = misaligned.as_strided(  # token major, but blocks 1 + a multiple of 16 apart
        fp8.v_cache.shape, (block_size * heads * dim + 1, 1, dim * block_size, block_size)
    )
    with pytest.raises(ValueError, match="v_cache must have the strides of k_cache, or be token"):
        decode.paged_decode_attention(*args[:2], misaligned, *args[3:], **fp8.cache)
    with pytest.raises(ValueError, match="only a quantized cache has k_scales/v_scales"):
        kv_store.store_kv(
            case.keys[0], case.values[0], case.k_cache, case.v_cache, case.slot_mapping,
            **fp8.cache,
        )  # fmt: skip


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1])
@V_LAYOUTS
@CODES
def test_decode_over_a_shared_prefix_reads_the_quantized_cache(
    device, dtype, tol, sizes, num_splits, v_layout, codes
) -> None:
    """The prefix kernel reads an fp8 cache's shared blocks (scales per token, either V layout)
    as the split kernel reads the rest: dense attention over the dequantized cache."""
    _skip_if_unavailable(device)
    shared = 3 if device == "cpu" else 96
    lens = [49, 64, 97, 130] if device == "cpu" else [1537, 2049, 4096, 1600] * 5
    exact = make_paged_case(
        lens, [1] * len(lens), **sizes, dtype=dtype, device=device, seed=41, shared_blocks=shared
    )
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    tokens = shared * 16
    described = torch.tensor([tokens, 1, *[tokens] * len(lens)], dtype=torch.int32, device=device)
    out = decode.paged_decode_attention(
        case.query, fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, case.scale,
        **fp8.cache, shared_prefix=described, num_splits=num_splits,
    )  # fmt: skip
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@V_LAYOUTS
@CODES
def test_a_mixed_step_reads_the_quantized_cache_in_both_kernels(
    device, dtype, tol, sizes, v_layout, codes
) -> None:
    """A step with prompt tokens over an fp8 cache: the prefill kernel attends the chunks, the
    decode kernels the one-token sequences (over their shared prefix), one output."""
    _skip_if_unavailable(device)
    shared = 3 if device == "cpu" else 96
    lens = [49, 64, 97, 130, 70] if device == "cpu" else [1537, 2049, 4096, 1600, 1700]
    queries = [1, 20, 1, 1, 33] if device == "cpu" else [1, 300, 1, 1, 129]
    exact = make_paged_case(
        lens, queries, **sizes, dtype=dtype, device=device, seed=42, shared_blocks=shared
    )
    fp8 = _fp8_case(exact, v_layout, codes)
    case = fp8.case
    tokens = shared * 16
    shares = [tokens * (n == 1) for n in queries]
    described = torch.tensor([tokens, 0, *shares], dtype=torch.int32, device=device)
    cache = (fp8.k_cache, fp8.v_cache, case.block_tables)
    out = prefill.prefill_attention(
        case.query, *cache, case.cu_query_lens, case.context_lens, case.scale, **fp8.cache,
        decodes_apart=True,
    )  # fmt: skip
    decode.paged_decode_attention(
        case.query, *cache, case.context_lens, case.scale, **fp8.cache, shared_prefix=described,
        cu_query_lens=case.cu_query_lens, out=out,
    )  # fmt: skip
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(
    ("num_seqs", "codes", "tile"),
    [(8, FP8_DTYPE, 32), (33, FP8_DTYPE, 16), (33, torch.int8, 32)],
)
def test_one_warp_fp8_decode_takes_short_tiles_where_its_programs_fill_two_waves(
    num_seqs, codes, tile
) -> None:
    """The one-warp fp8 decode reads 16-token tiles where its unsplit programs fill two waves of
    the GPU's (the interpreter's 4 SMs hold 32 one-warp programs: 33 sequences x 2 kv heads are
    66 programs), 32-token tiles otherwise and over int8 codes (not measured with 16): its
    default launch is that explicit one, bit for bit, and matches dense attention."""
    decode_plan = importlib.import_module("kvfleet_engine.kernels.decode_plan")
    assert decode_plan.token_major_fp8_tile(512, 8, 132) == 16  # the 1k/1k decode on an H100
    assert decode_plan.token_major_fp8_tile(64, 8, 132) == 32  # 64 x 4k: 512 programs
    lens = [(7 * i) % 90 + 1 for i in range(num_seqs)]
    exact = make_paged_case(lens, [1] * num_seqs, **SMALL, dtype=torch.float32, device="cpu")
    fp8 = _fp8_case(exact, "tokens", codes)
    case = fp8.case
    cache = (fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, case.scale)
    default = decode.paged_decode_attention(case.query, *cache, **fp8.cache, num_splits=1)
    explicit = decode.paged_decode_attention(
        case.query, *cache, **fp8.cache, num_splits=1, block_n=tile
    )
    assert torch.equal(default, explicit)
    assert relative_error(default, dense_attention(case)) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_short_fp8_tiles_decode_alike_at_a_full_batch_on_the_gpu(dtype) -> None:
    """300 sequences x 8 kv heads fill two waves of an H100's / H200's one-warp programs: the
    default launch takes 16-token tiles with the scales loaded where used, and matches the
    32-token tiles with prefetched scales and dense attention over the dequantized cache."""
    _skip_if_unavailable("cuda")
    decode_plan = importlib.import_module("kvfleet_engine.kernels.decode_plan")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if decode_plan.token_major_fp8_tile(300, 8, sms) != 16:
        pytest.skip(f"{sms} SMs: 300 sequences do not fill two waves")
    lens = [(37 * i) % 700 + 1 for i in range(300)]
    exact = make_paged_case(lens, [1] * 300, **LLAMA, dtype=dtype, device="cuda")
    fp8 = _fp8_case(exact, "tokens")
    case = fp8.case
    cache = (fp8.k_cache, fp8.v_cache, case.block_tables, case.context_lens, case.scale)
    short = decode.paged_decode_attention(case.query, *cache, **fp8.cache)
    long = decode.paged_decode_attention(
        case.query, *cache, **fp8.cache, block_n=32, prefetch_scales=True
    )
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    assert relative_error(short, dense_attention(case)) < tol
    assert relative_error(short, long.double().cpu()) < tol
