"""One context tile of the attention kernels' online softmax, shared by decode and prefill: the
running row max and sum updated by a tile's scores (log2 domain, -inf where masked), and the
tile's P · V when the cache is fp8 (V scaled per token, rows past the context zeroed, and with
EARLY_V converted in swapped pairs before shared memory: `kv_fp8`)."""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.kernels.kv_fp8 import V_SCALE_BOOST, swapped_pairs, v_rows_valid


@triton.jit
def softmax_tile(scores, m_i, l_i):
    """(new row max, the factor that rescales what came before, P, new row sum) of a tile."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def fp8_pv(
    p, v, v_scale, valid, dot_like,
    V_ROWS: tl.constexpr, EARLY_V: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """P · V of an fp8 tile in dot_like's dtype: the per-token V scales (boosted, undone after
    the loop) go into P."""
    weighted = (p * (v_scale * V_SCALE_BOOST)[None, :]).to(dot_like.dtype)
    v = v_rows_valid(v.to(dot_like.dtype), valid, V_ROWS)
    if EARLY_V:  # columns swapped in pairs (undone at the store): see swapped_pairs
        v = swapped_pairs(v)
    return tl.dot(weighted, v, input_precision=DOT_PRECISION)
