"""A real Prometheus beside the local control plane (integration tests): Kubernetes service
discovery against our kube-apiserver finds the engine pods (label kvfleet.io/deployment, port
`http`, ready) and the router pods (label kvfleet.io/router) and labels them as the operator's
ServiceMonitors would (namespace, service, pod, job; the routers' service is `NAME-router`), and
a static target scrapes the operator's own /metrics (`kvfleet operator --metrics-port`).

    with Prometheus.start(cluster.config, operator_metrics_port=port, state_dir=tmp) as prom:
        prom.query('sum(rate(kvfleet_generation_tokens_total[20s]))')   # -> list of series
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from kvcluster import procs
from kvcluster.binaries import PROMETHEUS_SPEC, ensure_binaries
from kvcluster.config import ClusterConfig
from kvcluster.pki import Pki

SCRAPE_INTERVAL = "2s"  # the autoscaler ticks every second in the tests; 2 s keeps rate() fresh
READY_TIMEOUT_S = 60.0


def render_config(config: ClusterConfig, operator_metrics_port: int | None) -> dict[str, Any]:
    """prometheus.yml: the engines and the routers through Kubernetes SD, the operator as a
    static target."""
    scrape_configs = [
        # the engines' Service is named after the InferenceDeployment
        _pods_job(config, "kvfleet-engines", "kvfleet.io/deployment", "${1}"),
        # the routers' (pods labelled kvfleet.io/router=NAME) is NAME-router; a router pod's
        # target is up only where a real router runs at its IP (e2e/router_process.py)
        _pods_job(config, "kvfleet-routers", "kvfleet.io/router", "${1}-router"),
    ]
    if operator_metrics_port is not None:
        scrape_configs.append(
            {
                "job_name": "kvfleet-operator",
                # its series name the InferenceDeployment's namespace, not the operator's
                "honor_labels": True,
                "static_configs": [{"targets": [f"127.0.0.1:{operator_metrics_port}"]}],
            }
        )
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "scrape_configs": scrape_configs,
    }


def _pods_job(config: ClusterConfig, job_name: str, pod_label: str, service: str) -> dict[str, Any]:
    """The ready pods carrying `pod_label`, port `http`, with the target labels the Prometheus
    Operator gives a ServiceMonitor's (their Service, port http, ready endpoints): namespace,
    service, pod, job (= service). `service` names the Service, `${1}` standing for the pod
    label's value."""
    pki = Pki.under(config.state_dir.resolve() / "pki")  # Prometheus reads paths from its own dir
    tls = {"ca_file": str(pki.ca_cert), "cert_file": str(pki.admin_cert),
           "key_file": str(pki.admin_key)}  # fmt: skip
    label = "__meta_kubernetes_pod_label_" + pod_label.replace(".", "_").replace("/", "_")
    return {
        "job_name": job_name,
        "metrics_path": "/metrics",
        # Pods, not EndpointSlices: the API server refuses loopback addresses in an EndpointSlice,
        # so the Services of kwok pods (127.x IPs) have no endpoints here.
        "kubernetes_sd_configs": [
            {
                "role": "pod",
                "api_server": f"https://127.0.0.1:{config.ports.apiserver}",
                "tls_config": tls,
            }
        ],
        "relabel_configs": [
            {"action": "keep", "regex": ".+", "source_labels": [label]},
            {"action": "keep", "regex": "http",
             "source_labels": ["__meta_kubernetes_pod_container_port_name"]},
            {"action": "keep", "regex": "true",
             "source_labels": ["__meta_kubernetes_pod_ready"]},
            {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
            {"source_labels": [label], "replacement": service, "target_label": "service"},
            {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            {"source_labels": [label], "replacement": service, "target_label": "job"},
        ],
    }  # fmt: skip


@dataclass
class Prometheus:
    """A running Prometheus; `stop()` (or leaving the `with`) ends it."""

    url: str  # http://127.0.0.1:<port>
    pid: int
    binary: str
    log_path: Path

    @classmethod
    def start(
        cls, config: ClusterConfig, state_dir: Path, operator_metrics_port: int | None = None
    ) -> Prometheus:
        """Build (if not cached) and start Prometheus with its data and log under `state_dir`;
        returns once /-/ready answers."""
        binary = ensure_binaries(config.bin_root, (PROMETHEUS_SPEC,))["prometheus"]
        port = config.ports.prometheus
        if procs.port_in_use(port):
            raise RuntimeError(f"prometheus: port 127.0.0.1:{port} is already in use")
        state_dir.mkdir(parents=True, exist_ok=True)
        config_file = state_dir / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(render_config(config, operator_metrics_port)))
        log_path = state_dir / "prometheus.log"
        argv = (
            str(binary),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={state_dir / 'data'}",
            "--storage.tsdb.retention.time=2h",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        )
        prom = cls(f"http://127.0.0.1:{port}", procs.spawn(argv, log_path), str(binary), log_path)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not procs.probe(f"{prom.url}/-/ready", None):
            if not procs.is_alive(prom.pid, prom.binary) or time.monotonic() > deadline:
                prom.stop()
                raise RuntimeError(f"prometheus did not become ready:\n{procs.tail(log_path)}")
            time.sleep(0.25)
        return prom

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        procs.stop(self.pid, self.binary)

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's result vector (raises on a query Prometheus refuses)."""
        params = {"query": promql, **({"time": f"{at:.3f}"} if at is not None else {})}
        body = self._get("/api/v1/query?" + urllib.parse.urlencode(params))
        return list(body["data"]["result"])

    def targets(self) -> list[dict[str, Any]]:
        """Active scrape targets with their labels, health and last error."""
        return list(self._get("/api/v1/targets?state=active")["data"]["activeTargets"])

    def _get(self, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as response:
                body = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # 400: a bad query; the body says why
            body = json.loads(exc.read() or b"{}")
        if body.get("status") != "success":
            raise ValueError(f"Prometheus refused {path}: {body.get('error', body)}")
        return dict(body)
