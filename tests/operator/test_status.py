"""Status: kstatus conditions from what the cluster reports, and the events for transitions."""

from __future__ import annotations

from kvfleet_operator.accelerators import resolve_accelerator
from kvfleet_operator.model_catalog import model_architecture
from kvfleet_operator.plan import ClusterFeatures, plan_deployment
from kvfleet_operator.status import compute_status, invalid_spec_status, transition_events
from kvfleet_operator.workload_state import (
    WorkloadState,
    deployment_failure,
    external_scaling,
    pod_troubles,
    summarize_workload,
)

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
CLUSTER = ClusterFeatures(leader_worker_set=False, service_monitor=False)


def status_for(spec, workload, old=None, now=T0, generation=3):
    profile = resolve_accelerator(spec.resources.accelerator, {})
    plan = plan_deployment("llama", spec, profile, model_architecture(spec.model), CLUSTER)
    return compute_status(
        name="llama",
        namespace="team-a",
        generation=generation,
        spec=spec,
        plan=plan,
        workload=workload,
        old_status=old or {},
        now=now,
    )


def conditions(status) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def workload(**kw) -> WorkloadState:
    base = dict(
        desired=2, replicas=2, updated=2, ready=2, current=True, deadline_exceeded=False,
        failing_pods=(), unschedulable=None, quantization="none",
    )  # fmt: skip
    return WorkloadState(**{**base, **kw})


def test_all_replicas_ready_is_ready_and_current(make_spec) -> None:
    status = status_for(make_spec(), workload())
    assert conditions(status) == {
        "Ready": ("True", "AllReplicasReady"),
        "Reconciling": ("False", "Reconciled"),
        "Stalled": ("False", "Healthy"),
        "Planned": ("True", "Planned"),
        "Available": ("True", "MinimumReplicasAvailable"),
    }
    assert status["observedGeneration"] == 3
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    assert status["replicasSummary"] == "2/2" and status["scaling"] == "Manual"
    assert status["selector"] == "kvfleet.io/deployment=llama"
    assert status["endpoint"] == {
        "url": "http://llama-router.team-a.svc:8000/v1",
        "servedModelName": "llama",
    }
    assert status["memoryPlan"]["fits"] is True
    assert status["topology"]["gpusPerReplica"] == 1


def test_rollout_in_progress_is_reconciling(make_spec) -> None:
    status = status_for(make_spec(), workload(updated=1, ready=1, replicas=3))
    assert conditions(status)["Reconciling"] == ("True", "RollingOut")
    assert conditions(status)["Ready"] == ("False", "RollingOut")
    assert conditions(status)["Available"][0] == "True"


def test_a_replica_restarting_on_the_current_template_is_not_a_rollout(make_spec) -> None:
    """An engine process died and its container restarts: the pod is unready, every replica
    still runs the current template."""
    status = status_for(make_spec(), workload(ready=1))
    assert conditions(status)["Ready"] == ("False", "ReplicasNotReady")
    assert conditions(status)["Reconciling"] == ("True", "ReplicasNotReady")
    assert conditions(status)["Available"] == ("True", "MinimumReplicasAvailable")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["message"] == "1/2 replicas ready, 2/2 updated"
    assert status["replicasSummary"] == "1/2"


def test_crash_looping_pods_are_never_ready(make_spec) -> None:
    failing = workload(ready=0, failing_pods=("llama-abc: CrashLoopBackOff",))
    status = status_for(make_spec(), failing)
    assert conditions(status)["Ready"] == ("False", "EngineFailing")
    assert conditions(status)["Stalled"] == ("True", "EngineFailing")
    assert "llama-abc: CrashLoopBackOff" in status["conditions"][0]["message"]


def waiting_pod(name: str, reason: str, message: str | None = None) -> dict:
    waiting = {"reason": reason} | ({"message": message} if message else {})
    return {
        "metadata": {"name": name},
        "status": {"containerStatuses": [{"name": "engine", "state": {"waiting": waiting}}]},
    }


def stalled_by(make_spec, pods: list[dict]) -> tuple[dict, list]:
    """The Stalled condition and the Warning events for a Deployment whose pods are these."""
    deployment = {
        "metadata": {"generation": 1},
        "spec": {"replicas": len(pods)},
        "status": {"observedGeneration": 1, "replicas": len(pods), "updatedReplicas": len(pods)},
    }
    status = status_for(make_spec(), summarize_workload(deployment, pods))
    stalled = next(c for c in status["conditions"] if c["type"] == "Stalled")
    return stalled, [e for e in transition_events({}, status) if e.type == "Warning"]


def test_a_missing_secret_is_named_where_the_user_looks(make_spec) -> None:
    """auth.apiKeySecretRef naming a Secret that does not exist: "CreateContainerConfigError"
    alone did not say which; the kubelet's message does, in `kubectl describe` and the event."""
    pod = waiting_pod(
        "llama-7c9d-x2k", "CreateContainerConfigError", 'secret "my-api-key" not found'
    )
    stalled, [event] = stalled_by(make_spec, [pod])
    expected = (
        'pods are not starting: llama-7c9d-x2k: CreateContainerConfigError: secret "my-api-key" '
        "not found"
    )
    assert (stalled["status"], stalled["reason"], stalled["message"]) == (
        "True", "EngineFailing", expected,
    )  # fmt: skip
    assert (event.reason, event.message) == ("EngineFailing", expected)


def test_kubelet_messages_are_kept_where_they_say_what_to_fix() -> None:
    pull = 'failed to pull and unpack image "registry.example.com/kvfleet:tpyo":\n' + "x" * 400
    failing, _ = pod_troubles([
        waiting_pod("a", "ErrImagePull", pull),
        waiting_pod("b", "CrashLoopBackOff", "back-off 5m0s restarting failed container=engine"),
        waiting_pod("c", "ImagePullBackOff", 'Back-off pulling image "kvfleet:tpyo"'),
        waiting_pod("d", "CreateContainerConfigError",
                    "couldn't find key token in Secret team-a/llama-key"),
        waiting_pod("e", "InvalidImageName"),
    ])  # fmt: skip
    assert failing[0].startswith('a: ErrImagePull: failed to pull and unpack image "registry')
    assert "\n" not in failing[0] and failing[0].endswith("x…")
    assert len(failing[0]) == len("a: ErrImagePull: ") + 200
    assert failing[1:] == (
        "b: CrashLoopBackOff",  # its message only says it backs off: the log says why
        'c: ImagePullBackOff: Back-off pulling image "kvfleet:tpyo"',
        "d: CreateContainerConfigError: couldn't find key token in Secret team-a/llama-key",
        "e: InvalidImageName",
    )


def test_many_failing_pods_make_one_bounded_message(make_spec) -> None:
    """40 replicas missing the same Secret key: three are named, the others counted, so the
    condition and its event (1,024 characters at most) stay readable."""
    missing = "couldn't find key token in Secret team-a/llama-key"
    pods = [waiting_pod(f"llama-{i:02}", "CreateContainerConfigError", missing) for i in range(40)]
    stalled, [event] = stalled_by(make_spec, pods)
    assert stalled["message"] == (
        f"pods are not starting: llama-00: CreateContainerConfigError: {missing}; "
        f"llama-01: CreateContainerConfigError: {missing}; "
        f"llama-02: CreateContainerConfigError: {missing}; and 37 more"
    )
    assert event.message == stalled["message"]


def test_plan_problem_is_stalled_with_reason(make_spec) -> None:
    spec = make_spec(quantization={"weights": "fp8"}, resources={"accelerator": "a100-40gb"})
    status = status_for(spec, None)
    assert conditions(status)["Stalled"] == ("True", "UnsupportedQuantization")
    assert conditions(status)["Planned"] == ("False", "UnsupportedQuantization")
    assert conditions(status)["Reconciling"][0] == "False"


def test_transition_time_moves_only_when_status_changes(make_spec) -> None:
    first = status_for(make_spec(), workload(ready=1, updated=1))
    second = status_for(make_spec(), workload(ready=1, updated=1), old=first, now=T1)
    assert second == first  # nothing changed: nothing to write
    third = status_for(make_spec(), workload(), old=first, now=T1)
    times = {c["type"]: c["lastTransitionTime"] for c in third["conditions"]}
    assert times["Ready"] == T1 and times["Planned"] == T0


def test_foreign_conditions_are_kept(make_spec) -> None:
    old = {"conditions": [{"type": "ScalingActive", "status": "True", "reason": "ValidMetrics"}]}
    status = status_for(make_spec(), workload(), old=old)
    assert status["conditions"][-1]["type"] == "ScalingActive"


def test_autoscaled_desired_comes_from_the_deployment(make_spec) -> None:
    spec = make_spec(
        replicas=None, autoscaling={"maxReplicas": 5, "targets": {"kvCacheUtilization": 0.7}}
    )
    status = status_for(spec, workload(desired=3, replicas=3, updated=3, ready=3))
    assert status["replicasSummary"] == "3/3" and status["scaling"] == "Auto(1-5)"


def test_events_for_ready_and_stalled_transitions(make_spec) -> None:
    rolling = status_for(make_spec(), workload(ready=0, updated=0))
    ready = status_for(make_spec(), workload(), old=rolling)
    assert [(e.type, e.reason) for e in transition_events(rolling, ready)] == [("Normal", "Ready")]
    assert transition_events(ready, ready) == []
    bad = make_spec(quantization={"weights": "fp8"}, resources={"accelerator": "a100-80gb"})
    stalled = status_for(bad, workload(), old=ready)
    kinds = [(e.type, e.reason) for e in transition_events(ready, stalled)]
    assert kinds == [("Warning", "NotReady"), ("Warning", "UnsupportedQuantization")]


def test_summarize_workload_reads_deployment_and_pods() -> None:
    deployment = {
        "metadata": {"generation": 4},
        "spec": {"replicas": 2},
        "status": {"observedGeneration": 4, "replicas": 2, "updatedReplicas": 2,
                   "readyReplicas": 1},
    }  # fmt: skip
    pods = [
        {
            "metadata": {"name": "a"},
            "status": {
                "containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
            },
        },
        {
            "metadata": {"name": "b"},
            "status": {
                "conditions": [
                    {
                        "type": "PodScheduled",
                        "status": "False",
                        "reason": "Unschedulable",
                        "message": "0/2 nodes: insufficient nvidia.com/gpu",
                    }
                ]
            },
        },
        {"metadata": {"name": "c", "deletionTimestamp": T0}, "status": {}},
    ]
    state = summarize_workload(deployment, pods)
    assert state.current and state.ready == 1
    assert state.failing_pods == ("a: CrashLoopBackOff",)
    assert state.unschedulable == "0/2 nodes: insufficient nvidia.com/gpu"


def test_invalid_spec_is_stalled() -> None:
    status = invalid_spec_status(generation=2, message="spec.x: bad", old_status={}, now=T0)
    assert {c["type"]: c["reason"] for c in status["conditions"]}["Stalled"] == "InvalidSpec"


def test_rollout_events() -> None:
    from kvfleet_operator.status import rollout_event

    first = {"metadata": {"generation": 1}}
    second = {"metadata": {"generation": 2}}
    assert rollout_event(None, first).reason == "Created"
    assert rollout_event(first, second).reason == "RolloutStarted"
    assert rollout_event(second, second) is None
    assert rollout_event(None, None) is None
    # A new replica count alone (spec.suspend, spec.replicas) is a scale, not a rollout.
    template = {"template": {"spec": {"containers": [{"name": "engine", "args": ["--seed"]}]}}}
    running = {"metadata": {"generation": 2}, "spec": {"replicas": 2, **template}}
    suspended = {"metadata": {"generation": 3}, "spec": {"replicas": 0, **template}}
    scaled = rollout_event(running, suspended)
    assert scaled is not None and scaled.reason == "Scaled"
    assert scaled.message == "Deployment scaled from 2 to 0 replicas"
    changed = {"metadata": {"generation": 4}, "spec": {"replicas": 0, "template": {}}}
    assert rollout_event(suspended, changed).reason == "RolloutStarted"


def test_memory_plan_says_where_its_numbers_came_from(make_spec) -> None:
    status = status_for(make_spec(), workload())
    assert status["memoryPlan"]["source"] == "catalog"
    unknown = status_for(make_spec(model={"uri": "pvc://models/finetune/model.gguf"}), workload())
    planned = next(c for c in unknown["conditions"] if c["type"] == "Planned")
    assert unknown["memoryPlan"] is None
    assert planned["message"].endswith(
        "memory not estimated (the operator reads GGUF headers of hf:// files only, not pvc://: "
        "set model.hints)"
    )


def _engine_deployment(args: list[str]) -> dict:
    return {
        "metadata": {"generation": 1},
        "spec": {"replicas": 1, "template": {"spec": {"containers": [
            {"name": "engine", "args": ["--model", "/models", *args]}]}}},
        "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1},
    }  # fmt: skip


def test_quantization_is_the_weight_format_the_pods_run(make_spec) -> None:
    awq = make_spec(quantization={"weights": "int4-awq", "kvCache": "fp8"})
    running = summarize_workload(_engine_deployment(["--quantization", "awq"]), [])
    assert running.quantization == "int4-awq"
    assert status_for(awq, running)["quantization"] == "int4-awq"
    # While the first Deployment is created: the spec's format, about to run.
    assert status_for(awq, None)["quantization"] == "int4-awq"
    # A change to fp8 that cannot run on an A100 leaves the bf16 pods serving: status says so.
    fp8_a100 = make_spec(quantization={"weights": "fp8"}, resources={"accelerator": "a100-80gb"})
    serving = summarize_workload(_engine_deployment([]), [])
    status = status_for(fp8_a100, serving)
    assert conditions(status)["Stalled"] == ("True", "UnsupportedQuantization")
    assert status["quantization"] == "none"
    # Nothing runs at all: no format is in effect.
    assert status_for(fp8_a100, None)["quantization"] is None


def test_pods_the_api_server_refuses_are_named_in_status(make_spec) -> None:
    """A namespace enforcing PodSecurity baseline refuses a file:// model's hostPath pod: the
    Deployment says so in ReplicaFailure and no pod exists. Before, status read "RollingOut:
    0/1 replicas ready" for the 600 s of the progress deadline, then a generic message."""
    refusal = (
        'pods "llama-5d9c-x" is forbidden: violates PodSecurity "baseline:latest": hostPath '
        'volumes (volume "model")'
    )
    deployment = {
        "metadata": {"generation": 2},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 2,
            "conditions": [
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetCreated"},
                {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                 "message": refusal},
            ],
        },
    }  # fmt: skip
    state = summarize_workload(deployment, [])
    assert state.pods_refused == refusal
    status = status_for(make_spec(replicas=1), state)
    assert conditions(status)["Stalled"] == ("True", "PodsRefused")
    assert conditions(status)["Ready"] == ("False", "PodsRefused")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert refusal in ready["message"]
    # Once the pods exist and serve, the old condition (cleared by the controller) is gone.
    deployment["status"] = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1,
                            "readyReplicas": 1}  # fmt: skip
    healthy = status_for(make_spec(replicas=1), summarize_workload(deployment, []))
    assert conditions(healthy)["Ready"] == ("True", "AllReplicasReady")


def test_a_router_that_cannot_run_keeps_the_deployment_from_ready(make_spec) -> None:
    """routing.image " " left the router's Deployment with a ReplicaFailure and 0/1 ready while
    the resource said Ready (AllReplicasReady) and status.endpoint.url pointed at the router."""
    router = {"status": {"conditions": [
        {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
         "message": 'Pod "llama-router-x" is invalid: spec.containers[0].image: Required value'},
    ]}}  # fmt: skip
    failure = deployment_failure(router)
    assert failure is not None and "image: Required value" in failure
    status = status_for(make_spec(), workload(router_failure=failure))
    assert conditions(status)["Ready"] == ("False", "RouterFailing")
    assert conditions(status)["Stalled"] == ("True", "RouterFailing")
    late = {
        "status": {
            "conditions": [
                {
                    "type": "Progressing",
                    "status": "False",
                    "reason": "ProgressDeadlineExceeded",
                    "message": 'ReplicaSet "llama-router-x" has timed out',
                }
            ]
        }
    }
    assert deployment_failure(late) == 'ReplicaSet "llama-router-x" has timed out'
    assert deployment_failure({"status": {"readyReplicas": 1}}) is None
    # Without routing the router's Deployment is being pruned: its state does not count.
    no_router = status_for(make_spec(routing={"enabled": False}), workload(router_failure=failure))
    assert conditions(no_router)["Ready"] == ("True", "AllReplicasReady")


# What kube-controller-manager v1.37 writes on an HPA whose Pods metrics nobody serves.
HPA_NO_METRICS = {
    "kind": "HorizontalPodAutoscaler",
    "metadata": {"name": "llama"},
    "status": {"conditions": [
        {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale",
         "message": "the HPA controller was able to get the target's current scale"},
        {"type": "ScalingActive", "status": "False", "reason": "FailedGetPodsMetric",
         "message": "the HPA was unable to compute the replica count: unable to get metric "
                    "kvfleet_kv_cache_usage_ratio: no custom metrics API "
                    "(custom.metrics.k8s.io) registered"},
    ]},
}  # fmt: skip


def test_an_hpa_that_cannot_scale_says_so_on_the_inference_deployment(make_spec) -> None:
    """controller HPA without a metrics adapter: the HPA's ScalingActive=False was visible only
    on the HPA; the InferenceDeployment showed Ready and no ScalingLimited."""
    spec = make_spec(
        replicas=None,
        autoscaling={"controller": "HPA", "maxReplicas": 4, "targets": {"kvCacheUtilization": 0.7}},
    )
    trouble = external_scaling(HPA_NO_METRICS)
    status = status_for(spec, workload(external_scaling=trouble))
    limited = next(c for c in status["conditions"] if c["type"] == "ScalingLimited")
    assert (limited["status"], limited["reason"]) == ("True", "FailedGetPodsMetric")
    assert limited["message"].startswith("HorizontalPodAutoscaler llama: the HPA was unable")
    assert conditions(status)["Ready"][0] == "True"  # it serves; scaling is what is limited
    # Once the adapter serves the metrics, it clears, and its transition time moves once.
    active = {**HPA_NO_METRICS, "status": {"conditions": [
        {"type": "AbleToScale", "status": "True", "reason": "ReadyForNewScale"},
        {"type": "ScalingActive", "status": "True", "reason": "ValidMetricFound"},
        {"type": "ScalingLimited", "status": "False", "reason": "DesiredWithinRange"},
    ]}}  # fmt: skip
    later = status_for(
        spec, workload(external_scaling=external_scaling(active)), old=status, now=T1
    )
    cleared = next(c for c in later["conditions"] if c["type"] == "ScalingLimited")
    assert (cleared["status"], cleared["lastTransitionTime"]) == ("False", T1)
    assert [c["type"] for c in later["conditions"]].count("ScalingLimited") == 1


def test_a_scaled_object_not_ready_or_in_fallback_is_limited() -> None:
    base = {"kind": "ScaledObject", "metadata": {"name": "llama"}}
    not_ready = {
        "type": "Ready",
        "status": "False",
        "reason": "ScaledObjectCheckFailed",
        "message": "failed to ensure HPA is correctly created for ScaledObject",
    }
    assert external_scaling({**base, "status": {"conditions": [not_ready]}}) == (
        "True", "ScaledObjectCheckFailed",
        "ScaledObject llama: failed to ensure HPA is correctly created for ScaledObject",
    )  # fmt: skip
    fallback = [
        {"type": "Ready", "status": "True"},
        {"type": "Fallback", "status": "True", "reason": "FallbackExists",
         "message": "At least one trigger is falling back"},
    ]  # fmt: skip
    assert external_scaling({**base, "status": {"conditions": fallback}})[:2] == (
        "True", "FallbackExists"
    )  # fmt: skip
    assert external_scaling({**base, "status": {}}) is None  # nothing reported yet
