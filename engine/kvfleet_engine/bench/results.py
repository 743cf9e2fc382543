"""Benchmark results: rows {system, metric, value, unit}, one JSON file per run, a short table."""

from __future__ import annotations

import argparse
import datetime
import json
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SYSTEMS = ("kvfleet", "transformers-generate", "transformers-generate_batch", "roofline")
# kvfleet and roofline rows of quantized weights carry the method: kvfleet-fp8, roofline-awq.
QUANTIZATIONS = ("fp8", "int8", "awq", "gptq")


def split_system(system: str) -> tuple[str, str]:
    """ "kvfleet-awq" -> ("kvfleet", "awq"); "kvfleet" -> ("kvfleet", "none")."""
    base, _, quantization = system.rpartition("-")
    if base in ("kvfleet", "roofline") and quantization in QUANTIZATIONS:
        return base, quantization
    return system, "none"


@dataclass(frozen=True)
class Row:
    system: str  # one of SYSTEMS, kvfleet / roofline with a quantization suffix
    metric: str  # e.g. decode_tokens_per_s, output_tokens_per_s
    value: float
    unit: str  # e.g. tokens/s, s, fraction

    def __post_init__(self) -> None:
        if split_system(self.system)[0] not in SYSTEMS:
            raise ValueError(
                f"system must be one of {SYSTEMS} (kvfleet and roofline may end in -"
                f"{'|'.join(QUANTIZATIONS)}), got {self.system!r}"
            )


def writable_dir(text: str) -> Path:
    """argparse type of an output directory (created when the results are written): its
    nearest existing ancestor must be a directory we can write in, so that a run never ends
    unable to save its results."""
    path = Path(text)
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write to {text!r}: {existing} is not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        raise argparse.ArgumentTypeError(
            f"cannot write to {text!r}: {existing} is not writable ({error.strerror or error})"
        ) from None
    return path


def writable_file(text: str) -> Path:
    """argparse type of an output file (its directories created when it is written): not a
    directory, and in a directory we can write in (see writable_dir)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write to {text!r}: it is a directory")
    writable_dir(str(path.parent))
    return path


def gpu_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return "cpu"


def write_results(
    directory: Path,
    what: str,
    gpu: str,
    command: str,
    shape: str,
    workload: dict[str, Any],
    rows: list[Row],
) -> Path:
    """bench/results/<date>-<gpu>-<what>.json with the keys gpu, date, command, shape,
    workload, results; `-run2`, `-run3`... before `.json` when an earlier run of the day wrote
    that name (a result is never overwritten)."""
    now = datetime.datetime.now(datetime.UTC)
    slug = re.sub(r"[^a-z0-9.]+", "-", gpu.lower()).strip("-")
    directory.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d}-{slug}-{what}"
    path = directory / f"{stem}.json"
    run = 2
    while path.exists():
        path = directory / f"{stem}-run{run}.json"
        run += 1
    document = {
        "gpu": gpu,
        "date": now.isoformat(timespec="seconds"),
        "command": command,
        "shape": shape,
        "workload": workload,
        "results": [asdict(row) for row in rows],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path


def format_table(rows: list[Row]) -> str:
    """system | metric | value | unit, plus each rate as a fraction of the roofline's (of the
    same quantization)."""
    roof = {
        (split_system(row.system)[1], row.metric): row.value
        for row in rows
        if split_system(row.system)[0] == "roofline"
    }
    header = f"{'system':<28} {'metric':<30} {'value':>12}  {'unit':<10} {'of roofline':>11}"
    lines = [header, "-" * len(header)]
    for row in rows:
        ratio = ""
        base, quantization = split_system(row.system)
        limit = roof.get((quantization, row.metric))
        if base != "roofline" and row.unit == "tokens/s" and limit:
            ratio = f"{row.value / limit:.1%}"
        lines.append(
            f"{row.system:<28} {row.metric:<30} {row.value:>12,.2f}  {row.unit:<10} {ratio:>11}"
        )
    return "\n".join(lines)
