"""How paged decode attention is launched (`decode_attention`): tiles and warps per cache, the
programs an SM holds at once, and how many splits each (sequence, kv head)'s context takes.
Pure functions of shapes and dtypes: a captured decode graph's launch depends on nothing else."""

from __future__ import annotations

import functools
from dataclasses import dataclass

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


# The shared-prefix kernel's tiles (`shared_prefix`): query rows per program (16 sequences of a
# 4-head group, Llama-3.1-8B) and prefix tokens per tile, for every cache (the split kernel's
# vary: it has 4 rows).
PREFIX_BLOCK_Q = 64
PREFIX_BLOCK_N = 64


def choose_prefix_splits(
    num_seqs: int, group: int, num_kv_heads: int, max_context: int, num_sms: int, merged: bool
) -> int:
    """How many programs the prefix kernel runs (its splits times its tiles of query rows),
    never more splits than the longest prefix has tiles. Depends on shapes only.

    Its programs (168 registers and 82.9 KB of shared memory each, sm_90, a bf16 cache;
    `bench.kernel_asm`; two fit an SM) run beside the split kernel's and leave it room: one an
    SM beside a split kernel of several splits (on a second stream), one every other SM before
    a split kernel that merges their partials (`merged`: it launches with PDL and walks its own
    context meanwhile, `shared_prefix.launch`), whose programs (five an SM alone, three beside
    a prefix program) then fit one wave at 64 sequences of an 8B model. Measured on an H100, 64
    sequences of 2,112 tokens, 1,536 shared (bench/NOTES.md section 32): bf16, merged, 64.4-65.0
    us with 2 splits, 71.1-79.0 with 4, 83.3 with 8; an fp8 cache, beside, 62.8 with 4 splits,
    66.4 with 2, 71.5 with 8. Rounded down: a program past the places starts only when one
    ends (9 splits once made 288 programs for 264 places). Merged, at least two splits: one
    program walking the whole prefix outlasts the split kernel beside it (128 sequences:
    129.9 us with 1 split, 117.7 with 2; 256: 244.0 and 241.1)."""
    places = num_sms // 2 if merged else num_sms
    q_tiles = -(-num_seqs * group // PREFIX_BLOCK_Q)
    fit = max(places // max(q_tiles * num_kv_heads, 1), 2 if merged else 1)
    max_tiles = max(-(-max_context // PREFIX_BLOCK_N), 1)
    return max(1, min(fit, max_tiles, 64))


@dataclass(frozen=True)
class DecodePlan:
    """How one decode attention launch is tiled and split."""

    block_n: int  # context tokens per tile of the split kernel
    num_warps: int
    num_splits: int  # of each (sequence, kv head)'s context after any shared prefix
    prefix_splits: int  # the prefix kernel's (0: no shared prefix)

    @property
    def slots(self) -> int:
        """Partial outputs per (sequence, query head): the splits', then the prefix's."""
        return self.num_splits + self.prefix_splits

    @property
    def merge_prefix(self) -> bool:
        """One split over a shared prefix: the split kernel merges the prefix's partials
        itself, launched beside the prefix kernel by PDL (`pdl`), and no merge kernel runs."""
        return self.prefix_splits > 0 and self.num_splits == 1


@functools.cache  # asked once a layer by eager steps, as choose_num_splits is
def plan_decode(
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    max_context: int,
    num_sms: int,
    *,
    token_major_fp8: bool,  # a quantized cache with V token major (`kv_fp8`)
    fp8_codes: bool,  # e4m3 codes (int8 ones: not measured over 16-token tiles)
    mixed: bool,  # a step with prompt tokens (`decode_attention`)
    shared_prefix: bool,
    forced: tuple[int | None, int | None, int | None, int | None] = (None, None, None, None),
    registers: int | None = None,
) -> DecodePlan:
    """The tiles, warps and splits of a decode step's attention; `forced` (benchmarks): block_n,
    num_warps, num_splits, prefix_splits, each None for the rules'. A mixed step's splits are
    fixed, so every mixed step, eager or captured, runs one compile (and a shared prefix of 0
    tokens stands in for none, the same variant)."""
    block_n, num_warps, num_splits, prefix_splits = forced
    default_n, default_warps = TOKEN_MAJOR_FP8_TILES if token_major_fp8 else DEFAULT_TILES
    if token_major_fp8 and fp8_codes and not mixed and num_warps in (None, 1):
        default_n = token_major_fp8_tile(num_seqs, num_kv_heads, num_sms, registers)
    block_n = block_n or default_n
    num_warps = num_warps or default_warps
    if mixed:
        splits = (num_splits or MIXED_SPLITS, prefix_splits or MIXED_PREFIX_SPLITS)
        return DecodePlan(block_n, num_warps, *splits)
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_context, block_n, num_sms, num_warps, registers
        )
    if not shared_prefix:
        return DecodePlan(block_n, num_warps, num_splits, 0)
    prefix_splits = prefix_splits or choose_prefix_splits(
        num_seqs, group, num_kv_heads, max_context, num_sms, merged=num_splits == 1
    )
    return DecodePlan(block_n, num_warps, num_splits, prefix_splits)
