"""How paged decode attention is launched (`decode_attention`): tiles and warps per cache, the
programs an SM holds at once, and how many splits each (sequence, kv head)'s context takes.
Pure functions of shapes and dtypes: a captured decode graph's launch depends on nothing else."""

from __future__ import annotations

import functools

# Tiles and warps where the caller leaves them (None): a token-major fp8 cache is read fastest by
# one-warp programs over 32-token tiles (H200, 512 x 1.5k: 69% of copy bandwidth, against 49-54%
# for the 4-warp, 64-token default, whose softmax reductions cross warps through shared memory);
# every other cache by 4 warps over 64 tokens.
TOKEN_MAJOR_FP8_TILES = (32, 1)
DEFAULT_TILES = (64, 4)
# ... and over 16-token tiles where unsplit programs fill two waves or more: H100, 512 x 1.5k
# (4,096 programs, 3.9 waves): 639.5 against 672.9 us (2026-12-05) and 616.8 against 664.1 us
# (90.1% of copy bandwidth against 83.7%, 2026-12-06), two calls; at 64 x 4k (512 programs, split
# in 2) they lost, 244.9 against 239.6 us. Over 16-token tiles the scales are loaded where used,
# not a tile ahead: 586.6 against 617.6 us at 512 x 1.5k (92.6% of copy bandwidth; the
# prefetch still wins over 32-token tiles: 64 x 4k 236.4 against 275.2 us), one H100 call.
# Not yet measured on an H200 (bench/NOTES.md section 24).
SHORT_FP8_TILE = 16
SHORT_FP8_TILE_WAVES = 2


def token_major_fp8_tile(
    num_seqs: int, num_kv_heads: int, num_sms: int, registers: int | None = None
) -> int:
    """Context tokens per tile of the one-warp fp8 decode programs (of `registers` a thread)
    for a step of num_seqs; an int8 cache keeps 32-token tiles (not measured with 16)."""
    slots = programs_per_sm(registers) * num_sms
    if num_seqs * num_kv_heads >= SHORT_FP8_TILE_WAVES * slots:
        return SHORT_FP8_TILE
    return TOKEN_MAJOR_FP8_TILES[0]


# One-warp programs (`TOKEN_MAJOR_FP8_TILES`) keep ptxas's own register count (255: 8 an SM). A cap
# of 192 (10 an SM, no spill in the sm_90 compile) measured slower on an H100 at 512 x 1.5k, fp8
# cache: 756.5 us capped (3 splits) against 673.0 uncapped (1 split) in one call; 2 splits capped
# 715.8 (bench/NOTES.md section 17). `registers` below: a launch's own cap (benchmarks).
def programs_per_sm(registers: int | None) -> int:
    """One-warp programs of `registers` a thread (None: 255) that fit on an SM at once."""
    return 65536 // (32 * (registers or 256))


# What a program costs beyond its tiles (its query, the merge's share), in tiles.
PROGRAM_COST_TILES = 2


@functools.cache  # eager steps ask once a layer: 15 us of Python a call at batch 1 uncached
def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_context: int,
    block_n: int,
    num_sms: int,
    num_warps: int = 4,
    registers: int | None = None,
) -> int:
    """Splits of each (sequence, kv head)'s context, never more than the longest possible context
    has tiles. Depends on shapes only. 4-warp programs: about two waves of them over the SMs.
    One-warp programs (of `registers` a thread): the splits that take the least time in waves of
    the programs that fit at once, each wave as long as a program's tiles and its fixed cost
    (64 x 4k on the H200, fp8 cache: 3 splits, 1.45 waves, 245 us; 2 splits, one wave, 215 us)."""
    pairs = max(num_seqs * num_kv_heads, 1)
    max_tiles = max(-(-max_context // block_n), 1)
    most = min(max_tiles, 64)
    if num_warps == 1:
        slots = programs_per_sm(registers) * num_sms

        def time(splits: int) -> tuple[int, int]:
            waves = -(-pairs * splits // slots)
            return waves * (-(-max_tiles // splits) + PROGRAM_COST_TILES), splits

        return min(range(1, most + 1), key=time)
    wanted = -(-2 * max(1, 4 // num_warps) * num_sms // pairs)
    return max(1, min(wanted, most))


# A mixed step's splits (the split kernel's are compile-time constants, and a mixed step's
# sequence count and block-table width vary from step to step where a captured decode step's do
# not): one per decode row over its context (mixed steps hold 16+ of them beside prompt chunks,
# which the prefill kernel attends before), the shared prefix in 4 per tile of rows (a prefix of
# no tokens when there is none, so that one variant serves both).
MIXED_SPLITS = 1
MIXED_PREFIX_SPLITS = 4
