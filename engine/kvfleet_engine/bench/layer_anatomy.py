"""The kernels of a traced run grouped by the model's repeating pattern: a decoder layer's
kernels come in the same order in every layer and step, so each position of that order (the qkv
product, the attention, ...) gets its own mean time and the mean idle gap before it, in place in
the real step, PDL overlaps and graph replays included. `--host-trace` prints it.

The sequence is cut before each occurrence of its most frequent kernel (a layer's norm, say);
cuts with the same names in the same order are one pattern. A pattern seen at least twice is
reported; what falls in no repeated pattern (embedding, final norm, lm_head, sampling) is summed
apart."""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

Span = tuple[float, float, str]  # start, end (µs), kernel name


@dataclass
class Pattern:
    names: tuple[str, ...]
    count: int
    durations: list[float] = field(init=False)  # per position, summed over its runs
    gaps: list[float] = field(init=False)  # idle before each position, summed

    def __post_init__(self) -> None:
        self.durations = [0.0] * len(self.names)
        self.gaps = [0.0] * len(self.names)


def patterns(spans: Sequence[Span]) -> tuple[list[Pattern], float]:
    """The repeated patterns, most time first, and the µs of kernels in no repeated pattern."""
    ordered = sorted(spans)
    if not ordered:
        return [], 0.0
    counts = collections.Counter(name for _, _, name in ordered)
    anchor = max(counts, key=lambda name: (counts[name], -_first(ordered, name)))
    cuts = [i for i, (_, _, name) in enumerate(ordered) if name == anchor] + [len(ordered)]
    pieces = [
        (begin, end, tuple(name for _, _, name in ordered[begin:end]))
        for begin, end in [(0, cuts[0]), *itertools.pairwise(cuts)]
    ]
    counts_of = collections.Counter(names for _, _, names in pieces if names)
    repeated = {names: Pattern(names, n) for names, n in counts_of.items() if n >= 2}
    loose = 0.0
    for begin, end, names in pieces:
        pattern = repeated.get(names)
        for position, i in enumerate(range(begin, end)):
            start, stop, _ = ordered[i]
            if pattern is None:
                loose += stop - start
                continue
            pattern.durations[position] += stop - start
            if i > 0:
                pattern.gaps[position] += start - ordered[i - 1][1]
    return sorted(repeated.values(), key=lambda p: -sum(p.durations)), loose


def _first(ordered: Sequence[Span], name: str) -> int:
    return next(i for i, span in enumerate(ordered) if span[2] == name)


def report(spans: Sequence[Span], steps: int, top: int = 3) -> list[str]:
    """Lines: each repeated pattern's kernels with their mean µs and the mean gap before them
    (negative: it began before the previous one ended, as PDL allows), per step totals."""
    found, loose = patterns(spans)
    if not found:
        return []
    lines = ["layer anatomy (µs, mean per run; gap: idle before it, negative: overlapped):"]
    for p in found[:top]:
        per_step = sum(p.durations) / max(steps, 1) / 1e3
        lines.append(f"  pattern x{p.count} ({p.count / max(steps, 1):.0f} per step, "
                     f"{per_step:.3f} ms per step):")  # fmt: skip
        for name, total, gap in zip(p.names, p.durations, p.gaps, strict=True):
            lines.append(f"    {name[:64]:<64} {total / p.count:>8.1f}  gap {gap / p.count:>6.1f}")
    lines.append(f"  in no repeated pattern: {loose / max(steps, 1) / 1e3:.3f} ms per step")
    return lines
