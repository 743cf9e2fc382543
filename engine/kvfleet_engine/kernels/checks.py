"""Input checks shared by the kernel wrappers: a kernel launched on bad input reads garbage or
faults, so wrappers reject it first with a message naming the argument. Also the launch settings
the attention wrappers share."""

from __future__ import annotations

import functools

import torch

from kvfleet_engine.layers.attention_torch import CODE_MAX, SCALE_DTYPE
from kvfleet_engine.layers.kv_shaping import KMoment

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
CODE_DTYPES = tuple(CODE_MAX)  # a quantized cache's element types: e4m3, int8
LOG2E = 1.4426950408889634  # the attention kernels compute exp2(x * scale * LOG2E) = e^(x * scale)


def token_major(v_cache: torch.Tensor) -> bool:
    """A V cache laid out [num_blocks, num_kv_heads, head_dim, block_size] in memory (a permuted
    view of that, so its shape is the K cache's): each dimension's values of one block's tokens
    are one contiguous run (`kv_memory` allocates a quantized cache's V so, `kv_fp8` says why)."""
    return v_cache.stride(1) == 1 and v_cache.stride(-1) != 1


def to_token_major(cache: torch.Tensor) -> torch.Tensor:
    """A copy of the cache's values laid out token major (`token_major`), as a view of its shape."""
    return cache.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2)


@functools.cache
def num_sms(device: torch.device) -> int:
    """The device's streaming multiprocessors (4 off a GPU: the interpreter, where a few programs
    of work exercise the splits)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_cache(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """A float cache without scales, or a quantized cache (fp8, int8) with its scales."""
    require(k_cache.dim() == 4, "k_cache must be [num_blocks, block_size, num_kv_heads, head_dim]")
    require(v_cache.shape == k_cache.shape, "v_cache must have the shape of k_cache")
    require(k_cache.dtype == v_cache.dtype, "k_cache and v_cache must share a dtype")
    require(
        k_cache.dtype in (*FLOAT_DTYPES, *CODE_DTYPES),
        f"cache dtype must be one of {(*FLOAT_DTYPES, *CODE_DTYPES)}",
    )
    require(k_cache.stride(-1) == 1, "k_cache must be contiguous in head_dim")
    block_size = k_cache.shape[1]
    require(  # token major: the kernels load a block's tokens as runs from aligned offsets
        v_cache.stride() == k_cache.stride()
        or (v_cache.stride(1) == 1 and v_cache.stride(0) % block_size == 0),
        "v_cache must have the strides of k_cache, or be token major (contiguous in block_size, "
        "blocks a multiple of block_size apart)",
    )
    require(block_size & (block_size - 1) == 0, "block_size must be a power of two")
    if k_cache.dtype not in CODE_DTYPES:
        require(
            k_scales is None and v_scales is None, "only a quantized cache has k_scales/v_scales"
        )
        return
    require(
        k_scales is not None and v_scales is not None, "a quantized cache needs k_scales/v_scales"
    )
    assert k_scales is not None and v_scales is not None
    num_blocks, _, num_kv_heads, _ = k_cache.shape
    require(
        k_scales.shape == (num_blocks, num_kv_heads, block_size),
        f"k_scales must be [num_blocks, num_kv_heads, block_size] = "
        f"{[num_blocks, num_kv_heads, block_size]}, got {list(k_scales.shape)}",
    )
    require(v_scales.shape == k_scales.shape, "v_scales must have the shape of k_scales")
    require(v_scales.stride() == k_scales.stride(), "v_scales must have the strides of k_scales")
    require(
        k_scales.dtype == SCALE_DTYPE and v_scales.dtype == SCALE_DTYPE,
        f"k_scales/v_scales must be {SCALE_DTYPE}",
    )
    require(k_scales.stride(-1) == 1, "k_scales/v_scales must be contiguous in block_size")
    require(
        k_scales.device == k_cache.device and v_scales.device == k_cache.device,
        "k_scales/v_scales must be on the cache's device",
    )


def check_heads(x: torch.Tensor, name: str, k_cache: torch.Tensor, per_kv_head: bool) -> None:
    """x: [num_tokens, num_heads, head_dim] on the cache's device, in the cache's dtype (any float
    dtype for a quantized cache)."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    require(x.dim() == 3, f"{name} must be [num_tokens, num_heads, head_dim]")
    require(x.shape[2] == head_dim, f"{name} head_dim {x.shape[2]} != cache head_dim {head_dim}")
    if per_kv_head:
        require(x.shape[1] == num_kv_heads, f"{name} must have {num_kv_heads} kv heads")
    else:
        require(x.shape[1] % num_kv_heads == 0, f"{name} heads must be a multiple of kv heads")
    if k_cache.dtype in CODE_DTYPES:
        require(x.dtype in FLOAT_DTYPES, f"{name} dtype must be one of {FLOAT_DTYPES}")
    else:
        require(x.dtype == k_cache.dtype, f"{name} dtype {x.dtype} != cache dtype {k_cache.dtype}")
    require(x.device == k_cache.device, f"{name} must be on the cache's device")
    require(x.stride(-1) == 1, f"{name} must be contiguous in head_dim")


def check_index(
    x: torch.Tensor, name: str, dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    require(x.dim() == dim, f"{name} must have {dim} dimension(s)")
    require(x.dtype == dtype, f"{name} must be {dtype}, got {x.dtype}")
    require(x.device == device, f"{name} must be on {device}")
    require(x.stride(-1) == 1, f"{name} must be contiguous in its last dimension")


def check_paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
) -> None:
    """What both attention wrappers read: the cache, the query heads and, per sequence, a block
    table row and a context length."""
    check_cache(k_cache, v_cache, k_scales, v_scales)
    check_heads(query, "query", k_cache, per_kv_head=False)
    check_index(block_tables, "block_tables", 2, torch.int32, k_cache.device)
    check_index(context_lens, "context_lens", 1, torch.int32, k_cache.device)
    require(
        block_tables.shape[0] == context_lens.shape[0],
        "block_tables must have one row per sequence (per context_lens entry)",
    )


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact for float32 inputs (what the tests compare against)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def check_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor
) -> None:
    """Rotate-half rotary inputs: q and k heads of one head_dim, a float32 cos | sin table."""
    num_tokens, _, head_dim = query.shape
    require(head_dim % 2 == 0, f"head_dim must be even for rotate-half rotary, got {head_dim}")
    require(key.shape[0] == num_tokens and key.shape[2] == head_dim, "key must match query")
    require(query.stride(-1) == 1 and key.stride(-1) == 1, "q/k must be contiguous in head_dim")
    require(
        cos_sin.dim() == 2 and cos_sin.shape[1] == head_dim and cos_sin.dtype == torch.float32,
        f"cos_sin must be [max_positions, {head_dim}] float32 (cos | sin halves)",
    )
    require(cos_sin.device == query.device, "cos_sin must be on the device of query")
    require(cos_sin.stride(-1) == 1, "cos_sin must be contiguous in its last dimension")
    check_index(positions, "positions", 1, torch.int64, query.device)
    require(positions.shape[0] == num_tokens, "positions must have one entry per token")


def check_rotary_store(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Rotary inputs whose new key and value rows are stored in the cache at slot_mapping."""
    check_rotary(positions, query, key, cos_sin)
    check_heads(query, "query", k_cache, per_kv_head=False)
    check_heads(key, "key", k_cache, per_kv_head=True)
    check_heads(value, "value", k_cache, per_kv_head=True)
    check_index(slot_mapping, "slot_mapping", 1, torch.int64, k_cache.device)
    require(
        value.shape[0] == query.shape[0] and slot_mapping.shape[0] == query.shape[0],
        "query, key, value and slot_mapping must have the same number of tokens",
    )
    require(key.dtype == query.dtype == value.dtype, "query, key and value must share a dtype")


def check_moment(
    moment: KMoment,
    k_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """A store's `k_moment` (`layers.kv_shaping.KMoment`): an fp8 cache's, float32 factors
    [kv heads, dim, rank] (a power-of-two rank) and isotropic [kv heads]."""
    require(
        k_cache.dtype == torch.float8_e4m3fn and k_scales is not None,
        "k_moment needs an fp8 cache",
    )
    factors, isotropic = moment.factors, moment.isotropic
    rank = factors.shape[-1] if factors.dim() == 3 else 0
    require(
        factors.shape[:2] == (num_kv_heads, head_dim)
        and rank > 0
        and rank & (rank - 1) == 0
        and isotropic.shape == (num_kv_heads,)
        and all(t.dtype == torch.float32 and t.is_contiguous() for t in (factors, isotropic))
        and factors.device == isotropic.device == k_cache.device
        and head_dim % 2 == 0,
        "k_moment must hold factors [num_kv_heads, head_dim, rank] (a power-of-two rank) and "
        "isotropic [num_kv_heads], float32, contiguous, on the cache's device (an even head_dim)",
    )
