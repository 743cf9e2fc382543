"""What the autoscaling e2e test and `make demo` share: an InferenceDeployment of the tiny
model autoscaled 1-3 on the generation token rate, with short windows, and the `kvfleet bench
serve` load that drives it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

NAME = "tiny"
SCALE_DOWN_STABILIZATION_S = 20


def inference_deployment(namespace: str, model: Path, tokens_per_second: float) -> dict[str, Any]:
    """The InferenceDeployment `NAME` serving `model`, target `tokens_per_second` per replica."""
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targets": {"generationTokenRate": {"tokensPerSecond": tokens_per_second}},
        "behavior": {
            "syncPeriodSeconds": 1,
            "stableWindowSeconds": 10,
            "panicWindowSeconds": 4,
            "warmupSeconds": 0,
            "scaleDown": {
                "stabilizationWindowSeconds": SCALE_DOWN_STABILIZATION_S,
                "maxReplicasPerPeriod": 3,
                "periodSeconds": 5,
                "drainTimeoutSeconds": 5,
            },
        },
    }
    return {
        "apiVersion": "kvfleet.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME, "namespace": namespace},
        "spec": {
            "model": {"uri": f"file://{model}", "servedModelName": NAME, "maxModelLen": 512},
            "resources": {"accelerator": "h100-80gb"},
            "autoscaling": autoscaling,
        },
    }


def start_load(url: str, log: IO[bytes] | int) -> subprocess.Popen[bytes]:
    """`kvfleet bench serve` against `url`: 8 requests in flight until interrupted (SIGINT)."""
    command = [
        sys.executable, "-m", "kvfleet_cli", "bench", "serve", "--url", url,
        "--concurrency", "8", "--num-prompts", "100000",
        "--random-input-len", "32", "--random-output-len", "64", "--ignore-eos", "--no-progress",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
