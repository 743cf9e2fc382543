"""The modules and hooks tensor parallelism puts into a single-device model: a vocab-parallel
embedding, the all-reduce after a row-parallel linear, the all-gather after a vocab-parallel
LM head."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvfleet_engine.parallel.groups import Groups


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + num_local) of the embedding (the vocabulary padded to a multiple of
    the ranks); a token outside them looks up zeros here and its row on another rank, and one
    all-reduce sums the ranks' parts."""

    def __init__(self, vocab_size: int, hidden_size: int, groups: Groups) -> None:
        super().__init__()
        tp = groups.place.tp_size
        self.vocab_size = vocab_size
        self.num_local = -(-vocab_size // tp)  # rows per rank, the last one padded with zeros
        self.start = groups.place.tp_rank * self.num_local
        self.groups = groups
        shape = (self.num_local, hidden_size)
        self.weight = nn.Parameter(torch.empty(shape))  # [num_local, hidden]
        self.attach_weight_loaders()

    def attach_weight_loaders(self) -> None:
        """Give the weight its loader (again after to_empty, which makes new parameters)."""
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"has {loaded.shape[0]} rows, expected {self.vocab_size}")
        param.data.copy_(vocab_rows(loaded, self.start, self.num_local))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] int64
        local_ids = input_ids - self.start
        outside = (local_ids < 0) | (local_ids >= self.num_local)  # [num_tokens]
        hidden = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        hidden = hidden.masked_fill(outside[:, None], 0)  # [num_tokens, hidden]
        return self.groups.all_reduce(hidden)


def vocab_rows(loaded: torch.Tensor, start: int, num_rows: int) -> torch.Tensor:
    """Rows [start, start + num_rows) of a [vocab, ...] tensor, zeros past its end."""
    rows = loaded[start : start + num_rows]
    if rows.shape[0] == num_rows:
        return rows
    padding = torch.zeros(
        (num_rows - rows.shape[0], *loaded.shape[1:]), dtype=loaded.dtype, device=loaded.device
    )
    return torch.cat([rows, padding])


def all_reduce_output(groups: Groups, module: nn.Module) -> None:
    """Sum the module's output over the stage's ranks (after a row-parallel linear)."""
    module.register_forward_hook(partial(_all_reduce_hook, groups))


def gather_vocab_output(groups: Groups, module: nn.Module, vocab_size: int) -> None:
    """Concatenate the ranks' logits [rows, vocab / tp] into [rows, vocab] (LM head)."""
    module.register_forward_hook(partial(_gather_hook, groups, vocab_size))


def _all_reduce_hook(groups: Groups, module: nn.Module, args: Any, output: torch.Tensor) -> None:
    groups.all_reduce(output)


def _gather_hook(
    groups: Groups, vocab_size: int, module: nn.Module, args: Any, output: torch.Tensor
) -> torch.Tensor:
    gathered = groups.all_gather_last(output)  # [rows, padded vocab]
    return gathered if gathered.shape[-1] == vocab_size else gathered[..., :vocab_size]
