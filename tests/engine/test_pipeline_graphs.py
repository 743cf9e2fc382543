"""Pipeline stages through their CUDA graphs' forward: the model split in two stages, each stage's
decode and prompt graphs (the first from the input ids, the second from the first's hidden state
and residual; the second ends at the logits), give the whole model's logits step after step —
prompts, decodes, a step mixing both, a decode padded to a larger graph.

On the CPU (Triton interpreter, float32) the graphs' padded forward runs uncaptured, through the
executor's graph path; on the GPU (marked `gpu`) the stages capture and replay real graphs in
bf16. Two GPUs are needed for stages in two processes (NCCL); one process holds both here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from engine_cases import ARCHITECTURES
from engine_checkpoints import Checkpoints
from pipeline_steps import (
    SETTINGS,
    count_replays,
    run_steps,
    stage_executors,
    steps,
    whole_executor,
)
from test_gpu import gpu_checkpoints  # noqa: F401 (the tiny checkpoints, made once)
from test_triton_backend import PATCH

from kvfleet_engine.config import EngineConfig

HERE = Path(__file__).parent

CPU_SCRIPT = (
    PATCH
    + """
import json, sys
from collections import Counter
import torch
sys.path.insert(0, sys.argv[2])
from kvfleet_engine.config import EngineConfig
from pipeline_steps import (
    SETTINGS, count_replays, run_steps, stage_executors, steps, whole_executor,
)

config = EngineConfig.create(sys.argv[1], device="cpu", attention_backend="triton", **SETTINGS)
stages = stage_executors(config, torch.device("cpu"))
replayed = Counter()
for executor in stages:  # graphs without a capture: a replay runs the padded forward
    executor.decode_graphs, executor.prompt_graphs = executor.make_graphs()
    for graphs in (executor.decode_graphs, executor.prompt_graphs):
        graphs.replay = graphs._forward
    count_replays(executor, replayed)
got = run_steps(stages, steps())
want = run_steps([whole_executor(config)], steps())
print(json.dumps({
    "replayed": replayed,
    "rows": [list(g.shape) for g in got],
    "max_abs_diff": [float((g - w).abs().max()) for g, w in zip(got, want)],
    "scale": max(float(w.abs().max()) for w in want),
}))
"""
)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter check")
@pytest.mark.parametrize("name", ["llama3", "qwen2"])  # qwen2: tied embeddings on the last stage
def test_stage_graphs_forward_gives_the_whole_models_logits(
    name: str, checkpoints: Checkpoints
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CPU_SCRIPT, str(checkpoints.path(name)), str(HERE)],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every step went through a graph of both stages: 2 decode steps, 2 prompt steps each.
    assert result["replayed"] == {"decode": 4, "prompt": 4}, result
    assert [rows[0] for rows in result["rows"]] == [2, 2, 3, 3]  # a row per sequence
    tolerance = 1e-5 * max(1.0, result["scale"])
    assert max(result["max_abs_diff"]) <= tolerance, result


# ---- on the GPU: captured graphs, bf16 -------------------------------------------------------

# Logits of a few units in bf16 differ by ~1e-2 between two correct computations (another
# summation order, another padded size): the stages' graphs and the whole model's eager forward
# agree within this, and on every row's most likely token where its lead is above it.
BF16_LOGITS = 0.1


def _agree(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, what
    diff = float((got - want).abs().max())
    assert diff <= BF16_LOGITS * max(1.0, float(want.abs().max()) / 10), f"{what}: {diff}"
    top2 = want.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > BF16_LOGITS
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear]), what


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_stage_graphs_replay_the_whole_models_logits_on_gpu(
    name: str,
    gpu_checkpoints: dict[str, Path],  # noqa: F811 (the fixture imported above)
) -> None:
    path = str(gpu_checkpoints[name])
    config = EngineConfig.create(path, device="cuda", **SETTINGS)
    stages = stage_executors(config, torch.device("cuda"))
    replayed: Counter[str] = Counter()
    for executor in stages:
        assert executor.decode_graphs is not None, "a stage captures its graphs"
        count_replays(executor, replayed)
    got = run_steps(stages, steps())
    eager = EngineConfig.create(path, device="cuda", enforce_eager=True, **SETTINGS)
    want = run_steps([whole_executor(eager)], steps())
    assert replayed == {"decode": 4, "prompt": 4}, replayed
    for index, (g, w) in enumerate(zip(got, want, strict=True)):
        _agree(g, w, f"{name} step {index}")
