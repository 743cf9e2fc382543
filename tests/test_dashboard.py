"""manifests/dashboards/kvfleet.json checked without Grafana: every query names only series that
the engine (metrics contract v1), the operator (kvfleet_autoscaler_*) or the router
(kvfleet_router_*) export, each panel the issue asks for is there, and only the dashboard's own
variables are used. Whether each query returns data from real engines is
e2e/test_prometheus.py's job."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfleet_engine.metrics import EngineInfo, EngineMetrics
from kvfleet_operator import metrics as operator_metrics
from kvfleet_router.metrics import RouterMetrics
from kvfleet_router.replicas import ReplicaPool
from kvfleet_router.waiting import WaitingQueue

DASHBOARD = Path(__file__).resolve().parents[1] / "manifests" / "dashboards" / "kvfleet.json"
# PromQL words that look like a series name followed by "(" or "{": functions, aggregations, "by".
_NAME = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{")
_VARIABLE = re.compile(r"\$(\w+)")


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target."""
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def exported_series() -> set[str]:
    """Every sample name a scrape of an engine or the operator shows (with _bucket, _total...)."""
    engine = EngineMetrics(EngineInfo("m", "0.1.0", "none", 1))
    engine.set_capacity(100.0)
    texts = [engine.render()[0].decode()]
    texts.append(generate_latest(operator_metrics.REGISTRY).decode())
    pool = ReplicaPool()
    router = RouterMetrics("prefix", pool, WaitingQueue(pool, 8))
    router.finished("engine-0", "success")  # a labelled counter shows samples once used
    router.routed("prefix", 4, 4)
    router.retried("429")
    texts.append(router.render()[0].decode())
    names = {"up"}  # Prometheus's own per-target series
    for text in texts:
        for family in text_string_to_metric_families(text):
            names.add(family.name)
            names.update(sample.name for sample in family.samples)
    names.add("kvfleet_autoscaler_scale_events_total")  # a counter shows no sample before a tick
    return names


def test_every_query_names_exported_series_only() -> None:
    known = exported_series()
    unknown = {
        (title, name)
        for title, expr in queries()
        for name in _NAME.findall(expr)
        if name not in known
    }
    assert not unknown, f"series no engine or operator exports: {sorted(unknown)}"


def test_the_panels_cover_replicas_decisions_tokens_latency_kv_queue_hits_rejections_routers():
    exprs = "\n".join(expr for _, expr in queries())
    for series in (
        "kvfleet_autoscaler_desired_replicas",
        "kvfleet_autoscaler_scale_events_total",
        "kvfleet_generation_tokens_total",
        "kvfleet_prompt_tokens_total",
        "kvfleet_time_to_first_token_seconds_bucket",
        "kvfleet_inter_token_latency_seconds_bucket",
        "kvfleet_e2e_request_latency_seconds_sum",
        "kvfleet_kv_cache_usage_ratio",
        "kvfleet_requests_waiting",
        "kvfleet_preemptions_total",
        "kvfleet_prefix_cache_hits_total",
        "kvfleet_requests_rejected_total",
        "kvfleet_router_requests_total",
        "kvfleet_router_routing_decisions_total",
        "kvfleet_router_queued_requests",
        "kvfleet_router_added_latency_seconds_bucket",
    ):
        assert f"{series}{{" in exprs, f"no panel reads {series}"
    for quantile in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({quantile}, sum by (le) (rate(kvfleet_time_to_first" in exprs


def test_queries_use_only_the_dashboards_variables_and_select_one_inference_deployment() -> None:
    defined = {v["name"] for v in dashboard()["templating"]["list"]}
    assert defined == {"datasource", "namespace", "inferencedeployment"}
    for title, expr in queries():
        assert set(_VARIABLE.findall(expr)) <= defined | {"__rate_interval"}, title
        for selector in re.findall(r"\{([^}]*)\}", expr):
            if selector:  # every series is narrowed to the chosen InferenceDeployment
                assert 'namespace="$namespace"' in selector, (title, selector)
                assert "$inferencedeployment" in selector, (title, selector)


def test_panels_have_unique_ids_and_titles_and_use_the_datasource_variable() -> None:
    panels = dashboard()["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    titled = [p["title"] for p in panels if p["type"] != "row"]
    assert len(set(titled)) == len(titled)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
