"""The one shape of a bad-setting error: a ValueError naming the setting and what it allows."""

from __future__ import annotations


def check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
