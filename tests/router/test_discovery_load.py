"""What the router reads: EndpointSlices into addresses, /metrics into load, flags into
settings."""

from __future__ import annotations

import pytest

from kvfleet_router.cli import main as router_main
from kvfleet_router.discovery import backend_address, ready_endpoints, ready_pod_endpoints
from kvfleet_router.load import parse_load
from kvfleet_router.settings import RouterSettings


def pod_ref(name: str) -> dict[str, str]:
    return {"kind": "Pod", "name": name, "namespace": "default"}


def test_only_ready_endpoints_on_the_http_port_are_replicas_named_by_their_pods() -> None:
    slices = [
        {
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [
                {
                    "addresses": ["10.0.0.1"],
                    "conditions": {"ready": True},
                    "targetRef": pod_ref("llama-5d8f-a"),
                },
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["10.0.0.4"], "targetRef": pod_ref("llama-5d8f-b")},  # ready
            ],
        },
        {"ports": [{"name": "http", "port": 8000}], "endpoints": None},
        {
            "ports": [{"name": "http", "port": 8000}],
            # Without a pod behind it (a hand-made slice), an endpoint is named by its address.
            "endpoints": [{"addresses": ["fd00::5"], "conditions": {"ready": True}}],
        },
    ]
    assert ready_endpoints(slices) == {
        "10.0.0.1:8000": "llama-5d8f-a",
        "10.0.0.4:8000": "llama-5d8f-b",
        "[fd00::5]:8000": "[fd00::5]:8000",
    }


def test_backend_urls_become_addresses() -> None:
    assert backend_address("http://127.0.0.1:8001") == "127.0.0.1:8001"
    assert backend_address("http://engine") == "engine:80"


KVFLEET_METRICS = """\
# HELP kvfleet_requests_waiting Requests waiting to be scheduled.
# TYPE kvfleet_requests_waiting gauge
kvfleet_requests_waiting{model_name="tiny"} 3.0
vllm:num_requests_waiting{model_name="tiny"} 3.0
kvfleet_requests_running{model_name="tiny"} 5.0
kvfleet_kv_cache_usage_ratio{model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{model_name="tiny"} 0.25
vllm:cache_config_info{block_size="16",model_name="tiny",num_gpu_blocks="4096"} 1.0
kvfleet_time_to_first_token_seconds_bucket{le="0.1",model_name="tiny"} 7.0
"""

VLLM_METRICS = """\
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 2.0
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.5
"""


def test_the_kvfleet_gauges_are_read_once_each() -> None:
    sample = parse_load(KVFLEET_METRICS)
    assert (sample.waiting, sample.running, sample.kv_usage) == (3.0, 5.0, 0.25)
    assert (sample.num_gpu_blocks, sample.block_size) == (4096, 16)
    assert sample.model_names == {"tiny"}


def test_a_vllm_engine_is_read_through_the_vllm_names() -> None:
    sample = parse_load(VLLM_METRICS)
    assert (sample.waiting, sample.running, sample.kv_usage) == (2.0, 1.0, 0.5)
    assert sample.num_gpu_blocks is None
    assert sample.model_names == {"meta-llama/Llama-3.1-8B"}


def test_an_endpoint_without_the_queue_gauge_is_not_an_engine() -> None:
    with pytest.raises(ValueError, match="requests_waiting"):
        parse_load("process_cpu_seconds_total 3.0\n")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"backends": ("ftp://x:1",)}, "backends"),
        ({"strategy": "random"}, "strategy"),
        ({"queue_size": -1}, "queue_size"),
        ({"scrape_interval_s": 0.5}, "scrape_interval_s"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"upstream_first_byte_timeout_s": 0.0}, "upstream_first_byte_timeout_s"),
        ({"upstream_first_byte_timeout_s": float("inf")}, "upstream_first_byte_timeout_s"),
        ({"upstream_idle_timeout_s": -1.0}, "upstream_idle_timeout_s"),
        ({"upstream_idle_timeout_s": float("nan")}, "upstream_idle_timeout_s"),
    ],
)
def test_settings_errors_name_the_field(overrides: dict[str, object], field: str) -> None:
    base: dict[str, object] = {"backends": ("http://127.0.0.1:8001",)}
    with pytest.raises(ValueError, match=f"^{field}: "):
        RouterSettings(**{**base, **overrides})  # type: ignore[arg-type]


def test_the_cli_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        router_main(["--backend", "http://127.0.0.1:8001", "--scrape-interval", "1"])
    assert exit_info.value.code == 2
    assert "--scrape-interval: must be in (0, 0.1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        router_main([])
    assert "set --deployment (with --namespace) or --backend: no replicas to route to" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        router_main(["--deployment", "d", "--namespace", "n", "--backend", "http://h:1"])
    assert "set either --deployment (with --namespace) or --backend, not both" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        router_main(["--backend", "http://127.0.0.1:8001", "--upstream-idle-timeout", "0"])
    assert "--upstream-idle-timeout: must be a positive number of seconds, got 0.0" in (
        capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        router_main(["--backend", "http://127.0.0.1:8001", "--upstream-first-byte-timeout", "x"])
    assert "--upstream-first-byte-timeout: invalid float value: 'x'" in capsys.readouterr().err


def test_the_upstream_timeouts_are_read_from_their_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[RouterSettings] = []
    monkeypatch.setattr("kvfleet_router.app.run", seen.append)
    backend = ["--backend", "http://127.0.0.1:8001"]
    timeouts = ["--upstream-first-byte-timeout", "900", "--upstream-idle-timeout", "30"]
    assert router_main(backend) == 0
    assert router_main([*backend, *timeouts]) == 0
    defaults, given = seen
    assert (defaults.upstream_first_byte_timeout_s, defaults.upstream_idle_timeout_s) == (300, 120)
    assert (given.upstream_first_byte_timeout_s, given.upstream_idle_timeout_s) == (900, 30)


def test_pod_discovery_takes_running_ready_pods_only() -> None:
    def pod(ip: str, phase: str = "Running", ready: str = "True", deleting: bool = False):
        meta: dict[str, object] = {"name": f"llama-{ip.rsplit('.', 1)[1]}"}
        if deleting:
            meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
        conditions = [{"type": "Ready", "status": ready}]
        return {"metadata": meta, "status": {"phase": phase, "podIP": ip, "conditions": conditions}}

    pods = [
        pod("10.0.0.1"),
        pod("10.0.0.2", ready="False"),
        pod("10.0.0.3", phase="Pending"),
        pod("10.0.0.4", deleting=True),
        {"metadata": {"name": "no-ip"}, "status": {"phase": "Pending"}},
    ]
    assert ready_pod_endpoints(pods) == {"10.0.0.1:8000": "llama-1"}
