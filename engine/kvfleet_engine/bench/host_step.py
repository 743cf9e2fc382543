"""Host cost of one engine step, on the CPU: `python -m kvfleet_engine.bench.host_step`.

A tiny model (2 layers, hidden 64) keeps the forward pass small, and `--num-seqs` requests
(default 256) decode together; the engine's own step runs unchanged while its parts are timed.
The figure that matters is host time per step: the whole step minus the model's forward pass
(on a GPU that part is the graph replay). Times are CPU time of this thread (time.thread_time),
which a busy shared machine disturbs far less than wall time; torch runs on one thread.
Writes `<output-dir>/<date>-cpu-host-step.json` with the exact command.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _timed(table: dict[str, list[float]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            table[name].append(time.thread_time() - start)

    return wrapper


MODEL_PART = "forward"  # the model's forward pass (on a GPU: the graph replay)


def _instrument(engine: Any, table: dict[str, list[float]]) -> None:
    """Wrap the step's parts (instance attributes); the model's forward pass must be one."""
    runner = engine.model_runner
    parts = [
        (engine.scheduler, "schedule"),
        (engine.scheduler, "update"),
        (runner, "prepare_inputs"),
        (runner.executor, MODEL_PART),
        (runner, "sampler"),
        (engine, "_output"),
        (engine, "_outputs"),
    ]
    for owner, name in parts:
        fn = getattr(owner, name, None)
        if fn is not None:
            setattr(owner, name, _timed(table, name, fn))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from kvfleet_engine.llm import LLM
    from kvfleet_engine.sampling import SamplingParams
    from kvfleet_engine.tiny_model import write_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="kvfleet-host-step-") as tmp:
        write_tiny_model(Path(tmp))
        llm = LLM(
            tmp,
            device="cpu",
            dtype="float32",
            max_num_seqs=args.num_seqs,
            max_num_batched_tokens=max(args.num_seqs * args.input_len, 2048),
            max_model_len=args.input_len + args.warmup_steps + args.steps + 8,
        )
    engine = llm.engine
    if hasattr(engine, "stream_outputs"):
        engine.stream_outputs = args.stream
    stop = ["never-matches-xyz"] if args.stop_strings else []
    params = SamplingParams(
        temperature=0.0,
        max_tokens=args.warmup_steps + args.steps + 4,
        ignore_eos=True,
        stop=stop,
    )
    for i in range(args.num_seqs):
        prompt = [(7 * i + j) % 250 + 1 for j in range(args.input_len)]
        engine.add_request(str(i), prompt, params)
    for _ in range(args.warmup_steps):  # prefill, then settle into pure decode
        engine.step()
    table: dict[str, list[float]] = defaultdict(list)
    _instrument(engine, table)
    steps: list[float] = []
    for _ in range(args.steps):
        start = time.thread_time()
        engine.step()
        steps.append(time.thread_time() - start)
    model = table.pop(MODEL_PART)
    if len(model) != len(steps):
        raise SystemExit(f"the model ran {len(model)} times in {len(steps)} steps")
    host = [s - m for s, m in zip(steps, model, strict=True)]
    ms = 1e3
    parts = {
        name: round(sum(values) / args.steps * ms, 3) for name, values in sorted(table.items())
    }
    return {
        "host_ms_per_step_median": round(statistics.median(host) * ms, 3),
        "host_ms_per_step_mean": round(statistics.mean(host) * ms, 3),
        "step_ms_per_step_median": round(statistics.median(steps) * ms, 3),
        "model_forward_ms_per_step_median": round(statistics.median(model) * ms, 3),
        "parts_ms_per_step_mean": parts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfleet_engine.bench.host_step", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--warmup-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument(
        "--stop-strings", action="store_true", help="give every request a stop string"
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="an output with text for every token (the server's mode); default: LLM.generate's",
    )
    parser.add_argument("--label", default="", help="tag stored in the JSON (e.g. before/after)")
    parser.add_argument("--output-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    results = run(args)
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python -m kvfleet_engine.bench.host_step " + " ".join(sys.argv[1:]),
        "label": args.label,
        "workload": {
            "num_seqs": args.num_seqs,
            "input_len": args.input_len,
            "steps": args.steps,
            "stop_strings": args.stop_strings,
            "stream": args.stream,
        },
        "results": results,
    }
    print(json.dumps(record, indent=2))
    if args.output_dir is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        suffix = f"-{args.label}" if args.label else ""
        path = args.output_dir / f"{record['date']}-cpu-host-step{suffix}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
