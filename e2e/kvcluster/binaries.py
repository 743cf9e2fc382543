"""Build the control-plane binaries from the Go module proxy, once, and cache them by version.

Each `BuildSpec` is one consumer module under e2e/tools/ (go.mod and go.sum committed) and one
`go build` invocation. Its binaries land in <bin_root>/<key>/ only when the whole build
succeeded, so a directory that exists is complete and a warm run builds nothing.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvcluster import procs
from kvcluster.config import (
    ETCD_VERSION,
    HELM_VERSION,
    KEDA_VERSION,
    KUBERNETES_VERSION,
    KWOK_VERSION,
    PROMETHEUS_VERSION,
    TOOLS_DIR,
)

log = logging.getLogger(__name__)


class BuildError(RuntimeError):
    """A binary could not be built; the message names it and its build log."""


@dataclass(frozen=True)
class BuildSpec:
    """One `go build` in one consumer module."""

    key: str  # cache sub-directory, e.g. "k8s-v1.37.2"
    module: str  # directory under e2e/tools/
    packages: tuple[str, ...]  # Go main packages, built together so they share compiled code
    binaries: tuple[str, ...]  # output file names, in the order of `packages`
    ldflags: str  # version stamps (-X) and -s -w
    tags: tuple[str, ...] = ()  # Go build tags, e.g. to leave out service discoveries


def _k8s_ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    stamps = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        stamps += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    return " ".join(["-s -w", *stamps])


BUILD_SPECS = (
    BuildSpec(
        key=f"etcd-{ETCD_VERSION}",
        module="etcd",
        packages=("go.etcd.io/etcd/server/v3",),
        binaries=("etcd",),
        # The version string itself is a constant in go.etcd.io/etcd/api/v3/version.
        ldflags=f"-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA={ETCD_VERSION}",
    ),
    BuildSpec(
        key=f"kwok-{KWOK_VERSION}",
        module="kwok",
        packages=("sigs.k8s.io/kwok/cmd/kwok",),
        binaries=("kwok",),
        ldflags="-s -w",  # kwok's version is a constant in its consts package
    ),
    BuildSpec(
        key=f"k8s-{KUBERNETES_VERSION}",
        module="k8s",
        packages=tuple(
            f"k8s.io/kubernetes/cmd/{name}"
            for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")
        ),
        binaries=("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl"),
        ldflags=_k8s_ldflags(KUBERNETES_VERSION),
    ),
)


def _prometheus_ldflags(module_version: str) -> str:
    """Prometheus 3.x is tagged v0.3XY.Z as a Go module: v0.316.0 is release 3.16.0."""
    minor_patch = module_version.removeprefix("v0.3").split(".")
    release = f"3.{int(minor_patch[0])}.{minor_patch[1]}"
    pkg = "github.com/prometheus/common/version"
    return (
        f"-s -w -X {pkg}.Version={release} -X {pkg}.Branch=HEAD -X {pkg}.Revision={module_version}"
    )


# helm, for the chart tests: built with the control plane (`make cluster-bin`), as `make test`
# runs `helm lint` / `helm template` / `helm install`.
HELM_SPEC = BuildSpec(
    key=f"helm-{HELM_VERSION}",
    module="helm",
    packages=("helm.sh/helm/v3/cmd/helm",),
    binaries=("helm",),
    ldflags=" ".join(
        [
            "-s -w",
            f"-X helm.sh/helm/v3/internal/version.version={HELM_VERSION}",
            "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
            # the Kubernetes version `helm lint` and `.Capabilities` assume without a cluster
            "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1",
            "-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=37",
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1",
            "-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=37",
        ]
    ),
)

# The integrations (`make integrations-bin`): a real Prometheus (no web UI assets: without the
# `builtinassets` tag it would read them from disk, and only its API is used) and KEDA's operator
# and metrics adapter, built together so they share compiled code.
PROMETHEUS_SPEC = BuildSpec(
    key=f"prometheus-{PROMETHEUS_VERSION}",
    module="prometheus",
    packages=("github.com/prometheus/prometheus/cmd/prometheus",),
    binaries=("prometheus",),
    ldflags=_prometheus_ldflags(PROMETHEUS_VERSION),
    # Only Kubernetes service discovery (and file/http, always in): no cloud SDKs to compile.
    tags=("remove_all_sd", "enable_kubernetes_sd"),
)
KEDA_SPEC = BuildSpec(
    key=f"keda-{KEDA_VERSION}",
    module="keda",
    packages=(
        "github.com/kedacore/keda/v2/cmd/operator",
        "github.com/kedacore/keda/v2/cmd/adapter",
    ),
    binaries=("keda-operator", "keda-adapter"),
    ldflags=(
        f"-s -w -X github.com/kedacore/keda/v2/version.Version={KEDA_VERSION.lstrip('v')}"
        f" -X github.com/kedacore/keda/v2/version.GitCommit={KEDA_VERSION}"
    ),
)
TOOL_SPECS = (*BUILD_SPECS, HELM_SPEC)  # what `make cluster-bin` builds
INTEGRATION_SPECS = (PROMETHEUS_SPEC, KEDA_SPEC)


def binary_paths(bin_root: Path, specs: Sequence[BuildSpec] = BUILD_SPECS) -> dict[str, Path]:
    """Where each binary lives once built: name -> path."""
    return {name: bin_root / spec.key / name for spec in specs for name in spec.binaries}


def missing_specs(bin_root: Path, specs: Sequence[BuildSpec] = BUILD_SPECS) -> list[BuildSpec]:
    return [
        spec
        for spec in specs
        if not all((bin_root / spec.key / name).is_file() for name in spec.binaries)
    ]


def ensure_binaries(bin_root: Path, specs: Sequence[BuildSpec] = BUILD_SPECS) -> dict[str, Path]:
    """Build whatever is not cached yet (under a lock, so parallel sessions build once)."""
    if missing_specs(bin_root, specs):
        bin_root.mkdir(parents=True, exist_ok=True)
        with procs.locked(bin_root / ".build.lock"):
            for spec in missing_specs(bin_root, specs):
                build(spec, bin_root)
    return binary_paths(bin_root, specs)


def _go_env() -> dict[str, str]:
    # local toolchain only (never download another Go), static binaries, go.sum must be complete
    return {**os.environ, "GOTOOLCHAIN": "local", "CGO_ENABLED": "0", "GOFLAGS": "-mod=readonly"}


def build(spec: BuildSpec, bin_root: Path) -> None:
    """Build one spec into <bin_root>/<key>/ (staged, renamed into place only on success)."""
    go = shutil.which("go")
    names = ", ".join(spec.binaries)
    if go is None:
        raise BuildError(f"cannot build {names}: `go` is not on PATH (Go >= 1.26 is needed)")
    module_dir = TOOLS_DIR / spec.module
    build_log = bin_root / "logs" / f"{spec.key}.build.log"
    build_log.parent.mkdir(parents=True, exist_ok=True)
    staging = bin_root / f".tmp-{spec.key}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    # Several packages go to a directory (named after each command); one goes to its file,
    # because a major-version suffix (…/server/v3) would otherwise name the binary "server".
    out = str(staging) + "/" if len(spec.packages) > 1 else str(staging / spec.binaries[0])
    tags = ["-tags", ",".join(spec.tags)] if spec.tags else []
    cmd = [go, "build", "-v", "-trimpath", *tags, "-ldflags", spec.ldflags, "-o", out,
           *spec.packages]  # fmt: skip

    total = _count_packages(go, module_dir, spec.packages, spec.tags)
    progress = _Progress(f"{names} ({spec.key})", total)
    with build_log.open("w") as log_file:
        log_file.write(f"$ cd {module_dir} && {shlex.join(cmd)}\n")
        log_file.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=module_dir,
            env=_go_env(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:  # `go build -v` names each package as it compiles it
            log_file.write(line)
            progress.advance(line.strip())
        code = proc.wait()
    progress.finish(ok=code == 0)
    if code != 0:
        tail = "".join(build_log.read_text().splitlines(keepends=True)[-15:])
        raise BuildError(
            f"building {names} ({spec.key}) failed with exit code {code}.\n"
            f"Last lines:\n{tail}\nFull build log: {build_log}"
        )
    if len(spec.packages) > 1:  # each command was named after its package: give it its name
        for package, name in zip(spec.packages, spec.binaries, strict=True):
            built = staging / package.rsplit("/", 1)[-1]
            if built.name != name:
                built.rename(staging / name)
    staging.rename(bin_root / spec.key)


def _count_packages(
    go: str, module_dir: Path, packages: tuple[str, ...], tags: tuple[str, ...] = ()
) -> int | None:
    """How many packages the build may compile (for the progress bar); None if unknown."""
    tag_args = ["-tags", ",".join(tags)] if tags else []
    result = subprocess.run(
        [go, "list", "-deps", *tag_args, *packages],
        cwd=module_dir,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    return len(result.stdout.split()) if result.returncode == 0 else None


class _Progress:
    """Build progress on stderr: a line every 20 s (the build takes 10-30 min cold)."""

    def __init__(self, what: str, total: int | None, emit: Callable[[str], None] | None = None):
        self._what = what
        self._total = total
        self._emit = emit or (lambda text: print(text, file=sys.stderr, flush=True))
        self._done = 0
        self._last = ""
        self._start = time.monotonic()
        self._stop = threading.Event()
        self._emit(
            f"building {what} with Go (10-30 min on 2 cores if Go's build cache is empty)"
            + (f", up to {total} packages" if total else "")
        )
        self._ticker = threading.Thread(target=self._tick, daemon=True)
        self._ticker.start()

    def advance(self, package: str) -> None:
        if package and not package.startswith(("#", "go:")):
            self._done += 1
            self._last = package

    def _line(self) -> str:
        elapsed = int(time.monotonic() - self._start)
        counted = f"{self._done}/{self._total}" if self._total else str(self._done)
        return f"  {self._what}: {counted} packages compiled, {elapsed // 60}m{elapsed % 60:02d}s"

    def _tick(self) -> None:
        while not self._stop.wait(20.0):
            doing = f"compiling {self._last}" if self._last else "linking (packages cached)"
            self._emit(f"{self._line()}, {doing}")

    def finish(self, ok: bool) -> None:
        self._stop.set()
        self._ticker.join()
        self._emit(f"{self._line()} — {'done' if ok else 'FAILED'}")
