"""Versions, ports and paths of the local control plane, read once from the environment."""

from __future__ import annotations

import os
from dataclasses import astuple, dataclass, field
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
REPO_DIR = E2E_DIR.parent
TOOLS_DIR = E2E_DIR / "tools"
KWOK_STAGES_DIR = E2E_DIR / "kwok-stages"

KUBERNETES_VERSION = "v1.37.2"
ETCD_VERSION = "v3.6.16"
KWOK_VERSION = "v0.8.0"
# Beside the control plane: helm for the chart tests, Prometheus and KEDA for the integration tests.
HELM_VERSION = "v3.22.0"
PROMETHEUS_VERSION = "v0.316.0"  # the Go module's tag of Prometheus 3.16.0
KEDA_VERSION = "v2.21.0"

# Pod IPs come from here. The whole 127.0.0.0/8 is local on Linux, so a test can bind a real
# process (an engine) to a pod's IP and anything scraping the pod reaches it. A cluster moved by
# KVFLEET_PORT_OFFSET also moves its pod range (`pod_cidr_for`), so two clusters on one machine
# never hand out the same IP (their engines all bind <pod IP>:8000).
POD_CIDR = "127.1.0.0/16"
SERVICE_CIDR = "10.96.0.0/16"
GPU_RESOURCE = "nvidia.com/gpu"
GPUS_PER_NODE = 8
GPU_PRODUCT = "NVIDIA-H100-80GB-HBM3"
GPU_MEMORY_MIB = 81559


@dataclass(frozen=True)
class Ports:
    """TCP ports on 127.0.0.1, one per listening endpoint."""

    etcd_client: int = 2379  # etcd client URL
    etcd_peer: int = 2380  # etcd peer URL (single member, still must listen)
    apiserver: int = 6443  # kube-apiserver HTTPS
    controller_manager: int = 10257  # kube-controller-manager /healthz (HTTPS)
    scheduler: int = 10259  # kube-scheduler /healthz (HTTPS)
    kwok: int = 10247  # kwok's fake kubelet server
    prometheus: int = 9090  # Prometheus's HTTP API (integration tests)
    operator_metrics: int = 8481  # `kvfleet operator --metrics-port` in the integration tests
    keda_grpc: int = 9666  # KEDA operator's metrics service (gRPC), read by its adapter
    keda_health: int = 8681  # KEDA operator's /healthz and /readyz
    keda_metrics: int = 8682  # KEDA operator's own Prometheus metrics
    keda_adapter: int = 6543  # KEDA's external metrics API (HTTPS, on the host address)
    keda_adapter_metrics: int = 8683  # KEDA adapter's own Prometheus metrics

    def shifted(self, offset: int) -> Ports:
        """The same layout moved by `offset`, for a second cluster beside the first."""
        return Ports(*(port + offset for port in astuple(self)))


@dataclass(frozen=True)
class ClusterConfig:
    """Everything `up` needs; built at the edge (CLI, pytest fixture)."""

    state_dir: Path  # pki/, etcd/, logs/, kubeconfig and state.json live here
    bin_root: Path  # cache of built binaries, one sub-directory per version key
    num_nodes: int = 2  # fake GPU nodes to create
    ports: Ports = field(default_factory=Ports)
    ready_timeout_s: float = 90.0  # per component
    gpu_product: str = GPU_PRODUCT  # nvidia.com/gpu.product label of every node
    pod_cidr: str = POD_CIDR  # 127.<n>.0.0/16; node i hands out 127.<n>.<i>.0/24

    @property
    def logs_dir(self) -> Path:
        return self.state_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        return self.state_dir / "kubeconfig"

    def log_path(self, component: str) -> Path:
        return self.logs_dir / f"{component}.log"


def cache_root() -> Path:
    """~/.cache/kvfleet, or $KVFLEET_CACHE_DIR."""
    env = os.environ.get("KVFLEET_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "kvfleet"


def default_state_dir() -> Path:
    """<repo>/.kvfleet/cluster (gitignored), or $KVFLEET_CLUSTER_DIR."""
    env = os.environ.get("KVFLEET_CLUSTER_DIR")
    return Path(env) if env else REPO_DIR / ".kvfleet" / "cluster"


def default_config(num_nodes: int = 2) -> ClusterConfig:
    """$KVFLEET_PORT_OFFSET moves every port, so two clusters can share one machine."""
    raw_offset = os.environ.get("KVFLEET_PORT_OFFSET", "0")
    if not raw_offset.isdigit() or int(raw_offset) > 20000:
        raise ValueError(f"KVFLEET_PORT_OFFSET must be an integer 0..20000, got {raw_offset!r}")
    return ClusterConfig(
        state_dir=default_state_dir(),
        bin_root=cache_root() / "bin",
        num_nodes=num_nodes,
        ports=Ports().shifted(int(raw_offset)),
        pod_cidr=pod_cidr_for(int(raw_offset)),
    )


def pod_cidr_for(port_offset: int) -> str:
    """127.1.0.0/16 for offset 0; each further 100 of offset moves the second octet by one
    (offset 4000: 127.41.0.0/16), so clusters whose offsets differ by a multiple of 100 (up to
    25300) never share a pod IP."""
    return f"127.{1 + (port_offset // 100) % 254}.0.0/16"
