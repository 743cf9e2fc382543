"""A small kubectl wrapper bound to one kubeconfig."""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class KubectlError(RuntimeError):
    """kubectl exited non-zero; the message carries its command line and stderr."""


@dataclass(frozen=True)
class Kubectl:
    binary: Path  # the kubectl built with the control plane (same version as the apiserver)
    kubeconfig: Path

    def __call__(self, *args: str, input: str | None = None, check: bool = True) -> str:
        """Run `kubectl --kubeconfig=... *args`; return stdout. Raises KubectlError if check."""
        cmd = [str(self.binary), f"--kubeconfig={self.kubeconfig}", *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, check=False)
        if check and result.returncode != 0:
            raise KubectlError(
                f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
            )
        return result.stdout

    def json(self, *args: str) -> Any:
        """Run kubectl with `-o json` and parse the output."""
        return json.loads(self(*args, "-o", "json"))

    def find(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        """`kubectl get KIND NAME -n NAMESPACE -o json`, parsed; None when it is not found."""
        try:
            return dict(self.json("get", kind, name, "-n", namespace))
        except KubectlError as exc:
            if "NotFound" in str(exc):
                return None
            raise

    def apply(self, manifest: dict[str, Any]) -> str:
        return self("apply", "-f", "-", input=json.dumps(manifest))
