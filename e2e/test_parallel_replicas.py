"""Tensor-parallel replicas, on one pod and over several nodes, end to end on the local control
plane, with the operator under the ServiceAccount and RBAC of manifests/.

- A replica larger than a node without the LeaderWorkerSet API: one StatefulSet per replica, its
  ranks on separate kwok nodes, the API Service on the leader only; scaling 1 -> 2 -> 1 groups;
  a rank's restart recreates its whole group.
- With the LeaderWorkerSet CRD installed (e2e/manifests/leaderworkerset-crd.yaml, written from
  the upstream v1 types; no LWS controller runs here): the API server accepts the
  LeaderWorkerSet the operator renders, field for field.
- With real engines (`kvfleet serve --nnodes`, skipped while the engine lacks it): a TP 2 replica
  (one pod, the engine starts both ranks) and a TP 2 replica over two one-GPU kwok nodes (one
  engine per pod, bound at the pod's IP, talking gloo) serve completions through the
  InferenceDeployment's Service (the ready pods its selector picks: no kube-proxy runs here),
  and so does a PP 2 replica over two one-GPU kwok nodes (one stage per pod);
  killing one rank's process makes the replica not ready and the group is recreated.
  `RankEngines` plays the kubelet: it starts each pod's engine from the pod's own arguments,
  reports /ready as the pod's Ready condition and a process that exits as a container restart.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvcluster.kubectl import Kubectl
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
LWS_CRD_FILE = Path(__file__).resolve().parent / "manifests" / "leaderworkerset-crd.yaml"
LWS_CRD = "leaderworkersets.leaderworkerset.x-k8s.io"
NAMESPACE_PREFIX = "e2e-par-"
PRODUCT = "NVIDIA-H100-80GB-HBM3"  # the kwok nodes' GPU
T = TypeVar("T")


def _engine_runs_groups() -> bool:
    from kvfleet_engine.server.cli import build_parser

    return "--nnodes" in build_parser().format_help()


needs_engine_groups = pytest.mark.skipif(
    not _engine_runs_groups(), reason="kvfleet serve has no --nnodes yet (engine branch tp)"
)


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def installed(cluster: E2ECluster) -> E2ECluster:
    kubectl = cluster.kubectl
    kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    cluster.wait_established("inferencedeployments.kvfleet.io", "acceleratorprofiles.kvfleet.io")
    for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
        kubectl("apply", "--server-side", "-f", str(ROOT / "manifests" / name))
    return cluster


@pytest.fixture
def namespace(installed: E2ECluster) -> Iterator[str]:
    name = f"{NAMESPACE_PREFIX}{uuid.uuid4().hex[:8]}"
    installed.kubectl("create", "namespace", name)
    yield name
    installed.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def logs(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture
def operator(installed: E2ECluster, namespace: str, logs: Path) -> Iterator[subprocess.Popen]:
    """`kvfleet operator` for this test's namespace, as system:serviceaccount:kvfleet-system:
    kvfleet-operator (the shipped RBAC)."""
    env = {**os.environ, "KUBECONFIG": str(installed.service_account_kubeconfig(logs))}
    with (logs / "operator.log").open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_cli", "operator", "-n", namespace],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    yield proc
    stop_child(proc, signal.SIGTERM, 20)


@pytest.fixture
def one_gpu_nodes(installed: E2ECluster, namespace: str) -> Iterator[str]:
    """An AcceleratorProfile of one GPU per node on the kwok nodes: two ranks need two nodes."""
    name = f"one-gpu-{namespace}"
    installed.kubectl.apply(
        {
            "apiVersion": "kvfleet.io/v1alpha1",
            "kind": "AcceleratorProfile",
            "metadata": {"name": name},
            "spec": {
                "memoryGiB": 80,
                "computeCapability": "9.0",
                "devicesPerNode": 1,
                "nodeSelector": {"nvidia.com/gpu.product": PRODUCT},
            },
        }
    )
    yield name
    installed.kubectl("delete", "acceleratorprofile", name, check=False)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    """The tiny random Llama (2 layers, 4 heads, 2 KV heads: TP 2 divides it) and
    its model.hints."""
    directory = tmp_path_factory.mktemp("tiny") / "model"
    subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "tiny-model", str(directory)],
        check=True,
        capture_output=True,
    )
    config = json.loads((directory / "config.json").read_text())
    heads = config["num_attention_heads"]
    hints = {
        "numParameters": 1_000_000,
        "numLayers": config["num_hidden_layers"],
        "numAttentionHeads": heads,
        "numKeyValueHeads": config["num_key_value_heads"],
        "headDim": config.get("head_dim") or config["hidden_size"] // heads,
        "maxPositionEmbeddings": config["max_position_embeddings"],
    }
    return directory, hints


# -- tests ------------------------------------------------------------------------------------


def test_two_node_group_runs_as_statefulsets_and_scales_by_groups(
    installed: E2ECluster,
    namespace: str,
    operator: subprocess.Popen,
    one_gpu_nodes: str,
    tiny_model: tuple[Path, dict[str, int]],
    logs: Path,
) -> None:
    kubectl = installed.kubectl
    model, hints = tiny_model
    name = "tp2"  # tensor 2 over one-GPU nodes: a group of two pods
    kubectl.apply(infd(namespace, name, model, hints, {"tensor": 2}, one_gpu_nodes, replicas=1))
    pods = wait(lambda: running_group(kubectl, namespace, name, 0, 2), 60, "group 0", logs)
    # One pod per node, ranks by ordinal, the leader's DNS name as --master-addr.
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, [p["spec"]["nodeName"] for p in pods]
    assert [p["metadata"]["labels"]["apps.kubernetes.io/pod-index"] for p in pods] == ["0", "1"]
    args = pods[1]["spec"]["containers"][0]["args"]
    assert flag(args, "--tensor-parallel-size") == "2" and flag(args, "--nnodes") == "2"
    assert flag(args, "--node-rank") == "$(KVFLEET_NODE_RANK)"
    assert flag(args, "--master-addr") == f"{name}-group-0-0.{name}-group.{namespace}.svc"
    assert pods[1]["spec"]["hostname"] == f"{name}-group-0-1"
    assert pods[1]["spec"]["subdomain"] == f"{name}-group"
    # The API Service has the leader only.
    leader_ip = pods[0]["status"]["podIP"]
    wait(lambda: service_ips(kubectl, namespace, name) == [leader_ip], 30, "leader", logs)

    obj = wait(lambda: ready(kubectl, namespace, name, generation=1), 60, "Ready", logs)
    assert obj["status"]["topology"] == {
        "kind": "StatefulSet", "tensor": 2, "pipeline": 1, "gpusPerReplica": 2,
        "podsPerReplica": 2, "gpusPerPod": 1, "nodesPerReplica": 2,
    }  # fmt: skip
    assert obj["status"]["replicasSummary"] == "1/1"
    pdb = kubectl.json("get", "pdb", name, "-n", namespace)
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # The ranks' step-channel key: a Secret of this deployment's own, which its pods read.
    secret = kubectl.json("get", "secret", f"{name}-group-key", "-n", namespace)
    (owner,) = secret["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == (
        "InferenceDeployment",
        name,
        True,
    )
    assert len(secret["data"]["authkey"]) >= 40
    env = {e["name"]: e for e in pods[1]["spec"]["containers"][0]["env"]}
    assert (
        env["KVFLEET_PARALLEL_AUTHKEY"]["valueFrom"]["secretKeyRef"]["name"] == f"{name}-group-key"
    )

    # 1 -> 2 groups: a second StatefulSet, counted as one replica.
    kubectl("scale", "infd", name, "-n", namespace, "--replicas=2")
    wait(lambda: running_group(kubectl, namespace, name, 1, 2), 60, "group 1", logs)
    obj = wait(lambda: ready(kubectl, namespace, name, generation=2), 60, "2 groups", logs)
    assert obj["status"]["replicasSummary"] == "2/2"
    # 2 -> 1: the second StatefulSet is deleted.
    kubectl("scale", "infd", name, "-n", namespace, "--replicas=1")
    wait(lambda: statefulsets(kubectl, namespace, name) == [f"{name}-group-0"], 60, "1", logs)
    obj = wait(lambda: ready(kubectl, namespace, name, generation=3), 60, "1 group", logs)
    assert obj["status"]["replicasSummary"] == "1/1"

    # A rank's container restarts (as a kubelet reports it): the whole group is recreated.
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    report_restart(kubectl, namespace, f"{name}-group-0-1")

    def recreated() -> list[dict[str, Any]] | None:
        group = running_group(kubectl, namespace, name, 0, 2)
        uids = {p["metadata"]["name"]: p["metadata"]["uid"] for p in group or []}
        fresh = group and all(uids[n] != uid for n, uid in before.items())
        return group if fresh else None

    wait(recreated, 90, "group 0 recreated whole", logs)
    events = kubectl.json(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}"
    )["items"]
    assert "GroupsReplaced" in {e["reason"] for e in events}


def test_leader_worker_set_is_accepted_as_rendered(
    installed: E2ECluster, namespace: str, one_gpu_nodes: str, logs: Path
) -> None:
    from kvfleet_operator.accelerators import resolve_accelerator
    from kvfleet_operator.model_catalog import model_architecture
    from kvfleet_operator.models import AcceleratorProfileSpec, InferenceDeploymentSpec
    from kvfleet_operator.plan import ClusterFeatures, plan_deployment
    from kvfleet_operator.render import render_children

    kubectl = installed.kubectl
    created = not kubectl("get", "crd", LWS_CRD, check=False).strip()
    if created:
        kubectl("apply", "--server-side", "-f", str(LWS_CRD_FILE))
        installed.wait_established(LWS_CRD)
    proc = None
    try:
        # The operator starts after the CRD, so discovery finds the API at once.
        env = {**os.environ, "KUBECONFIG": str(installed.service_account_kubeconfig(logs))}
        with (logs / "operator.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet_cli", "operator", "-n", namespace],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        spec = {
            "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
            "parallelism": {"tensor": 2},  # over one-GPU nodes: a group of two pods
            "resources": {"accelerator": one_gpu_nodes},
            "rollout": {"maxSurge": 1, "maxUnavailable": 0},
            "replicas": 2,
        }
        kubectl.apply(manifest(namespace, "lws", spec))
        stored = wait(
            lambda: kubectl.find("leaderworkerset", "lws-group", namespace), 60, "the LWS", logs
        )
        typed = InferenceDeploymentSpec.model_validate(spec)
        one_gpu = kubectl.json("get", "acceleratorprofile", one_gpu_nodes)["spec"]
        profiles = {one_gpu_nodes: AcceleratorProfileSpec.model_validate(one_gpu)}
        profile = resolve_accelerator(one_gpu_nodes, profiles)
        features = ClusterFeatures(leader_worker_set=True, service_monitor=False)
        plan = plan_deployment("lws", typed, profile, model_architecture(typed.model), features)
        rendered = render_children("lws", namespace, typed, plan, profile, service_monitor=False)
        assert stored["spec"] == rendered[0]["spec"], "the API server pruned or changed fields"
        owner = stored["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == ("InferenceDeployment", "lws")
        service = kubectl.json("get", "service", "lws", "-n", namespace)
        assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"

        def topology() -> dict[str, Any] | None:
            obj = kubectl.find("infd", "lws", namespace) or {}
            return (obj.get("status") or {}).get("topology")

        found = wait(topology, 30, "status.topology", logs)
        assert (found["kind"], found["nodesPerReplica"], found["gpusPerReplica"]) == (
            "LeaderWorkerSet", 2, 2
        )  # fmt: skip
        assert statefulsets(kubectl, namespace, "lws") == []
    finally:
        if proc is not None:
            stop_child(proc, signal.SIGTERM, 20)
        if created:
            kubectl("delete", "crd", LWS_CRD, "--wait=false", check=False)


@needs_engine_groups
@pytest.mark.slow
@pytest.mark.parametrize(
    ("parallelism", "profile", "pods"),
    [({"tensor": 2}, "builtin", 1), ({"tensor": 2}, "one", 2), ({"pipeline": 2}, "one", 2)],
)
def test_parallel_replica_serves_through_its_service_and_recovers(
    installed: E2ECluster,
    namespace: str,
    operator: subprocess.Popen,
    one_gpu_nodes: str,
    tiny_model: tuple[Path, dict[str, int]],
    logs: Path,
    parallelism: dict[str, int],
    profile: str,
    pods: int,
) -> None:
    kubectl = installed.kubectl
    model, hints = tiny_model
    accelerator = "h100-80gb" if profile == "builtin" else one_gpu_nodes
    name = "par"
    kubectl.apply(infd(namespace, name, model, hints, parallelism, accelerator, replicas=1))
    with RankEngines(kubectl, namespace, name, model, logs) as engines:
        answer = wait(lambda: complete(kubectl, namespace, name), 300, "a completion", logs)
        assert answer["usage"]["completion_tokens"] == 8, answer
        assert len(engines.started) == pods
        obj = wait(lambda: ready(kubectl, namespace, name, generation=1), 60, "Ready", logs)
        assert obj["status"]["replicasSummary"] == "1/1"

        # Kill the last rank's process: the replica turns not ready, its group is recreated
        # (a Deployment pod's container restarts; a StatefulSet group is replaced whole) and
        # serves again.
        victim = engines.started[-1]
        engines.kill(victim)
        wait(lambda: not_ready(kubectl, namespace, name), 60, "the replica not ready", logs)
        wait(lambda: complete(kubectl, namespace, name), 300, "a completion again", logs)
        assert len(engines.started) >= 2 * pods, engines.started


# -- helpers ----------------------------------------------------------------------------------


def manifest(namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def infd(
    namespace: str,
    name: str,
    model: Path,
    hints: dict[str, int],
    parallelism: dict[str, int],
    accelerator: str,
    replicas: int,
) -> dict[str, Any]:
    spec = {
        "model": {"uri": f"file://{model}", "maxModelLen": 512, "hints": hints},
        "parallelism": parallelism,
        "resources": {"accelerator": accelerator},
        "rollout": {"drainTimeoutSeconds": 5},
        "replicas": replicas,
    }
    return manifest(namespace, name, spec)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def group_pods(kubectl: Kubectl, namespace: str, name: str) -> list[dict[str, Any]]:
    items = kubectl.json("get", "pods", "-n", namespace, "-l", f"kvfleet.io/deployment={name}")
    return [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]


def running_group(
    kubectl: Kubectl, namespace: str, name: str, group: int, size: int
) -> list[dict[str, Any]] | None:
    pods = [
        p
        for p in group_pods(kubectl, namespace, name)
        if p["metadata"]["labels"].get("kvfleet.io/group") == str(group)
        and p["status"].get("phase") == "Running"
        and p["status"].get("podIP")
    ]
    pods.sort(key=lambda p: int(p["metadata"]["labels"]["apps.kubernetes.io/pod-index"]))
    return pods if len(pods) == size else None


def statefulsets(kubectl: Kubectl, namespace: str, name: str) -> list[str]:
    items = kubectl.json(
        "get", "statefulsets", "-n", namespace, "-l", f"kvfleet.io/deployment={name}"
    )["items"]
    live = [i for i in items if not i["metadata"].get("deletionTimestamp")]
    return sorted(i["metadata"]["name"] for i in live)


def service_ips(kubectl: Kubectl, namespace: str, name: str) -> list[str]:
    """The addresses the Service `name` sends to: its selector's Running, Ready pods, sorted.
    (What its EndpointSlice would hold; here the EndpointSlice controller cannot write one:
    the API refuses the loopback pod IPs kwok hands out, and no kube-proxy would route them.)"""
    service = kubectl.find("service", name, namespace)
    if service is None:  # not created yet
        return []
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", selector)["items"]
    return sorted(
        p["status"]["podIP"]
        for p in pods
        if not p["metadata"].get("deletionTimestamp")
        and p["status"].get("podIP")
        and any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in p["status"].get("conditions", [])
        )
    )


def condition(obj: dict[str, Any] | None, kind: str) -> dict[str, Any] | None:
    conditions = ((obj or {}).get("status") or {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == kind), None)


def ready(kubectl: Kubectl, namespace: str, name: str, generation: int) -> dict[str, Any] | None:
    obj = kubectl.find("infd", name, namespace)
    cond = condition(obj, "Ready")
    if obj and cond and cond["status"] == "True" and cond["observedGeneration"] == generation:
        return obj
    return None


def not_ready(kubectl: Kubectl, namespace: str, name: str) -> bool:
    cond = condition(kubectl.find("infd", name, namespace), "Ready")
    return bool(cond and cond["status"] == "False")


def complete(kubectl: Kubectl, namespace: str, name: str) -> dict[str, Any] | None:
    """A completion from an address of the InferenceDeployment's Service."""
    for ip in service_ips(kubectl, namespace, name):
        try:
            response = httpx.post(
                f"http://{ip}:8000/v1/completions",
                json={"model": name, "prompt": "hello", "max_tokens": 8, "temperature": 0,
                      "ignore_eos": True},
                timeout=60,
            )  # fmt: skip
        except httpx.HTTPError:
            continue
        if response.status_code == 200:
            return dict(response.json())
    return None


def report_restart(kubectl: Kubectl, namespace: str, pod: str) -> None:
    """What a kubelet reports when the engine container exits and restarts: restartCount + 1,
    the pod not ready."""
    obj = kubectl.json("get", "pod", pod, "-n", namespace)
    statuses = obj["status"].get("containerStatuses") or [{"name": "engine", "image": "engine"}]
    for status in statuses:
        status["restartCount"] = int(status.get("restartCount", 0)) + 1
        status["ready"] = False
    conditions = [
        {**c, "status": "False"} if c["type"] in ("Ready", "ContainersReady") else c
        for c in obj["status"].get("conditions", [])
    ]
    patch = {"status": {"containerStatuses": statuses, "conditions": conditions}}
    kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge",
            "-p", json.dumps(patch))  # fmt: skip


def wait(check: Callable[[], T | None], timeout: float, what: str, logs: Path) -> T:
    def tails() -> str:
        return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in sorted(logs.glob("*.log")))

    return wait_until(check, timeout, what, tails)


class RankEngines:
    """The kubelet's part for the pods of one InferenceDeployment: one `kvfleet serve` (CPU) per
    Running pod, from the pod's own engine arguments with its $(VAR)s expanded, bound at the
    pod's IP, the leader's DNS name resolved to the leader pod's IP (no cluster DNS here), the
    model path the local directory; each engine's /ready is written as its pod's Ready
    condition, and an engine that exits as a container restart (what the operator acts on)."""

    def __init__(
        self, kubectl: Kubectl, namespace: str, name: str, model: Path, logs: Path
    ) -> None:
        self.kubectl, self.namespace, self.name = kubectl, namespace, name
        self.model, self.logs = model, logs
        self.procs: dict[str, tuple[str, str, subprocess.Popen[bytes]]] = {}  # uid -> pod, ip
        self.started: list[str] = []  # pod names, in start order
        self.readiness: dict[str, bool] = {}
        self.exited: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RankEngines:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for _, _, proc in self.procs.values():
            stop_child(proc, signal.SIGTERM, 15)

    def kill(self, pod: str) -> None:
        for pod_name, _, proc in self.procs.values():
            if pod_name == pod:
                proc.send_signal(signal.SIGKILL)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._step()
            except Exception as exc:  # the API server is busy: try again
                print(f"RankEngines: {exc}", file=sys.stderr)
            self._stop.wait(1.0)

    def _step(self) -> None:
        pods = group_pods(self.kubectl, self.namespace, self.name)
        running = {
            p["metadata"]["uid"]: p
            for p in pods
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        }
        for uid, pod in running.items():
            if uid not in self.procs:
                self._start(pod, pods)
        for uid in list(self.procs):
            pod_name, ip, proc = self.procs[uid]
            if uid not in running:  # pod gone: its engine drains
                stop_child(proc, signal.SIGTERM, 15)
                del self.procs[uid]
                continue
            if proc.poll() is not None:
                if uid not in self.exited:
                    self.exited.add(uid)
                    report_restart(self.kubectl, self.namespace, pod_name)
                    self.readiness[uid] = False
                    if "kvfleet.io/group" not in running[uid]["metadata"]["labels"]:
                        # A Deployment's pod: the kubelet restarts the container in place. A
                        # StatefulSet group's pod waits for the operator to recreate the group.
                        del self.procs[uid]
                        self.exited.discard(uid)
                        self._start(running[uid], pods)
                continue
            self._probe(uid, pod_name, ip)

    def _probe(self, uid: str, pod: str, ip: str) -> None:
        try:
            ok = httpx.get(f"http://{ip}:8000/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            ok = False
        if self.readiness.get(uid) == ok:
            return
        self.readiness[uid] = ok
        obj = self.kubectl.json("get", "pod", pod, "-n", self.namespace)
        status = "True" if ok else "False"
        conditions = [
            {**c, "status": status} if c["type"] in ("Ready", "ContainersReady") else c
            for c in obj["status"].get("conditions", [])
        ]
        patch = json.dumps({"status": {"conditions": conditions}})
        self.kubectl(
            "patch", "pod", pod, "-n", self.namespace, "--subresource=status", "--type=merge",
            "-p", patch,
        )  # fmt: skip

    def _start(self, pod: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        container = pod["spec"]["containers"][0]
        env = {}
        for var in container.get("env", []):
            ref = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath", "")
            label = re.fullmatch(r"metadata\.labels\['(.+)'\]", ref)
            if label:
                env[var["name"]] = pod["metadata"]["labels"][label[1]]
            elif "value" in var:
                env[var["name"]] = var["value"]
        args = [re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), a) for a in container["args"]]
        ip = pod["status"]["podIP"]
        args[args.index("--host") + 1] = ip
        args[args.index("--model") + 1] = str(self.model)
        if "--master-addr" in args:
            at = args.index("--master-addr") + 1
            leader = args[at].split(".", 1)[0]  # NAME-group-I-0, the leader pod's hostname
            ips = [p["status"].get("podIP") for p in pods if p["metadata"]["name"] == leader]
            if not ips or not ips[0]:
                return  # the leader has no IP yet: next round
            args[at] = ips[0]
        command = [
            sys.executable, "-m", "kvfleet_cli", "serve", *args, "--device", "cpu",
            "--kv-cache-blocks", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "128",
        ]  # fmt: skip
        name = pod["metadata"]["name"]
        with (self.logs / f"engine-{name}.log").open("ab") as log:
            run_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
            proc = subprocess.Popen(command, env=run_env, stdout=log, stderr=subprocess.STDOUT)
        self.procs[pod["metadata"]["uid"]] = (name, ip, proc)
        self.started.append(name)
