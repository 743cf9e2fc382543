"""KEDA in the local cluster: its own CRDs from the pinned module (github.com/kedacore/keda/v2 at
KEDA_VERSION, the one e2e/tools/keda builds), so the ScaledObject schema the API server validates
against is the real one; and `Keda.start`, its operator and metrics adapter as processes (the
adapter behind the aggregation layer) for `make test-integrations`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcluster import procs
from kvcluster.binaries import KEDA_SPEC, _go_env, ensure_binaries
from kvcluster.config import TOOLS_DIR, ClusterConfig
from kvcluster.controlplane import advertise_address
from kvcluster.kubectl import Kubectl
from kvcluster.pki import Pki

KEDA_MODULE = "github.com/kedacore/keda/v2"


def module_dir() -> Path:
    """The pinned KEDA module's source in Go's module cache (downloaded if needed)."""
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("KEDA's CRDs come from its Go module: `go` is not on PATH")
    result = subprocess.run(
        [go, "mod", "download", "-json", KEDA_MODULE],
        cwd=TOOLS_DIR / "keda",
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"go mod download {KEDA_MODULE} failed:\n{result.stdout}{result.stderr}")
    return Path(json.loads(result.stdout)["Dir"])


def crd_files() -> list[Path]:
    """KEDA's CRD manifests (ScaledObject, ScaledJob, TriggerAuthentication, ...)."""
    files = sorted((module_dir() / "config" / "crd" / "bases").glob("*.yaml"))
    if not files:
        raise RuntimeError(f"no CRDs under {module_dir()}/config/crd/bases")
    return files


EXTERNAL_METRICS_API = "v1beta1.external.metrics.k8s.io"
NAMESPACE = "keda"
READY_TIMEOUT_S = 120.0


@dataclass
class Keda:
    """KEDA's operator and metrics adapter as processes beside the control plane, the adapter
    registered with kube-apiserver's aggregation layer as external.metrics.k8s.io, so the real
    HPA controller in kube-controller-manager reads ScaledObject triggers through it."""

    kubectl: Kubectl
    pids: list[tuple[int, str]]  # (pid, binary), start order
    logs: list[Path]
    created_crds: bool  # KEDA's CRDs were not there before: `stop` removes them again

    @classmethod
    def start(cls, config: ClusterConfig, kubectl: Kubectl, state_dir: Path) -> Keda:
        binaries = ensure_binaries(config.bin_root, (KEDA_SPEC,))
        pki = Pki.under(config.state_dir / "pki")
        certs = state_dir / "certs"  # what KEDA mounts at /certs: the cluster's CA and cert
        certs.mkdir(parents=True, exist_ok=True)
        for source, name in ((pki.ca_cert, "ca.crt"), (pki.admin_cert, "tls.crt"),
                             (pki.admin_key, "tls.key")):  # fmt: skip
            shutil.copyfile(source, certs / name)
        scaled_objects = "scaledobjects.keda.sh"
        created_crds = not kubectl("get", "crd", scaled_objects, "--ignore-not-found").strip()
        for path in crd_files():
            kubectl("apply", "--server-side", "-f", str(path))
        kubectl("create", "namespace", NAMESPACE, check=False)

        p = config.ports
        host = advertise_address()  # an Endpoints address may not be loopback
        env = {**os.environ, "KUBECONFIG": str(config.kubeconfig), "POD_NAMESPACE": NAMESPACE,
               "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE, "WATCH_NAMESPACE": ""}  # fmt: skip
        keda = cls(kubectl, [], [], created_crds)
        try:
            keda._spawn(state_dir / "keda-operator.log", env, (
                str(binaries["keda-operator"]), "--leader-elect=false",
                "--enable-cert-rotation=false", f"--cert-dir={certs}",
                "--enable-webhook-patching=false", "--enable-apiservice-patching=false",
                f"--metrics-bind-address=127.0.0.1:{p.keda_metrics}",
                f"--health-probe-bind-address=127.0.0.1:{p.keda_health}",
                f"--metrics-service-bind-address=127.0.0.1:{p.keda_grpc}",
                "--zap-log-level=info",
            ))  # fmt: skip
            keda._wait(f"http://127.0.0.1:{p.keda_health}/readyz", "the KEDA operator")
            keda._spawn(state_dir / "keda-adapter.log", env, (
                str(binaries["keda-adapter"]), f"--secure-port={p.keda_adapter}",
                f"--bind-address={host}", f"--cert-dir={certs}",
                f"--tls-cert-file={certs / 'tls.crt'}",
                f"--tls-private-key-file={certs / 'tls.key'}",
                f"--client-ca-file={certs / 'ca.crt'}",
                f"--lister-kubeconfig={config.kubeconfig}",
                f"--authentication-kubeconfig={config.kubeconfig}",
                f"--authorization-kubeconfig={config.kubeconfig}",
                f"--metrics-service-address=127.0.0.1:{p.keda_grpc}",
                f"--port={p.keda_adapter_metrics}", "--zap-log-level=info",
            ))  # fmt: skip
            for manifest in _aggregation_manifests(host, p.keda_adapter):
                kubectl.apply(manifest)
            keda._wait_available()
        except BaseException:
            keda.stop()
            raise
        return keda

    def __enter__(self) -> Keda:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Unregister the external metrics API (discovery would fail without it), then stop."""
        self.kubectl("delete", "apiservice", EXTERNAL_METRICS_API, "--ignore-not-found",
                     check=False)  # fmt: skip
        for pid, binary in reversed(self.pids):
            procs.stop(pid, binary)
        self.pids.clear()
        if self.created_crds:  # other tests expect a cluster without KEDA
            for path in crd_files():
                self.kubectl("delete", "-f", str(path), "--wait=false", check=False)

    def log_tails(self) -> str:
        return "\n".join(f"--- {p.name} ---\n{procs.tail(p, 25)}" for p in self.logs)

    def _spawn(self, log_path: Path, env: dict[str, str], argv: tuple[str, ...]) -> None:
        with log_path.open("ab") as log:
            proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.pids.append((proc.pid, argv[0]))
        self.logs.append(log_path)

    def _check_alive(self, what: str) -> None:
        for pid, binary in self.pids:
            if not procs.is_alive(pid, binary):
                raise RuntimeError(f"{Path(binary).name} exited while waiting for {what}:\n"
                                   f"{self.log_tails()}")  # fmt: skip

    def _wait(self, url: str, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not procs.probe(url, None):
            self._check_alive(what)
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {READY_TIMEOUT_S:.0f}s:\n"
                                   f"{self.log_tails()}")  # fmt: skip
            time.sleep(0.5)

    def _wait_available(self) -> None:
        jsonpath = '{.status.conditions[?(@.type=="Available")].status}'
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            status = self.kubectl("get", "apiservice", EXTERNAL_METRICS_API, "-o",
                                  f"jsonpath={jsonpath}", check=False).strip()  # fmt: skip
            if status == "True":
                return
            self._check_alive("the external metrics API")
            if time.monotonic() > deadline:
                described = self.kubectl("describe", "apiservice", EXTERNAL_METRICS_API,
                                         check=False)  # fmt: skip
                raise RuntimeError(
                    f"{EXTERNAL_METRICS_API} not Available after "
                    f"{READY_TIMEOUT_S:.0f}s:\n{described}\n{self.log_tails()}"
                )
            time.sleep(0.5)


def _aggregation_manifests(host: str, port: int) -> list[dict[str, Any]]:
    """A selector-less Service whose Endpoints is the adapter at host:port, and the APIService
    naming it (its certificate is the cluster's admin one, not issued for the Service's name)."""
    service = "keda-metrics-apiserver"
    return [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": service, "namespace": NAMESPACE},
         "spec": {"ports": [{"name": "https", "port": 443, "targetPort": port}]}},
        {"apiVersion": "v1", "kind": "Endpoints",
         "metadata": {"name": service, "namespace": NAMESPACE},
         "subsets": [{"addresses": [{"ip": host}], "ports": [{"name": "https", "port": port}]}]},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": EXTERNAL_METRICS_API},
         "spec": {"service": {"name": service, "namespace": NAMESPACE, "port": 443},
                  "group": "external.metrics.k8s.io", "version": "v1beta1",
                  "insecureSkipTLSVerify": True,
                  "groupPriorityMinimum": 100, "versionPriority": 100}},
    ]  # fmt: skip
