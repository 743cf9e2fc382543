"""The KV cache tensors of one rank: how many blocks fit, and each attention layer's K/V (and,
for a quantized cache, scales) bound to it. A rank holds only its own layers and KV heads."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import torch

from kvfleet_engine.layers.attention import Attention
from kvfleet_engine.layers.attention_torch import CODE_MAX, SCALE_DTYPE

# KV cache memory when sizing it on the CPU (there is no memory probe worth trusting).
CPU_KV_CACHE_BYTES = 2 << 30


def block_bytes(layers: list[Attention], block_size: int, kv_cache_dtype: torch.dtype) -> int:
    """K and V of one block in each of `layers`, with a quantized cache's scales."""
    total = 0
    for layer in layers:
        row_bytes = layer.head_dim * kv_cache_dtype.itemsize  # one token's K of one kv head
        if kv_cache_dtype in CODE_MAX:
            row_bytes += SCALE_DTYPE.itemsize
        total += 2 * layer.num_kv_heads * row_bytes * block_size
    return total


def allocate_kv_cache(
    layers: list[Attention],
    num_blocks: int,
    block_size: int,
    kv_cache_dtype: torch.dtype,
    backend: ModuleType,
    device: torch.device,
) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's K and V caches [num_blocks, block_size, kv_heads, head_dim] and, for a
    quantized cache (fp8, int8), their scales [num_blocks, kv_heads, block_size], bound to the
    layer. A quantized cache's V is token major in memory where the backend asks for it
    (`QUANTIZED_V_TOKEN_MAJOR`): a permuted view of [num_blocks, kv_heads, head_dim,
    block_size], the same shape as K."""
    quantized = kv_cache_dtype in CODE_MAX
    token_major = quantized and getattr(backend, "QUANTIZED_V_TOKEN_MAJOR", False)
    caches: list[tuple[torch.Tensor, ...]] = []
    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        k_cache = torch.zeros(shape, dtype=kv_cache_dtype, device=device)
        if token_major:
            v_shape = (num_blocks, layer.num_kv_heads, layer.head_dim, block_size)
            v_cache = torch.zeros(v_shape, dtype=kv_cache_dtype, device=device)
            v_cache = v_cache.permute(0, 3, 1, 2)
        else:
            v_cache = torch.zeros(shape, dtype=kv_cache_dtype, device=device)
        scales: tuple[torch.Tensor, ...] = ()
        if quantized:
            scales_shape = (num_blocks, layer.num_kv_heads, block_size)
            k_scales = torch.zeros(scales_shape, dtype=SCALE_DTYPE, device=device)
            scales = (k_scales, torch.zeros_like(k_scales))
        layer.bind(k_cache, v_cache, backend, *scales)
        caches.append((k_cache, v_cache, *scales))
    return caches


def unbind_kv_cache(layers: list[Attention], backend: ModuleType) -> None:
    for layer in layers:
        layer.bind(torch.empty(0), torch.empty(0), backend)


def check_holds_a_sequence(num_blocks: int, block_size: int, max_model_len: int) -> None:
    if num_blocks * block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks x {block_size} tokens = "
            f"{num_blocks * block_size} tokens, fewer than max_model_len "
            f"({max_model_len}); raise kv_cache_blocks / gpu_memory_utilization or lower "
            f"max_model_len"
        )


def check_fits(num_blocks: int, block_bytes: int, device: torch.device) -> None:
    """A requested kv_cache_blocks must fit the device's memory (on a GPU what is free now,
    counting what torch's cache holds unused; on the CPU the host's memory or the container's
    limit, whichever is less); beyond it the allocation would fail deep in torch, or the OOM
    killer would end the process as the zeros are written."""
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        capacity, what = torch.cuda.mem_get_info(device)[0] + unused, f"free memory of {device}"
    else:
        capacity, what = _host_memory_bytes()
    needed = num_blocks * block_bytes
    if needed > capacity:
        raise ValueError(
            f"kv_cache_blocks={num_blocks} needs {needed / 2**30:,.1f} GiB of KV cache "
            f"({block_bytes} bytes a block), more than the {what} ({capacity / 2**30:,.1f} GiB); "
            "lower kv_cache_blocks, or leave it unset to size the cache from "
            "gpu_memory_utilization"
        )


def _host_memory_bytes() -> tuple[int, str]:
    """The host's physical memory, or the cgroup v2 limit of this container where lower."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        limit = "max"
    if limit.isdigit() and int(limit) < physical:
        return int(limit), "container's memory limit"
    return physical, "host's physical memory"
