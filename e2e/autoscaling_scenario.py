"""What the autoscaling e2e test and `make demo` share: an InferenceDeployment autoscaled 1-3 on
the generation token rate, with short windows, and the `kvfleet bench serve` load that drives it.
The test runs it on the tiny random model (`NAME`) with random token prompts; the demo on
SmolLM2 with chat questions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import IO, Any

NAME = "tiny"
MAX_REPLICAS = 3
SCALE_DOWN_STABILIZATION_S = 20

# `kvfleet bench serve` datasets: prompts of 32 random token ids, 64 tokens each (EOS ignored);
# or the built-in chat questions, answered in at most 64 tokens (real answers: EOS ends them).
RANDOM_PROMPTS = (
    "--dataset", "random", "--random-input-len", "32", "--random-output-len", "64", "--ignore-eos",
)  # fmt: skip
CHAT_QUESTIONS = ("--dataset", "chat", "--chat-output-len", "64", "--no-ignore-eos")


def inference_deployment(
    namespace: str,
    model: Path,
    tokens_per_second: float,
    name: str = NAME,
    served_model_name: str = NAME,
) -> dict[str, Any]:
    """The InferenceDeployment `name` serving `model` (a directory or a GGUF file) as
    `served_model_name`, target `tokens_per_second` generation tokens/s per replica."""
    autoscaling = {
        "minReplicas": 1,
        "maxReplicas": MAX_REPLICAS,
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
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "model": {
                "uri": f"file://{model}",
                "servedModelName": served_model_name,
                "maxModelLen": 512,
            },
            "resources": {"accelerator": "h100-80gb"},
            "autoscaling": autoscaling,
        },
    }


def start_load(
    url: str, log: IO[bytes] | int, dataset: tuple[str, ...] = RANDOM_PROMPTS
) -> subprocess.Popen[bytes]:
    """`kvfleet bench serve` against `url`: 8 requests of `dataset` in flight until interrupted
    (SIGINT)."""
    command = [
        sys.executable, "-m", "kvfleet_cli", "bench", "serve", "--url", url,
        "--concurrency", "8", "--num-prompts", "100000", *dataset, "--no-progress",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
