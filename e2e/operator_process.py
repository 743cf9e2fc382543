"""What the e2e tests that run the operator share: the CRDs installed, `kvfleet operator` as a
subprocess (started, killed, restarted), the tiny random model written, a Llama manifest, and
waits that show the logs' last lines when they time out. The `operator` and `tiny_model`
fixtures of conftest.py are built from these."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

ROOT = Path(__file__).resolve().parents[1]
STARTED_LINE = "'configure' succeeded"  # kopf logs it once the startup handler ran
START_ATTEMPTS = 3
START_TIMEOUT_S = 180.0  # kopf's start on a loaded 2-core machine
T = TypeVar("T")


def install_crds(cluster: E2ECluster) -> None:
    """crds/ applied (server-side), the InferenceDeployment CRD Established."""
    cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.wait_established("inferencedeployments.kvfleet.io")


def write_tiny_model(directory: Path) -> Path:
    """`kvfleet tiny-model DIRECTORY`: the tiny random model the CPU engines serve."""
    subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "tiny-model", str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


def llama_manifest(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    """An InferenceDeployment of Llama 3.1 8B on the fake H100s, `spec` added (no engine
    process runs it: kwok marks its pods ready)."""
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
            "resources": {"accelerator": "h100-80gb"},
            **spec,
        },
    }


def wait_logged(
    check: Callable[[], T | None],
    timeout: float,
    what: str,
    logs: Sequence[Path] | Callable[[], Sequence[Path]],
) -> T:
    """`wait_until`, with the last lines of each of `logs` (or of what `logs()` returns then)
    in the timeout's message."""

    def tails() -> str:
        paths = logs() if callable(logs) else logs
        return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in paths if p.exists())

    return wait_until(check, timeout, what, tails)


class OperatorProcess:
    """`kvfleet operator --namespace N...` as a subprocess logging to `log_path`."""

    def __init__(
        self,
        env: dict[str, str],
        namespaces: Sequence[str],
        log_path: Path,
        extra_args: Sequence[str] = (),
    ) -> None:
        """`env`: with KUBECONFIG (E2ECluster.env, or a service account's kubeconfig);
        `namespaces`: the --namespace patterns; `extra_args`: e.g. --metrics-port."""
        self.env, self.log_path = env, log_path
        self.argv = [sys.executable, "-m", "kvfleet_cli", "operator"]
        for namespace in namespaces:
            self.argv += ["--namespace", namespace]
        self.argv += list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Start it and wait until its startup handler ran; seconds that took. Its 30 s start-up
        check of the API server can time out on a loaded machine: then it starts again."""
        began = time.monotonic()
        for _ in range(START_ATTEMPTS):
            if self._start_once():
                return time.monotonic() - began
        raise AssertionError(f"the operator exited {START_ATTEMPTS} times at start\n{self.tail()}")

    def _start_once(self) -> bool:
        """One start; False if the process exited before its startup handler ran."""
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.proc = proc
        wait_until(
            lambda: proc.poll() is not None or STARTED_LINE in self._log_since(offset),
            START_TIMEOUT_S,
            "the operator to start",
            self.tail,
        )
        return proc.poll() is None

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Stop it with `sig` (SIGKILL: a crash), SIGKILL after 20 s."""
        if self.proc is not None:
            stop_child(self.proc, sig, 20)
            self.proc = None

    def tail(self, lines: int = 40) -> str:
        return f"--- operator log ---\n{tail(self.log_path, lines)}"

    def _log_since(self, offset: int) -> str:
        with self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")


@contextmanager
def running_operator(
    env: dict[str, str], namespaces: Sequence[str], log_path: Path, extra_args: Sequence[str] = ()
) -> Iterator[OperatorProcess]:
    """An OperatorProcess, started for the block and stopped (SIGTERM) after it."""
    operator = OperatorProcess(env, namespaces, log_path, extra_args)
    operator.start()
    try:
        yield operator
    finally:
        operator.stop()
