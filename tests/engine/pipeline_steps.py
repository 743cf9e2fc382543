"""Pipeline stages in one process, for the tests of their CUDA graphs: a tiny checkpoint split in
two stages (`ModelExecutor`s with a one-rank-per-stage place, no process group: a stage of one
tensor-parallel rank has no collective), run step by step with the next stage fed the previous
one's output by hand, against the whole model. Both sides see the same steps — prompts, decodes,
a step that mixes them, a padded decode — and each step's logits are compared."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from test_step_inputs import Item  # one sequence's share of a step, as build_inputs reads it

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.parallel.groups import Groups, RankPlace
from kvfleet_engine.runner.executor import ModelExecutor
from kvfleet_engine.runner.inputs import build_inputs

BLOCK_SIZE = 16
# Graph sizes these settings give: decode 1, 2, 4 sequences; prompt steps 16, 32, 64 tokens.
SETTINGS: dict[str, Any] = dict(
    max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, kv_cache_blocks=16
)


def steps(seed: int = 3) -> list[list[Item]]:
    """Two prompts (46 tokens: a 64-token prompt graph), their decodes (a 2-sequence decode
    graph), a new prompt beside both decodes (9 tokens: a 16-token prompt graph), then the three
    decoding (padded to a 4-sequence decode graph)."""
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, 200, (n,), generator=g).tolist()

    a, b, c = [1, 2], [3, 4, 6], [5]
    return [
        [Item("a", tokens(16), 0, a), Item("b", tokens(30), 0, b)],
        [Item("a", tokens(1), 16, a), Item("b", tokens(1), 30, b)],
        [Item("c", tokens(7), 0, c), Item("a", tokens(1), 17, a), Item("b", tokens(1), 31, b)],
        [Item("a", tokens(1), 18, a), Item("b", tokens(1), 32, b), Item("c", tokens(1), 7, c)],
    ]


def stage_executors(config: EngineConfig, device: torch.device) -> list[ModelExecutor]:
    """The model in two stages, each with its own KV cache (its layers only)."""
    executors = []
    for stage in range(2):
        place = RankPlace(
            rank=stage, world_size=2, tp_rank=0, tp_size=1, pp_rank=stage, pp_size=2,
            local_rank=0,
        )  # fmt: skip
        executor = ModelExecutor(config, Groups(place, device, timeout_s=60.0))
        executor.allocate(config.cache.num_blocks or 0)
        executors.append(executor)
    return executors


def whole_executor(config: EngineConfig) -> ModelExecutor:
    executor = ModelExecutor(config)
    executor.allocate(config.cache.num_blocks or 0)
    return executor


def count_replays(executor: ModelExecutor, replayed: Counter[str]) -> None:
    """Count each replay of `executor`'s graphs by kind (decode, prompt) in `replayed`."""
    for graphs in (executor.decode_graphs, executor.prompt_graphs):
        assert graphs is not None
        replay = graphs.replay

        def counted(key: Any, replay: Any = replay, kind: str = graphs.kind) -> Any:
            replayed[kind] += 1
            return replay(key)

        graphs.replay = counted  # type: ignore[method-assign]


def run_steps(pipeline: list[ModelExecutor], step_items: list[list[Item]]) -> list[torch.Tensor]:
    """Each step's [sampling rows, vocab] float32 logits: through the stages in order, or the
    whole model's forward for a one-executor pipeline."""
    logits = []
    for items in step_items:
        first = pipeline[0]
        inputs = build_inputs(items, BLOCK_SIZE, first.device, {}, first.attention_features)
        if len(pipeline) == 1:
            logits.append(first.forward(inputs)[0])
            continue
        out = None
        for executor in pipeline:
            out = executor.forward_stage(inputs, out)
        assert out is not None
        logits.append(out)
    return logits
