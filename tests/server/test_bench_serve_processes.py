"""`kvfleet bench serve --client-processes`: several client processes share one load."""

from __future__ import annotations

import json
import os
import sys
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


def _late_clients(tmp_path: Path, monkeypatch: Any, then: str) -> Path:
    """Client interpreters started from here on run `then` (Python) at start-up, before they
    import anything, all but the first to start; returns the file the first one claims."""
    site = tmp_path / "site"
    site.mkdir()
    claim = tmp_path / "first-client"
    (site / "sitecustomize.py").write_text(
        "import os, time\n"
        "try:\n"
        f"    os.close(os.open({str(claim)!r}, os.O_CREAT | os.O_EXCL))\n"
        "except FileExistsError:\n"
        f"    {then}\n"
    )
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *sys.path]))
    return claim


TWO_CLIENTS = ["--concurrency", "2", "--num-prompts", "2", "--client-processes", "2"]
TWO_CLIENTS += ["--random-input-len", "8", "--random-output-len", "2", "--no-progress"]


def test_client_processes_send_their_first_requests_together(
    live_server: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    # The second client is 1.5 s late (a busy host): the early one must still wait for it
    # rather than load the server alone.
    claim = _late_clients(tmp_path, monkeypatch, then="time.sleep(1.5)")
    out = tmp_path / "bench.json"
    assert main(["--url", live_server.url, *TWO_CLIENTS, "--output", str(out)]) == 0
    assert claim.exists()  # the clients did start through the slow site
    results = json.loads(out.read_text())["results"]
    assert results["completed"] == 2
    assert results["client_start_spread_ms"] < 500  # not the 1,500 ms the late one took
    # the duration runs from the common start: not the late process's 1.5 s of start-up
    assert results["duration_s"] < 1.5


def test_a_client_process_that_dies_ends_the_load_with_an_error(
    live_server: Any, tmp_path: Path, monkeypatch: Any, capfd: Any
) -> None:
    # The second client exits at start-up: the first, waiting for it, is stopped and the
    # command says which process failed, without a traceback.
    _late_clients(tmp_path, monkeypatch, then="os._exit(3)")
    assert main(["--url", live_server.url, *TWO_CLIENTS]) == 1
    err = capfd.readouterr().err  # the client processes' stderr too
    assert "kvfleet bench serve: error: bench-client-" in err and "exit code 3" in err
    assert "Traceback" not in err


def test_the_report_says_how_much_the_prefix_cache_served(
    live_server: Any, tmp_path: Path, capsys: Any
) -> None:
    # The same seed twice: the second load's prompts are the first's, so the server computes
    # only what its cache does not hold (each 64-token prompt's last block: 48 of 64 cached).
    argv = ["--url", live_server.url, "--concurrency", "5", "--num-prompts", "5", "--seed", "4242"]
    argv += ["--random-input-len", "64", "--random-output-len", "4", "--no-progress"]
    records = []
    for run in ("cold", "warm"):
        out = tmp_path / f"{run}.json"
        assert main([*argv, "--output", str(out)]) == 0
        records.append(json.loads(out.read_text())["results"]["server"])
    cold, warm = records
    assert cold["prefix_cache_queries"] == warm["prefix_cache_queries"] == 5 * 64
    assert cold["prefix_cache_hit_ratio"] == 0.0
    assert warm["prefix_cache_hits"] == 5 * 48 and warm["prefix_cache_hit_ratio"] == 0.75
    assert cold["steps_prefill"] + cold["steps_mixed"] >= 1 and cold["steps_decode"] >= 1
    assert "server: prompt tokens from cache  75.0% (240 of 320)" in capsys.readouterr().out


def test_the_counters_wrap_any_load_generator(live_server: Any, capsys: Any) -> None:
    from kvfleet_engine.bench import serve_counters

    # One 40-token completion sent by a plain script: the record counts its prompt and steps.
    load = (
        "import httpx, sys; r = httpx.post(sys.argv[1] + '/v1/completions', timeout=60,"
        " json={'model': 'kvfleet-tiny', 'prompt': list(range(3, 43)), 'max_tokens': 3,"
        " 'ignore_eos': True}); sys.exit(r.status_code != 200)"
    )
    argv = ["--url", live_server.url, "--label", "one", "--", sys.executable, "-c", load]
    assert serve_counters.main([*argv, live_server.url]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert record["label"] == "one"
    assert record["server"]["prompt_tokens"] == record["server"]["prefix_cache_queries"] == 40
    assert record["server"]["steps_decode"] >= 2  # tokens 2 and 3
