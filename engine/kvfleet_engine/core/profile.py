"""Where a serving process's time goes: wall seconds per named phase, CPU time, GC pauses.

Both serving processes keep one `PhaseProfile` (always on: a phase costs two clock reads). The
engine core times its step loop (idle wait, commands, schedule, launch, collect, update, output
record, send); the API process its request handling, pipe reads, output processing, chunk
writes. `GET /debug/profile` returns both snapshots; the difference of two snapshots taken
around a load says whether a process is saturated (`busy`: its loop thread's CPU seconds per
wall second) and on what. `first_token` sums each request's way to its first token, hop by hop
(`FIRST_TOKEN_HOPS`), over the requests that got one.
"""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import msgspec

# A request's way to its first token, as consecutive time.time() stamps; a hop is the time
# from the stamp before it. Set by: the HTTP app (received, handled), the API process's engine
# (sent, dispatched), the core (added, scheduled, token), the stream (written).
FIRST_TOKEN_HOPS = (
    "handled",  # ASGI call began -> route handler entered (body read, parsed, validated)
    "sent",  # -> AddRequest sent to the core (tokenize, checks, admission, encode)
    "added",  # -> the core applied it (pipe, input thread, the step loop's wait)
    "scheduled",  # -> first scheduled (waiting for a step's token budget)
    "token",  # -> its first token on the core's host (launch, device, collect)
    "dispatched",  # -> the API process put it on the request's stream (record, detokenize)
    "written",  # -> its first chunk handed to the HTTP transport
)


class ProcessProfile(msgspec.Struct, gc=False):
    """One process's totals since it started; subtract two to get an interval's."""

    # The process id and its role ("api" or "core").
    pid: int
    role: str
    # Seconds since the profile began.
    wall_s: float
    # CPU seconds of the whole process (all threads) and of the thread that runs its loop
    # (the step loop, the event loop: snapshots are taken there).
    cpu_s: float
    loop_thread_cpu_s: float
    # CPUs the process may run on, and the torch intra-op threads (0 where torch is not loaded).
    num_cpus: int
    torch_threads: int
    # name -> [seconds, count] of each named phase.
    phases: dict[str, list[float]]
    # Garbage collections: count and pause seconds per generation (index 0, 1, 2).
    gc_collections: list[int]
    gc_pause_s: list[float]
    # FIRST_TOKEN_HOPS name -> summed seconds, and how many requests contributed.
    first_token: dict[str, float] = {}
    num_first_tokens: int = 0


class PhaseProfile:
    """Accumulates phases on the thread that owns the process's loop (not thread-safe)."""

    def __init__(self, role: str, phases: tuple[str, ...]) -> None:
        self.role = role
        self._seconds = dict.fromkeys(phases, 0.0)
        self._counts = dict.fromkeys(phases, 0)
        self._first_token = dict.fromkeys(FIRST_TOKEN_HOPS, 0.0)
        self._num_first_tokens = 0
        self._started = time.perf_counter()
        self._gc_collections = [0, 0, 0]
        self._gc_pause_s = [0.0, 0.0, 0.0]
        self._gc_started = 0.0

    def track_gc(self) -> None:
        """Count collections and time their pauses from now on (once per process: a serving
        process's entry point calls it)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def add(self, phase: str, seconds: float, count: int = 1) -> None:
        self._seconds[phase] += seconds
        self._counts[phase] += count

    def add_first_token(self, stamps: dict[str, float]) -> None:
        """One request's first-token stamps: "received" and every FIRST_TOKEN_HOPS name."""
        previous = stamps["received"]
        for hop in FIRST_TOKEN_HOPS:
            stamp = stamps[hop]
            self._first_token[hop] += stamp - previous
            previous = stamp
        self._num_first_tokens += 1

    def snapshot(self) -> ProcessProfile:
        """The totals so far; call on the thread that runs the loop."""
        return ProcessProfile(
            pid=os.getpid(),
            role=self.role,
            wall_s=time.perf_counter() - self._started,
            cpu_s=time.process_time(),
            loop_thread_cpu_s=time.thread_time(),
            num_cpus=len(os.sched_getaffinity(0)),
            torch_threads=_torch_threads(),
            phases={k: [self._seconds[k], float(self._counts[k])] for k in self._seconds},
            gc_collections=list(self._gc_collections),
            gc_pause_s=list(self._gc_pause_s),
            first_token=dict(self._first_token),
            num_first_tokens=self._num_first_tokens,
        )

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, event: str, info: dict[str, Any]) -> None:
        if event == "start":
            self._gc_started = time.perf_counter()
            return
        generation = info["generation"]
        self._gc_collections[generation] += 1
        self._gc_pause_s[generation] += time.perf_counter() - self._gc_started


def _torch_threads() -> int:
    import sys

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 0


def interval(before: ProcessProfile, after: ProcessProfile) -> dict[str, Any]:
    """What happened between two snapshots of one process, as plain data: wall and CPU
    seconds, `busy` (loop-thread CPU per wall second), each phase's seconds, count and share of
    the wall time, GC pauses, and the mean first-token hops in milliseconds."""
    wall = max(after.wall_s - before.wall_s, 1e-9)
    phases = {}
    for name, (seconds, count) in after.phases.items():
        prev_seconds, prev_count = before.phases.get(name, [0.0, 0.0])
        spent = seconds - prev_seconds
        phases[name] = {
            "s": round(spent, 4),
            "count": int(count - prev_count),
            "share": round(spent / wall, 4),
        }
    num_first = after.num_first_tokens - before.num_first_tokens
    hops = {
        hop: round((seconds - before.first_token.get(hop, 0.0)) / num_first * 1e3, 3)
        for hop, seconds in after.first_token.items()
        if num_first
    }
    return {
        "role": after.role,
        "pid": after.pid,
        "wall_s": round(wall, 3),
        "cpu_s": round(after.cpu_s - before.cpu_s, 3),
        "busy": round((after.loop_thread_cpu_s - before.loop_thread_cpu_s) / wall, 3),
        "cpu_per_wall": round((after.cpu_s - before.cpu_s) / wall, 3),
        "num_cpus": after.num_cpus,
        "torch_threads": after.torch_threads,
        "phases": phases,
        "gc_collections": [
            a - b for a, b in zip(after.gc_collections, before.gc_collections, strict=True)
        ],
        "gc_pause_s": [
            round(a - b, 4) for a, b in zip(after.gc_pause_s, before.gc_pause_s, strict=True)
        ],
        "num_first_tokens": num_first,
        "first_token_ms": hops,
    }
