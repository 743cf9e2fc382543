"""Tensor parallelism applied from outside the single-device model (gpt-fast's `apply_tp`):
on the meta device, after the quantized linears are swapped in and before weights load, each
split linear is replaced by its part with a `checkpoint_slicer` that cuts every checkpoint
tensor down to that part as it loads.

- column-parallel (q/k/v, gate/up): the output features split; q's heads evenly, k/v's heads
  evenly too, or replicated when there are fewer KV heads than ranks (rank r holds KV head
  r // (tp / kv_heads));
- row-parallel (o, down): the input features split, then one all-reduce sums the ranks'
  partial outputs (one after attention, one after the MLP); a bias is added by rank 0 only;
- vocab-parallel embedding and LM head (tied or not): the vocabulary split (padded to a
  multiple of the ranks), the LM head's logits all-gathered.

Quantized linears split the same way: along N (column) their packed tensors narrow on the
dimension of the output features, along K (row) on that of the input features, group scales
with their groups. An act-order (g_idx) layer splits along N; along K only if each rank's
columns keep to its own groups, otherwise it is refused.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch
from torch import nn

from kvfleet_engine.layers.linear import Linear, MergedLinear
from kvfleet_engine.parallel.groups import Groups
from kvfleet_engine.parallel.layers import (
    VocabParallelEmbedding,
    all_reduce_output,
    gather_vocab_output,
    vocab_rows,
)
from kvfleet_engine.quant.linear import QuantLinear

log = logging.getLogger(__name__)

# Model module name (last part) -> how tensor parallelism splits it.
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")

AnyLinear = Linear | QuantLinear
# Checkpoint shard (None: an unfused linear) -> (this rank's part, number of parts).
Split = dict[str | None, tuple[int, int]]


def apply_tensor_parallel(model: Any, groups: Groups) -> None:
    """Split `model` (built on the meta device, weights not loaded) for this rank."""
    tp, rank = groups.place.tp_size, groups.place.tp_rank
    if tp == 1:
        return
    for name, module in list(model.named_modules()):
        if hasattr(module, "qkv_proj"):
            _split_attention(module, name, rank, tp)
        elif hasattr(module, "gate_up_proj"):
            inner = module.gate_up_proj.shard_offsets()["gate"][1]
            split: Split = {"gate": (rank, tp), "up": (rank, tp)}
            module.gate_up_proj = _column_parallel(
                module.gate_up_proj, split, f"{name}.gate_up_proj"
            )
            log.debug("%s: %d of %d MLP rows", name, inner // tp, inner)
        for child in ROW_PARALLEL:
            linear = getattr(module, child, None)
            if isinstance(linear, AnyLinear):
                setattr(module, child, _row_parallel(linear, groups, f"{name}.{child}"))
    _split_vocabulary(model, groups)


def _split_attention(attention: Any, name: str, rank: int, tp: int) -> None:
    heads, kv_heads = attention.num_heads, attention.num_kv_heads
    kv_parts = min(tp, kv_heads)  # fewer KV heads than ranks: each is held by tp / kv ranks
    kv_index = rank // (tp // kv_parts)
    split: Split = {"q": (rank, tp), "k": (kv_index, kv_parts), "v": (kv_index, kv_parts)}
    attention.qkv_proj = _column_parallel(attention.qkv_proj, split, f"{name}.qkv_proj")
    attention.num_heads, attention.num_kv_heads = heads // tp, kv_heads // kv_parts
    attention.q_size = attention.num_heads * attention.head_dim
    attention.kv_size = attention.num_kv_heads * attention.head_dim
    attention.attn.num_heads, attention.attn.num_kv_heads = (
        attention.num_heads,
        attention.num_kv_heads,
    )


# ---- column-parallel ---------------------------------------------------------------------------


def _column_parallel(module: nn.Module, split: Split, name: str) -> AnyLinear:
    assert isinstance(module, AnyLinear), name
    offsets = module.shard_offsets()
    local = {shard: rows // split[shard][1] for shard, (_, rows) in offsets.items()}
    for shard, (_, rows) in offsets.items():
        if rows % split[shard][1]:
            raise ValueError(
                f"{name}: shard {shard!r} of {rows} rows does not split {split[shard][1]} ways"
            )
    if isinstance(module, QuantLinear):
        out_features = sum(local.values()) if local else module.out_features // split[None][1]
        bias = "bias" in module.checkpoint_layout
        layer = QuantLinear(
            module.in_features, local, out_features, bias, module.scheme, module.dtype
        )
        layer.checkpoint_slicer = partial(_slice_quant_columns, layer, split)
        return layer
    in_features = module.weight.shape[1]
    bias = module.bias is not None
    part: Linear
    if local:
        part = MergedLinear(in_features, local, bias=bias)
    else:
        part = Linear(in_features, module.weight.shape[0] // split[None][1], bias=bias)
    part.checkpoint_slicer = partial(_slice_columns, split)
    return part


def _slice_columns(
    split: Split, name: str, loaded: torch.Tensor, shard: str | None
) -> torch.Tensor:
    index, parts = split[shard]
    rows = loaded.shape[0] // parts
    return loaded.narrow(0, index * rows, rows)  # weight [rows, in] and bias [rows] alike


def _slice_quant_columns(
    layer: QuantLinear, split: Split, name: str, loaded: torch.Tensor, shard: str | None
) -> torch.Tensor:
    spec = layer.checkpoint_layout[name]
    index, parts = split[shard]
    if spec.kind == "shape":  # [rows, in_features] of the whole shard
        return torch.tensor([int(loaded[0]) // parts, int(loaded[1])], dtype=loaded.dtype)
    if spec.kind != "slice" or (spec.broadcast and loaded.numel() == 1):
        return loaded  # act-order g_idx (over the input features), a per-tensor scale
    size = loaded.shape[spec.shard_dim] // parts
    return loaded.narrow(spec.shard_dim, index * size, size)


# ---- row-parallel ------------------------------------------------------------------------------


def _row_parallel(module: AnyLinear, groups: Groups, name: str) -> AnyLinear:
    tp, rank = groups.place.tp_size, groups.place.tp_rank
    if isinstance(module, QuantLinear):
        in_features = module.in_features
        local_in = _local_in_features(in_features, tp, name)
        layout = module.checkpoint_layout
        for spec in layout.values():
            if spec.k_dim is not None and spec.k_per and local_in % spec.k_per:
                raise ValueError(
                    f"{name}: {in_features} input features split {tp} ways ({local_in} each) "
                    f"do not divide into {spec.name}'s groups of {spec.k_per}"
                )
        shards = {shard: rows for shard, (_, rows) in module.shard_offsets().items()}
        layer = QuantLinear(
            local_in, shards, module.out_features, "bias" in layout, module.scheme, module.dtype
        )
        layer.checkpoint_slicer = partial(_slice_quant_rows, layer, rank, tp)
        part: AnyLinear = layer
    else:
        out_features, in_features = module.weight.shape
        part = Linear(
            _local_in_features(in_features, tp, name), out_features, module.bias is not None
        )
        part.checkpoint_slicer = partial(_slice_rows, rank, tp)
    all_reduce_output(groups, part)
    return part


def _local_in_features(in_features: int, tp: int, name: str) -> int:
    if in_features % tp:
        raise ValueError(f"{name}: {in_features} input features do not split {tp} ways")
    return in_features // tp


def _slice_rows(
    rank: int, tp: int, name: str, loaded: torch.Tensor, shard: str | None
) -> torch.Tensor:
    if name == "bias":  # added once, after the all-reduce: by rank 0
        return loaded if rank == 0 else torch.zeros_like(loaded)
    size = loaded.shape[1] // tp
    return loaded.narrow(1, rank * size, size)


def _slice_quant_rows(
    layer: QuantLinear, rank: int, tp: int, name: str, loaded: torch.Tensor, shard: str | None
) -> torch.Tensor:
    spec = layer.checkpoint_layout[name]
    if name == "bias":
        return loaded if rank == 0 else torch.zeros_like(loaded)
    if spec.kind == "shape":  # [rows, in_features]
        return torch.tensor([int(loaded[0]), int(loaded[1]) // tp], dtype=loaded.dtype)
    if spec.k_dim is None or spec.k_per == 0 or (spec.broadcast and loaded.numel() == 1):
        return loaded  # per output channel: every rank needs all of it
    size = loaded.shape[spec.k_dim] // tp
    part = loaded.narrow(spec.k_dim, rank * size, size)
    if spec.kind == "equal":  # act-order g_idx: the group of each input column
        group_size = layer.scheme.group_size or layer.in_features * tp
        first = rank * layer.in_features // group_size
        local = part.to(torch.int64) - first
        if bool(((local < 0) | (local >= layer.in_features // group_size)).any()):
            raise ValueError(
                f"{spec.name}: act-order input columns mix groups across the {tp} ranks' "
                f"input-feature splits; a row-parallel layer cannot split them (use a "
                "checkpoint without desc_act, or tensor_parallel_size 1)"
            )
        return local.to(part.dtype)
    return part


# ---- vocabulary --------------------------------------------------------------------------------


def _split_vocabulary(model: Any, groups: Groups) -> None:
    embedding = model.model.embed_tokens
    vocab_size, hidden = embedding.weight.shape
    parallel_embedding = VocabParallelEmbedding(vocab_size, hidden, groups)
    model.model.embed_tokens = parallel_embedding
    head = model.lm_head
    tp, rank = groups.place.tp_size, groups.place.tp_rank
    num_local, start = parallel_embedding.num_local, parallel_embedding.start
    part: AnyLinear
    if getattr(model, "tie_word_embeddings", False):
        part = Linear(hidden, num_local)
        part.weight = parallel_embedding.weight  # the checkpoint's embedding fills both
        # The shared parameter ends up with the LM head's loader (attached last): same rows.
        part.checkpoint_slicer = lambda name, loaded, shard: vocab_rows(loaded, start, num_local)
    elif isinstance(head, QuantLinear):
        if vocab_size % tp:
            log.info(
                "lm_head stays whole: quantized, and %d rows do not split %d ways", vocab_size, tp
            )
            return
        part = _column_parallel(head, {None: (rank, tp)}, "lm_head")
    else:
        part = Linear(hidden, num_local)
        part.checkpoint_slicer = lambda name, loaded, shard: vocab_rows(loaded, start, num_local)
    gather_vocab_output(groups, part, vocab_size)
    model.lm_head = part
