"""What e2e tests hold: the `E2ECluster` handle (from the `cluster` fixture) and `wait_until`."""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import yaml

from kvcluster.config import ClusterConfig
from kvcluster.kubectl import Kubectl

T = TypeVar("T")
# Tables a test module leaves for the end of the session: title -> lines (e2e/conftest.py's
# pytest_terminal_summary prints them; output from a test or fixture is captured).
SUMMARY: dict[str, list[str]] = {}


@dataclass(frozen=True)
class E2ECluster:
    """What an e2e test gets from the `cluster` fixture."""

    config: ClusterConfig  # ports, state dir, log paths (config.log_path(name))
    kubeconfig: Path  # admin kubeconfig (system:masters)
    kubectl: Kubectl  # kubectl(*args) -> stdout, .json(*args), .apply(manifest)

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, for subprocesses (operator, kubectl, clients)."""
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def service_account_kubeconfig(
        self, directory: Path, account: str = "kvfleet-operator", namespace: str = "kvfleet-system"
    ) -> Path:
        """A kubeconfig for system:serviceaccount:NAMESPACE:ACCOUNT (a 2-hour token), written to
        DIRECTORY/operator.kubeconfig: the operator runs with exactly the shipped RBAC."""
        admin = yaml.safe_load(self.kubeconfig.read_text())
        token = self.kubectl("create", "token", account, "-n", namespace, "--duration=2h").strip()
        entry = admin["clusters"][0]["cluster"]
        if "certificate-authority" in entry:
            ca = Path(entry.pop("certificate-authority")).read_bytes()
            entry["certificate-authority-data"] = base64.b64encode(ca).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": entry}],
            "users": [{"name": account, "user": {"token": token}}],
            "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": account}}],
            "current-context": "e2e",
        }
        path = directory / "operator.kubeconfig"
        path.write_text(yaml.safe_dump(config))
        return path

    @contextmanager
    def temporary_namespace(self, prefix: str = "e2e-") -> Iterator[str]:
        """A fresh namespace PREFIX<8 hex digits> for the block, deleted (without waiting) after
        it."""
        name = f"{prefix}{uuid.uuid4().hex[:8]}"
        self.kubectl("create", "namespace", name)
        try:
            yield name
        finally:
            self.kubectl("delete", "namespace", name, "--wait=false", check=False)

    def wait_established(self, *crd_names: str, timeout_s: float = 30) -> None:
        """Wait until each CustomResourceDefinition is Established.

        Polls instead of `kubectl wait`, which fails outright on a CRD created a moment ago whose
        status has no conditions yet."""
        jsonpath = '{.status.conditions[?(@.type=="Established")].status}'
        for name in crd_names:
            wait_until(
                lambda name=name: (
                    self.kubectl(
                        "get", "crd", name, "-o", f"jsonpath={jsonpath}", check=False
                    ).strip()
                    == "True"
                ),
                timeout_s,
                f"CRD {name} to be Established",
            )


@contextmanager
def in_background(step: Callable[[], None], period_s: float) -> Iterator[None]:
    """Call `step` every `period_s` in a daemon thread for the block (and once more is not
    promised: the thread stops at the next period after the block)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            step()
            stop.wait(period_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=30)


def wait_until(
    check: Callable[[], T | None],
    timeout_s: float,
    what: str,
    details: Callable[[], str] | None = None,
) -> T:
    """Call `check` every 0.25 s until it returns something truthy; return that.

    On timeout, raise AssertionError naming `what`, followed by `details()` (say, log tails)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            message = f"timed out after {timeout_s:.0f}s waiting for {what}"
            raise AssertionError(f"{message}\n{details()}" if details else message)
        time.sleep(0.25)
