"""Pipeline parallelism applied from outside the single-device model, like tensor parallelism:
on the meta device, before weights load, every module another stage owns is replaced by a
`MissingLayer` (no parameters, no KV cache; the checkpoint's tensors under it are skipped).

Stage s of P owns a contiguous range of the L decoder layers, as even as possible (the first
L % P stages one layer more: the last stage also runs the final norm, the LM head and the
sampler). The first stage also owns the embedding, the last the final norm and the LM head;
with tied embeddings the last stage keeps the embedding module too, whose weight is its head's.

Between stages the hidden state and the residual stream ([2, num_tokens, hidden], one message)
go from each rank to the rank of the same tp_rank in the next stage (ranks are stage-major:
rank = pp_rank * tp_size + tp_rank, `groups.RankPlace`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from kvfleet_engine.parallel.groups import RankPlace


@dataclass(frozen=True)
class StageLayers:
    """The part of the model one pipeline stage runs."""

    start: int  # first decoder layer it owns
    end: int  # one past its last
    is_first: bool  # embeds the input ids
    is_last: bool  # final norm, LM head, sampling


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> StageLayers:
    """Stage `pp_rank`'s layers: L // P each, the first L % P stages one more."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is larger than the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    end = start + base + (pp_rank < extra)
    return StageLayers(start, end, pp_rank == 0, pp_rank == pp_size - 1)


class MissingLayer(nn.Module):
    """A module another pipeline stage owns: it holds nothing here and never runs here."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("this module belongs to another pipeline stage")


def apply_pipeline_stage(model: Any, place: RankPlace) -> StageLayers | None:
    """Cut `model` (on the meta device, weights not loaded) down to this rank's stage; sets and
    returns `model.model.stage` (None with one stage: the model stays whole)."""
    if place.pp_size == 1:
        return None
    inner = model.model
    stage = stage_layers(len(inner.layers), place.pp_size, place.pp_rank)
    for index in range(len(inner.layers)):
        if not stage.start <= index < stage.end:
            inner.layers[index] = MissingLayer()
    tied = bool(getattr(model, "tie_word_embeddings", False))
    if not stage.is_first and not (stage.is_last and tied):
        inner.embed_tokens = MissingLayer()
    if not stage.is_last:
        inner.norm = MissingLayer()
        model.lm_head = MissingLayer()
    inner.stage = stage
    return stage


def missing_prefixes(model: nn.Module) -> frozenset[str]:
    """Module names of the MissingLayers: the checkpoint's tensors under them are skipped."""
    return frozenset(name for name, m in model.named_modules() if isinstance(m, MissingLayer))


def is_missing(name: str, prefixes: frozenset[str]) -> bool:
    """Whether checkpoint tensor `name` (model.layers.3.mlp.down_proj.weight) lies under one."""
    if not prefixes:
        return False
    parts = name.split(".")
    return any(".".join(parts[:k]) in prefixes for k in range(1, len(parts)))


def intermediate_shape(num_tokens: int, hidden_size: int) -> tuple[int, int, int]:
    """The stage boundary's message: the last layer's output and the residual stream it adds to
    (the next stage's first norm adds them), [2, num_tokens, hidden]."""
    return (2, num_tokens, hidden_size)
