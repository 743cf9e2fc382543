"""minReplicas 0: the router's demand takes the fleet from zero to one, and idleness to zero."""

from __future__ import annotations

import copy
from typing import Any

import httpx

from kvfleet_operator.autoscaling.autoscaler import autoscale_once
from kvfleet_operator.autoscaling.decision import decide
from kvfleet_operator.autoscaling.samples import (
    EngineSample,
    Observation,
    PodObservation,
    RouterDemand,
)
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState

T0 = 1_700_000_000.0
IDLE_AFTER = 600.0
SPEC = AutoscalingSpec.model_validate(
    {
        "minReplicas": 0,
        "maxReplicas": 4,
        "targets": {"generationTokenRate": {"tokensPerSecond": 100}},
        "behavior": {"warmupSeconds": 0},
    }
)


def observe(replicas: int, demand: RouterDemand | None, now: float = T0) -> Observation:
    sample = EngineSample(now, 0.0, 0.0, 0.0, 0.0, 0.0, None, None)
    pods = tuple(PodObservation(f"p{i}", T0 - 3600, sample) for i in range(replicas))
    return Observation(now, replicas, replicas, 0, pods, demand, IDLE_AFTER)


def test_a_request_waiting_in_the_router_scales_zero_to_one_at_once() -> None:
    decision = decide(SPEC, observe(0, RouterDemand(1, 1, 0)), ScalerState())
    assert decision.desired_replicas == 1
    assert decision.reason.startswith("scale from zero: 1 queued")


def test_at_zero_without_requests_it_stays_at_zero() -> None:
    decision = decide(SPEC, observe(0, RouterDemand(0, 0, 5000)), ScalerState())
    assert (decision.desired_replicas, decision.limited) == (0, "")
    unknown = decide(SPEC, observe(0, None), ScalerState())
    assert (unknown.desired_replicas, unknown.limited) == (0, "MetricsUnavailable")


def test_no_load_never_goes_below_one_until_the_router_was_idle_long_enough() -> None:
    state = ScalerState()
    for tick in range(20):  # no tokens at all, but a request 100 s ago
        decision = decide(SPEC, observe(2, RouterDemand(0, 0, 100), T0 + 5 * tick), state)
        state = decision.state
    assert decision.desired_replicas >= 1
    busy = decide(SPEC, observe(1, RouterDemand(0, 2, 0), T0 + 200), state)
    assert busy.desired_replicas == 1
    idle = decide(SPEC, observe(1, RouterDemand(0, 0, IDLE_AFTER), T0 + 205), busy.state)
    assert idle.desired_replicas == 0
    assert "scale to zero: no request through the router for 600 s" in idle.reason


class ZeroCluster:
    """The API calls of one autoscaler tick: an InferenceDeployment at zero, one router pod."""

    def __init__(self) -> None:
        self.infd = {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
            "spec": {
                "autoscaling": SPEC.model_dump(by_alias=True),
                "routing": {"scaleToZeroAfterSeconds": 60},
            },
            "status": {},
        }
        self.replicas = 0
        self.writes: list[Any] = []

    async def get(self, api_version: str, kind: str, name: str, namespace: str | None = None):
        if kind == "InferenceDeployment":
            return copy.deepcopy(self.infd)
        if kind == "Deployment":
            owner = {"apiVersion": "kvfleet.io/v1alpha1", "kind": "InferenceDeployment",
                     "name": "m", "uid": "u", "controller": True}  # fmt: skip
            return {"metadata": {"ownerReferences": [owner]}, "spec": {"replicas": self.replicas}}
        return None

    async def list(self, api_version: str, kind: str, namespace=None, selector: str = ""):
        if selector == "kvfleet.io/router=m":
            ready = {
                "type": "Ready",
                "status": "True",
                "lastTransitionTime": "2020-01-01T00:00:00Z",
            }
            return [
                {
                    "metadata": {"name": "router-0"},
                    "status": {"podIP": "127.2.0.9", "phase": "Running", "conditions": [ready]},
                }
            ]
        assert selector == "kvfleet.io/deployment=m"
        return []

    async def scale(self, namespace: str, name: str, replicas: int, **_: Any) -> dict[str, Any]:
        self.writes.append(("scale", replicas))
        self.replicas = replicas
        return {}

    async def apply(self, manifest: dict[str, Any], *, field_manager: str, owner=None):
        return manifest

    async def patch_status(self, api_version, kind, name, namespace, status, resource_version=None):
        self.infd["status"] = {**self.infd["status"], **status}
        return copy.deepcopy(self.infd)

    async def post_event(self, involved, type_, reason, message) -> None:
        self.writes.append(("event", reason, message))


def router_metrics(queued: int) -> httpx.AsyncClient:
    def handle(request: httpx.Request) -> httpx.Response:
        assert (request.url.host, request.url.port, request.url.path) == (
            "127.2.0.9",
            8000,
            "/metrics",
        )
        text = (
            f"kvfleet_router_queued_requests {queued}.0\n"
            f"kvfleet_router_requests_in_flight {queued}.0\n"
            "kvfleet_router_idle_seconds 0.0\n"
        )
        return httpx.Response(200, text=text)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def test_the_autoscaler_reads_the_routers_queue_and_scales_from_zero() -> None:
    cluster = ZeroCluster()
    async with router_metrics(queued=0) as http:
        decision, _ = await autoscale_once(cluster, http, "ns", "m", T0)  # type: ignore[arg-type]
    assert decision is not None and decision.desired_replicas == 0
    assert cluster.writes == []
    async with router_metrics(queued=3) as http:
        decision, _ = await autoscale_once(cluster, http, "ns", "m", T0 + 1)  # type: ignore[arg-type]
    assert cluster.writes[0] == ("scale", 1)
    assert cluster.writes[1][:2] == ("event", "ScaledUp")
    assert "scale from zero: 3 queued" in cluster.writes[1][2]
    assert cluster.infd["status"]["autoscaling"]["desiredReplicas"] == 1


async def test_with_several_routers_idle_needs_every_one_and_a_queue_needs_one() -> None:
    """Two router pods: their queues add up; idleness counts only when both answered (one that
    did not may be serving, and scaling to zero would cut its streams)."""
    from kvfleet_operator.autoscaling.pods import PodFacts
    from kvfleet_operator.autoscaling.sources import scrape_routers

    pods = [PodFacts(f"router-{i}", f"127.2.0.{i}", T0, False, None) for i in (1, 2)]
    answers = {"127.2.0.1": (2, 900.0), "127.2.0.2": (1, 700.0)}

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.host not in answers:
            raise httpx.ConnectError("refused", request=request)
        queued, idle = answers[request.url.host]
        text = (
            f"kvfleet_router_queued_requests {queued}\n"
            "kvfleet_router_requests_in_flight 0\n"
            f"kvfleet_router_idle_seconds {idle}\n"
        )
        return httpx.Response(200, text=text)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as http:
        assert await scrape_routers(http, pods) == RouterDemand(3, 0, 700.0)
        del answers["127.2.0.2"]  # one router does not answer this tick
        assert await scrape_routers(http, pods) == RouterDemand(2, 0, 0.0)
        answers.clear()
        assert await scrape_routers(http, pods) is None
