"""Real engines standing in for kwok pods: one `kvfleet serve` (tiny model, CPU) per Running pod
of a Deployment, bound at the pod's IP:8000 (kwok hands out IPs from a loopback CIDR), started
when the pod appears and stopped (SIGTERM, so it drains) when the pod goes. Used by the
autoscaling e2e test and `make demo`."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from kvcluster.kubectl import Kubectl
from kvcluster.procs import stop_child


class EnginePods:
    """One `kvfleet serve` per pod of the Deployment, bound at the pod's IP, kept in step with
    the pods by a background thread."""

    def __init__(
        self, kubectl: Kubectl, namespace: str, deployment: str, model: Path, logs: Path
    ) -> None:
        self.kubectl, self.namespace, self.deployment = kubectl, namespace, deployment
        self.model, self.logs = model, logs
        self.procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        self.started: list[str] = []  # pod names, in start order
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> EnginePods:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for name in list(self.procs):
            self._terminate(name)

    def pods(self) -> list[dict[str, Any]]:
        items = self.kubectl.json(
            "get", "pods", "-n", self.namespace, "-l", f"kvfleet.io/deployment={self.deployment}"
        )["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def ready_ips(self) -> list[str]:
        ready = []
        with self._lock:
            ips = [ip for ip, _ in self.procs.values()]
        for ip in ips:
            try:
                if httpx.get(f"http://{ip}:8000/ready", timeout=1).status_code == 200:
                    ready.append(ip)
            except httpx.HTTPError:
                pass
        return ready

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                pods = {
                    p["metadata"]["name"]: p["status"].get("podIP")
                    for p in self.pods()
                    if p["status"].get("phase") == "Running"
                }
            except Exception:  # the API server is busy: try again
                pods = None
            if pods is not None:
                for name, ip in pods.items():
                    if ip and name not in self.procs:
                        self._start(name, ip)
                for name in set(self.procs) - set(pods):  # pod gone: its engine drains
                    self._terminate(name)
            self._stop.wait(0.5)

    def _start(self, name: str, ip: str) -> None:
        command = [
            sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(self.model),
            "--served-model-name", self.deployment, "--host", ip, "--port", "8000",
            "--device", "cpu",
            "--kv-cache-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--drain-timeout", "5",
        ]  # fmt: skip
        with (self.logs / f"engine-{name}.log").open("ab") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            self.procs[name] = (ip, proc)
            self.started.append(name)

    def _terminate(self, name: str) -> None:
        with self._lock:
            _, proc = self.procs.pop(name)
        stop_child(proc, signal.SIGTERM, 15)
