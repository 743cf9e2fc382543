"""`kvfleet bench accuracy`'s command line: --config NAME=PATH[:KEY=VALUE,...] (the options typed
as LLM()'s keyword defaults), --bound NAME=PERCENT and --device."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Config:
    name: str
    path: str
    # LLM() keywords given on the command line.
    options: dict[str, Any] = field(default_factory=dict)


def parse_config(text: str) -> Config:
    """NAME=PATH[:KEY=VALUE,...] -> Config; ValueError naming the problem."""
    from kvfleet_engine.config import EngineConfig

    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"--config must be NAME=PATH[:KEY=VALUE,...], got {text!r}")
    path, _, option_text = rest.partition(":")
    options: dict[str, Any] = {}
    defaults = EngineConfig.keyword_defaults()
    for item in filter(None, option_text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config {name}: option {item!r} is not KEY=VALUE")
        if key not in defaults:
            raise ValueError(f"--config {name}: unknown option {key!r}; one of {sorted(defaults)}")
        options[key] = _value(value)
        _check_type(name, key, options[key], defaults[key])
    return Config(name, path, options)


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _check_type(name: str, key: str, value: Any, default: Any) -> None:
    """The option's value is of its default's type (any, where the default is None)."""
    kind = type(default)
    if default is None or type(value) is kind or (kind is float and type(value) is int):
        return
    raise ValueError(f"--config {name}: {key} takes {_KINDS[kind]}, got {value!r}")


def _value(text: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_bound(text: str) -> tuple[str, float]:
    """NAME=PERCENT -> (name, percent); ValueError naming the problem."""
    name, sep, value = text.partition("=")
    try:
        percent = float(value)
    except ValueError:
        percent = None
    if not sep or not name or percent is None or math.isnan(percent):
        raise ValueError(f"--bound must be NAME=PERCENT, got {text!r}")
    return name, percent


def device_choice(text: str) -> str:
    """--device: auto, cpu, cuda or cuda:N."""
    if text in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", text):
        return text
    raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
