"""argparse `type=` callables shared by the engine's command lines (serve, bench)."""

from __future__ import annotations

import argparse
import math

from kvfleet_engine.sampling import MAX_SEED


def _integer(text: str, low: float, high: float, expected: str, bounds: str | None = None) -> int:
    """`text` as an integer in [low, high]; else "expected {expected}" (or, for an integer out
    of range, "expected {bounds}"), got what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"expected {bounds or expected}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, math.inf, "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, math.inf, "an integer >= 0")


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**64 - 1], the range torch's generators take."""
    return _integer(text, 0, MAX_SEED, "an integer seed", "an integer in [0, 2**64 - 1]")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _finite_non_negative(text, "a number >= 0")


def positive_float(text: str) -> float:
    """A number > 0; `inf` is accepted."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def port_number(text: str) -> int:
    return _integer(text, 1, 65535, "a port number", "a port number in 1..65535")


def non_negative_seconds(text: str) -> float:
    return _finite_non_negative(text, "a number of seconds")


def _finite_non_negative(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value
