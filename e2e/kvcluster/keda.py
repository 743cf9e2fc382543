"""KEDA's own CRDs, from the pinned module (github.com/kedacore/keda/v2 at KEDA_VERSION, the one
e2e/tools/keda builds): the ScaledObject schema the API server then validates against is the
real one, not a stand-in."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from kvcluster.binaries import _go_env
from kvcluster.config import TOOLS_DIR

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
