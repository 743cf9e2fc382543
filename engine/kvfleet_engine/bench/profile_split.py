"""Where a running server's time went during a load: `GET /debug/profile` before and after.

    python -m kvfleet_engine.bench.profile_split --url URL [--output OUT.json] -- COMMAND...

Runs COMMAND (a load generator), then prints, per serving process, how busy its loop thread
was (CPU seconds per wall second: near 1.0 means that process limits the server), GC pauses,
each named phase's seconds, count and share of the wall time, and the mean first-token hops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvfleet_engine.bench import around_load


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfleet_engine.bench.profile_split")
    around_load.add_arguments(parser)
    parser.add_argument("--output", type=Path, help="write the split as JSON here")
    args = parser.parse_args(argv)
    command = around_load.load_command(parser, args)
    before = fetch(args.url)
    returncode = around_load.run(command)
    after = fetch(args.url)
    split = split_of(before, after)
    print_split(split, args.label)
    if args.output:
        args.output.write_text(json.dumps(split, indent=1))
    return returncode


def fetch(url: str) -> dict[str, Any]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/debug/profile", timeout=30) as response:
        body: dict[str, Any] = json.loads(response.read())
    return body


def split_of(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Each process's interval between two `/debug/profile` bodies."""
    from kvfleet_engine.core.profile import ProcessProfile, interval

    return {
        role: interval(ProcessProfile(**before[role]), ProcessProfile(**after[role]))
        for role in ("api", "core")
        if role in before and role in after
    }


def print_split(split: dict[str, Any], label: str = "") -> None:
    title = f" ({label})" if label else ""
    for role, part in split.items():
        gc_ms = sum(part["gc_pause_s"]) * 1e3
        print(
            f"{role}{title}: busy {part['busy']:.2f} of {part['wall_s']:.1f} s "
            f"(all threads: {part['cpu_per_wall']:.2f} CPUs; {part['num_cpus']} CPUs, "
            f"torch threads {part['torch_threads']}); GC {part['gc_collections']} "
            f"collections, {gc_ms:.1f} ms"
        )
        print(f"  {'phase':<10}{'seconds':>9}{'share':>8}{'count':>9}{'ms each':>10}")
        for name, phase in part["phases"].items():
            if not phase["count"]:
                continue
            each = phase["s"] / phase["count"] * 1e3
            print(
                f"  {name:<10}{phase['s']:>9.3f}{phase['share']:>8.1%}{phase['count']:>9}"
                f"{each:>10.3f}"
            )
        hops = part.get("first_token_ms") or {}
        if hops:
            path = ", ".join(f"{hop} {ms:.2f}" for hop, ms in hops.items())
            print(f"  first token, mean ms over {part['num_first_tokens']}: {path}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
