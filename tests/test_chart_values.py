"""charts/kvfleet given careless values: `helm template` (and so `helm install`) refuses each one
naming the value, instead of rendering objects Kubernetes refuses, pods that never start or an
operator that exits at start-up."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from test_chart import CHART, NAMESPACE, _operator, helm, render


def refusal(*values: str) -> str:
    """helm's error for `helm template` with `values` (--set flags)."""
    args = [arg for value in values for arg in ("--set", value)]
    result = helm("template", "kvfleet", str(CHART), "-n", NAMESPACE, *args, check=False)
    assert result.returncode != 0, f"{values} rendered"
    return result.stderr


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # the metrics Service "<name>-metrics" is a DNS-1035 label: it starts with a letter
        ("name=1kvfleet", "at '/name': '1kvfleet' does not match"),
        # a tag with a space, a repository with its own tag: pods fail with InvalidImageName
        ("image.tag=0.1 beta", "at '/image/tag': '0.1 beta' does not match"),
        ("image.repository=ghcr.io/kvfleet/op:0.2", "at '/image/repository'"),
        ("engine.image=registry.example/engine 0.1", "at '/engine/image'"),
        # quantities Kubernetes refuses, and 512m of memory: half a byte, not 512 MiB
        ("resources.limits.memory=lots", "at '/resources/limits/memory'"),
        ("resources.limits.memory=512m", "at '/resources/limits/memory': '512m'"),
        ("resources.requests.cpu=-1", "at '/resources/requests/cpu': minimum"),
        ("resources.limit.memory=1Gi", "additional properties 'limit' not allowed"),
        # the operator exits 2 at start-up on these (--hf-endpoint, --namespace)
        ("hfEndpoint=hf-mirror.example", "at '/hfEndpoint'"),
        ("watchNamespaces={Team_A}", "at '/watchNamespaces/0': 'Team_A'"),
        # label values Kubernetes refuses
        ("serviceMonitor.labels.release=kube prometheus", "at '/serviceMonitor/labels/release'"),
    ],
)
def test_a_value_kubernetes_or_the_operator_would_refuse_is_refused_naming_it(
    value: str, message: str
) -> None:
    assert message in refusal(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # `tag:` left empty in a values file is null, which deletes the default: the image
        # was "ghcr.io/kvfleet/kvfleet-operator:", the port and replicas empty, every name ""
        ("image.tag=null", "at '/image': missing property 'tag'"),
        ("image.repository=null", "at '/image': missing property 'repository'"),
        ("metrics.port=null", "at '/metrics': missing property 'port'"),
        ("replicas=null", "missing property 'replicas'"),
        ("name=null", "missing property 'name'"),
        ("serviceMonitor.interval=null", "at '/serviceMonitor': missing property 'interval'"),
    ],
)
def test_a_value_left_empty_is_refused_instead_of_rendering_an_empty_field(
    value: str, message: str
) -> None:
    assert message in refusal(value)


def test_the_metrics_port_may_not_be_the_liveness_port() -> None:
    """Both on 8080: the metrics server binds first, kopf's liveness endpoint cannot, and the
    operator restarts forever."""
    assert "metrics.port: 8080 is the operator's liveness port" in refusal("metrics.port=8080")


@pytest.mark.parametrize("prefix", ["/var/../etc", "/.."])
def test_a_host_path_prefix_with_dot_dot_is_refused_as_the_operator_refuses_it(
    prefix: str,
) -> None:
    assert f'hostPathPrefixes: "{prefix}" has a .. component' in refusal(
        f"hostPathPrefixes={{{prefix}}}"
    )


def test_valid_values_beside_the_defaults_still_render() -> None:
    digest = "0" * 64
    container = _operator(
        render(
            "--set", f"image.tag=0.2.0@sha256:{digest}",
            "--set", "image.repository=localhost:5000/kvfleet/kvfleet-operator",
            "--set", "resources.limits.memory=1Gi", "--set", "resources.requests.cpu=0.5",
            "--set", "serviceMonitor.interval=1m30s",
            "--set", "hostPathPrefixes={/var/models..d}",
        )
    )  # fmt: skip
    assert container["image"] == f"localhost:5000/kvfleet/kvfleet-operator:0.2.0@sha256:{digest}"
    assert container["resources"]["requests"]["cpu"] == "0.5"


def test_the_dashboard_without_labels_renders() -> None:
    """dashboard.labels=null (no sidecar label, for a Grafana that selects otherwise) was a YAML
    parse error."""
    objects = render("--set", "dashboard.enabled=true", "--set", "dashboard.labels=null")
    (config_map,) = [o for o in objects if o["kind"] == "ConfigMap"]
    assert "grafana_dashboard" not in config_map["metadata"]["labels"]


@pytest.mark.parametrize(
    ("namespaces", "sample"),
    [("{team-*,team-b}", "team-b"), ("{team-*}", "NAMESPACE"), ("{team-a}", "team-a")],
)
def test_notes_apply_the_sample_to_a_watched_namespace_not_to_a_pattern(
    tmp_path: Path, namespaces: str, sample: str
) -> None:
    """NOTES.txt said `kubectl apply -n team-* ...` when the first watched namespace was a
    pattern. helm renders NOTES only against a cluster, so this renders them as a template."""
    chart = tmp_path / "kvfleet"
    shutil.copytree(CHART, chart, symlinks=False)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "templates" / "notes.txt")
    out = helm(
        "template", "kvfleet", str(chart), "-n", NAMESPACE, "--debug",
        "--set", f"watchNamespaces={namespaces}", "--show-only", "templates/notes.txt",
        check=False,
    ).stdout  # fmt: skip
    assert f"kubectl apply -n {sample} -f manifests/samples/small.yaml" in out


def test_the_chart_takes_the_namespace_patterns_the_operator_takes() -> None:
    """The schema's watchNamespaces rule is the operator's --namespace rule (kvfleet_operator.
    flags), so a value helm admits never stops the operator at start, and the reverse."""
    import json

    from kvfleet_operator.flags import NAMESPACE_PATTERN

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["watchNamespaces"]["items"]["pattern"] == NAMESPACE_PATTERN
