"""spec.routing: the router's objects, where status.endpoint points, and the rules of
autoscaling.minReplicas 0."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from test_status import conditions, status_for, workload

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.render import render_children, selector

CLUSTER = ClusterFeatures(leader_worker_set=False, service_monitor=False)
SCALE_TO_ZERO = {
    "minReplicas": 0,
    "maxReplicas": 3,
    "targets": {"generationTokenRate": {"tokensPerSecond": 100}},
}


def plan_for(spec):
    profile = resolve_accelerator(spec.resources.accelerator, {})
    return plan_deployment("llama", spec, profile, model_architecture(spec.model), CLUSTER), profile


def rendered(spec) -> dict[tuple[str, str], dict]:
    plan, profile = plan_for(spec)
    assert plan.ok, plan.problems
    objects = render_children("llama", "team-a", spec, plan, profile, service_monitor=False)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def test_the_router_fronts_the_engine_service_with_the_spec_settings(make_spec) -> None:
    spec = make_spec(
        model={"servedModelName": "chat"},
        routing={"strategy": "least-load", "queueSize": 32, "queueTimeoutSeconds": 90},
    )
    objects = rendered(spec)
    router = objects[("Deployment", "llama-router")]
    pod = router["spec"]["template"]
    args = pod["spec"]["containers"][0]["args"]
    assert args == [
        "--deployment", "llama", "--namespace", "team-a", "--served-model-name", "chat",
        "--strategy", "least-load", "--queue-size", "32", "--queue-timeout", "90",
        "--port", "8000",
    ]  # fmt: skip
    assert pod["spec"]["serviceAccountName"] == "llama-router"
    # Router pods never match the engines' selector (Deployment, Service, PDB, autoscaler).
    engine_selector = selector("llama").items()
    assert not engine_selector <= pod["metadata"]["labels"].items()
    assert objects[("Service", "llama-router")]["spec"]["selector"] == {
        "kvfleet.io/router": "llama"
    }
    # Its RBAC: EndpointSlices read-only, in its namespace, for its ServiceAccount only.
    role = objects[("Role", "llama-router")]
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    binding = objects[("RoleBinding", "llama-router")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "llama-router", "namespace": "team-a"}
    ]
    assert ("PodDisruptionBudget", "llama-router") in objects
    # The engine pods say which model-server protocol they speak (llm-d / GIE pickers).
    engine_pod = objects[("Deployment", "llama")]["spec"]["template"]
    assert engine_pod["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"


def test_the_routers_are_several_and_spread_over_nodes(make_spec) -> None:
    """Two by default, so one node's failure or a rolling update leaves a router up (the PDB
    lets one go at a time); routing.replicas sets how many."""
    for routing, count in (({}, 2), ({"replicas": 3}, 3), ({"replicas": 1}, 1)):
        objects = rendered(make_spec(routing=routing))
        router = objects[("Deployment", "llama-router")]
        assert router["spec"]["replicas"] == count
        assert router["spec"]["template"]["spec"]["topologySpreadConstraints"] == [
            {
                "maxSkew": 1,
                "topologyKey": "kubernetes.io/hostname",
                "whenUnsatisfiable": "ScheduleAnyway",
                "labelSelector": {"matchLabels": {"kvfleet.io/router": "llama"}},
            }
        ]
        pdb = objects[("PodDisruptionBudget", "llama-router")]
        assert pdb["spec"]["maxUnavailable"] == 1
    with pytest.raises(ValidationError, match=r"routing\.replicas"):
        make_spec(routing={"replicas": 0})


@pytest.mark.parametrize(
    "extra_args",
    [
        ["--max-request-body-bytes", "33554432"],
        ["--seed", "1", "--max-request-body-bytes=33554432"],
    ],
)
def test_an_engine_body_limit_raised_in_extra_args_is_the_routers_too(
    make_spec, extra_args
) -> None:
    """The router refuses bodies above its limit before an engine sees them; with the same
    default as the engine's, an engine given a larger limit gets a router that lets them by."""
    spec = make_spec(engine={"extraArgs": extra_args})
    args = rendered(spec)[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    assert args["containers"][0]["args"][-2:] == ["--max-request-body-bytes", "33554432"]
    default = rendered(make_spec())[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    assert "--max-request-body-bytes" not in default["containers"][0]["args"]


def test_an_engine_body_timeout_in_extra_args_is_the_routers_too(make_spec) -> None:
    """A slow client's body the engine waits 300 s for must not get the router's 408 at 60."""
    extra = ["--body-timeout=300", "--max-request-body-bytes", "8388608"]
    spec = make_spec(engine={"extraArgs": extra})
    args = rendered(spec)[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    assert args["containers"][0]["args"][-4:] == [
        "--max-request-body-bytes", "8388608", "--body-timeout", "300"
    ]  # fmt: skip
    default = rendered(make_spec())[("Deployment", "llama-router")]["spec"]["template"]["spec"]
    assert "--body-timeout" not in default["containers"][0]["args"]


def test_routing_disabled_renders_no_router_and_points_at_the_engines(make_spec) -> None:
    spec = make_spec(routing={"enabled": False})
    assert [kind for kind, _ in rendered(spec)] == [
        "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"
    ]  # fmt: skip
    status = status_for(spec, workload())
    assert status["endpoint"]["url"] == "http://llama.team-a.svc:8000/v1"
    routed = status_for(make_spec(), workload())
    assert routed["endpoint"]["url"] == "http://llama-router.team-a.svc:8000/v1"


def test_min_replicas_zero_needs_the_router(make_spec) -> None:
    plan, _ = plan_for(make_spec(replicas=None, autoscaling=SCALE_TO_ZERO))
    assert plan.ok
    plan, _ = plan_for(
        make_spec(replicas=None, autoscaling=SCALE_TO_ZERO, routing={"enabled": False})
    )
    assert [p.reason for p in plan.problems] == ["InvalidAutoscaling"]
    assert "autoscaling.minReplicas: 0 needs routing.enabled" in plan.problems[0].message


def test_min_replicas_zero_needs_a_router_queue(make_spec) -> None:
    """With routing.queueSize 0 the router answered 503 at once at zero replicas: no request
    ever waited, so the autoscaler never saw demand and the deployment stayed at zero."""
    plan, _ = plan_for(
        make_spec(replicas=None, autoscaling=SCALE_TO_ZERO, routing={"queueSize": 0})
    )
    assert [p.reason for p in plan.problems] == ["InvalidAutoscaling"]
    assert "autoscaling.minReplicas: 0 needs routing.queueSize >= 1" in plan.problems[0].message
    plan, _ = plan_for(
        make_spec(replicas=None, autoscaling=SCALE_TO_ZERO, routing={"queueSize": 1})
    )
    assert plan.ok


def test_min_replicas_zero_needs_the_builtin_controller(make_spec) -> None:
    autoscaling = {**SCALE_TO_ZERO, "controller": "HPA"}
    with pytest.raises(
        ValidationError, match=r"autoscaling\.minReplicas: 0 needs controller Builtin"
    ):
        make_spec(replicas=None, autoscaling=autoscaling)


def test_scaled_to_zero_is_ready_and_says_so(make_spec) -> None:
    spec = make_spec(replicas=None, autoscaling=SCALE_TO_ZERO)
    status = status_for(spec, workload(desired=0, replicas=0, updated=0, ready=0))
    assert conditions(status)["Ready"] == ("True", "ScaledToZero")
    assert conditions(status)["Available"] == ("False", "ScaledToZero")
    assert status["replicasSummary"] == "0/0"


def test_the_operator_may_write_every_router_object_and_hold_what_it_grants(make_spec) -> None:
    from pathlib import Path

    import yaml

    role = next(yaml.safe_load_all((Path(__file__).parents[2] / "manifests/rbac.yaml").open()))
    allowed = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    from kvfleet_operator.apply import RESOURCES

    for (kind, _), obj in rendered(make_spec()).items():
        group = obj["apiVersion"].rpartition("/")[0]
        plural, _ = RESOURCES[(obj["apiVersion"], kind)]
        assert {"get", "create", "patch"} <= allowed[(group, plural)], kind
    router_role = rendered(make_spec())[("Role", "llama-router")]
    for rule in router_role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= allowed[(group, resource)]
