"""How long a `kvfleet serve` takes to refuse 4 MiB request bodies of a million bad list
elements, and how long GET /health waits meanwhile (CPU; the API process is what is measured).

    python bench/hostile_bodies.py --tree . --tree /tmp/old-tree --output results.json

Each --tree is a checkout whose engine/ and operator/ are put first on PYTHONPATH for its
server (the tiny random model, built once); the trees run one after the other on one port.
Per body: its status, the seconds to the answer, the longest /health poll (every 20 ms) while
it was handled, and the server's peak RSS (VmHWM of its processes) after the load."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

LIMIT = 4 * 1024 * 1024 - 300  # under the server's default body limit (4 MiB)


def _list(items: bytes, fill: int) -> bytes:
    return b"[" + b",".join([items] * fill) + b"]"


def bodies(model: str) -> dict[str, tuple[str, bytes]]:
    """name -> (path, body): each a list of about a million bad (or, last, good) elements."""
    head = b'{"model": "' + model.encode() + b'", "max_tokens": 1, '
    chat = head + b'"messages": [{"role": "user", "content": '
    return {
        "prompt of empty lists": ("completions", head + b'"prompt": ' + _list(b"[]", LIMIT // 3)
                                  + b"}"),
        "prompt of floats": ("completions", head + b'"prompt": ' + _list(b"1.5", LIMIT // 4)
                             + b"}"),
        "negative stop_token_ids": ("completions", head + b'"prompt": "hi", "stop_token_ids": '
                                    + _list(b"-1", LIMIT // 3) + b"}"),
        "content of numbers": ("chat/completions", chat + _list(b"1", LIMIT // 2) + b"}]}"),
        "tools of numbers": ("chat/completions", chat + b'"hi"}], "tools": '
                             + _list(b"1", LIMIT // 2) + b"}"),
        "valid stop_token_ids": ("completions", head + b'"prompt": "hi", "stop_token_ids": '
                                 + _list(b"5", LIMIT // 2) + b"}"),
    }  # fmt: skip


def peak_rss_mib(pid: int) -> float:
    """VmHWM of the server and its children (the engine core), MiB."""
    pids = [pid]
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        pids += [int(p) for p in children.read_text().split()]
    total = 0
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1])
    return total / 1024


def measure(url: str, path: str, body: bytes) -> dict[str, float | int]:
    polls: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(f"{url}/health")
                polls.append(time.perf_counter() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    start = time.perf_counter()
    response = httpx.post(
        f"{url}/v1/{path}", content=body, headers={"Content-Type": "application/json"},
        timeout=300,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    time.sleep(0.2)
    done.set()
    poller.join()
    return {"status": response.status_code, "seconds": round(seconds, 3),
            "health_max_s": round(max(polls), 3), "bytes": len(body)}  # fmt: skip


def serve(tree: Path, model: str, port: int) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=f"{tree / 'engine'}:{tree / 'operator'}")
    command = [sys.executable, "-m", "kvfleet_cli", "serve", "--model", model, "--device", "cpu",
               "--port", str(port), "--max-model-len", "256"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"the server of {tree} did not become ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, action="append", required=True)
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    model = str(Path(tempfile.gettempdir()) / "kvfleet-hostile-tiny")
    subprocess.run([sys.executable, "-m", "kvfleet_cli", "tiny-model", model, "--force"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    results = {}
    for tree in args.tree:
        proc = serve(tree.resolve(), model, args.port)
        rows = {}
        try:
            for name, (path, body) in bodies(model).items():
                rows[name] = measure(f"http://127.0.0.1:{args.port}", path, body)
                print(f"{tree!s:<24} {name:<26} {rows[name]}", flush=True)
            rows["peak_rss_mib"] = round(peak_rss_mib(proc.pid), 1)  # type: ignore[assignment]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        results[str(tree)] = rows
    if args.output:
        args.output.write_text(json.dumps({"command": " ".join(sys.argv), "trees": results},
                                          indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
