"""The Triton kernels against dense attention and the torch reference.

Without a GPU the kernels run under TRITON_INTERPRET=1 on CPU at small sizes (in CI); with one,
the `gpu`-marked cases run them natively in bf16/fp16 at model-like sizes.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from paged_cases import dense_attention, make_paged_case, relative_error

from kvfleet_engine.layers import attention_torch as ref

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when a @triton.jit function is defined


def _let_interpreter_index_with_scalars() -> None:
    """The interpreter keeps scalars as 1-element arrays and turns them into loop bounds with
    int(array), which numpy >= 2.4 refuses; index through the element instead."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "kvfleet_patched", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.kvfleet_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if not ON_GPU:
    _let_interpreter_index_with_scalars()


def _kernel_module(name: str):
    """Import a kernel module, re-defining its kernels if they were made in the other mode."""
    module = importlib.import_module(f"kvfleet_engine.kernels.{name}")
    kernels = [
        value
        for key, value in vars(module).items()
        if key == "_start" or (key.startswith("_") and key.endswith("_kernel"))
    ]
    interpreted = all(type(k).__name__ == "InterpretedFunction" for k in kernels)
    if interpreted == ON_GPU:
        module = importlib.reload(module)
    return module


pdl = _kernel_module("pdl")  # its helper first: the kernels below bind it
kv_store = _kernel_module("kv_store")
decode = _kernel_module("decode_attention")
prefill = _kernel_module("prefill_attention")
fused = _kernel_module("fused")
norm = _kernel_module("rms_norm")
activation = _kernel_module("activation")
graph_inputs = _kernel_module("graph_inputs")

# (device, dtype, tolerance, sizes): small interpreted cases on CPU; model-like sizes on the GPU.
SMALL = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 32}
LLAMA = {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128}
TARGETS = [
    pytest.param("cpu", torch.float32, 1e-4, SMALL, id="interpret-fp32"),
    pytest.param("cuda", torch.bfloat16, 1e-2, LLAMA, id="gpu-bf16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float16, 2e-3, LLAMA, id="gpu-fp16", marks=pytest.mark.gpu),
    pytest.param("cuda", torch.float32, 1e-4, SMALL, id="gpu-fp32", marks=pytest.mark.gpu),
]


def _skip_if_unavailable(device: str) -> None:
    if (device == "cuda") != ON_GPU:
        pytest.skip(f"this run uses {'cuda' if ON_GPU else 'the interpreter on cpu'}")


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_store_kv_matches_reference(device, dtype, tol, sizes) -> None:
    _skip_if_unavailable(device)
    case = make_paged_case([23, 9], [23, 9], **sizes, dtype=dtype, device=device, seed=1)
    key, value = torch.cat(case.keys).to(device), torch.cat(case.values).to(device)
    slots = case.slot_mapping.clone()
    slots[::5] = -1
    expected_k, expected_v = case.k_cache.clone(), case.v_cache.clone()
    ref.store_kv(key, value, expected_k, expected_v, slots)
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    kv_store.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(7.0), expected_k.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), expected_v.nan_to_num(7.0))


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_decode_matches_dense_attention(device, dtype, tol, sizes, num_splits) -> None:
    _skip_if_unavailable(device)
    lens = [1, 17, 64, 130] if device == "cpu" else [1, 17, 300, 2049, 4096]
    case = make_paged_case(lens, [1] * len(lens), **sizes, dtype=dtype, device=device, seed=2)
    out = decode.paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.context_lens,
        case.scale,
        num_splits=num_splits,
    )
    assert out.shape == case.query.shape and out.dtype == dtype
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1])  # 1: the split kernel writes the output itself
def test_decode_gives_zeros_for_a_padding_sequence_of_length_zero(
    device, dtype, tol, sizes, num_splits
):
    _skip_if_unavailable(device)
    case = make_paged_case([20, 1], [1, 1], **sizes, dtype=dtype, device=device, seed=3)
    context_lens = case.context_lens.clone()
    context_lens[1] = 0
    out = decode.paged_decode_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        context_lens,
        case.scale,
        num_splits=num_splits,
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert relative_error(out[:1], dense_attention(case)[:1]) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize(
    ("context_lens", "query_lens"),
    [
        ([5, 40, 16], [5, 40, 16]),  # fresh prompts
        ([40, 70, 9], [8, 1, 9]),  # cached prefixes, a decode-like token, a fresh prompt
        ([33, 20], [0, 20]),  # a sequence with no query tokens this step
    ],
)
def test_prefill_matches_dense_causal_attention(
    device, dtype, tol, sizes, context_lens, query_lens
) -> None:
    _skip_if_unavailable(device)
    if device == "cuda":  # long prompts and prefixes on the GPU
        context_lens = [n * 25 for n in context_lens]
        query_lens = [n * 25 if n > 1 else n for n in query_lens]
    case = make_paged_case(context_lens, query_lens, **sizes, dtype=dtype, device=device, seed=4)
    out = prefill.prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_query_lens,
        case.context_lens,
        case.scale,
    )
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("block_n", [16, 32])
def test_prefill_chunks_after_a_long_cached_prefix_in_small_tiles(
    device, dtype, tol, sizes, block_n
) -> None:
    """Tiles wholly before a query tile's first position skip the causal mask: chunks that
    start inside a tile, several query tiles per chunk and tile edges on either side of them."""
    _skip_if_unavailable(device)
    case = make_paged_case([150, 97, 64], [40, 33, 16], **sizes, dtype=dtype, device=device, seed=6)
    out = prefill.prefill_attention(
        case.query,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.cu_query_lens,
        case.context_lens,
        case.scale,
        block_m=16,
        block_n=block_n,
    )
    assert relative_error(out, dense_attention(case)) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_prefill_with_an_odd_group_size_and_block_size_32(device, dtype, tol, sizes) -> None:
    _skip_if_unavailable(device)
    sizes = {**sizes, "num_q_heads": 3 * sizes["num_kv_heads"]}
    case = make_paged_case(
        [50, 7], [30, 7], **sizes, block_size=32, dtype=dtype, device=device, seed=5
    )
    args = (case.k_cache, case.v_cache, case.block_tables)
    out = prefill.prefill_attention(
        case.query, *args, case.cu_query_lens, case.context_lens, case.scale
    )
    assert relative_error(out, dense_attention(case)) < tol
    last = case.cu_query_lens[1:].long() - 1  # each sequence's newest token, as a decode step
    out = decode.paged_decode_attention(case.query[last], *args, case.context_lens, case.scale)
    assert relative_error(out, dense_attention(case)[last.cpu()]) < tol


def test_wrappers_reject_bad_input_naming_the_argument() -> None:
    case = make_paged_case([8], [1])
    with pytest.raises(ValueError, match=r"block_tables must be torch\.int32"):
        decode.paged_decode_attention(
            case.query,
            case.k_cache,
            case.v_cache,
            case.block_tables.long(),
            case.context_lens,
            case.scale,
        )
    decode_args = (case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens)
    with pytest.raises(ValueError, match="prefix_splits must be 1 or more, got 0"):
        decode.paged_decode_attention(*decode_args, case.scale, prefix_splits=0)
    with pytest.raises(ValueError, match="num_splits must be 1 or more, got -1"):
        decode.paged_decode_attention(*decode_args, case.scale, num_splits=-1)
    with pytest.raises(ValueError, match="query dtype"):
        prefill.prefill_attention(
            case.query.double(),
            case.k_cache,
            case.v_cache,
            case.block_tables,
            case.cu_query_lens,
            case.context_lens,
            case.scale,
        )
    with pytest.raises(ValueError, match=r"slot_mapping must be torch\.int64"):
        kv_store.store_kv(
            case.keys[0], case.values[0], case.k_cache, case.v_cache, case.slot_mapping.int()
        )
    qkv, q, k, v = _qkv_views(8, 8, 2, 32, torch.float32, "cpu", seed=0)
    cos_sin = _rotary_table(32, seed=0)[1].float()
    with pytest.raises(ValueError, match=r"positions must be torch\.int64"):
        fused.rotary_store_kv(
            torch.zeros(8, dtype=torch.int32), q, k, v, cos_sin, *_cache_and_slots(case)
        )
    with pytest.raises(ValueError, match="same number of tokens"):
        fused.rotary_store_kv(
            torch.zeros(8, dtype=torch.int64),
            q,
            k,
            v,
            cos_sin,
            case.k_cache,
            case.v_cache,
            case.slot_mapping[:7],
        )
    with pytest.raises(ValueError, match="even number of columns"):
        activation.silu_and_mul(qkv[:, :7])


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_fused_rms_norm_matches_torch(device, dtype, tol, sizes, with_residual) -> None:
    _skip_if_unavailable(device)
    dim = 64 if device == "cpu" else 4096
    gen = torch.Generator().manual_seed(6)
    x, residual = (torch.randn(5, dim, generator=gen).to(device, dtype) for _ in range(2))
    weight = torch.rand(dim, generator=gen).to(device, dtype)
    out, summed = norm.rms_norm(x, weight, 1e-5, residual if with_residual else None)
    total = (x + residual) if with_residual else x
    normed = total.double() * torch.rsqrt(total.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert relative_error(out, (weight.double() * normed).cpu()) < tol
    if with_residual:
        assert summed is not None and torch.equal(summed, total)
    else:
        assert summed is None


def _qkv_views(num_tokens, heads, kv_heads, dim, dtype, device, seed):
    """q, k and v as views of one fused qkv output, like the model's (not contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(device, dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return (
        qkv,
        q.view(num_tokens, heads, dim),
        k.view(num_tokens, kv_heads, dim),
        v.view(num_tokens, kv_heads, dim),
    )


def _rotary_table(dim: int, seed: int, positions: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Random angles [positions, dim // 2] float64 and their cos | sin table in float64."""
    gen = torch.Generator().manual_seed(seed)
    angles = torch.rand(positions, dim // 2, generator=gen, dtype=torch.float64) * 6.3
    return angles, torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rotate_half_reference(x: torch.Tensor, angles: torch.Tensor, positions: torch.Tensor):
    """Rotate-half rotary in float64 on the CPU."""
    half = x.shape[-1] // 2
    cos = angles.cos().repeat(1, 2)[positions][:, None]
    sin = angles.sin().repeat(1, 2)[positions][:, None]
    x = x.double().cpu()
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _cache_and_slots(case):
    """A cache filled with a sentinel (a skipped store shows) and the case's slots, every 4th -1."""
    slots = case.slot_mapping.clone()
    slots[::4] = -1
    return torch.full_like(case.k_cache, 7.0), torch.full_like(case.v_cache, 7.0), slots


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_fused_rotary_matches_rotate_half_in_place(device, dtype, tol, sizes) -> None:
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    qkv, q, k, _ = _qkv_views(6, heads, kv_heads, dim, dtype, device, seed=7)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    angles, cos_sin = _rotary_table(dim, seed=8)
    positions = torch.tensor([0, 5, 99, 3, 3, 42])
    want_q = _rotate_half_reference(q, angles, positions)
    want_k = _rotate_half_reference(k, angles, positions)
    fused.rotary_embedding_(positions.to(device), q, k, cos_sin.float().to(device))
    assert relative_error(q, want_q) < tol and relative_error(k, want_k) < tol
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before), "v must be untouched"


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize(
    ("group", "head_dim_scale", "block_size"),
    [(None, 1, 16), (3, 1.5, 32)],  # as given; an odd group, head_dim/2 not a power of 2
)
def test_rotary_store_kv_rotates_then_stores(
    device, dtype, tol, sizes, group, head_dim_scale, block_size
) -> None:
    _skip_if_unavailable(device)
    kv_heads = sizes["num_kv_heads"]
    heads = group * kv_heads if group else sizes["num_q_heads"]
    dim = int(sizes["head_dim"] * head_dim_scale)
    case = make_paged_case(
        [23, 9], [1, 1], heads, kv_heads, dim, block_size, dtype=dtype, device=device, seed=9
    )
    k_cache, v_cache, slots = _cache_and_slots(case)
    num_tokens = slots.shape[0]
    _, q, k, v = _qkv_views(num_tokens, heads, kv_heads, dim, dtype, device, seed=10)
    v_before = v.clone()
    angles, cos_sin = _rotary_table(dim, seed=11)
    positions = torch.randint(0, 100, (num_tokens,), generator=torch.Generator().manual_seed(12))
    want_q = _rotate_half_reference(q, angles, positions)
    want_k = _rotate_half_reference(k, angles, positions)

    fused.rotary_store_kv(
        positions.to(device), q, k, v, cos_sin.float().to(device), k_cache, v_cache, slots
    )
    assert relative_error(q, want_q) < tol and relative_error(k, want_k) < tol
    assert torch.equal(v, v_before), "v must be untouched"
    # The cache holds exactly what store_kv of the rotated k (and of v) writes; -1 rows skipped.
    expected_k, expected_v = torch.full_like(k_cache, 7.0), torch.full_like(v_cache, 7.0)
    ref.store_kv(k, v, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_rotary_decode_attention_equals_rotary_store_then_decode(
    device, dtype, tol, sizes, num_splits
) -> None:
    """One launch does what rotary_store_kv then paged_decode_attention do: the same cache and
    the same output, for a padding row (length 0, slot -1) too; q, k and v are left unrotated."""
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    lens = [1, 17, 64, 130, 1] if device == "cpu" else [1, 17, 300, 2049, 4096, 1]
    case = make_paged_case(lens, [1] * len(lens), **sizes, dtype=dtype, device=device, seed=13)
    num_seqs = len(lens)
    cu = torch.tensor([0, *lens]).cumsum(0)
    slots = case.slot_mapping[cu[1:] - 1].clone()  # each sequence's newest position
    context_lens = case.context_lens.clone()
    context_lens[-1], slots[-1] = 0, -1  # a padding row of a captured batch
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    k_cache.view(-1, kv_heads, dim)[slots[:-1]] = 7.0  # the new token is not in the cache yet
    v_cache.view(-1, kv_heads, dim)[slots[:-1]] = 7.0
    _, q, k, v = _qkv_views(num_seqs, heads, kv_heads, dim, dtype, device, seed=14)
    _, cos_sin = _rotary_table(dim, seed=15, positions=max(lens))
    cos_sin = cos_sin.float().to(device)
    positions = (torch.tensor(lens) - 1).to(device)
    q_before, k_before, v_before = q.clone(), k.clone(), v.clone()

    want_k_cache, want_v_cache = k_cache.clone(), v_cache.clone()
    q_rot, k_rot = q.clone(), k.clone()
    fused.rotary_store_kv(positions, q_rot, k_rot, v, cos_sin, want_k_cache, want_v_cache, slots)
    want = decode.paged_decode_attention(
        q_rot,
        want_k_cache,
        want_v_cache,
        case.block_tables,
        context_lens,
        case.scale,
        num_splits=num_splits,
    )
    out = decode.rotary_decode_attention(
        positions,
        q,
        k,
        v,
        cos_sin,
        k_cache,
        v_cache,
        slots,
        case.block_tables,
        context_lens,
        case.scale,
        num_splits=num_splits,
    )
    # The rotated key may differ in its last bit: the compiler contracts the rotation's
    # multiply-adds differently in the two kernels. The value is copied, so it is exact.
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(k_cache, want_k_cache, rtol=2 * eps, atol=8 * eps, equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(3.0), want_v_cache.nan_to_num(3.0))
    assert torch.equal(q, q_before) and torch.equal(k, k_before) and torch.equal(v, v_before)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert relative_error(out, want.double().cpu()) < tol


SILU_SHAPES = {"cpu": [(1, 1100), (5, 37)], "cuda": [(1, 14336), (512, 14336), (3, 1000)]}


def _silu_mul_input(num_tokens: int, inner: int, dtype, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(inner)
    return (torch.randn(num_tokens, 2 * inner, generator=gen) * 3).to(device, dtype)


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_silu_and_mul_matches_torch(device, dtype, tol, sizes) -> None:
    _skip_if_unavailable(device)
    for num_tokens, inner in SILU_SHAPES[device]:
        x = _silu_mul_input(num_tokens, inner, dtype, device)
        gate, up = x.double().cpu().chunk(2, dim=-1)
        out = activation.silu_and_mul(x)
        assert out.shape == (num_tokens, inner) and out.dtype == dtype
        assert relative_error(out, F.silu(gate) * up) < tol


@pytest.mark.parametrize(
    ("device", "dtype"),
    [
        pytest.param("cpu", torch.float16, id="interpret-fp16"),  # the interpreter rounds fp16
        pytest.param("cuda", torch.bfloat16, id="gpu-bf16", marks=pytest.mark.gpu),
        pytest.param("cuda", torch.float16, id="gpu-fp16", marks=pytest.mark.gpu),
    ],
)
def test_silu_and_mul_rounds_like_eager_torch(device, dtype) -> None:
    """Eager `F.silu(gate) * up` (what transformers runs) rounds the SiLU before the product;
    rounding once instead would differ from it in about a quarter of the elements."""
    _skip_if_unavailable(device)
    x = _silu_mul_input(4, 1000, dtype, device)
    gate, up = x.chunk(2, dim=-1)
    eager = F.silu(gate) * up
    out = activation.silu_and_mul(x)
    assert (out == eager).float().mean().item() > 0.99  # exp may differ in its last bit
    torch.testing.assert_close(out, eager, rtol=torch.finfo(dtype).eps, atol=1e-6)


@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", id="interpret"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("with_pending", [True, False])
def test_decode_graph_inputs_fill_live_rows_and_pad_the_rest(device, with_pending) -> None:
    _skip_if_unavailable(device)
    n, size, width, graph_rows, graph_width = 5, 8, 3, 10, 7
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (n,), generator=g)
    positions = torch.randint(0, 1000, (n,), generator=g)
    slots = torch.randint(0, 1000, (n,), generator=g)
    context_lens = torch.randint(1, 1000, (n,), generator=g, dtype=torch.int32)
    tables = torch.randint(0, 1000, (n, width), generator=g, dtype=torch.int32)
    samples = torch.randint(2000, 3000, (6,), generator=g)
    sources = torch.tensor([3, -1, 0, -1, 5]) if with_pending else None
    out = (
        torch.full((graph_rows,), 77),
        torch.full((graph_rows,), 77),
        torch.full((graph_rows,), 77),
        torch.full((graph_rows,), 77, dtype=torch.int32),
        torch.full((graph_rows, graph_width), 77, dtype=torch.int32),
    )
    moved = [t.to(device) for t in (ids, positions, slots, context_lens, tables)]
    out_dev = tuple(t.to(device) for t in out)
    ids_d, positions_d, slots_d, context_lens_d, tables_d = moved
    graph_inputs.fill_graph_inputs(
        ids_d,
        positions_d,
        slots_d,
        context_lens_d,
        None,  # one token per sequence: the decode graph's cu_query_lens stay as captured
        tables_d,
        None if sources is None else sources.to(device),
        samples.to(device) if with_pending else None,
        out_dev,
        size,
        size,
    )
    got = [t.cpu() for t in out_dev]
    expected_ids = ids.clone()
    if sources is not None:
        expected_ids[sources >= 0] = samples[sources[sources >= 0]]
    assert got[0][:n].tolist() == expected_ids.tolist()
    assert got[1][:n].tolist() == positions.tolist()
    assert got[2][:n].tolist() == slots.tolist()
    assert got[3][:n].tolist() == context_lens.tolist()
    assert torch.equal(got[4][:n, :width], tables)
    assert got[2][n:size].tolist() == [-1] * (size - n)  # padding: store nothing ...
    assert got[3][n:size].tolist() == [0] * (size - n)  # ... and attend to nothing
    assert got[2][size:].tolist() == [77] * (graph_rows - size)  # beyond the graph's batch: kept
    assert (got[4][:, width:] == 77).all()  # stale table entries past the width are never read


@pytest.mark.parametrize(
    "device",
    [pytest.param("cpu", id="interpret"), pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)],
)
def test_prompt_graph_inputs_pad_tokens_and_sequences(device) -> None:
    """A prompt step of 3 sequences (9 tokens, two of them pending samples) into a graph of 16
    tokens and 5 sequences: the padding tokens store nothing, the padding sequences have context
    0 and no query tokens (their cu entries repeat the step's token count)."""
    _skip_if_unavailable(device)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 1000, (9,), generator=g)
    positions = torch.arange(9)
    slots = torch.randint(0, 1000, (9,), generator=g)
    context_lens = torch.tensor([4, 12, 1], dtype=torch.int32)
    cu = torch.tensor([0, 4, 8, 9], dtype=torch.int32)
    tables = torch.randint(0, 1000, (3, 2), generator=g, dtype=torch.int32)
    samples = torch.tensor([500, 600])
    sources = torch.tensor([-1, -1, -1, -1, -1, -1, -1, 1, 0])
    out = (
        torch.full((20,), 77),
        torch.full((20,), 77),
        torch.full((20,), 77),
        torch.full((6,), 77, dtype=torch.int32),
        torch.full((6, 4), 77, dtype=torch.int32),
        torch.full((7,), 77, dtype=torch.int32),
    )
    out_dev = tuple(t.to(device) for t in out)
    args = (ids, positions, slots, context_lens, cu, tables, sources, samples)
    graph_inputs.fill_graph_inputs(*(t.to(device) for t in args), out_dev, 16, 5)
    got_ids, got_positions, got_slots, got_context, got_tables, got_cu = (t.cpu() for t in out_dev)
    assert got_ids[:9].tolist() == [*ids[:7].tolist(), 600, 500]
    assert got_positions[:9].tolist() == positions.tolist()
    assert got_slots[:9].tolist() == slots.tolist()
    assert got_slots[9:16].tolist() == [-1] * 7 and got_slots[16:].tolist() == [77] * 4
    assert got_context.tolist() == [4, 12, 1, 0, 0, 77]
    assert torch.equal(got_tables[:3, :2], tables)
    assert got_cu.tolist() == [0, 4, 8, 9, 9, 9, 77]


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_decode_over_a_shared_prefix_matches_dense_attention(
    device, dtype, tol, sizes, num_splits
) -> None:
    """Sequences that share their first blocks: the prefix kernel attends to those once per
    tile of query rows, the split kernel to the rest; a padding row (context 0) gets zeros, and
    a prefix length of 0 gives the plain result."""
    _skip_if_unavailable(device)
    block = 16
    shared = 3 if device == "cpu" else 96
    lens = [49, 50, 64, 97, 130] if device == "cpu" else [1537, 1600, 2049, 4096] * 5
    case = make_paged_case(
        lens, [1] * len(lens), **sizes, block_size=block, dtype=dtype, device=device, seed=21,
        shared_blocks=shared,
    )  # fmt: skip
    want = dense_attention(case)
    everyone = [1] * len(lens)
    some = [1, 0] * (len(lens) // 2) + [1] * (len(lens) % 2)  # the others read it themselves
    # All of it, none, a part, by every sequence or some (the holder's row is the second):
    for prefix, sharers in ((shared * block, everyone), (0, everyone), (block, some)):
        described = _shared_prefix(prefix, 1, sharers, device)
        out = decode.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
            case.scale, shared_prefix=described, num_splits=num_splits,
        )  # fmt: skip
        assert relative_error(out, want) < tol, (prefix, sharers)
    context_lens = case.context_lens.clone()
    context_lens[-1] = 0  # a padding row of a captured batch
    out = decode.paged_decode_attention(
        case.query, case.k_cache, case.v_cache, case.block_tables, context_lens, case.scale,
        shared_prefix=_shared_prefix(shared * block, 0, everyone, device), num_splits=num_splits,
    )  # fmt: skip
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    assert relative_error(out[:-1], want[:-1]) < tol


def test_the_split_kernel_merges_a_shared_prefix_for_groups_not_a_power_of_two() -> None:
    """One split: the split kernel merges the prefix kernel's partials on the group's rows of
    its 16-row tile (`merged_with_slots`), for groups of 3 and 7 (Qwen2.5-7B's) too."""
    if ON_GPU:
        pytest.skip("the interpreter's case")
    lens = [49, 50, 64, 97, 130]
    for heads, kv_heads in ((6, 2), (7, 1)):
        case = make_paged_case(
            lens, [1] * len(lens), num_q_heads=heads, num_kv_heads=kv_heads, head_dim=32,
            dtype=torch.float32, device="cpu", seed=26, shared_blocks=3,
        )  # fmt: skip
        out = decode.paged_decode_attention(
            case.query, case.k_cache, case.v_cache, case.block_tables, case.context_lens,
            case.scale, shared_prefix=_shared_prefix(48, 1, [1] * len(lens), "cpu"), num_splits=1,
        )  # fmt: skip
        assert relative_error(out, dense_attention(case)) < 1e-4, heads


def test_the_prefix_kernel_leaves_the_split_kernel_room_beside_it() -> None:
    """The prefix kernel's programs on the 132 SMs of an H100 / H200: one an SM beside a split
    kernel of several splits, one every other SM before a split kernel that merges their
    partials, though at least two there (one program walking the whole prefix outlasts the
    split kernel); 64 sequences of an 8B model: 4 splits (128 programs) and 2 (64; 9 once
    made 288 for 264 places); never more splits than the context has tiles, never none."""
    decode_plan = importlib.import_module("kvfleet_engine.kernels.decode_plan")  # no kernels
    choose = decode_plan.choose_prefix_splits
    assert choose(64, 4, 8, 2112, 132, merged=False) == 4
    assert choose(64, 4, 8, 2112, 132, merged=True) == 2
    assert choose(16, 4, 8, 2112, 132, merged=False) == 16
    assert choose(16, 4, 8, 256, 132, merged=False) == 4  # the context's 4 tiles
    assert choose(128, 4, 8, 2112, 132, merged=True) == 2
    assert choose(256, 4, 8, 2112, 132, merged=True) == 2
    assert choose(256, 4, 8, 2112, 132, merged=False) == 1
    assert choose(64, 4, 8, 64, 132, merged=True) == 1  # one tile: one split
    for merged, places, least in ((False, 132, 1), (True, 66, 2)):
        for seqs in (1, 16, 33, 64, 100, 256, 512):
            splits = choose(seqs, 4, 8, 8192, 132, merged=merged)
            programs = -(-seqs * 4 // 64) * 8 * splits
            assert programs <= places or splits == least, (seqs, merged)
    # The whole plan of an 8B model's step at 64 sequences of 2,112 tokens, bf16 cache: one
    # split, so the split kernel merges the prefix's 2 slots itself; without a prefix, none.
    flags = {"token_major_fp8": False, "fp8_codes": False, "mixed": False}
    plan = decode_plan.plan_decode(64, 8, 4, 2112, 132, **flags, shared_prefix=True)
    assert (plan.num_splits, plan.prefix_splits, plan.slots, plan.merge_prefix) == (1, 2, 3, True)
    plan = decode_plan.plan_decode(64, 8, 4, 2112, 132, **flags, shared_prefix=False)
    assert (plan.prefix_splits, plan.merge_prefix) == (0, False)
    forced = decode_plan.plan_decode(
        64, 8, 4, 2112, 132, **flags, shared_prefix=True, forced=(None, None, 2, 4)
    )
    assert (forced.slots, forced.merge_prefix) == (6, False)  # the merge kernel's


def _shared_prefix(tokens: int, holder: int, sharers: list[int], device) -> torch.Tensor:
    """`kernels.shared_prefix`'s description: tokens, holder row, tokens per sequence."""
    per_seq = [tokens * s for s in sharers]
    return torch.tensor([tokens, holder, *per_seq], dtype=torch.int32, device=device)


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
def test_rotary_decode_attention_over_a_shared_prefix_rotates_the_queries_alike(
    device, dtype, tol, sizes
) -> None:
    """The prefix kernel rotates the query rows as the split kernel does: with and without the
    shared prefix, the same output and the same cache."""
    _skip_if_unavailable(device)
    heads, kv_heads, dim = sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"]
    shared = 3 if device == "cpu" else 96
    lens = [49, 64, 130, 50] if device == "cpu" else [1537, 2049, 4096, 1600] * 4
    case = make_paged_case(
        lens, [1] * len(lens), **sizes, dtype=dtype, device=device, seed=22, shared_blocks=shared
    )
    cu = torch.tensor([0, *lens]).cumsum(0)
    slots = case.slot_mapping[cu[1:] - 1].clone()
    _, q, k, v = _qkv_views(len(lens), heads, kv_heads, dim, dtype, device, seed=23)
    _, cos_sin = _rotary_table(dim, seed=24, positions=max(lens))
    cos_sin = cos_sin.float().to(device)
    positions = (torch.tensor(lens) - 1).to(device)
    results = []
    for prefix in (None, _shared_prefix(shared * 16, 2, [1] * len(lens), device)):
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        out = decode.rotary_decode_attention(
            positions, q, k, v, cos_sin, k_cache, v_cache, slots, case.block_tables,
            case.context_lens, case.scale, shared_prefix=prefix,
        )  # fmt: skip
        results.append((out, k_cache, v_cache))
    (want, want_k, want_v), (out, k_cache, v_cache) = results
    assert torch.equal(k_cache.nan_to_num(3.0), want_k.nan_to_num(3.0))
    assert torch.equal(v_cache.nan_to_num(3.0), want_v.nan_to_num(3.0))
    assert relative_error(out, want.double().cpu()) < tol


@pytest.mark.parametrize(("device", "dtype", "tol", "sizes"), TARGETS)
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_a_mixed_step_attends_its_one_token_sequences_with_the_decode_kernels(
    device, dtype, tol, sizes, num_splits
) -> None:
    """A step with prompt tokens: the prefill kernel skips one-token sequences
    (`decodes_apart`), and the decode kernels attend them at their tokens' rows, over the
    shared prefix or not, writing no other row."""
    _skip_if_unavailable(device)
    shared = 3 if device == "cpu" else 96
    lens = [49, 50, 64, 97, 130, 70] if device == "cpu" else [1537, 1600, 2048, 2049, 4096, 1700]
    queries = [1, 1, 20, 1, 1, 33] if device == "cpu" else [1, 1, 300, 1, 1, 129]
    case = make_paged_case(
        lens, queries, **sizes, dtype=dtype, device=device, seed=25, shared_blocks=shared
    )
    want = dense_attention(case)
    decodes = [int(n == 1) for n in queries]
    cache = (case.k_cache, case.v_cache, case.block_tables)
    for prefix in (None, _shared_prefix(shared * 16, 1, decodes, device)):
        out = prefill.prefill_attention(
            case.query, *cache, case.cu_query_lens, case.context_lens, case.scale,
            decodes_apart=True,
        )  # fmt: skip
        written = decode.paged_decode_attention(
            case.query, *cache, case.context_lens, case.scale, shared_prefix=prefix,
            cu_query_lens=case.cu_query_lens, out=out, num_splits=num_splits,
        )  # fmt: skip
        assert written is out
        assert relative_error(out, want) < tol, prefix
    untouched = torch.full_like(case.query, 7.0)
    decode.paged_decode_attention(
        case.query, *cache, case.context_lens, case.scale, cu_query_lens=case.cu_query_lens,
        out=untouched, num_splits=num_splits,
    )  # fmt: skip
    rows = torch.repeat_interleave(torch.tensor(decodes), torch.tensor(queries)).bool()
    assert (untouched[~rows.to(device)] == 7.0).all()
    assert relative_error(untouched[rows.to(device)], want[rows]) < tol


@pytest.mark.parametrize(
    ("num_seqs", "context"), [(64, 4096), (512, 1536), (16, 2048), (768, 2048), (1, 4096), (1, 64)]
)
def test_one_warp_decode_programs_split_into_whole_waves(num_seqs, context) -> None:
    """A token-major quantized cache's one-warp decode programs (8 an SM): splits that fill the
    waves of programs the 132 SMs of an H100 / H200 hold at once (the last wave at least 90%
    full) unless the split cap (64) or the context's tiles stop them first. 64 x 4k: 2 splits,
    not the 3 that ran 1.45 waves (245 us against 215 for one full wave, H200)."""
    decode_plan = importlib.import_module("kvfleet_engine.kernels.decode_plan")  # no kernels
    assert decode_plan.choose_num_splits(64, 8, 4096, 32, 132, 1) == 2
    tiles = -(-context // 32)
    splits = decode_plan.choose_num_splits(num_seqs, 8, context, 32, 132, 1)
    assert 1 <= splits <= min(tiles, 64)
    slots = decode_plan.programs_per_sm(None) * 132
    programs = num_seqs * 8 * splits
    waves = -(-programs // slots)
    assert programs / (waves * slots) >= 0.9 or splits == min(tiles, 64)
