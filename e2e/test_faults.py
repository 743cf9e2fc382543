"""Faults in the cluster, end to end on the local control plane, each measured from the fault to
what a user sees recovered:

1. An engine pod's process SIGKILLed mid-stream: the client's stream breaks, the pod turns
   unready with one restart (the kubelet's view, played by EnginePods), the InferenceDeployment
   says 0/1 ReplicasNotReady until the engine serves again, and the autoscaler holds at one
   replica throughout.
2. The operator SIGKILLed while a rollout it started is under way, and started again: the
   rollout finishes (Ready at the new generation), no object is duplicated, no event repeated.
3. The kube-apiserver restarted: the operator's watches recover (a spec change is handled by
   its update handler), and once settled it makes no more API requests than before.
4. A kwok node deleted: its pods are rescheduled on the other node (after the pod garbage
   collector's 40 s quarantine) and the status is back at Ready 2/2.

One operator for the module (namespaces e2e-fault-*); the table of recovery times is printed at
the end (and written as JSON to $KVFLEET_FAULTS_SUMMARY when set).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from autoscaling_scenario import NAME, inference_deployment
from engine_pods import EnginePods
from kvcluster import controlplane
from kvcluster.kubectl import Kubectl, KubectlError
from kvcluster.testing import SUMMARY, E2ECluster, in_background
from operator_process import (
    OperatorProcess,
    install_crds,
    llama_manifest,
    running_operator,
    wait_logged,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PREFIX = "e2e-fault-"  # this module's operator watches only these namespaces
SAMPLE_S = 0.25
QUIET_S = 16.0  # longer than one resync pass (loops.RESYNC_SECONDS, 15 s)
RESULTS: list[dict[str, Any]] = []  # one row per fault, printed at the end


@pytest.fixture(scope="module")
def operator(
    cluster: E2ECluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    install_crds(cluster)
    log_path = tmp_path_factory.mktemp("faults") / "operator.log"
    with running_operator(cluster.env, [f"{PREFIX}*"], log_path) as started:
        yield started
    _report()


@pytest.fixture
def namespace(cluster: E2ECluster) -> Iterator[str]:
    with cluster.temporary_namespace(PREFIX) as name:
        yield name


def test_engine_killed_mid_stream_comes_back_and_the_autoscaler_holds(
    cluster: E2ECluster, operator: OperatorProcess, namespace: str, tiny_model: Path, tmp_path: Path
) -> None:
    kubectl = cluster.kubectl
    # A target far above what one stream makes: any scale-up would be a reaction to the fault.
    manifest = inference_deployment(namespace, tiny_model, tokens_per_second=10_000)
    kubectl.apply(manifest)
    with EnginePods(kubectl, namespace, NAME, tiny_model, tmp_path, restart=True) as engines:

        def logs() -> list[Path]:
            return [operator.log_path, *(tmp_path / f"engine-{n}.log" for n in engines.started)]

        wait_logged(engines.ready_ips, 300, "the engine to be ready", logs)
        wait_logged(lambda: ready_at(infd(kubectl, namespace, NAME), 1), 60, "Ready", logs)
        (pod,) = engines.started
        ip = engines.ready_ips()[0]
        sampler = Sampler(kubectl, namespace, NAME)
        with in_background(sampler.sample, SAMPLE_S):
            body = {"model": NAME, "prompt": "fault", "max_tokens": 400, "ignore_eos": True}
            url = f"http://{ip}:8000/v1/completions"
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                engines.procs[pod][1].kill()
                killed = time.monotonic()
                with pytest.raises(httpx.TransportError) as broken:
                    for _ in lines:
                        pass

            def answered() -> bool:
                try:
                    reply = httpx.post(url, json={**body, "max_tokens": 4}, timeout=30)
                except httpx.HTTPError:
                    return False
                return reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4

            wait_logged(answered, 300, "the restarted engine to answer", logs)
            serving_s = time.monotonic() - killed
            back = wait_logged(
                lambda: ready_at(infd(kubectl, namespace, NAME), 1), 60, "Ready again", logs
            )
            ready_s = time.monotonic() - killed
            time.sleep(10)  # the autoscaler's next ticks see the restarted engine's counters
    # What kubectl showed: the one pod, unready with a restart, the status 0/1, then 1/1.
    assert sampler.pod_names == {pod}, sampler.pod_names
    assert "0/1 ReplicasNotReady" in sampler.summaries, sampler.summary_changes()
    assert back["status"]["replicasSummary"] == "1/1"
    restarts = kubectl.json("get", "pod", pod, "-n", namespace)["status"]["containerStatuses"]
    assert restarts[0]["restartCount"] == 1 and restarts[0]["ready"] is True
    # The autoscaler did not react: one replica all along, no scale event in its history.
    assert sampler.replicas == {1}, sampler.replicas
    history = (infd(kubectl, namespace, NAME) or {})["status"]["autoscaling"]["history"]
    assert all(h["toReplicas"] == h["fromReplicas"] for h in history), history
    record(
        "engine SIGKILLed mid-stream",
        ready_s,
        f"client {type(broken.value).__name__}; answered again at {serving_s:.1f} s; "
        f"status {' -> '.join(sampler.summary_changes())}; restarts 1; "
        f"replicas 1 in {sampler.samples} samples",
    )


def test_operator_restarted_during_a_rollout_finishes_it_without_duplicates(
    cluster: E2ECluster, operator: OperatorProcess, namespace: str
) -> None:
    kubectl = cluster.kubectl
    roll_out(
        kubectl, operator, llama_manifest(namespace, "roll", replicas=3, rollout={"maxSurge": 1})
    )
    before = objects(kubectl, namespace)
    deployment = kubectl.find("deployment", "roll", namespace)
    assert deployment is not None

    patch = {"spec": {"engine": {"maxNumSeqs": 64}}}
    kubectl("patch", "infd", "roll", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    wait_logged(
        lambda: (
            (d := kubectl.find("deployment", "roll", namespace))
            and d["metadata"]["generation"] > deployment["metadata"]["generation"]
        ),
        30,
        "the operator to apply the new template",
        [operator.log_path],
    )
    operator.stop(signal.SIGKILL)  # mid-rollout: the Deployment is replacing its pods
    killed = time.monotonic()
    at_kill = (kubectl.find("deployment", "roll", namespace) or {}).get("status", {})
    start_s = operator.start()
    done = wait_logged(
        lambda: (o := infd(kubectl, namespace, "roll")) and ready_at(o, 2) and o,
        90,
        "Ready at generation 2 after the restart",
        [operator.log_path],
    )
    recovery_s = time.monotonic() - killed

    after = objects(kubectl, namespace)
    assert {k: v for k, v in after.items() if k != "replicasets"} == {
        k: v for k, v in before.items() if k != "replicasets"
    }
    assert after["deployments"] == ["roll", "roll-router"]
    engine_sets = [rs for rs in after["replicasets"] if not rs.startswith("roll-router-")]
    assert len(engine_sets) == 2, after["replicasets"]  # the old template's and the new one's
    final = kubectl.find("deployment", "roll", namespace)
    assert final is not None and final["metadata"]["uid"] == deployment["metadata"]["uid"]
    args = final["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "64"
    assert done["status"]["replicasSummary"] == "3/3"
    reasons = event_reasons(kubectl, namespace, "roll")
    assert reasons.count("RolloutStarted") == 1 and reasons.count("Created") == 1, reasons
    assert done["metadata"]["generation"] == 2  # the operator wrote no spec
    record(
        "operator SIGKILLed mid-rollout",
        recovery_s,
        f"killed at {at_kill.get('updatedReplicas', 0)}/3 updated; restarted in "
        f"{start_s:.1f} s; Ready 3/3 at generation 2; {sum(map(len, after.values()))} "
        "objects, none twice; RolloutStarted once",
    )


def test_api_server_restarted_watches_recover_without_a_reconcile_storm(
    cluster: E2ECluster, operator: OperatorProcess, namespace: str
) -> None:
    kubectl = cluster.kubectl
    roll_out(kubectl, operator, llama_manifest(namespace, "watched", replicas=1))
    baseline = requests_during(kubectl, QUIET_S)

    began = time.monotonic()
    down_s = controlplane.restart(cluster.config, "kube-apiserver", report=lambda _: None)
    offset = operator.log_path.stat().st_size
    patch = {"spec": {"engine": {"maxNumSeqs": 32}}}
    kubectl("patch", "infd", "watched", "-n", namespace, "--type=merge", "-p", json.dumps(patch))
    patched = time.monotonic()

    def update_handled() -> bool:  # kopf's line names no object: this is the only change
        return "Handler 'spec_changed/spec' succeeded" in log_since(operator.log_path, offset)

    wait_logged(update_handled, 120, "the update handler to see the patch", [operator.log_path])
    watch_s = time.monotonic() - patched
    wait_logged(
        lambda: ready_at(infd(kubectl, namespace, "watched"), 2),
        60,
        "Ready at generation 2",
        [operator.log_path],
    )
    recovery_s = time.monotonic() - began

    versions = resource_versions(kubectl, namespace, "watched")
    quiet_offset = operator.log_path.stat().st_size
    after = requests_during(kubectl, QUIET_S)
    assert resource_versions(kubectl, namespace, "watched") == versions, "writes while idle"
    quiet_log = log_since(operator.log_path, quiet_offset)
    assert "Traceback" not in quiet_log, quiet_log[-3000:]
    assert after <= 2 * baseline + 10, (after, baseline)
    record(
        "kube-apiserver restarted",
        recovery_s,
        f"API server back in {down_s:.1f} s; a spec change handled {watch_s:.1f} s "
        f"after; Ready at generation 2; idle {QUIET_S:.0f} s: {after} API requests on "
        f"InferenceDeployments and Deployments (before: {baseline}), no writes",
    )


def test_node_deleted_its_replicas_are_rescheduled(
    cluster: E2ECluster, operator: OperatorProcess, namespace: str
) -> None:
    kubectl = cluster.kubectl
    roll_out(kubectl, operator, llama_manifest(namespace, "spread", replicas=2))
    pods = engine_pods(kubectl, namespace, "spread")
    victim = pods[0]["spec"]["nodeName"]
    lost = {p["metadata"]["name"] for p in pods if p["spec"]["nodeName"] == victim}
    sampler = Sampler(kubectl, namespace, "spread")
    try:
        with in_background(sampler.sample, SAMPLE_S):
            kubectl("delete", "node", victim)
            deleted = time.monotonic()

            def rescheduled() -> bool:
                now = engine_pods(kubectl, namespace, "spread")
                return (
                    len(now) == 2
                    and not lost & {p["metadata"]["name"] for p in now}
                    and all(p["status"].get("phase") == "Running" for p in now)
                    and ready_at(infd(kubectl, namespace, "spread"), 1) is not None
                )

            wait_logged(rescheduled, 180, "the lost pods to be replaced", [operator.log_path])
            recovery_s = time.monotonic() - deleted
    finally:
        controlplane.restore_nodes(cluster.config, report=lambda _: None)
    now = engine_pods(kubectl, namespace, "spread")
    assert victim not in {p["spec"]["nodeName"] for p in now}
    obj = infd(kubectl, namespace, "spread")
    assert obj is not None and obj["status"]["replicasSummary"] == "2/2"
    record(
        "kwok node deleted",
        recovery_s,
        f"{len(lost)} of 2 pods on {victim} replaced on the other node; status "
        f"{' -> '.join(sampler.summary_changes())}",
    )


# -- what the tests read ------------------------------------------------------------------------


class Sampler:
    """What `kubectl get` shows at each `sample()` (run every SAMPLE_S in the background): the
    Deployment's spec.replicas, its pods' names, the InferenceDeployment's replicasSummary."""

    def __init__(self, kubectl: Kubectl, namespace: str, name: str) -> None:
        self.kubectl, self.namespace, self.name = kubectl, namespace, name
        self.replicas: set[int] = set()
        self.pod_names: set[str] = set()
        self.summaries: list[str] = []  # "replicasSummary Ready's reason", e.g. "1/2 RollingOut"
        self.samples = 0

    def summary_changes(self) -> list[str]:
        changes: list[str] = []
        for summary in self.summaries:
            if not changes or changes[-1] != summary:
                changes.append(summary)
        return changes

    def sample(self) -> None:
        try:
            deployment = self.kubectl.find("deployment", self.name, self.namespace)
            pods = engine_pods(self.kubectl, self.namespace, self.name)
            obj = infd(self.kubectl, self.namespace, self.name)
        except KubectlError:  # the API server restarting
            return
        if deployment is not None:
            self.replicas.add(int(deployment["spec"].get("replicas", 1)))
        self.pod_names |= {p["metadata"]["name"] for p in pods}
        status = (obj or {}).get("status") or {}
        ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
        if status.get("replicasSummary") and ready is not None:
            self.summaries.append(f"{status['replicasSummary']} {ready['reason']}")
        self.samples += 1


def record(fault: str, recovery_s: float, seen: str) -> None:
    """One row of the table printed at the end."""
    RESULTS.append({"fault": fault, "recovery_s": round(recovery_s, 1), "seen": seen})


def roll_out(kubectl: Kubectl, operator: OperatorProcess, manifest: dict[str, Any]) -> None:
    """Apply `manifest` and wait until it is Ready at generation 1."""
    kubectl.apply(manifest)
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    wait_logged(
        lambda: ready_at(infd(kubectl, namespace, name), 1),
        60,
        f"{name} Ready",
        [operator.log_path],
    )


def infd(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    return kubectl.find("infd", name, namespace)


def ready_at(obj: dict[str, Any] | None, generation: int) -> dict[str, Any] | None:
    """`obj` if it is Ready=True at `generation` (status and condition observed it)."""
    status = (obj or {}).get("status") or {}
    ready = next((c for c in status.get("conditions", []) if c["type"] == "Ready"), None)
    if (
        ready is not None
        and ready["status"] == "True"
        and ready.get("observedGeneration") == generation
        and status.get("observedGeneration") == generation
    ):
        return obj
    return None


def engine_pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    items = kubectl.json("get", "pods", "-n", namespace, "-l", f"kvfleet.io/deployment={name}")
    return [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]


OBJECT_KINDS = (
    "deployments", "replicasets", "services", "poddisruptionbudgets", "serviceaccounts",
    "roles", "rolebindings", "networkpolicies",
)  # fmt: skip


def objects(kubectl: Kubectl, namespace: str) -> dict[str, list[str]]:
    """The names of every object of OBJECT_KINDS in `namespace` but the `default`
    ServiceAccount that Kubernetes adds."""
    found = {}
    for kind in OBJECT_KINDS:
        items = kubectl.json("get", kind, "-n", namespace)["items"]
        names = sorted(i["metadata"]["name"] for i in items)
        found[kind] = [n for n in names if not (kind == "serviceaccounts" and n == "default")]
    return found


def event_reasons(kubectl: Kubectl, namespace: str, name: str) -> list[str]:
    items = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector",
        f"involvedObject.name={name},involvedObject.kind=InferenceDeployment",
    )["items"]  # fmt: skip
    reasons: list[str] = []
    for event in items:
        reasons += [event["reason"]] * int(event.get("count") or 1)
    return reasons


def resource_versions(kubectl: Kubectl, namespace: str, name: str) -> tuple[str, ...]:
    return tuple(
        kubectl("get", kind, name, "-n", namespace, "-o", "jsonpath={.metadata.resourceVersion}")
        for kind in ("infd", "deployment", "service")
    )


REQUEST_LINE = re.compile(
    r'^apiserver_request_total\{(?=[^}]*resource="(?:inferencedeployments|deployments)")'
    r"[^}]*\} (\S+)$",
    re.MULTILINE,
)


def requests_during(kubectl: Kubectl, seconds: float) -> int:
    """API requests on InferenceDeployments and Deployments (every client, every verb) that
    the API server counted over `seconds` from now; the operator is nearly all of them."""

    def total() -> float:
        return sum(float(v) for v in REQUEST_LINE.findall(kubectl("get", "--raw", "/metrics")))

    first = total()
    time.sleep(seconds)
    return round(total() - first)


def log_since(path: Path, offset: int) -> str:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


def _report() -> None:
    """The table (fault, recovery s, what was seen) at the end of the session; as JSON in
    $KVFLEET_FAULTS_SUMMARY when set."""
    if not RESULTS:
        return
    lines = [f"{'fault':<32} {'recovery s':>10}  what a user saw"]
    lines += [f"{r['fault']:<32} {r['recovery_s']:>10.1f}  {r['seen']}" for r in RESULTS]
    SUMMARY["faults in the cluster"] = lines
    path = os.environ.get("KVFLEET_FAULTS_SUMMARY")
    if path:
        Path(path).write_text(json.dumps(RESULTS, indent=2) + "\n")
