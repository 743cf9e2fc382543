"""`kvfleet bench serve --client-processes`: several client processes share one load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvfleet_engine.bench.serve import main


def test_two_client_processes_send_every_request_once(live_server: Any, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = ["--url", live_server.url, "--concurrency", "3", "--num-prompts", "5"]
    argv += ["--random-input-len", "8", "--random-output-len", "4", "--no-progress"]
    argv += ["--client-processes", "2", "--output", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["completed"] == 5 and results["failed"] == 0
    assert results["total_output_tokens"] == 20 and results["total_input_tokens"] == 40
    assert results["duration_s"] > 0 and results["ttft_ms"]["p50"] > 0
