"""Real engines standing in for kwok pods: one `kvfleet serve` (CPU) per Running pod of a
Deployment, bound at the pod's IP:8000 (kwok hands out IPs from a loopback CIDR), started when the
pod appears and stopped (SIGTERM, so it drains) when the pod goes. Used by the autoscaling e2e
test (tiny random model) and `make demo` (SmolLM2, a GGUF file)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvcluster.kubectl import Kubectl
from kvcluster.procs import stop_child

# One CPU thread per engine, as if each pod had its own core. Measured on 2 shared cores, SmolLM2
# with 8 chat requests in flight: 2 threads (torch's default) 22 tok/s alone, 6 tok/s while two
# more engines start, which then take 112 s to serve; 1 thread: 36 tok/s, 12 tok/s and 63 s.
ENGINE_THREADS = 1


class EnginePods:
    """One `kvfleet serve` per pod of the Deployment, bound at the pod's IP, kept in step with
    the pods by a background thread."""

    def __init__(
        self,
        kubectl: Kubectl,
        namespace: str,
        deployment: str,
        model: Path,
        logs: Path,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        restart: bool = False,
    ) -> None:
        """`model`: a model directory or GGUF file, served as `served_model_name` (default: the
        Deployment's name, as the operator does) with `extra_args` appended to each command
        line (e.g. the operator's `--quantization`); each engine logs to
        `logs`/engine-POD.log. `restart`: an engine that exits while its pod stays is started
        again, as the kubelet restarts a container: the pod turns unready with its restart
        count raised until the new engine's /ready answers."""
        self.kubectl, self.namespace, self.deployment = kubectl, namespace, deployment
        self.model, self.logs = model, logs
        self.extra_args = list(extra_args)
        self.served_model_name = served_model_name or deployment
        self.restart = restart
        self.procs: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        self.started: list[str] = []  # pod names, in start order
        self.restarting: set[str] = set()  # pods whose engine was started again, not ready yet
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
        with self._lock:
            ips = [ip for ip, _ in self.procs.values()]
        return [ip for ip in ips if _answers_ready(ip)]

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
                if self.restart:
                    self._restart_exited()
            self._stop.wait(0.5)

    def _restart_exited(self) -> None:
        for name, (ip, proc) in list(self.procs.items()):
            if proc.poll() is not None:
                self._set_pod_ready(name, ready=False)
                with self._lock:
                    del self.procs[name]
                self._start(name, ip)
                self.restarting.add(name)
            elif name in self.restarting and _answers_ready(ip):
                self._set_pod_ready(name, ready=True)
                self.restarting.discard(name)

    def _set_pod_ready(self, name: str, ready: bool) -> None:
        """The pod's Ready and ContainersReady conditions and its container's readiness, as the
        kubelet reports them; a container that exited also counts one more restart."""
        try:
            pod = self.kubectl.json("get", "pod", name, "-n", self.namespace)
        except Exception:  # gone meanwhile, or the API server is busy: the next pass sees
            return
        status = pod["status"]
        word = "True" if ready else "False"
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for condition in status.get("conditions", []):
            if condition["type"] in ("Ready", "ContainersReady"):
                condition.update(status=word, lastTransitionTime=now)
        for container in status.get("containerStatuses", []):
            container["ready"] = ready
            if not ready:
                container["restartCount"] = container.get("restartCount", 0) + 1
        patch = {
            "status": {k: status[k] for k in ("conditions", "containerStatuses") if k in status}
        }
        self.kubectl(
            "patch", "pod", name, "-n", self.namespace, "--subresource=status",
            "--type=merge", "-p", json.dumps(patch), check=False,
        )  # fmt: skip

    def _start(self, name: str, ip: str) -> None:
        # 256 tokens a step, not 512: the start-up self-benchmark's prefill (3 x 256 tokens) then
        # takes ~4 s of SmolLM2 on 2 cores, not ~10; 8 chat prompts still fit in two steps.
        command = [
            sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(self.model),
            "--served-model-name", self.served_model_name, "--host", ip, "--port", "8000",
            "--device", "cpu",
            "--kv-cache-blocks", "256", "--max-model-len", "512", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "256", "--drain-timeout", "5", *self.extra_args,
        ]  # fmt: skip
        with (self.logs / f"engine-{name}.log").open("ab") as log:
            env = {**os.environ, "OMP_NUM_THREADS": str(ENGINE_THREADS)}
            proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        with self._lock:
            self.procs[name] = (ip, proc)
            self.started.append(name)

    def _terminate(self, name: str) -> None:
        with self._lock:
            _, proc = self.procs.pop(name)
        stop_child(proc, signal.SIGTERM, 15)


def _answers_ready(ip: str) -> bool:
    try:
        return httpx.get(f"http://{ip}:8000/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
