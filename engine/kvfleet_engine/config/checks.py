"""The one shape of a bad-setting error: a ValueError naming the setting and what it allows."""

from __future__ import annotations

import math


def check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def is_int(value: object) -> bool:
    """An integer, and not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_switch(name: str, value: object) -> None:
    check(isinstance(value, bool), name, value, "True or False")
