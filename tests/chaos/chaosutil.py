"""What the chaos suite shares: real `kvfleet serve` processes, their pids and memory, SSE
reading, and the tally of cases tried and statuses seen that the suite reports at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e"))  # the process helpers
from kvcluster.procs import ENGINE_CORE, child_running, kill_tree
from kvcluster.procs import wait_gone as wait_gone  # the chaos tests use it

MODEL_NAME = "kvfleet-tiny"
API_KEY = "sk-chaos-0123456789abcdef"  # every chaos server requires it
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LABEL = f'{{model_name="{MODEL_NAME}"}}'


@dataclass
class Tally:
    """Per category: cases tried and the statuses they got (or a transport error's name)."""

    statuses: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    notes: dict[str, str] = field(default_factory=dict)  # fault -> what happened, how fast

    def add(self, category: str, status: int | str) -> None:
        self.statuses[category][str(status)] += 1

    def note(self, fault: str, text: str) -> None:
        self.notes[fault] = text

    def as_dict(self) -> dict[str, Any]:
        return {
            "categories": {
                name: {"cases": sum(seen.values()), "statuses": dict(sorted(seen.items()))}
                for name, seen in sorted(self.statuses.items())
            },
            "faults": self.notes,
        }

    def merge(self, summary: dict[str, Any]) -> None:
        """Add another process's `as_dict()` (a pytest-xdist worker's) to this tally."""
        for name, seen in summary["categories"].items():
            self.statuses[name].update(seen["statuses"])
        self.notes.update(summary["faults"])


TALLY = Tally()
# Where an xdist worker hands its tally to the controller (tests/conftest.py prints it there).
WORKER_OUTPUT_KEY = "kvfleet_chaos_tally"


def report(terminalreporter: Any, tally: Tally) -> None:
    """The suite's end-of-run section (and $KVFLEET_CHAOS_SUMMARY), if anything was tallied."""
    summary = tally.as_dict()
    if not summary["categories"] and not summary["faults"]:
        return
    write = terminalreporter.write_line
    terminalreporter.section("chaos suite: cases per category, statuses seen")
    for name, seen in summary["categories"].items():
        statuses = ", ".join(f"{status} x{count}" for status, count in seen["statuses"].items())
        write(f"{name:<28} {seen['cases']:>5}  {statuses}")
    for fault, text in summary["faults"].items():
        write(f"{fault:<28} {text}")
    path = os.environ.get("KVFLEET_CHAOS_SUMMARY")
    if path:
        Path(path).write_text(json.dumps(summary, indent=2) + "\n")
        write(f"written to {path}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Serve:
    """One `kvfleet serve` process on the tiny model (CPU), with the chaos API key."""

    def __init__(self, model_dir: Path, log_path: Path, port: int, *extra: str) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(model_dir)]
        command += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1"]
        command += ["--port", str(port), "--device", "cpu", "--max-model-len", "512"]
        command += ["--max-request-body-bytes", str(1024 * 1024), *extra]
        self._log = log_path.open("ab")
        env = {**os.environ, "KVFLEET_API_KEY": API_KEY}
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.log_path = log_path

    def wait_ready(self, timeout_s: float = 240.0) -> float:
        """Seconds until /ready answered 200."""
        began = time.monotonic()
        while time.monotonic() - began < timeout_s:
            if self.proc.poll() is not None:
                raise AssertionError(f"kvfleet serve exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready after {timeout_s} s: {self.tail()}")

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    @property
    def core_pid(self) -> int:
        return child_running(self.proc.pid, ENGINE_CORE)

    def stop(self) -> None:
        kill_tree(self.proc)
        self._log.close()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def metric(url: str, name: str) -> float:
    """The value of `name{model_name=...}` in the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    start = f"{name}{LABEL} "
    for line in text.splitlines():
        if line.startswith(start):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {start!r}")


def wait_idle(url: str, timeout_s: float = 30.0) -> float:
    """Seconds until running, waiting and KV usage are all 0."""
    began = time.monotonic()
    names = ("kvfleet_requests_running", "kvfleet_requests_waiting", "kvfleet_kv_cache_usage_ratio")
    while True:
        values = [metric(url, name) for name in names]
        if values == [0.0, 0.0, 0.0]:
            return time.monotonic() - began
        assert time.monotonic() - began < timeout_s, dict(zip(names, values, strict=True))
        time.sleep(0.1)


def sse_events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The JSON events of a server-sent-events response, up to [DONE]."""
    for line in response.iter_lines():
        if line == "data: [DONE]":
            return
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


@dataclass
class StreamResult:
    text: str = ""
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: dict[str, Any] | None = None


def read_stream(response: httpx.Response, stop_after_chunks: int | None = None) -> StreamResult:
    """Collect a completion stream (with include_usage); stop reading after that many chunks."""
    result = StreamResult()
    for k, event in enumerate(sse_events(response)):
        if "error" in event:
            result.error = event["error"]
        for choice in event.get("choices", []):
            result.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            result.finish_reason = choice.get("finish_reason") or result.finish_reason
        if event.get("usage"):
            result.completion_tokens = event["usage"]["completion_tokens"]
        if stop_after_chunks is not None and k + 1 >= stop_after_chunks:
            break
    return result
