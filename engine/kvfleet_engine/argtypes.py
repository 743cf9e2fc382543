"""argparse `type=` callables shared by the engine's command lines (serve, bench)."""

from __future__ import annotations

import argparse
import math
import os
import re

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


def served_model_name(text: str) -> str:
    """The name clients send as `model`: 1 to 253 characters, no whitespace (it is also a
    metric label and a log field; the operator's servedModelName takes the same)."""
    if not re.fullmatch(r"\S{1,253}", text):
        raise argparse.ArgumentTypeError(
            f"expected 1 to 253 characters without whitespace, got {text!r}"
        )
    return text


def api_key(text: str) -> str:
    """A bearer key a client can send: printable ASCII without spaces at either end (an
    Authorization header cannot carry a newline, and the server strips the spaces)."""
    if not re.fullmatch(r"[!-~]([ -~]*[!-~])?", text):
        raise argparse.ArgumentTypeError(
            "expected a non-empty key of printable ASCII characters, not starting or ending "
            "with a space (unset: no authentication)"
        )
    return text


def api_key_or_environment(
    parser: argparse.ArgumentParser, given: str | None, variable: str
) -> str | None:
    """--api-key's value, else the environment `variable` checked as the flag is (set but empty
    is refused, not read as no authentication), else None."""
    if given is not None:
        return given
    value = os.environ.get(variable)
    if value is None:
        return None
    try:
        return api_key(value)
    except argparse.ArgumentTypeError as error:
        parser.error(f"${variable}: {error}")


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
