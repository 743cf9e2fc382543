"""`kvfleet --help` names every benchmark `kvfleet bench` runs."""

from __future__ import annotations

from kvfleet_cli.main import SUBCOMMANDS
from kvfleet_engine.bench.cli import BENCHMARKS


def test_the_bench_line_names_every_benchmark() -> None:
    _, help_ = SUBCOMMANDS["bench"]
    named = {name.strip() for name in help_.removeprefix("benchmarks:").split(",")}
    assert named == set(BENCHMARKS)
