"""Smoke test of the local control plane: GPU nodes, scheduling, garbage collection, teardown."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from dataclasses import astuple, replace
from pathlib import Path
from typing import Any

import pytest

from kvcluster import binaries, controlplane, procs
from kvcluster.config import GPU_PRODUCT, ClusterConfig
from kvcluster.pki import ensure_pki
from kvcluster.testing import E2ECluster, wait_until

pytestmark = pytest.mark.e2e

GPU = "nvidia.com/gpu"


def gpu_deployment(namespace: str, name: str, gpus: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [
                        {
                            "name": "engine",
                            "image": "kvfleet/engine:e2e",  # never pulled: kwok runs nothing
                            "resources": {"limits": {GPU: str(gpus)}},
                        }
                    ]
                },
            },
        },
    }


def pods_of(cluster: E2ECluster, namespace: str, app: str) -> list[dict[str, Any]]:
    return list(cluster.kubectl.json("get", "pods", "-n", namespace, "-l", f"app={app}")["items"])


def running_pod(cluster: E2ECluster, namespace: str, app: str) -> dict[str, Any]:
    def check() -> dict[str, Any] | None:
        pods = pods_of(cluster, namespace, app)
        return pods[0] if pods and pods[0]["status"].get("phase") == "Running" else None

    return wait_until(check, 60, f"a Running pod of {app}")


def test_nodes_are_ready_with_eight_gpus(cluster: E2ECluster) -> None:
    nodes = cluster.kubectl.json("get", "nodes")["items"]

    assert len(nodes) >= cluster.config.num_nodes  # `up --nodes N` may have added more
    for node in nodes:
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True", node["metadata"]["name"]
        assert node["status"]["capacity"][GPU] == "8"
        assert node["status"]["allocatable"][GPU] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == GPU_PRODUCT


def test_gpu_deployment_is_scheduled_and_runs_with_a_loopback_ip(
    cluster: E2ECluster, namespace: str
) -> None:
    cluster.kubectl.apply(gpu_deployment(namespace, "llm", 4))

    pod = running_pod(cluster, namespace, "llm")

    assert pod["spec"]["nodeName"].startswith("kvfleet-gpu-")
    assert pod["spec"]["containers"][0]["resources"]["limits"][GPU] == "4"
    pod_ip = ipaddress.ip_address(pod["status"]["podIP"])
    assert pod_ip in ipaddress.ip_network(cluster.config.pod_cidr)
    assert pod_ip.is_loopback


def test_pod_asking_for_more_gpus_than_any_node_stays_pending(
    cluster: E2ECluster, namespace: str
) -> None:
    cluster.kubectl.apply(gpu_deployment(namespace, "huge", 9))

    def unschedulable() -> dict[str, Any] | None:
        pods = pods_of(cluster, namespace, "huge")
        conditions = pods[0]["status"].get("conditions", []) if pods else []
        return next(
            (c for c in conditions if c["type"] == "PodScheduled" and c["status"] == "False"),
            None,
        )

    condition = wait_until(unschedulable, 60, "PodScheduled=False on the 9-GPU pod")

    assert condition["reason"] == "Unschedulable"
    assert f"Insufficient {GPU}" in condition["message"]
    [pod] = pods_of(cluster, namespace, "huge")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_deleting_a_deployment_collects_its_replicaset_and_pods(
    cluster: E2ECluster, namespace: str
) -> None:
    cluster.kubectl.apply(gpu_deployment(namespace, "gc", 2))
    running_pod(cluster, namespace, "gc")
    assert cluster.kubectl.json("get", "replicasets", "-n", namespace, "-l", "app=gc")["items"]

    cluster.kubectl("delete", "deployment", "gc", "-n", namespace, "--wait=false")

    def collected() -> bool:
        rs = cluster.kubectl.json("get", "replicasets", "-n", namespace, "-l", "app=gc")
        return not rs["items"] and not pods_of(cluster, namespace, "gc")

    wait_until(collected, 60, "the ReplicaSet and pods of a deleted Deployment to be collected")


@pytest.fixture
def second_config(cluster: E2ECluster, tmp_path: Path) -> Iterator[ClusterConfig]:
    """A second, one-node cluster beside the session's, on other ports and its own state."""
    # Other pytest sessions on this machine may run this test at the same time: take the
    # first block of ports that is entirely free.
    offsets = range(1000, 3000, 50)
    ports = next(
        ports
        for ports in (cluster.config.ports.shifted(offset) for offset in offsets)
        if not any(procs.port_in_use(port) for port in astuple(ports))
    )
    config = replace(cluster.config, state_dir=tmp_path / "cluster", num_nodes=1, ports=ports)
    yield config
    controlplane.down(config, report=lambda line: None)


def test_taken_port_names_the_component_and_stops_what_started(
    second_config: ClusterConfig,
) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", second_config.ports.apiserver))
        squatter.listen()

        with pytest.raises(controlplane.ClusterError) as failure:
            controlplane.up(second_config, report=lambda line: None)

    message = str(failure.value)
    assert message.startswith("kube-apiserver: port 127.0.0.1:")
    assert str(second_config.ports.apiserver) in message
    assert str(second_config.log_path("kube-apiserver")) in message
    # etcd had started before the apiserver failed; it must be gone again
    assert second_config.log_path("etcd").is_file()
    assert controlplane.status(second_config) == []
    assert not procs.port_in_use(second_config.ports.etcd_client)


def test_component_that_exits_is_named_with_its_log_and_the_rest_is_stopped(
    second_config: ClusterConfig,
) -> None:
    pki = ensure_pki(second_config.state_dir / "pki")
    pki.sa_pub.write_text("not a public key\n")  # kube-apiserver refuses to start with this

    with pytest.raises(controlplane.ClusterError) as failure:
        controlplane.up(second_config, report=lambda line: None)

    message = str(failure.value)
    assert message.startswith("kube-apiserver: exited during start-up. Last log lines:")
    assert str(second_config.log_path("kube-apiserver")) in message
    assert controlplane.status(second_config) == []
    assert not procs.port_in_use(second_config.ports.etcd_client)


def test_down_leaves_no_process_running(second_config: ClusterConfig) -> None:
    assert controlplane.up(second_config, report=lambda line: None)
    started = controlplane.status(second_config)
    assert [s.name for s in started] == [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kwok",
    ]
    assert all(s.alive for s in started)

    stopped = controlplane.down(second_config, report=lambda line: None)

    assert stopped == [s.name for s in reversed(started)]
    assert not any(procs.is_alive(s.pid) for s in started)
    assert not [port for port in astuple(second_config.ports) if procs.port_in_use(port)]


def test_failed_build_names_the_binary_and_its_build_log(tmp_path: Path) -> None:
    spec = replace(
        binaries.BUILD_SPECS[0],
        key="etcd-broken",
        packages=("go.etcd.io/etcd/server/v3/no-such-command",),
    )

    with pytest.raises(binaries.BuildError) as failure:
        binaries.build(spec, tmp_path)

    build_log = tmp_path / "logs" / "etcd-broken.build.log"
    assert str(failure.value).startswith("building etcd (etcd-broken) failed with exit code 1")
    assert f"Full build log: {build_log}" in str(failure.value)
    assert "no-such-command" in build_log.read_text()
    assert not (tmp_path / "etcd-broken").exists()  # nothing half-built is cached
