"""The local cluster harness's pure parts (e2e/kvcluster): pod ranges per port offset, the
Prometheus scrape config, the build stamps of the integration binaries."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "e2e"))
from kvcluster import binaries  # noqa: E402
from kvcluster.config import ClusterConfig, Ports, pod_cidr_for  # noqa: E402
from kvcluster.plan import render_node  # noqa: E402
from kvcluster.prometheus import render_config  # noqa: E402


def test_clusters_a_multiple_of_100_apart_never_share_a_pod_ip() -> None:
    ranges = [ipaddress.ip_network(pod_cidr_for(offset)) for offset in range(0, 25400, 100)]
    assert str(ranges[0]) == "127.1.0.0/16" and str(ranges[40]) == "127.41.0.0/16"
    assert all(r.is_loopback for r in ranges)
    assert len({r.network_address for r in ranges}) == len(ranges)


def test_each_node_hands_out_ips_inside_its_clusters_range() -> None:
    node = render_node(3, "NVIDIA-H100-80GB-HBM3", pod_cidr_for(4000))
    assert node["spec"]["podCIDR"] == "127.41.3.0/24"


def test_prometheus_scrapes_ready_engine_pods_with_service_monitor_labels_and_the_operator(
    tmp_path: Path,
) -> None:
    config = ClusterConfig(tmp_path, tmp_path / "bin", ports=Ports().shifted(4000))
    jobs = {job["job_name"]: job for job in render_config(config, 12481)["scrape_configs"]}
    engines = jobs["kvfleet-engines"]
    assert engines["kubernetes_sd_configs"][0]["api_server"] == "https://127.0.0.1:10443"
    relabel = engines["relabel_configs"]
    keeps = {r["source_labels"][0]: r["regex"] for r in relabel if r.get("action") == "keep"}
    assert keeps == {
        "__meta_kubernetes_pod_label_kvfleet_io_deployment": ".+",
        "__meta_kubernetes_pod_container_port_name": "http",
        "__meta_kubernetes_pod_ready": "true",
    }
    assert {r["target_label"] for r in relabel if "target_label" in r} == {
        "namespace", "service", "pod", "job"
    }  # fmt: skip
    assert jobs["kvfleet-operator"]["honor_labels"] is True
    assert jobs["kvfleet-operator"]["static_configs"] == [{"targets": ["127.0.0.1:12481"]}]
    assert "kvfleet-operator" not in {
        job["job_name"] for job in render_config(config, None)["scrape_configs"]
    }


def test_integration_binaries_carry_their_release_versions() -> None:
    assert "-X github.com/prometheus/common/version.Version=3.16.0" in (
        binaries.PROMETHEUS_SPEC.ldflags
    )
    assert "-X helm.sh/helm/v3/internal/version.version=v3.22.0" in binaries.HELM_SPEC.ldflags
    assert binaries.KEDA_SPEC.binaries == ("keda-operator", "keda-adapter")
    assert binaries.HELM_SPEC in binaries.TOOL_SPECS
    assert not set(binaries.INTEGRATION_SPECS) & set(binaries.TOOL_SPECS)


def test_cluster_status_of_a_stopped_control_plane_is_an_answer_not_a_failure(
    tmp_path: Path,
) -> None:
    """`make cluster-status` before `make cluster-up` (or after `cluster-down`) says so and exits
    0: make printed `Error 1` for it before."""
    import subprocess

    env = {"PATH": "/usr/bin:/bin", "KVFLEET_CLUSTER_DIR": str(tmp_path / "cluster")}
    result = subprocess.run(
        [sys.executable, str(ROOT / "e2e" / "cluster.py"), "status"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("control plane not running")
    assert "make cluster-up" in result.stdout
