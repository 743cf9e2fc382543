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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvcluster import procs
from kvcluster.config import ETCD_VERSION, KUBERNETES_VERSION, KWOK_VERSION, TOOLS_DIR

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


def binary_paths(bin_root: Path) -> dict[str, Path]:
    """Where each binary lives once built: name -> path."""
    return {name: bin_root / spec.key / name for spec in BUILD_SPECS for name in spec.binaries}


def missing_specs(bin_root: Path) -> list[BuildSpec]:
    return [
        spec
        for spec in BUILD_SPECS
        if not all((bin_root / spec.key / name).is_file() for name in spec.binaries)
    ]


def ensure_binaries(bin_root: Path) -> dict[str, Path]:
    """Build whatever is not cached yet (under a lock, so parallel sessions build once)."""
    if missing_specs(bin_root):
        bin_root.mkdir(parents=True, exist_ok=True)
        with procs.locked(bin_root / ".build.lock"):
            for spec in missing_specs(bin_root):
                build(spec, bin_root)
    return binary_paths(bin_root)


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
    cmd = [go, "build", "-v", "-trimpath", "-ldflags", spec.ldflags, "-o", out, *spec.packages]

    total = _count_packages(go, module_dir, spec.packages)
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
    staging.rename(bin_root / spec.key)


def _count_packages(go: str, module_dir: Path, packages: tuple[str, ...]) -> int | None:
    """How many packages the build may compile (for the progress bar); None if unknown."""
    result = subprocess.run(
        [go, "list", "-deps", *packages],
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
