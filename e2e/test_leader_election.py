"""Two operator replicas with `--leader-election` on the local control plane: one holds the
Lease and reconciles, the other waits; the leader SIGKILLed (its pod's node lost), the standby
takes the Lease once it has stood unrenewed for its 15 s and reconciles what comes next; a leader
stopped with SIGTERM (a rolling update) releases the Lease on its way out."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from kvcluster.testing import E2ECluster
from operator_process import OperatorProcess, install_crds, llama_manifest, wait_logged

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

LEASE = "kvfleet-operator"


def test_a_standby_takes_over_when_the_leader_dies_and_at_once_when_it_leaves(
    cluster: E2ECluster, namespace: str, tmp_path: Path
) -> None:
    install_crds(cluster)
    kubectl = cluster.kubectl

    def holder() -> str | None:
        lease = kubectl.find("lease", LEASE, namespace)
        return ((lease or {}).get("spec") or {}).get("holderIdentity")

    def replica(identity: str) -> OperatorProcess:
        env = {**cluster.env, "POD_NAMESPACE": namespace, "POD_NAME": identity}
        return OperatorProcess(
            env, [namespace], tmp_path / f"{identity}.log", ["--leader-election"]
        )

    a, b = replica("operator-a"), replica("operator-b")
    logs = [a.log_path, b.log_path]
    try:
        a.start()
        wait_logged(lambda: holder() == "operator-a", 30, "operator-a to take the Lease", logs)
        b.start()
        kubectl("apply", "--server-side", "-f", "-",
                input=json.dumps(llama_manifest(namespace, "first")))  # fmt: skip
        wait_logged(lambda: kubectl.find("deployment", "first", namespace), 60,
                    "the leader to reconcile 'first'", logs)  # fmt: skip
        assert holder() == "operator-a"
        assert "leading" not in b.log_path.read_text()  # the standby never led

        a.stop(signal.SIGKILL)  # no release: the standby waits the Lease out
        killed = time.monotonic()
        wait_logged(lambda: holder() == "operator-b", 60, "operator-b to take the Lease", logs)
        takeover_s = time.monotonic() - killed
        assert 10 <= takeover_s <= 40, takeover_s  # the lease's 15 s, seen from b's own clock
        kubectl("apply", "--server-side", "-f", "-",
                input=json.dumps(llama_manifest(namespace, "second")))  # fmt: skip
        wait_logged(lambda: kubectl.find("deployment", "second", namespace), 60,
                    "the new leader to reconcile 'second'", logs)  # fmt: skip

        b.stop(signal.SIGTERM)  # shutting down: it gives the Lease up
        assert holder() is None
        print(f"\nleader SIGKILLed: the standby led {takeover_s:.1f} s later")
    finally:
        a.stop()
        b.stop()
