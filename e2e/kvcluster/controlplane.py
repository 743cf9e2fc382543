"""Bring the local control plane up, take it down, report its state.

Start order: etcd -> kube-apiserver (/readyz) -> kube-controller-manager (/healthz, then the
`default` service account exists) -> kube-scheduler (/healthz) -> kwok -> fake GPU nodes Ready.
Every pid is written to <state_dir>/state.json as soon as it starts, so `down` (or a failed
`up`) stops exactly what was started, in reverse order. etcd's data is wiped on `down`: each
`up` starts from an empty cluster.
"""

from __future__ import annotations

import json
import logging
import shutil
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcluster import procs
from kvcluster.binaries import BuildError, binary_paths, ensure_binaries
from kvcluster.config import ClusterConfig
from kvcluster.kubectl import Kubectl, KubectlError
from kvcluster.pki import Pki, PkiError, ensure_pki, render_kubeconfig
from kvcluster.plan import Component, node_name, plan_components, render_node, render_node_status

log = logging.getLogger(__name__)

Report = Callable[[str], None]


class ClusterError(RuntimeError):
    """`up` failed. Names the component and its log; everything started was stopped."""

    def __init__(self, component: str, problem: str, log_path: Path | None):
        self.component = component
        self.log_path = log_path
        where = f"\n  log: {log_path}" if log_path else ""
        super().__init__(f"{component}: {problem}{where}")


@dataclass(frozen=True)
class ComponentState:
    """One started process, as saved in state.json."""

    name: str  # component name, e.g. "kube-apiserver"
    pid: int
    binary: str  # argv[0]; guards against killing an unrelated process that reused the pid
    alive: bool  # at the time the state was read


def up(config: ClusterConfig, owner: str = "cli", report: Report = print) -> bool:
    """Start the cluster unless it is already running; True if this call started it."""
    with procs.locked(config.state_dir / ".lock"):
        if is_running(config):
            report(f"control plane already running (state: {config.state_dir})")
            _add_missing_nodes(config, report)
            return False
        _stop_all(config)  # leftovers of a crashed run, if any
        shutil.rmtree(config.logs_dir, ignore_errors=True)
        started = time.monotonic()
        try:
            _start(config, owner, report)
        except BaseException:
            _stop_all(config)
            raise
        report(f"control plane up in {time.monotonic() - started:.1f}s")
        return True


def down(config: ClusterConfig, report: Report = print) -> list[str]:
    """Stop every saved process (reverse start order); return their names."""
    with procs.locked(config.state_dir / ".lock"):
        stopped = _stop_all(config)
    if stopped:
        report(f"stopped {', '.join(stopped)}")
    else:
        report("control plane not running")
    return stopped


def status(config: ClusterConfig) -> list[ComponentState]:
    return _read_state(config)


def is_running(config: ClusterConfig) -> bool:
    """Every saved process is alive and the API server answers /readyz."""
    states = _read_state(config)
    if not states or not all(state.alive for state in states):
        return False
    if {state.name for state in states} != {"etcd", "kube-apiserver", "kube-controller-manager",
                                           "kube-scheduler", "kwok"}:  # fmt: skip
        return False
    pki = Pki.under(config.state_dir / "pki")
    return procs.probe(
        f"https://127.0.0.1:{config.ports.apiserver}/readyz",
        procs.client_ssl_context(pki.ca_cert, pki.admin_cert, pki.admin_key),
    )


def owner(config: ClusterConfig) -> str | None:
    """Who started the running cluster: "cli", "fixture", or None."""
    try:
        return str(json.loads(_state_file(config).read_text())["owner"])
    except (FileNotFoundError, KeyError, ValueError):
        return None


def kubectl_for(config: ClusterConfig) -> Kubectl:
    return Kubectl(binary_paths(config.bin_root)["kubectl"], config.kubeconfig)


# --- starting -------------------------------------------------------------------------------


def _start(config: ClusterConfig, owner: str, report: Report) -> None:
    try:
        binaries = ensure_binaries(config.bin_root)
    except BuildError as exc:
        raise ClusterError("build", str(exc), None) from exc
    try:
        pki = ensure_pki(config.state_dir / "pki")
    except PkiError as exc:
        raise ClusterError("pki", str(exc), None) from exc
    server = f"https://127.0.0.1:{config.ports.apiserver}"
    config.kubeconfig.write_text(render_kubeconfig(pki, server))
    config.kubeconfig.chmod(0o600)
    kubectl = Kubectl(binaries["kubectl"], config.kubeconfig)
    ssl_context = procs.client_ssl_context(pki.ca_cert, pki.admin_cert, pki.admin_key)

    _write_state(config, owner, [])
    for component in plan_components(config, binaries, pki, advertise_address()):
        t0 = time.monotonic()
        _launch(config, owner, component)
        _wait_ready(config, component, ssl_context, kubectl)
        report(f"  {component.name} ready ({time.monotonic() - t0:.1f}s)")


def _launch(config: ClusterConfig, owner: str, component: Component) -> None:
    log_path = config.log_path(component.name)
    for port in component.ports:
        if procs.port_in_use(port):
            raise ClusterError(
                component.name,
                f"port 127.0.0.1:{port} is already in use (another cluster? "
                f"`make cluster-down`, or find it with `ss -ltnp 'sport = :{port}'`)",
                log_path,
            )
    if component.name == "etcd":
        shutil.rmtree(config.state_dir / "etcd", ignore_errors=True)
    pid = procs.spawn(component.argv, log_path)
    states = _read_state(config)
    entry = ComponentState(component.name, pid, component.argv[0], alive=True)
    _write_state(config, owner, [*states, entry])


def _wait_ready(
    config: ClusterConfig, component: Component, ssl_context: ssl.SSLContext, kubectl: Kubectl
) -> None:
    log_path = config.log_path(component.name)
    pid = next(s.pid for s in _read_state(config) if s.name == component.name)
    checks: list[Callable[[], bool]] = []
    if component.health_url:
        context = ssl_context if component.health_url.startswith("https") else None
        url = component.health_url
        checks.append(lambda: procs.probe(url, context))
    if component.name == "kube-controller-manager":
        # pods are refused until the service-account controller made `default`
        checks.append(lambda: _succeeds(kubectl, "get", "serviceaccount", "default"))
    if component.name == "kwok":
        _create_nodes(config, kubectl, list(range(config.num_nodes)), log_path)
        checks.append(lambda: _nodes_ready(kubectl, config.num_nodes))

    deadline = time.monotonic() + config.ready_timeout_s
    pending = list(checks)
    while pending:
        if not procs.is_alive(pid, component.argv[0]):
            raise ClusterError(
                component.name,
                f"exited during start-up. Last log lines:\n{procs.tail(log_path)}",
                log_path,
            )
        if pending[0]():
            pending.pop(0)
            continue
        if time.monotonic() > deadline:
            raise ClusterError(
                component.name,
                f"not ready after {config.ready_timeout_s:.0f}s. Last log lines:\n"
                f"{procs.tail(log_path)}",
                log_path,
            )
        time.sleep(0.25)


def _add_missing_nodes(config: ClusterConfig, report: Report) -> None:
    """A running cluster asked for more nodes than it has (`up --nodes 4`): add them."""
    kubectl = kubectl_for(config)
    existing = {node["metadata"]["name"] for node in kubectl.json("get", "nodes")["items"]}
    missing = [i for i in range(config.num_nodes) if node_name(i) not in existing]
    if not missing:
        return
    log_path = config.log_path("kwok")
    _create_nodes(config, kubectl, missing, log_path)
    deadline = time.monotonic() + config.ready_timeout_s
    while not _nodes_ready(kubectl, config.num_nodes):
        if time.monotonic() > deadline:
            raise ClusterError(
                "kwok", f"added nodes not Ready after {config.ready_timeout_s:.0f}s", log_path
            )
        time.sleep(0.25)
    report(f"  added {', '.join(node_name(i) for i in missing)}")


def _create_nodes(
    config: ClusterConfig, kubectl: Kubectl, indices: list[int], log_path: Path
) -> None:
    try:
        for index in indices:
            kubectl.apply(render_node(index, config.gpu_product, config.pod_cidr))
            kubectl(
                "patch", "node", node_name(index), "--subresource=status", "--type=merge",
                "-p", json.dumps(render_node_status()),
            )  # fmt: skip
    except KubectlError as exc:
        raise ClusterError("kwok", f"creating fake GPU nodes failed: {exc}", log_path) from exc


def _succeeds(kubectl: Kubectl, *args: str) -> bool:
    try:
        kubectl(*args)
    except KubectlError:
        return False
    return True


def _nodes_ready(kubectl: Kubectl, num_nodes: int) -> bool:
    try:
        nodes = kubectl.json("get", "nodes", "-l", "type=kwok")["items"]
    except KubectlError:
        return False
    ready = [
        node
        for node in nodes
        if any(c["type"] == "Ready" and c["status"] == "True" for c in _conditions(node))
    ]
    return len(ready) >= num_nodes


def _conditions(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return list(obj.get("status", {}).get("conditions") or [])


def advertise_address() -> str:
    """The host's address on its default route (the API server refuses loopback);
    a TEST-NET address if there is no route (it is only written into an Endpoints object)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))  # UDP: picks a route, sends nothing
            address = str(sock.getsockname()[0])
        except OSError:
            address = ""
    return address if address and not address.startswith("127.") else "192.0.2.10"


# --- state and stopping ---------------------------------------------------------------------


def _state_file(config: ClusterConfig) -> Path:
    return config.state_dir / "state.json"


def _read_state(config: ClusterConfig) -> list[ComponentState]:
    try:
        raw = json.loads(_state_file(config).read_text())
    except (FileNotFoundError, ValueError):
        return []
    return [
        ComponentState(c["name"], c["pid"], c["binary"], procs.is_alive(c["pid"], c["binary"]))
        for c in raw.get("components", [])
    ]


def _write_state(config: ClusterConfig, owner: str, states: list[ComponentState]) -> None:
    config.state_dir.mkdir(parents=True, exist_ok=True)
    components = [{"name": s.name, "pid": s.pid, "binary": s.binary} for s in states]
    tmp = _state_file(config).with_suffix(".tmp")
    tmp.write_text(json.dumps({"owner": owner, "components": components}, indent=2))
    tmp.replace(_state_file(config))


def _stop_all(config: ClusterConfig) -> list[str]:
    stopped = []
    for state in reversed(_read_state(config)):
        if state.alive:
            procs.stop(state.pid, state.binary)
            stopped.append(state.name)
    _state_file(config).unlink(missing_ok=True)
    shutil.rmtree(config.state_dir / "etcd", ignore_errors=True)
    return stopped


# --- faults ---------------------------------------------------------------------------------


def restart(config: ClusterConfig, component: str, report: Report = print) -> float:
    """Stop one running component (SIGTERM, as a rolling restart of a static pod does) and start
    it again with the same command line; returns once it is ready again, the seconds that took.
    etcd is refused: starting it wipes its data."""
    if component == "etcd":
        raise ValueError("component: etcd cannot be restarted (its start wipes the data)")
    with procs.locked(config.state_dir / ".lock"):
        states = _read_state(config)
        names = [state.name for state in states]
        if component not in names:
            raise ValueError(f"component: must be one of {', '.join(names)}, got {component!r}")
        pki = Pki.under(config.state_dir / "pki")
        planned = plan_components(config, binary_paths(config.bin_root), pki, advertise_address())
        spec = next(c for c in planned if c.name == component)
        began = time.monotonic()
        old = next(state for state in states if state.name == component)
        procs.stop(old.pid, old.binary)
        pid = procs.spawn(spec.argv, config.log_path(component))
        new = ComponentState(component, pid, spec.argv[0], alive=True)
        _write_state(config, owner(config) or "cli", [new if s is old else s for s in states])
        ssl_context = procs.client_ssl_context(pki.ca_cert, pki.admin_cert, pki.admin_key)
        _wait_ready(config, spec, ssl_context, kubectl_for(config))
    took = time.monotonic() - began
    report(f"  {component} restarted ({took:.1f}s)")
    return took


def restore_nodes(config: ClusterConfig, report: Report = print) -> None:
    """Create the fake GPU nodes that are missing (a test deleted one) and wait until Ready."""
    with procs.locked(config.state_dir / ".lock"):
        _add_missing_nodes(config, report)
