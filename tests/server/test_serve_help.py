"""`kvfleet serve --help` names each flag's default once, and never as "None"."""

from __future__ import annotations

import re

from kvfleet_engine.server.cli import build_parser


def test_help_names_each_default_once() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "(default: None)" not in text
    # the help's own "(default: ...)", then argparse's again
    assert not re.search(r"\(default[^)]*\) \(default", text), text
    assert "model name clients send (default: --model) --host" in text
    assert "number of KV blocks (default: sized from free memory) --" in text
    assert "port to listen on (default: 8000)" in text  # defaults argparse adds still show
