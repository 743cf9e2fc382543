"""`kvfleet router` end to end on the local control plane, in front of real engines.

The operator renders the router's Deployment; kwok runs its pod and gives it an IP, and this test
starts the real `kvfleet router` bound at that IP:8000 with the arguments the operator rendered
(the operator's autoscaler scrapes it there, as in a cluster). One real engine (tiny random
model, CPU) is bound at each engine pod's IP, as in test_autoscaling.py. kwok's pod IPs are
loopback addresses, which the API server refuses in an EndpointSlice (the controller cannot
create the Service's slices here), so these routers discover the engine pods with
`--discovery pods`; EndpointSlice discovery is exercised against the API server on its own (0).

0. The router follows an EndpointSlice's ready endpoints as they change (list, then watch).
1. A conversation's turns land on one replica, and still do when they alternate between the
   two router pods (two processes, each with its own view: a tenant neither has seen goes to
   the replica its first block hashes to in both).
2. One engine is killed mid-run: its new requests go elsewhere; the only client errors are the
   streams it was serving.
3. An InferenceDeployment with minReplicas 0 scales to zero when idle; a request then waits in
   the router, the autoscaler scales 0 -> 1, and the request completes. The timeline is printed.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pods import EnginePods
from kvcluster.kubectl import Kubectl
from kvcluster.procs import stop_child, tail
from kvcluster.testing import E2ECluster, wait_until
from operator_process import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny"
REPLICA_HEADER = "x-kvfleet-replica"


class RouterProcess:
    """The real router, bound at its kwok pod's IP with the arguments the operator rendered."""

    def __init__(
        self, cluster: E2ECluster, namespace: str, name: str, log: Path, pod_index: int = 0
    ) -> None:
        """`pod_index`: which of the router pods (by name) it stands for."""
        self.cluster, self.namespace, self.name, self.log = cluster, namespace, name, log
        self.pod_index = pod_index
        self.extra = ["--discovery", "pods"]  # see the module docstring
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    def __enter__(self) -> RouterProcess:
        kubectl = self.cluster.kubectl
        pod = wait_until(
            lambda: _running_pod(kubectl, self.namespace, self.name, self.pod_index),
            60,
            "router pod",
        )
        ip = pod["status"]["podIP"]
        args = pod["spec"]["containers"][0]["args"]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvfleet_cli", "router", *args, *self.extra, "--host", ip],
                env=self.cluster.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://{ip}:8000"
        try:
            wait_until(lambda: _status(self.url + "/ready") == 200, 180, "router /ready", self.tail)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_child(self.proc, signal.SIGTERM, 20)

    def tail(self) -> str:
        return f"--- router ---\n{tail(self.log, 30)}"

    def metric(self, line_start: str) -> float | None:
        return _metric(self.url, line_start)


def _metric(url: str, line_start: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return None


def _running_pod(
    kubectl: Kubectl, namespace: str, name: str, index: int = 0
) -> dict[str, Any] | None:
    """The index-th running router pod by name, once that many run."""
    pods = kubectl.json("get", "pods", "-n", namespace, "-l", f"kvfleet.io/router={name}")
    running = sorted(
        (
            p
            for p in pods["items"]
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
        ),
        key=lambda p: p["metadata"]["name"],
    )
    return running[index] if len(running) > index else None


def _listening(ip: str, port: int = 8000) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def infd(namespace: str, name: str, model: Path, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {"uri": f"file://{model}", "servedModelName": MODEL, "maxModelLen": 512},
            "resources": {"accelerator": "h100-80gb"},
            **spec,
        },
    }


def system_prompt(tenant: int) -> str:
    return f"You are the assistant of tenant {tenant}. Answer in one short sentence, kindly. " * 2


def chat_body(tenant: int, turns: list[str], stream: bool = False) -> dict[str, Any]:
    messages = [{"role": "system", "content": system_prompt(tenant)}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": MODEL, "messages": messages, "max_tokens": 6, "stream": stream}


def test_the_router_follows_the_endpointslices_of_the_engine_service(
    cluster: E2ECluster, namespace: str, tmp_path: Path
) -> None:
    kubectl = cluster.kubectl
    kubectl.apply({"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "slices", "namespace": namespace},
                   "spec": {"ports": [{"name": "http", "port": 8000}]}})  # fmt: skip

    def endpoint(ip: str, ready: bool) -> dict[str, Any]:
        return {"addresses": [ip], "conditions": {"ready": ready}}

    def endpoint_slice(*endpoints: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "slices-a", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": "slices"}},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": list(endpoints),
        }  # fmt: skip

    # TEST-NET addresses: nothing answers there, so they are members that scrapes take out.
    kubectl.apply(endpoint_slice(endpoint("192.0.2.10", True), endpoint("192.0.2.11", True),
                                 endpoint("192.0.2.12", False)))  # fmt: skip
    port = _free_port()
    log_path = tmp_path / "router.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_cli", "router", "--deployment", "slices",
             "--namespace", namespace, "--host", "127.0.0.1", "--port", str(port)],
            env=cluster.env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def members() -> float | None:
        available = _metric(url, 'kvfleet_router_replicas{state="available"}')
        out = _metric(url, 'kvfleet_router_replicas{state="out"}')
        return None if available is None or out is None else available + out

    def details() -> str:
        return tail(log_path, 20)

    try:
        wait_until(lambda: _status(url + "/ready") == 200, 60, "router /ready", details)
        wait_until(lambda: members() == 2, 20, "two ready endpoints", details)
        kubectl.apply(endpoint_slice(endpoint("192.0.2.10", True), endpoint("192.0.2.11", False)))
        wait_until(lambda: members() == 1, 20, "one ready endpoint after the update", details)
        kubectl("delete", "endpointslice", "slices-a", "-n", namespace)
        wait_until(lambda: members() == 0, 20, "no endpoint after the delete", details)
        assert "replicas of kubernetes.io/service-name=slices: 192.0.2.10:8000" in details()
    finally:
        stop_child(proc, signal.SIGTERM, 20)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_conversations_stick_to_a_replica_and_a_killed_engine_loses_only_its_streams(
    cluster: E2ECluster,
    namespace: str,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    model = tiny_model
    cluster.kubectl("apply", "--server-side", "-f", "-",
                    input=json.dumps(infd(namespace, MODEL, model, replicas=3)))  # fmt: skip
    router_log = tmp_path / "router.log"
    with (
        EnginePods(cluster.kubectl, namespace, MODEL, model, tmp_path) as engines,
        RouterProcess(cluster, namespace, MODEL, router_log) as router,
        RouterProcess(cluster, namespace, MODEL, tmp_path / "router-1.log", 1) as other,
    ):
        logs = [operator.log_path, router_log]
        three = lambda: len(engines.ready_ips()) == 3  # noqa: E731
        wait_until(three, 420, "three engines", lambda: _tails(logs))
        wait_until(
            lambda: router.metric('kvfleet_router_replicas{state="available"}') == 3,
            30,
            "the router to see three replicas",
            router.tail,
        )

        # 1. Three conversations, interleaved, four turns each: each stays on one replica.
        homes: dict[int, set[str]] = {tenant: set() for tenant in range(3)}
        history: dict[int, list[str]] = {tenant: [] for tenant in range(3)}
        with httpx.Client(base_url=router.url, timeout=60) as http:
            for turn in range(4):
                for tenant in homes:
                    history[tenant].append(f"question {turn} from tenant {tenant}?")
                    body = chat_body(tenant, history[tenant])
                    response = http.post("/v1/chat/completions", json=body)
                    assert response.status_code == 200, response.text
                    homes[tenant].add(response.headers[REPLICA_HEADER])
                    answer = response.json()["choices"][0]["message"]["content"]
                    history[tenant].append(answer[:12] or "ok")
        assert all(len(replicas) == 1 for replicas in homes.values()), homes
        # Each tenant's first turn went to its hashed replica (its pod name with the prompt's
        # first block: where tenants land depends on the pods' random names), the rest by prefix.
        decisions = 'kvfleet_router_routing_decisions_total{reason="%s",strategy="prefix"}'
        assert router.metric(decisions % "hash") == 3
        assert router.metric(decisions % "prefix") == 9
        print(f"\nconversation homes: { {t: sorted(r)[0] for t, r in homes.items()} }")

        # 1b. The second router pod (routing.replicas 2), its own process and its own view:
        # three new conversations whose turns alternate between the two routers stay on one
        # replica each; each router places a tenant it has not seen by the same hash.
        wait_until(
            lambda: other.metric('kvfleet_router_replicas{state="available"}') == 3,
            30,
            "the second router to see three replicas",
            other.tail,
        )
        homes = {tenant: set() for tenant in range(3, 6)}
        history = {tenant: [] for tenant in homes}
        clients = [httpx.Client(base_url=r.url, timeout=60) for r in (router, other)]
        try:
            for turn in range(4):
                for tenant in homes:
                    history[tenant].append(f"question {turn} from tenant {tenant}?")
                    response = clients[turn % 2].post(
                        "/v1/chat/completions", json=chat_body(tenant, history[tenant])
                    )
                    assert response.status_code == 200, response.text
                    homes[tenant].add(response.headers[REPLICA_HEADER])
                    answer = response.json()["choices"][0]["message"]["content"]
                    history[tenant].append(answer[:12] or "ok")
        finally:
            for client in clients:
                client.close()
        assert all(len(replicas) == 1 for replicas in homes.values()), homes
        assert other.metric(decisions % "hash") == 3  # its first sight of each tenant

        # 2. Streams from four clients; one engine is killed mid-run.
        records: list[Record] = []
        stop = threading.Event()
        workers = [
            threading.Thread(target=_stream_forever, args=(router.url, tenant, records, stop))
            for tenant in range(4)
        ]
        for worker in workers:
            worker.start()
        time.sleep(8)
        counts: dict[str, int] = {}
        for record in records:
            if record.replica:
                counts[record.replica] = counts.get(record.replica, 0) + 1
        victim = max(counts, key=lambda replica: counts[replica])
        # The header names the pod that answered, never its address.
        assert victim in engines.procs, (victim, sorted(engines.procs))
        engines.procs[victim][1].kill()
        killed_at = time.monotonic()
        time.sleep(12)
        stop.set()
        for worker in workers:
            worker.join(60)

    after = [r for r in records if r.started > killed_at]
    failed = [r for r in records if not r.ok]
    print(f"streams: {len(records)}, after the kill: {len(after)}, failed: {len(failed)}")
    assert len(after) >= 8, "too few requests after the kill to say anything"
    assert all(r.ok for r in after), [r for r in after if not r.ok]
    assert all(r.replica != victim for r in after)
    for record in failed:  # only streams the killed engine was serving when it died
        assert record.replica == victim and record.started <= killed_at, record
        assert record.ended is not None and record.ended >= killed_at - 0.5, record


@dataclass
class Record:
    started: float  # monotonic
    replica: str | None = None  # from the response header
    ok: bool = False  # 200 and the stream ended with [DONE]
    ended: float | None = None
    error: str = ""


def _stream_forever(url: str, tenant: int, records: list[Record], stop: threading.Event) -> None:
    turns: list[str] = []
    with httpx.Client(base_url=url, timeout=60) as http:
        while not stop.is_set():
            if len(turns) >= 6:
                turns = []  # a new conversation before the context runs out
            turns.append(f"tell me {len(turns)} things")
            record = Record(time.monotonic())
            records.append(record)
            try:
                with http.stream(
                    "POST", "/v1/chat/completions", json=chat_body(10 + tenant, turns, stream=True)
                ) as response:
                    record.replica = response.headers.get(REPLICA_HEADER)
                    data = b"".join(response.iter_raw())
                record.ok = response.status_code == 200 and data.rstrip().endswith(b"[DONE]")
                if not record.ok:
                    record.error = f"{response.status_code}: {data[-200:]!r}"
            except httpx.HTTPError as exc:
                record.error = repr(exc)
            record.ended = time.monotonic()
            turns.append("sure")


def test_zero_replicas_a_request_waits_scales_to_one_and_completes(
    cluster: E2ECluster,
    namespace: str,
    operator: OperatorProcess,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    model = tiny_model
    kubectl = cluster.kubectl
    autoscaling = {
        "minReplicas": 0,
        "maxReplicas": 1,
        "targets": {"generationTokenRate": {"tokensPerSecond": 1000}},
        "behavior": {"syncPeriodSeconds": 1, "stableWindowSeconds": 10, "panicWindowSeconds": 4,
                     "warmupSeconds": 0},
    }  # fmt: skip
    # One router pod: one RouterProcess stands for it at its IP, and the autoscaler counts the
    # routers idle only when every ready router pod answers.
    routing = {"scaleToZeroAfterSeconds": 30, "queueTimeoutSeconds": 600, "replicas": 1}
    manifest = infd(namespace, "zero", model, autoscaling=autoscaling, routing=routing)
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def replicas() -> int:
        deployment = kubectl.json("get", "deployment", "zero", "-n", namespace)
        return int(deployment["spec"].get("replicas", 1))

    router_log = tmp_path / "router.log"
    with (
        EnginePods(kubectl, namespace, "zero", model, tmp_path, served_model_name=MODEL) as engines,
        RouterProcess(cluster, namespace, "zero", router_log) as router,
    ):
        logs = [operator.log_path, router_log]
        # Idle for routing.scaleToZeroAfterSeconds: the autoscaler takes it to zero.
        wait_until(lambda: engines.procs, 60, "the first pod's engine", lambda: _tails(logs))
        old_ips = [ip for ip, _ in engines.procs.values()]
        wait_until(lambda: replicas() == 0, 180, "the scale to zero", lambda: _tails(logs))
        wait_until(lambda: not engines.pods(), 60, "the engine pod to go", lambda: _tails(logs))
        # kwok may give the next pod the same IP: its engine must find the port free.
        wait_until(lambda: not any(_listening(ip) for ip in old_ips), 60, "the old engine to exit")
        wait_until(
            lambda: router.metric('kvfleet_router_replicas{state="available"}') == 0,
            30,
            "the router to see no replica",
            router.tail,
        )
        timeline: dict[str, float] = {}
        answer: dict[str, Any] = {}

        def ask() -> None:
            body = chat_body(0, ["Are you awake?"])
            response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=600)
            answer["status"], answer["body"] = response.status_code, response.text
            timeline["response"] = time.monotonic()

        sent = time.monotonic()
        client = threading.Thread(target=ask)
        client.start()
        wait_until(lambda: router.metric("kvfleet_router_queued_requests") == 1, 10, "queued")
        timeline["queued in the router"] = time.monotonic()
        wait_until(lambda: replicas() == 1, 60, "the scale from zero", lambda: _tails(logs))
        timeline["Deployment replicas 0 -> 1"] = time.monotonic()
        wait_until(lambda: engines.pods() and engines.procs, 60, "the new pod's engine")
        timeline["pod Running, engine starting"] = time.monotonic()
        client.join(600)
        assert answer.get("status") == 200, (answer, _tails(logs))
        assert json.loads(answer["body"])["choices"][0]["message"]["role"] == "assistant"
        # It waited at zero, and again while the new engine refused connections, then 503ed.
        waits = router.metric("kvfleet_router_queue_wait_seconds_count")
        assert waits is not None and waits >= 1
        status = kubectl.json("get", "infd", "zero", "-n", namespace)["status"]

    history = status["autoscaling"]["history"]
    ups = [h for h in history if (h["fromReplicas"], h["toReplicas"]) == (0, 1)]
    downs = [h for h in history if (h["fromReplicas"], h["toReplicas"]) == (1, 0)]
    assert downs and "scale to zero" in downs[0]["reason"]
    assert ups and "scale from zero" in ups[0]["reason"]
    print("\nscale-from-zero timeline (s after the request was sent):")
    for event, at in sorted({**timeline}.items(), key=lambda item: item[1]):
        print(f"  {at - sent:7.2f}  {event}")


def _tails(paths: list[Path]) -> str:
    return "\n".join(f"--- {p.name} ---\n{tail(p, 25)}" for p in paths if p.exists())
