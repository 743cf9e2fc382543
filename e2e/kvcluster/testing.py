"""What e2e tests hold: the `E2ECluster` handle (from the `cluster` fixture) and `wait_until`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from kvcluster.config import ClusterConfig
from kvcluster.kubectl import Kubectl

T = TypeVar("T")


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
