"""The quantized KV caches (`kv_cache_dtype="fp8"` and `"int8"`): the formats, and the Triton
helpers with which the store kernels quantize and the attention kernels read them.

Format (`layers.attention_torch.quantize_kv` defines it bit for bit; every kernel matches it):
- codes: float8_e4m3fn (fp8) or int8 (int8: -127..127, rounded to nearest even) in the cache
  tensors' own layout, [num_blocks, block_size, kv_heads, head_dim];
- scales: bfloat16 [num_blocks, kv_heads, block_size] beside each of K and V, one per token and
  kv head: value = code * scale.
- K is stored rotated by the Hadamard matrix after RoPE, the queries likewise
  (`layers.kv_rotation`, done by the attention layer and `fused.rotary_store_kv`): what is
  quantized here is already rotated; these helpers do not know.
The kernels tell the two apart by the cache tensors' element type (a compile-time constant), so
every kernel that reads or writes one reads or writes the other.

Why:
- Dynamic scales per (token, kv head), computed as each row is stored: no calibration, nothing
  extra in checkpoints, and an outlier token or head coarsens only its own row. A static scale per
  layer (vLLM's k_scale / v_scale, 1.0 unless calibrated) clips every value above 448 times the
  scale and spends the format's range on rows that do not need it.
- e4m3, not e5m2: with a scale per row the range is not needed, the mantissa bit is (relative
  rounding error 2^-4 instead of 2^-3).
- int8: a float code's relative rounding does not depend on its scale, so e4m3's 3 mantissa bits
  bound what any scale or rotation can recover (on SmolLM2 the rotated e4m3 K still costs +0.56%
  perplexity over 65k tokens). After the rotation a row of K is close to Gaussian, with no
  outlier channel; an even grid of 255 steps rounds such a row with a quarter of e4m3's error
  (0.6% against 2.5% relative RMS on Gaussian rows), and the gap vanishes (bench/NOTES.md section
  16). Integer codes convert to float16 exactly, and need no e4m3 type: any GPU.
- The scale is the row's largest magnitude / 448 rounded *up* to a bfloat16, and the codes are the
  row times the reciprocal of that rounded scale: no code exceeds 448 (nothing clips) and the
  rounding of the scale costs no accuracy. Two bytes per row instead of float32's four: head_dim
  128 stores 130 bytes per token and head against bf16's 256 (1.97x the tokens; head_dim 64,
  1.94x), and the attention kernels read 1.5% more bytes than the codes alone.
- Scales [blocks, kv_heads, block_size], not [blocks, block_size, kv_heads]: a program attending
  with one kv head reads a block's scales as one contiguous run instead of one 2-byte value per
  num_kv_heads * 2 bytes (which would pull whole 32-byte sectors for each).
- Dequantization is folded into attention: scores = (q · codes) * k_scale per column, and the
  softmax weights are multiplied by v_scale (times 2^9, kept in fp16's normal range) before
  p · codes. With 16-bit queries both dots run in float16, whatever the query dtype: e4m3 converts
  to float16 in one instruction per pair (to bfloat16 it takes three, which bound the first
  kernels at 42% of copy bandwidth); bfloat16 queries are rescaled by a power of two per row into
  float16's range first (exact), undone on the scores. The weighted values must stay below
  65504: values up to ~57000 in magnitude. fp32 queries keep fp32 dots.
- V is token major in memory for the Triton kernels (`checks.token_major`: [num_blocks, kv_heads,
  head_dim, block_size] under a view of K's shape; the allocator does it where the backend sets
  `QUANTIZED_V_TOKEN_MAJOR`). Tensor cores take V with the context as the reduction axis, so each
  thread needs consecutive tokens of one dimension: in float16 the operand loads transpose rows on
  the way (ldmatrix.trans), in 8-bit codes they cannot. With V in K's row layout the kernels
  converted each tile to float16 and sent it through shared memory again to transpose it
  (`swapped_pairs`, the early_v variant): Nsight Compute on the H200 (512 x 1.5k decode) saw shared
  memory as the limit (L1 81% busy against DRAM 47%; 4-way bank conflicts on those transposing
  loads). Token major, V's codes take K's path: one asynchronous copy into shared memory, loaded as
  operands and converted in registers. The kernels read and write either layout (strides), so a
  row-layout V (the torch and sdpa backends') still works.

Hardware: Triton has an e4m3 type (float8e4nv) only on compute capability >= 8.9 (Ada, Hopper) and
refuses to compile it below (A100), so the engine refuses kv_cache_dtype=fp8 with the triton
backend there, at start-up (int8 runs anywhere). The torch and sdpa backends use torch's own
e4m3 casts and read an fp8 cache on any device.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvfleet_engine.layers.attention_torch import AMAX_FLOOR, FP8_MAX, INT8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)
_INT8_MAX = tl.constexpr(INT8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_ROUND = tl.constexpr(12582912.0)  # 1.5 * 2^23: (x + _ROUND) - _ROUND rounds |x| < 2^22 to even


@triton.jit
def v_scale_boost(codes_ty: tl.constexpr):
    """A scale is ~1/448 (e4m3) or ~1/127 (int8) of its row's largest value, so softmax weights
    times V's scales would fall among fp16's subnormals for small values; the attention kernels
    weight by scale * this power of two instead (2^9 for e4m3, 2^7 for int8: the weighted rows
    stay below ~1.14 times V's largest magnitude) and multiply the sum back, exactly. codes_ty:
    the V cache's element type."""
    if codes_ty == tl.int8:
        boost = 128.0
    else:
        boost = 512.0
    return boost


@triton.jit
def row_amax(x):
    """The largest magnitude [rows] of each row of x [rows, cols], in float32."""
    return tl.max(tl.abs(x.to(tl.float32)), axis=1)


@triton.jit
def code_max(codes_ty: tl.constexpr):
    """The largest code of a cache whose element type is codes_ty: 127 (int8) or 448 (e4m3)."""
    if codes_ty == tl.int8:
        top = _INT8_MAX
    else:
        top = _FP8_MAX
    return top


@triton.jit
def kv_scales(amax, codes_ty: tl.constexpr):
    """Each row's scale, float32 holding a bfloat16 (amax / the largest code, rounded up), and its
    reciprocal: `quantize_kv`'s rule, in the same IEEE operations."""
    amax = tl.maximum(amax, _AMAX_FLOOR)
    bits = tl.math.div_rn(amax, code_max(codes_ty)).to(tl.uint32, bitcast=True)
    scale = ((bits + 0xFFFF) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return scale, tl.math.div_rn(1.0, scale)


@triton.jit
def to_codes(x, inverse_scale, codes_ty: tl.constexpr):
    """Codes of x (float rows) times their scale's reciprocal (broadcast against x): e4m3, or
    integers rounded to nearest even."""
    scaled = x.to(tl.float32) * inverse_scale
    if codes_ty == tl.int8:
        # Clamped before the rounding (the same codes): the product does not feed the addition
        # directly, so it cannot become one fused multiply-add, which would round x * inverse
        # to an integer in one step where the reference rounds it to float32 first.
        scaled = tl.clamp(scaled, -_INT8_MAX, _INT8_MAX)
        codes = ((scaled + _ROUND) - _ROUND).to(tl.int8)
    else:
        codes = tl.clamp(scaled, -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)
    return codes


@triton.jit
def quantize_rows(x, codes_ty: tl.constexpr):
    """x [rows, cols] (masked-out elements 0) -> codes [rows, cols] of codes_ty (the cache's
    element type) and scales [rows] bfloat16."""
    scale, inverse = kv_scales(row_amax(x), codes_ty)
    return to_codes(x, inverse[:, None], codes_ty), scale.to(tl.bfloat16)


@triton.jit
def f16_rows(q):
    """q [rows, cols] (bfloat16 or float16) as float16 rows scaled by a power of two each, so
    that the largest magnitude lands in [2^14, 2^15] (exact: float16 holds bfloat16's 8-bit
    mantissa over that range); and the float32 [rows] factor that undoes the scaling of a dot
    product. A row of zeros keeps factor 1."""
    amax = row_amax(q)
    exponent = tl.where(amax > 0, tl.math.ceil(tl.math.log2(tl.where(amax > 0, amax, 1.0))), 0.0)
    shift = tl.math.exp2(15.0 - exponent)
    return (q.to(tl.float32) * shift[:, None]).to(tl.float16), 1.0 / shift


@triton.jit
def swapped_pairs(x):
    """x [rows, cols] with columns 2i and 2i+1 swapped. A V tile passes through this after its
    conversion so that the conversion cannot be moved after the load from shared memory (the
    swap is not elementwise): the tile then makes the trip as float16, which the tensor-core
    operand loads transpose (ldmatrix.trans), instead of as e4m3 read byte by byte."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    even, odd = tl.split(tl.reshape(x, [rows, cols // 2, 2]))
    return tl.reshape(tl.join(odd, even), [rows, cols])


@triton.jit
def v_tile(block_ids, positions, used, rows_off, kv_offset, kv_mask, kv_head, dims, dim_mask,
           stride_cvb, stride_cvh, stride_cvd, V_ROWS: tl.constexpr, RUN: tl.constexpr,
           BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The offsets [BLOCK_N, BLOCK_D] of a V tile (tokens x dims) and the mask to load it with:
    K's own (V_ROWS: V in K's layout), or token major: each block's base plus the token's place
    in it, declared contiguous in runs of RUN = min(tile, block) tokens from multiples of RUN
    (true: tiles and blocks start at multiples of RUN, a block's stride is a multiple of its
    size), and masked by whole blocks (`used`: the tokens of blocks holding context, the block
    ids loaded under the same mask). The block ids come from loads, which hide the runs from
    the compiler, and a mask that changes from token to token splits them too: either way each
    code was loaded alone (measured: 33% of copy bandwidth against 48% in the row layout). The
    tokens of a partly used last block past the context are loaded too: `v_rows_valid` zeroes
    them."""
    if V_ROWS:
        offsets = rows_off[:, None] + kv_offset
        mask = kv_mask
    else:
        rows = block_ids.to(tl.int64) * stride_cvb + positions % BLOCK_SIZE
        rows = tl.max_contiguous(tl.multiple_of(rows, RUN), RUN)
        offsets = rows[:, None] + (kv_head * stride_cvh + dims * stride_cvd)[None, :]
        mask = used[:, None] & dim_mask[None, :]
    return offsets, mask


@triton.jit
def v_rows_valid(v, valid, V_ROWS: tl.constexpr):
    """A converted V tile with the rows past the context zeroed (a token-major tile loads whole
    blocks: a slot no token of this sequence wrote may hold anything, even NaN, and 0 x NaN in
    the product would spread it)."""
    if not V_ROWS:
        v = tl.where(valid[:, None], v, 0.0)
    return v


@triton.jit
def tile_scales(
    scales_ptr, block_ids, kv_head, positions, valid, stride_sb, stride_sh, BLOCK_SIZE: tl.constexpr
):
    """The float32 scales [BLOCK_N] of one kv head's tokens at `positions`, in the blocks
    `block_ids` (0 where not `valid`)."""
    offsets = block_ids.to(tl.int64) * stride_sb + kv_head * stride_sh + positions % BLOCK_SIZE
    return tl.load(scales_ptr + offsets, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def tile_block_ids(block_table, tile_start, end, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The block ids [BLOCK_N] of the tile of positions from tile_start (0 past `end`)."""
    positions = tile_start + tl.arange(0, BLOCK_N)
    return tl.load(block_table + positions // BLOCK_SIZE, mask=positions < end, other=0)


@triton.jit
def prefetched_scales(
    k_scales_ptr,
    v_scales_ptr,
    block_table,
    ids_next,
    tile_start,
    end,
    kv_head,
    stride_sb,
    stride_sh,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Software pipelining of the scale loads, which hang off the block table: during the tile at
    tile_start, the K and V scales [BLOCK_N] of the next tile (from `ids_next`, its block ids,
    loaded one tile earlier) and the block ids of the tile after it. Nothing loaded here is used
    before the next iteration, so no load waits on another within one (loaded where used, each
    tile waited for its block ids, then for its scales, twice the latency the bf16 loop sees)."""
    next_start = tile_start + BLOCK_N
    positions = next_start + tl.arange(0, BLOCK_N)
    valid = positions < end
    k_scale = tile_scales(
        k_scales_ptr, ids_next, kv_head, positions, valid, stride_sb, stride_sh, BLOCK_SIZE
    )
    v_scale = tile_scales(
        v_scales_ptr, ids_next, kv_head, positions, valid, stride_sb, stride_sh, BLOCK_SIZE
    )
    ids_after = tile_block_ids(block_table, next_start + BLOCK_N, end, BLOCK_N, BLOCK_SIZE)
    return k_scale, v_scale, ids_after
