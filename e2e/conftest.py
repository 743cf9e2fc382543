"""pytest fixtures for end-to-end tests against the local control plane (e2e/kvcluster).

    pytestmark = pytest.mark.e2e

    def test_something(cluster, namespace):
        cluster.kubectl("get", "nodes")                  # stdout; raises KubectlError on failure
        pods = cluster.kubectl.json("get", "pods", "-n", namespace)   # parsed `-o json`
        cluster.kubectl.apply({...manifest dict...})     # kubectl apply -f -
        subprocess.run([...], env=cluster.env)           # env with KUBECONFIG set, e.g. for kopf
        cluster.kubeconfig                               # Path of the admin kubeconfig
        cluster.config.log_path("kube-apiserver")        # component logs; also ports, state dir

    from kvcluster.testing import E2ECluster, wait_until  # type hints; polling with a deadline
    pod = wait_until(lambda: find_running_pod(...), 60, "a Running pod")  # AssertionError at 60 s

`cluster` (session scope) starts the control plane if it is not running (building the binaries
on first use, 10-30 min) and stops it at the end of the session if this session started it and
no other pytest session is still using it. A cluster started with `make cluster-up` is reused
and left running. Set KVFLEET_KEEP_CLUSTER=1 to leave a cluster this session started running.

`namespace` (function scope) is a fresh namespace, deleted (without waiting) after the test.
`operator` (function scope): the CRDs installed and `kvfleet operator` watching `namespace`
(an operator_process.OperatorProcess; its log is `operator.log_path`). `tiny_model`: the tiny
random model written to the test's tmp_path (a module may define its own of either).

Nodes: `kvfleet-gpu-0..N-1`, each with `nvidia.com/gpu: 8` allocatable and the label
`nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3`. kwok marks scheduled pods Running and gives them
IPs from the node's loopback pod CIDR (127.1.<node>.0/24), so a test can bind a real process to
a pod's IP.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcluster import controlplane
from kvcluster.config import default_config
from kvcluster.testing import SUMMARY, E2ECluster
from operator_process import OperatorProcess, install_crds, running_operator, write_tiny_model


@pytest.fixture(scope="session")
def cluster() -> Iterator[E2ECluster]:
    config = default_config()
    config.state_dir.mkdir(parents=True, exist_ok=True)
    # Every session using the cluster holds a shared lock; the last one out may stop it.
    with (config.state_dir / ".users.lock").open("w") as users:
        fcntl.flock(users, fcntl.LOCK_SH)
        failure = None
        try:
            controlplane.up(config, owner="fixture", report=_report)
        except controlplane.ClusterError as exc:
            failure = str(exc)
        if failure is not None:
            pytest.fail(f"local control plane did not come up: {failure}", pytrace=False)
        yield E2ECluster(config, config.kubeconfig, controlplane.kubectl_for(config))
        if os.environ.get("KVFLEET_KEEP_CLUSTER") == "1":
            return
        try:
            fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # another session still uses it; it will stop it
        if controlplane.owner(config) == "fixture":
            controlplane.down(config, report=_report)


@pytest.fixture
def namespace(cluster: E2ECluster) -> Iterator[str]:
    with cluster.temporary_namespace("e2e-") as name:
        yield name


@pytest.fixture
def operator(cluster: E2ECluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    install_crds(cluster)
    with running_operator(cluster.env, [namespace], tmp_path / "operator.log") as started:
        yield started


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / "model")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for title, lines in SUMMARY.items():
        terminalreporter.section(title)
        for line in lines:
            terminalreporter.write_line(line)


def _report(line: str) -> None:
    print(line, file=sys.stderr)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every e2e test on one pytest-xdist worker (`make test` runs two): they share the one local
    control plane, which a second worker would start again on the same ports."""
    for item in items:
        if item.nodeid.startswith("e2e/"):
            item.add_marker(pytest.mark.xdist_group("cluster"))
