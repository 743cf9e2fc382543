"""charts/kvfleet rendered by a real helm (built by `make cluster-bin`): it lints, its defaults
install exactly what manifests/ does, and each value changes what it says it changes.

Without a helm binary these tests skip, unless KVFLEET_REQUIRE_HELM=1 (set by `make test`, so
CI never skips them silently)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvfleet"
MANIFESTS = ROOT / "manifests"
NAMESPACE = "kvfleet-system"

sys.path.insert(0, str(ROOT / "e2e"))
from kvcluster.binaries import HELM_SPEC, binary_paths  # noqa: E402
from kvcluster.config import cache_root  # noqa: E402


def _helm() -> Path:
    built = binary_paths(cache_root() / "bin", (HELM_SPEC,))["helm"]
    found = built if built.is_file() else shutil.which("helm")
    if found:
        return Path(found)
    message = f"no helm binary: `make cluster-bin` builds it into {built.parent}"
    if os.environ.get("KVFLEET_REQUIRE_HELM") == "1":
        pytest.fail(message)
    pytest.skip(message)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    home = {"HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"}
    env = {k: v for k, v in os.environ.items() if k not in home and k != "KUBECONFIG"}
    return subprocess.run(
        [str(_helm()), *args], capture_output=True, text=True, env=env, check=check
    )


def render(*values: str) -> list[dict[str, Any]]:
    """`helm template` with the CRDs, as a list of objects."""
    out = helm("template", "kvfleet", str(CHART), "-n", NAMESPACE, "--include-crds", *values)
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def kustomize_objects(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k directory` creates (its resources: files and directories
    with their own Kustomization)."""
    names = ("kustomization.yaml", "Kustomization")
    kustomization = next(directory / n for n in names if (directory / n).exists())
    objects = []
    for resource in yaml.safe_load(kustomization.read_text())["resources"]:
        path = directory / resource
        if path.is_dir():
            objects += kustomize_objects(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return objects


def by_key(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects
    }


def test_chart_lints_clean() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "1 chart(s) linted, 0 chart(s) failed" in result.stdout, result.stdout


def test_defaults_install_what_manifests_install_less_the_namespace() -> None:
    chart = by_key(render())
    manifests = by_key(kustomize_objects(MANIFESTS))

    namespace = manifests.pop(("Namespace", "", NAMESPACE))
    assert namespace["metadata"]["name"] == NAMESPACE  # helm install --create-namespace makes it
    assert sorted(chart) == sorted(manifests)
    for key, obj in manifests.items():
        assert chart[key] == obj, f"{key} differs between charts/kvfleet and manifests/"


def _operator(objects: list[dict[str, Any]], name: str = "kvfleet-operator") -> dict[str, Any]:
    deployment = by_key(objects)[("Deployment", NAMESPACE, name)]
    return dict(deployment["spec"]["template"]["spec"]["containers"][0])


def test_values_set_namespaces_engine_image_resources_and_placement() -> None:
    objects = render(
        "--set", "watchNamespaces={team-a,team-*}",
        "--set", "engine.image=registry.example/kvfleet-engine:dev",
        "--set", "image.tag=0.2.0", "--set", "image.pullPolicy=Always",
        "--set", "resources.limits.memory=1Gi",
        "--set", "hfEndpoint=https://hf-mirror.example",
        "--set", "hostPathPrefixes={/var/models,/mnt/weights}",
        "--set", "nodeSelector.pool=system",
    )  # fmt: skip
    container = _operator(objects)
    args = container["args"]
    assert args[args.index("--namespace") :] == [
        "--namespace", "team-a", "--namespace", "team-*", "--hf-endpoint",
        "https://hf-mirror.example", "--host-path-prefix", "/var/models",
        "--host-path-prefix", "/mnt/weights",
    ]  # fmt: skip
    assert container["env"][:2] == [
        {"name": "KVFLEET_ENGINE_IMAGE", "value": "registry.example/kvfleet-engine:dev"},
        # routers run the operator's own image, wherever that is pulled from
        {"name": "KVFLEET_ROUTER_IMAGE", "value": "ghcr.io/kvfleet/kvfleet-operator:0.2.0"},
    ]
    assert container["image"] == "ghcr.io/kvfleet/kvfleet-operator:0.2.0"
    assert container["imagePullPolicy"] == "Always"
    assert container["resources"]["limits"] == {"memory": "1Gi"}
    pod = by_key(objects)[("Deployment", NAMESPACE, "kvfleet-operator")]["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"pool": "system"}


def test_replicas_elect_a_leader_on_a_lease_of_the_installs_own_name() -> None:
    """Two replicas by default, each campaigning for the Lease named like the install, in its
    namespace, with a Role for leases there only; a second install elects its own leader."""
    for name in ("kvfleet-operator", "kvfleet-canary"):
        objects = by_key(render("--set", f"name={name}", "--set", "replicas=3"))
        deployment = objects[("Deployment", NAMESPACE, name)]
        assert deployment["spec"]["replicas"] == 3
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        args = container["args"]
        assert args[args.index("--leader-election") :][:3] == [
            "--leader-election", "--leader-election-id", name,
        ]  # fmt: skip
        env = {e["name"]: e.get("valueFrom") for e in container["env"]}
        assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
        assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        role = objects[("Role", NAMESPACE, f"{name}-leader-election")]
        assert role["rules"] == [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
             "verbs": ["get", "create", "update"]},
        ]  # fmt: skip
        binding = objects[("RoleBinding", NAMESPACE, f"{name}-leader-election")]
        assert binding["subjects"][0]["name"] == name
    assert by_key(render())[("Deployment", NAMESPACE, "kvfleet-operator")]["spec"]["replicas"] == 2


def test_service_monitor_scrapes_the_operator_metrics_service_with_its_labels() -> None:
    assert not [o for o in render() if o["kind"] == "ServiceMonitor"]  # off by default
    objects = by_key(
        render("--set", "serviceMonitor.enabled=true",
               "--set", "serviceMonitor.labels.release=kube-prometheus-stack")
    )  # fmt: skip
    monitor = objects[("ServiceMonitor", NAMESPACE, "kvfleet-operator")]
    service = objects[("Service", NAMESPACE, "kvfleet-operator-metrics")]
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "honorLabels": True}
    ]
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]


def test_dashboard_configmap_carries_the_dashboard_file_and_the_sidecar_label() -> None:
    assert not [o for o in render() if o["kind"] == "ConfigMap"]  # off by default
    objects = by_key(render("--set", "dashboard.enabled=true"))
    config_map = objects[("ConfigMap", NAMESPACE, "kvfleet-operator-dashboard")]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads((MANIFESTS / "dashboards" / "kvfleet.json").read_text())
    assert json.loads(config_map["data"]["kvfleet.json"]) == dashboard


def test_a_second_install_renames_every_cluster_wide_object() -> None:
    objects = render("--set", "name=kvfleet-team-a")
    cluster_wide = {(o["kind"], o["metadata"]["name"]) for o in objects
                    if o["kind"] in ("ClusterRole", "ClusterRoleBinding")}  # fmt: skip
    assert cluster_wide == {
        ("ClusterRole", "kvfleet-team-a"),
        ("ClusterRoleBinding", "kvfleet-team-a"),
    }
    binding = by_key(objects)[("ClusterRoleBinding", "", "kvfleet-team-a")]
    assert binding["subjects"][0]["name"] == "kvfleet-team-a"
    pod = by_key(objects)[("Deployment", NAMESPACE, "kvfleet-team-a")]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "kvfleet-team-a"


def test_two_installs_select_only_their_own_operator() -> None:
    """Beside the default install, a second one's Deployment, metrics Service and
    ServiceMonitor select its own pods only, the default's Services do not select its pods,
    and their dashboards do not collide."""
    on = ("--set", "serviceMonitor.enabled=true", "--set", "dashboard.enabled=true")
    first = by_key(render(*on))
    second = by_key(render(*on, "--set", "name=kvfleet-team-a"))

    def pod_labels(objects: dict[tuple[str, str, str], Any], name: str) -> dict[str, str]:
        deployment = objects[("Deployment", NAMESPACE, name)]["spec"]
        labels = deployment["template"]["metadata"]["labels"]
        assert deployment["selector"]["matchLabels"].items() <= labels.items()
        return labels

    pods = {"kvfleet-operator": pod_labels(first, "kvfleet-operator")}
    pods["kvfleet-team-a"] = pod_labels(second, "kvfleet-team-a")
    for objects, own in ((first, "kvfleet-operator"), (second, "kvfleet-team-a")):
        selector = objects[("Service", NAMESPACE, f"{own}-metrics")]["spec"]["selector"]
        selected = {name for name, labels in pods.items() if selector.items() <= labels.items()}
        assert selected == {own}
        monitor = objects[("ServiceMonitor", NAMESPACE, own)]["spec"]["selector"]["matchLabels"]
        services = [o for k, o in {**first, **second}.items() if k[0] == "Service"]
        matched = [s["metadata"]["name"] for s in services
                   if monitor.items() <= s["metadata"]["labels"].items()]  # fmt: skip
        assert matched == [f"{own}-metrics"]
    dashboards = {k for k in {**first, **second} if k[0] == "ConfigMap"}
    assert len(dashboards) == 2
    # The default install's Deployment selector is the one installs had before the instance
    # label: Kubernetes refuses a change of it on upgrade.
    default_selector = first[("Deployment", NAMESPACE, "kvfleet-operator")]["spec"]["selector"]
    assert default_selector == {"matchLabels": {"app.kubernetes.io/name": "kvfleet-operator"}}


def test_an_empty_engine_image_is_refused_naming_the_value() -> None:
    result = helm("template", "kvfleet", str(CHART), "--set", "engine.image=", check=False)
    assert result.returncode != 0
    assert "engine.image must name an image" in result.stderr


def test_values_outside_the_schema_are_refused_naming_the_value() -> None:
    for flag, where in (
        ("watchNamespace=team-a", "additional properties 'watchNamespace' not allowed"),
        ("metrics.port=80", "/metrics/port"),  # the operator runs as user 1000
        ("image.pullPolicy=Sometimes", "/image/pullPolicy"),
    ):
        result = helm("template", "kvfleet", str(CHART), "--set", flag, check=False)
        assert result.returncode != 0, flag
        assert where in result.stderr, result.stderr
