"""`make demo`'s tick display (e2e/demo_autoscaling.py): readable in 80 columns, both as the live
table of a terminal and as the plain lines it prints when stdout is not a terminal."""

from __future__ import annotations

import io
import re
import sys
from pathlib import Path

import pytest
from rich.console import Console

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))

import demo_autoscaling as demo
from demo_autoscaling import Tick, read_tick, render_line, render_table

ANSI = re.compile(r"\x1b\[[0-9;]*m")


def status(mode: str, reason: str, value: float | None = None) -> dict[str, object]:
    signals = (
        [] if value is None else [{"name": "generationTokenRate", "value": value, "target": 4}]
    )
    return {"status": {"autoscaling": {"mode": mode, "reason": reason, "signals": signals}}}


# Reasons as the operator writes them.
PANIC = "panic: generationTokenRate 16.23/4 per replica -> 5; clamped to [1, 3]"
PENDING = "hold: 2 replica(s) pending; generationTokenRate 5.1/4 per replica -> 2"
IDLE = "generationTokenRate 0/4 per replica -> 1"
TICKS = [
    read_tick(0.4, {}, 1, 1, True),  # before the autoscaler's first decision
    read_tick(12.3, status("Panic", PANIC, 16.23), 3, 1, True),
    read_tick(61.0, status("Stable", PENDING, 5.1), 3, 1, True),
    read_tick(130.0, status("Stable", IDLE, 0.0), 1, 1, False),
]


def test_a_tick_reads_the_autoscalers_status() -> None:
    tick = TICKS[1]
    assert (tick.replicas, tick.serving, tick.mode, tick.reading) == (3, 1, "Panic", "16.2/4")
    assert tick.reason == "panic: gen 16.23/4 -> 5; clamped to [1, 3]"
    assert (TICKS[0].mode, TICKS[0].reading, TICKS[0].reason) == ("-", "-", "")
    assert TICKS[2].reason == "hold: 2 pending; gen 5.1/4 -> 2"


@pytest.mark.parametrize("terminal", [True, False])
def test_the_table_fits_80_columns_and_keeps_every_value(terminal: bool) -> None:
    out = io.StringIO()
    Console(width=80, file=out, force_terminal=terminal).print(render_table(TICKS))
    lines = [ANSI.sub("", line) for line in out.getvalue().splitlines()]
    assert lines and max(len(line) for line in lines) <= 80
    header = next(line for line in lines if "replicas" in line)
    assert header.split()[:6] == ["t", "load", "replicas", "serving", "mode", "tok/s"]
    rows = [line.split() for line in lines if re.match(r"\s*\d+s ", line)]
    assert [row[:6] for row in rows[1:]] == [
        ["12s", "on", "3", "1", "Panic", "16.2/4"],
        ["61s", "on", "3", "1", "Stable", "5.1/4"],
        ["130s", "off", "1", "1", "Stable", "0/4"],
    ]
    assert "hold: 2 pending; gen 5.1/4 -> 2" in lines[lines.index(header) + 3]
    assert any(line.rstrip().endswith("…") for line in lines)  # the long reason, cut


def test_plain_lines_fit_80_columns_in_the_tables_columns() -> None:
    header, *lines = [render_line(None), *(render_line(tick) for tick in TICKS)]
    assert max(len(line) for line in [header, *lines]) <= 80
    assert header.split()[:6] == ["t", "load", "replicas", "serving", "mode", "tok/s"]
    assert lines[1].split()[:6] == ["12s", "on", "3", "1", "Panic", "16.2/4"]
    assert lines[1].endswith("…") and "panic: gen 16.23/4 -> 5" in lines[1]
    assert header.index("mode") == lines[1].index("Panic")  # aligned under the header
    assert lines[3].endswith("gen 0/4 -> 1")


def test_without_a_terminal_each_tick_that_changed_something_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(demo, "console", Console(width=80, file=out, force_terminal=False))
    same_but_later = Tick(**{**vars(TICKS[3]), "elapsed_s": 132.0})
    ticks: list[Tick] = []
    with demo._showing_ticks() as show:
        for tick in [*TICKS, same_but_later]:
            ticks.append(tick)
            show(ticks)
    lines = out.getvalue().splitlines()
    assert lines == [render_line(None), *(render_line(tick) for tick in TICKS)]


def test_help_says_what_the_demo_does(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` gives the docstring's whole first paragraph, not a sentence cut at a line."""
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (
        "then watch the operator scale it on the token rate its engines report, on the local "
        "control plane (it must be up: `make cluster-up`)."
    ) in text
