"""`python -m kvfleet_engine.bench.host_step` (README, "Host work per step") runs on this engine
and splits a step into the model's forward pass and the host's parts."""

import json
from pathlib import Path

from kvfleet_engine.bench import host_step


def test_host_step_writes_the_split_of_a_step(tmp_path: Path) -> None:
    argv = ["--num-seqs", "8", "--input-len", "16", "--warmup-steps", "2", "--steps", "3"]
    assert host_step.main([*argv, "--label", "t", "--output-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("*-cpu-host-step-t.json")
    results = json.loads(path.read_text())["results"]
    assert results["model_forward_ms_per_step_median"] > 0
    assert 0 < results["host_ms_per_step_median"] < results["step_ms_per_step_median"]
    assert {"schedule", "prepare_inputs", "update"} <= set(results["parts_ms_per_step_mean"])
