"""`kvfleet router` on an address it cannot bind: one line naming it and exit 2, as
`kvfleet serve` does, never a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys


def _router(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvfleet_cli", "router", "--backend", "http://127.0.0.1:9"]
    return subprocess.run([*command, *flags], capture_output=True, text=True, timeout=60)


def test_a_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _router("--host", "127.0.0.1", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"kvfleet router: cannot listen on 127.0.0.1:{port}: " in result.stderr
    assert "in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_unknown_host_is_one_line_and_exit_2() -> None:
    result = _router("--host", "999.1.1.1", "--port", "8000")
    assert result.returncode == 2, result.stderr
    assert "kvfleet router: cannot listen on 999.1.1.1:8000: " in result.stderr
    assert "Traceback" not in result.stderr
