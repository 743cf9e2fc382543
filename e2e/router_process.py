"""A real `kvfleet router` standing in for an InferenceDeployment's router pod: kwok runs the pod
the operator rendered and gives it an IP, and the router is bound at that IP:8000 with the
arguments the operator rendered, so whatever reaches the pod (the operator's autoscaler,
Prometheus through Kubernetes SD, a client) reaches the router. kwok's pod IPs are loopback
addresses, which the API server refuses in an EndpointSlice, so it discovers the engine pods
with `--discovery pods` (test_router.py exercises EndpointSlice discovery on its own). Used by
test_prometheus.py."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvcluster.procs import probe, stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

POD_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 180.0  # the router imports no torch, but the machine may be busy


def running_router_pod(cluster: E2ECluster, namespace: str, name: str) -> dict[str, Any] | None:
    """The first (by name) Running router pod of InferenceDeployment `name` with an IP."""
    pods = cluster.kubectl.json("get", "pods", "-n", namespace, "-l", f"kvfleet.io/router={name}")
    running = [
        p
        for p in pods["items"]
        if p["status"].get("phase") == "Running"
        and p["status"].get("podIP")
        and not p["metadata"].get("deletionTimestamp")
    ]
    return min(running, key=lambda p: str(p["metadata"]["name"])) if running else None


@contextmanager
def running_router(
    cluster: E2ECluster, namespace: str, name: str, log_path: Path
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The router of InferenceDeployment `name` for the block, at its first running router pod:
    yields (its URL, http://POD_IP:8000, and that pod) once /ready answers; stopped (SIGTERM)
    after the block."""
    pod = wait_until(
        lambda: running_router_pod(cluster, namespace, name), POD_TIMEOUT_S, "a router pod"
    )
    ip = pod["status"]["podIP"]
    args = pod["spec"]["containers"][0]["args"]
    command = [sys.executable, "-m", "kvfleet_cli", "router", *args,
               "--discovery", "pods", "--host", ip]  # fmt: skip
    with log_path.open("ab") as log:
        proc = subprocess.Popen(command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://{ip}:8000"
    try:
        wait_until(
            lambda: proc.poll() is None and probe(f"{url}/ready", None),
            READY_TIMEOUT_S,
            "the router's /ready",
            lambda: f"--- {log_path.name} ---\n{tail(log_path, 25)}",
        )
        yield url, pod
    finally:
        stop_child(proc, signal.SIGTERM, 20)
