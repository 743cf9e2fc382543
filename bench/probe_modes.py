"""The command line the perplexity probes share (`kv_fp8_rotation_probe.py`,
`w8a8_rotation_probe.py`): MODEL, --max-tokens, --modes and --out; each mode's perplexity printed
beside the `auto` mode's as it finishes, and the JSON of all of them."""

from __future__ import annotations

import argparse
import json
import pathlib
import time
from collections.abc import Callable, Sequence


def main(
    argv: list[str],
    script: str,
    description: str,
    modes: Sequence[str],
    run: Callable[[str, str, int], float],
) -> int:
    """run(model, mode, max_tokens) -> perplexity, for each mode asked for."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--modes", default=",".join(modes))
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.modes.split(",")) - set(modes))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; one of {list(modes)}")
    rows: dict[str, float] = {}
    for mode in args.modes.split(","):
        started = time.perf_counter()
        rows[mode] = run(args.model, mode, args.max_tokens)
        gap = (rows[mode] / rows["auto"] - 1) * 100 if "auto" in rows else float("nan")
        print(f"{mode:22s} {rows[mode]:.4f} {gap:+.2f}%  ({time.perf_counter() - started:.0f} s)")
    result = {
        "command": f"PYTHONPATH=engine python bench/{script} " + " ".join(argv),
        "model": pathlib.Path(args.model).name,
        "max_tokens": args.max_tokens,
        "perplexity": rows,
        "vs_auto_percent": {m: (v / rows["auto"] - 1) * 100 for m, v in rows.items()}
        if "auto" in rows
        else None,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0
