"""Pure planning: each component's command line, and the fake GPU nodes' manifests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcluster.config import (
    GPU_MEMORY_MIB,
    GPU_RESOURCE,
    GPUS_PER_NODE,
    KWOK_STAGES_DIR,
    POD_CIDR,
    SERVICE_CIDR,
    ClusterConfig,
)
from kvcluster.pki import Pki

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_STAGES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)


@dataclass(frozen=True)
class Component:
    """One control-plane process."""

    name: str  # also the log file's stem: logs/<name>.log
    argv: tuple[str, ...]  # full command line, binary first
    ports: tuple[int, ...]  # must be free on 127.0.0.1 before it starts
    health_url: str | None  # polled until it answers 200; None: readiness is checked elsewhere


def plan_components(
    config: ClusterConfig, binaries: dict[str, Path], pki: Pki, advertise_address: str
) -> list[Component]:
    """The processes of the control plane, in start order."""
    p = config.ports
    state = config.state_dir
    kubeconfig = str(config.kubeconfig)
    etcd_url = f"http://127.0.0.1:{p.etcd_client}"
    peer_url = f"http://127.0.0.1:{p.etcd_peer}"
    tls = (f"--tls-cert-file={pki.admin_cert}", f"--tls-private-key-file={pki.admin_key}")

    def controller_flags(port: int) -> tuple[str, ...]:
        """kube-controller-manager and kube-scheduler: the admin kubeconfig for everything, no
        leader election, the health port on loopback."""
        return (
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            *tls,
        )

    return [
        Component(
            name="etcd",
            argv=(
                str(binaries["etcd"]),
                "--name=kvfleet",
                f"--data-dir={state / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=kvfleet={peer_url}",
                "--auto-compaction-retention=1",
                "--unsafe-no-fsync=true",  # test data only: speed over durability
                "--log-level=warn",
            ),
            ports=(p.etcd_client, p.etcd_peer),
            health_url=f"{etcd_url}/health",
        ),
        Component(
            name="kube-apiserver",
            argv=(
                str(binaries["kube-apiserver"]),
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.apiserver}",
                # Must not be loopback; only written into the default/kubernetes Endpoints.
                f"--advertise-address={advertise_address}",
                *tls,
                f"--client-ca-file={pki.ca_cert}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                f"--proxy-client-cert-file={pki.admin_cert}",
                f"--proxy-client-key-file={pki.admin_key}",
                f"--requestheader-client-ca-file={pki.ca_cert}",
                "--requestheader-allowed-names=kvfleet-admin",  # CN of the proxy client cert
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                # An APIService's Service has no cluster IP route here (no kube-proxy): send the
                # aggregated API's requests to its endpoint (KEDA's metrics adapter) directly.
                "--enable-aggregator-routing=true",
            ),
            ports=(p.apiserver,),
            health_url=f"https://127.0.0.1:{p.apiserver}/readyz",
        ),
        Component(
            name="kube-controller-manager",
            argv=(
                str(binaries["kube-controller-manager"]),
                *controller_flags(p.controller_manager),
                f"--root-ca-file={pki.ca_cert}",
                f"--service-account-private-key-file={pki.sa_key}",
                # Short periods so tests see node health and autoscaling decisions quickly.
                "--node-monitor-period=5s",
                "--node-monitor-grace-period=40s",
                "--horizontal-pod-autoscaler-sync-period=5s",
                "--horizontal-pod-autoscaler-downscale-stabilization=15s",
            ),
            ports=(p.controller_manager,),
            health_url=f"https://127.0.0.1:{p.controller_manager}/healthz",
        ),
        Component(
            name="kube-scheduler",
            argv=(
                str(binaries["kube-scheduler"]),
                *controller_flags(p.scheduler),
            ),
            ports=(p.scheduler,),
            health_url=f"https://127.0.0.1:{p.scheduler}/healthz",
        ),
        Component(
            name="kwok",
            argv=(
                str(binaries["kwok"]),
                f"--kubeconfig={kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--node-lease-duration-seconds=40",
                f"--cidr={config.pod_cidr}",
                "--node-ip=127.0.0.1",
                f"--node-port={p.kwok}",
                f"--server-address=127.0.0.1:{p.kwok}",
                *tls,
                *(f"--config={KWOK_STAGES_DIR / stage}" for stage in KWOK_STAGES),
            ),
            ports=(p.kwok,),
            health_url=None,  # ready when its nodes are Ready
        ),
    ]


def node_name(index: int) -> str:
    return f"kvfleet-gpu-{index}"


def node_pod_cidr(index: int, pod_cidr: str = POD_CIDR) -> str:
    """127.<n>.<index>.0/24 inside `pod_cidr`: each node hands out its own loopback pod IPs."""
    first, second = pod_cidr.split(".")[:2]
    return f"{first}.{second}.{index}.0/24"


def render_node(index: int, gpu_product: str, pod_cidr: str = POD_CIDR) -> dict[str, Any]:
    """A fake GPU node kwok manages (metadata and spec; status is `render_node_status`)."""
    name = node_name(index)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                # the labels NVIDIA GPU feature discovery puts on a real node
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": gpu_product,
                "nvidia.com/gpu.count": str(GPUS_PER_NODE),
                "nvidia.com/gpu.memory": str(GPU_MEMORY_MIB),
            },
        },
        "spec": {"providerID": f"kwok://{name}", "podCIDR": node_pod_cidr(index, pod_cidr)},
    }


def render_node_status() -> dict[str, Any]:
    """Capacity a kubelet with 8 GPUs would report; kwok keeps it and marks the node Ready."""
    resources = {"cpu": "96", "memory": "1024Gi", "pods": "110", GPU_RESOURCE: str(GPUS_PER_NODE)}
    return {"status": {"capacity": resources, "allocatable": resources}}
