"""A real Prometheus in the loop (`make test-integrations`): it discovers the engine and router
pods through our kube-apiserver (Kubernetes SD, labelled as the operator's ServiceMonitors would
label them), scrapes their real /metrics at the kwok pod IPs and the operator's own /metrics; the
operator's Builtin autoscaler with `source: Prometheus` reads the engines back from it and scales
1 -> 3 -> 1 like the direct scraper's test (test_autoscaling.py). The load goes through a real
`kvfleet router` bound at the router pod's IP (e2e/router_process.py). While three engines serve,
every query of the Grafana dashboard (manifests/dashboards/kvfleet.json), the Router row's
included, is evaluated against this Prometheus and must return data (the router's retries by
reason too: its series exist from start-up at 0, though nothing is retried while every engine
serves)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autoscaling_scenario import NAME, SCALE_DOWN_STABILIZATION_S, inference_deployment, start_load
from engine_pods import EnginePods
from kvcluster.binaries import PROMETHEUS_SPEC, missing_specs
from kvcluster.procs import stop_child
from kvcluster.prometheus import Prometheus
from kvcluster.testing import E2ECluster
from operator_process import OperatorProcess, install_crds, running_operator
from operator_process import wait_logged as wait
from router_process import running_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "manifests" / "dashboards" / "kvfleet.json"
TARGET_TOKENS_PER_SECOND = 40  # per replica, as in test_autoscaling.py
RATE_WINDOW = "20s"  # $__rate_interval: ten scrapes at 2 s
ENGINE_START_S = 600  # a CPU engine's start and self-benchmark on a busy 2-core machine


@pytest.fixture
def prometheus(cluster: E2ECluster, tmp_path: Path) -> Iterator[Prometheus]:
    if missing_specs(cluster.config.bin_root, (PROMETHEUS_SPEC,)):
        pytest.skip("Prometheus is not built: `make integrations-bin` (or make test-integrations)")
    port = cluster.config.ports.operator_metrics
    with Prometheus.start(cluster.config, tmp_path / "prometheus", port) as prom:
        yield prom


@pytest.fixture
def operator(cluster: E2ECluster, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    install_crds(cluster)
    port = str(cluster.config.ports.operator_metrics)
    log_path = tmp_path / "operator.log"
    with running_operator(cluster.env, [namespace], log_path, ["--metrics-port", port]) as started:
        yield started


def dashboard_queries(namespace: str) -> list[tuple[str, str]]:
    """(panel title, PromQL with the dashboard's variables filled in) of every target."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    fill = {"$namespace": namespace, "$inferencedeployment": NAME, "$__rate_interval": RATE_WINDOW}
    out = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for variable, value in fill.items():
                expr = expr.replace(variable, value)
            out.append((panel["title"], expr))
    return out


# Three CPU engines start, self-benchmark and serve on 2 shared cores: up to ~5 min each on a busy
# machine (load 15-19 measured), so the whole scale-up and stabilized scale-down can take 25 min.
@pytest.mark.timeout(2400)
def test_prometheus_source_scales_up_and_back_down_and_every_dashboard_query_has_data(
    cluster: E2ECluster,
    namespace: str,
    prometheus: Prometheus,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    kubectl = cluster.kubectl
    router_log = tmp_path / "router.log"
    logs = [operator.log_path, prometheus.log_path, router_log]
    manifest = inference_deployment(namespace, tiny_model, TARGET_TOKENS_PER_SECOND)
    manifest["spec"]["routing"] = {"replicas": 1}  # the one router pod a real router stands in for
    manifest["spec"]["autoscaling"]["source"] = "Prometheus"
    manifest["spec"]["autoscaling"]["prometheus"] = {"url": prometheus.url}
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def infd() -> dict[str, Any]:
        return dict(kubectl.json("get", "infd", NAME, "-n", namespace))

    def replicas() -> int:
        return int(kubectl.json("get", "deployment", NAME, "-n", namespace)["spec"]["replicas"])

    def targets_up(service: str) -> int:
        return len(prometheus.query(f'up{{namespace="{namespace}", service="{service}"}} == 1'))

    def engine_targets_up() -> int:
        return targets_up(NAME)

    with (
        EnginePods(cluster.kubectl, namespace, NAME, tiny_model, tmp_path) as engines,
        running_router(cluster, namespace, NAME, router_log) as (router_url, router_pod),
    ):
        wait(lambda: engines.ready_ips(), ENGINE_START_S, "the first engine to be ready", logs)
        wait(lambda: engine_targets_up() == 1, 60, "Prometheus to scrape the first engine", logs)
        target = next(t for t in prometheus.targets() if t["labels"].get("service") == NAME)
        assert target["labels"]["namespace"] == namespace
        assert target["labels"]["pod"] == engines.pods()[0]["metadata"]["name"]
        assert target["scrapeUrl"] == f"http://{engines.ready_ips()[0]}:8000/metrics"
        # the router's target, labelled as its ServiceMonitor's (the NAME-router Service)
        wait(lambda: targets_up(f"{NAME}-router") == 1, 60, "Prometheus to scrape the router",
             logs)  # fmt: skip
        target = next(t for t in prometheus.targets() if t["labels"]["job"] == f"{NAME}-router")
        assert target["labels"]["namespace"] == namespace
        assert target["labels"]["pod"] == router_pod["metadata"]["name"]
        assert target["scrapeUrl"] == f"{router_url}/metrics"
        assert replicas() == 1

        bench = start_load(router_url, (tmp_path / "bench.log").open("wb"))
        try:
            wait(lambda: replicas() == 3, 150, "the scale-up to maxReplicas (Prometheus)", logs)
            wait(lambda: len(engines.ready_ips()) == 3, ENGINE_START_S, "the new pods' engines",
                 logs + [tmp_path / f"engine-{n}.log" for n in engines.started])  # fmt: skip
            wait(lambda: engine_targets_up() == 3, 60, "Prometheus to scrape three engines", logs)
            time.sleep(10)  # a few scrapes of the three engines under load, for rate()
            empty = [(title, q) for title, q in dashboard_queries(namespace)
                     if not prometheus.query(q)]  # fmt: skip
            scaled_up = infd()
        finally:
            stop_child(bench, signal.SIGINT, 20)
            load_end = time.time()
        assert not empty, f"dashboard queries that returned nothing: {empty}"

        wait(lambda: replicas() < 3, SCALE_DOWN_STABILIZATION_S + 150, "a scale-down", logs)
        assert time.time() >= load_end + SCALE_DOWN_STABILIZATION_S - 1
        wait(lambda: replicas() == 1, 150, "the scale-down to minReplicas", logs)
        after = infd()

    assert scaled_up["status"]["autoscaling"]["source"] == "Prometheus"
    history = after["status"]["autoscaling"]["history"]
    ups = [h for h in history if h["toReplicas"] > h["fromReplicas"]]
    assert ups and "generationTokenRate" in ups[0]["reason"]
    assert [h for h in history if h["toReplicas"] < h["fromReplicas"]][-1]["toReplicas"] == 1
    # The operator's own series reached Prometheus too (honor_labels: the infd's namespace).
    decided = prometheus.query(
        f'kvfleet_autoscaler_scale_events_total{{namespace="{namespace}", direction="up"}}'
    )
    assert decided and float(decided[0]["value"][1]) >= 1
