"""CUDA graphs of the forward pass: decode steps (model, LM head and each row's most likely token)
per bucketed batch size, and short prompt steps (the model alone, to the final norm; the LM head
runs on the sampled rows only) per bucketed token count.

A step launches hundreds of kernels, each costing the host more than the device takes to run it
at small sizes: a 512-token prompt step of an 8B model launches for ~18 ms on an H200's host and
computes in ~12 ms. Replaying a captured graph launches them all at once. Inputs live in
persistent buffers that each step copies into (`kernels.graph_inputs`: padding tokens get slot
-1, so nothing is stored; padding sequences context 0 and no query tokens, so they attend to
nothing); the attention kernels read lengths, query offsets and block tables on the device, so
one capture serves every step of its size. Decode steps of at least SHARED_PREFIX_MIN_SEQS
sequences have a second graph per size, for steps whose sequences share a prefix
(`kernels.shared_prefix`; its length is a device buffer too). Prompt steps of more tokens than
DECODES_APART_MIN_SEQS have a second graph per size too when the backend sends a mixed step's
one-token sequences to its decode kernels (`runner.inputs`), with the shared prefix read once
where the runner finds one (a prefix of 0 tokens when it finds none).

Under pipeline parallelism each stage captures its own part of the step (`GraphStage`): the
first stage from the input ids, the others from the previous stage's hidden state and residual,
which each step copies into one more persistent buffer; every stage but the last ends at its
output for the next stage, the last at the logits (decode) or the final norm (prompt steps).
The send and receive between stages stay outside the graphs.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kvfleet_engine.layers.attention import AttentionMetadata
from kvfleet_engine.parallel.pipeline import StageLayers, intermediate_shape
from kvfleet_engine.runner.inputs import (
    DECODES_APART_MIN_SEQS,
    SHARED_PREFIX_MIN_SEQS,
    AttentionFeatures,
)

log = logging.getLogger(__name__)

# Prompt steps above this many tokens run eagerly: from ~1k tokens on, an 8B model's step takes
# the device longer than the host takes to launch it, and a graph would only add padding.
PROMPT_GRAPH_MAX_TOKENS = 1024


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


def prompt_bucket_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, then multiples of 64 to 512 and of 128 to 1024, up to and including
    max_tokens (at most PROMPT_GRAPH_MAX_TOKENS): a step is padded by under 64 tokens up to 512,
    under 128 above."""
    limit = min(max_tokens, PROMPT_GRAPH_MAX_TOKENS)
    sizes = [16, 32, 64, 128, *range(192, 513, 64), *range(640, 1025, 128)]
    below = [s for s in sizes if s < limit]
    return [*below, limit]


@dataclass(frozen=True)
class GraphStage:
    """What a pipeline stage's graphs need: its layers, and the shape of what stages pass on."""

    layers: StageLayers
    hidden_size: int
    dtype: torch.dtype


class _StepGraphs(ABC):
    """Graphs of one kind of step, one per key (a size, or a size and a variant), captured
    largest first into one memory pool (replays never overlap). `rows`: the most token rows a
    step has (the input buffers' length)."""

    kind = ""

    def __init__(
        self,
        sizes: list[int],
        model: Any,
        rows: int,
        device: torch.device,
        stage: GraphStage | None,
    ) -> None:
        self.sizes = sizes
        self.model = model
        self.graphs: dict[Any, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Any, Any] = {}
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)  # [rows]
        self.slot_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)  # [rows]
        self.stage = stage.layers if stage is not None else None
        # [2, rows, hidden]: the previous stage's output, past the first stage (rows past a
        # step's tokens keep stale values, which only padding rows read).
        self.previous: torch.Tensor | None = None
        if stage is not None and not stage.layers.is_first:
            shape = intermediate_shape(rows, stage.hidden_size)
            self.previous = torch.zeros(shape, dtype=stage.dtype, device=device)

    @property
    def ends_at_hidden(self) -> bool:
        """Whether the graphs end at the stage's output for the next stage (not the last)."""
        return self.stage is not None and not self.stage.is_last

    def _model(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """The model, or this stage's layers, on the first `size` rows of the buffers."""
        ids, positions = self.input_ids[:size], self.positions[:size]
        if self.stage is None:
            return self.model(ids, positions, meta)
        previous = self.previous[:, :size] if self.previous is not None else None
        return self.model.forward_stage(ids, positions, meta, previous)

    def _load_previous(self, previous: torch.Tensor | None) -> None:
        """Copy the previous stage's output [2, num_tokens, hidden] in (stages past the first)."""
        if self.previous is not None:
            assert previous is not None, "a stage past the first needs the previous one's output"
            self.previous[:, : previous.shape[1]].copy_(previous)

    def _keys(self) -> list[Any]:
        """What `capture` captures, in order: the sizes, largest first."""
        return list(reversed(self.sizes))

    @abstractmethod
    def _forward(self, key: Any) -> Any:
        """The step's forward pass for `key` on the persistent buffers (what is captured)."""

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        before = torch.cuda.memory_allocated()
        keys = self._keys()
        for key in keys:
            self._forward(key)  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[key] = self._forward(key)
            pool = graph.pool()
            self.graphs[key] = graph
        held = (torch.cuda.memory_allocated() - before) / 2**20
        log.info(
            "captured %d %s CUDA graphs for sizes %s (%.0f MiB)",
            len(keys), self.kind, self.sizes, held,
        )  # fmt: skip

    def _size(self, needed: int) -> int | None:
        return next((s for s in self.sizes if s >= needed), None)

    def replay(self, key: Any) -> Any:
        """Replay `key`'s graph (its inputs loaded): its outputs, for all its rows (graph
        memory, which the next replay overwrites)."""
        self.graphs[key].replay()
        return self.outputs[key]


class DecodeGraphs(_StepGraphs):
    """Keyed (size, shared): `shared` graphs read the step's shared prefix from `self.shared`
    and attend to it once per tile of sequences."""

    kind = "decode"

    def __init__(
        self,
        model: Any,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        shared_prefix: bool = False,  # capture the shared-prefix variants too
        stage: GraphStage | None = None,  # pipeline parallelism: this rank's stage
    ) -> None:
        sizes = bucket_sizes(max_num_seqs)
        super().__init__(sizes, model, sizes[-1], device, stage)
        self.shared_prefix = shared_prefix
        # [2 + n]: the shared prefix, as `kernels.shared_prefix` reads it; rows past a step's
        # sequences keep stale shares, read for padding rows only (context 0: nothing read).
        self.shared = torch.zeros(2 + max_num_seqs, dtype=torch.int32, device=device)
        # [n, vocab] in the model's dtype: every graph's logits, in one buffer (each graph's
        # own would hold sum(sizes) rows of the vocabulary: 0.5 GiB for an 8B model at 256
        # sequences). Made by the first, uncaptured forward. Not cast to float32 here: an
        # all-greedy step reads only the argmax, and the sampler casts the rows it samples.
        self.logits: torch.Tensor | None = None
        n = self.sizes[-1]
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        # [n, max_blocks_per_seq]: rows are overwritten up to each step's width; stale entries
        # past a sequence's context are never read.
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        # What `fill_graph_inputs` writes, in its order.
        self.buffers = (
            self.input_ids, self.positions, self.slot_mapping, self.context_lens,
            self.block_tables,
        )  # fmt: skip

    def _keys(self) -> list[tuple[int, bool]]:
        shared = [s for s in self.sizes if s >= SHARED_PREFIX_MIN_SEQS and self.shared_prefix]
        keys = [(s, True) for s in shared] + [(s, False) for s in self.sizes]
        return sorted(keys, reverse=True)  # largest first, its shared variant before it

    def _forward(self, key: tuple[int, bool]) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
        """[size, vocab] logits in the model's dtype and [size] int64 argmax (greedy rows'
        tokens without a launch of their own; the same as the float32 logits' argmax, since the
        cast is exact); a stage before the last: its output [2, size, hidden]."""
        size, shared = key
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_query_lens=self.cu_query_lens[: size + 1],
            is_decode=True,
            shared_prefix=self.shared[: 2 + size] if shared else None,
        )
        hidden = self._model(size, meta)
        if self.ends_at_hidden:
            return hidden
        model_logits = self.model.compute_logits(hidden)  # [size, vocab] in the model's dtype
        if self.logits is None:
            rows, vocab = self.sizes[-1], model_logits.shape[1]
            self.logits = torch.empty(rows, vocab, dtype=model_logits.dtype, device=hidden.device)
        logits = self.logits[:size]
        logits.copy_(model_logits)
        return logits, logits.argmax(dim=-1)

    def load(
        self,
        input_ids: torch.Tensor,  # [num_seqs] int64
        positions: torch.Tensor,  # [num_seqs] int64
        meta: AttentionMetadata,  # a decode step: one query token per sequence
        pending_sources: torch.Tensor | None = None,  # [num_seqs] row in samples, -1 = known
        samples: torch.Tensor | None = None,  # the previous step's sampled tokens
        previous: torch.Tensor | None = None,  # [2, num_seqs, hidden]: the previous stage's
    ) -> tuple[int, bool] | None:
        """Copy the step into the buffers: the key of the graph to replay, or None if none
        fits."""
        from kvfleet_engine.kernels.graph_inputs import fill_graph_inputs

        num_seqs = input_ids.shape[0]
        size = self._size(num_seqs)
        if size is None or meta.block_tables.shape[1] > self.block_tables.shape[1]:
            return None
        fill_graph_inputs(
            input_ids,
            positions,
            meta.slot_mapping,
            meta.context_lens,
            None,
            meta.block_tables,
            pending_sources,
            samples,
            self.buffers,
            size,
            size,
        )
        self._load_previous(previous)
        shared = False
        if meta.shared_prefix is not None and (size, True) in self.graphs:
            self.shared[: 2 + num_seqs].copy_(meta.shared_prefix)
            shared = True
        return size, shared

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pending_sources: torch.Tensor | None = None,
        samples: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([num_seqs, vocab] logits in the model's dtype, [num_seqs] int64 argmax) of the
        whole model, or None if no graph fits (`load`'s arguments)."""
        key = self.load(input_ids, positions, meta, pending_sources, samples)
        if key is None:
            return None
        logits, argmax_ids = self.replay(key)
        num_seqs = input_ids.shape[0]
        return logits[:num_seqs], argmax_ids[:num_seqs]


class PromptGraphs(_StepGraphs):
    """Steps with prompt tokens (prompts, prefill chunks, decodes beside them) of up to
    PROMPT_GRAPH_MAX_TOKENS tokens: the model to its final norm, for max_num_seqs sequences
    (those the step lacks have no tokens). Keyed (size, apart): `apart` graphs attend the
    one-token sequences with the decode kernels, over the prefix in `self.shared`."""

    kind = "prompt"

    def __init__(
        self,
        model: Any,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
        features: AttentionFeatures,
        stage: GraphStage | None = None,  # pipeline parallelism: this rank's stage
    ) -> None:
        sizes = prompt_bucket_sizes(max_num_batched_tokens)
        super().__init__(sizes, model, sizes[-1], device, stage)
        self.features = features
        s = max_num_seqs
        # [2 + s]: the shared prefix of an `apart` step (`kernels.shared_prefix`), zeros when it
        # has none (always, without the shared-prefix feature: the kernels' mixed variant reads
        # a description either way); rows past a step's sequences have no query tokens and read
        # nothing.
        self.shared = torch.zeros(2 + s, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(s, dtype=torch.int32, device=device)  # [s]
        self.cu_query_lens = torch.zeros(s + 1, dtype=torch.int32, device=device)  # [s + 1]
        self.block_tables = torch.zeros(s, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.buffers = (
            self.input_ids, self.positions, self.slot_mapping, self.context_lens,
            self.block_tables, self.cu_query_lens,
        )  # fmt: skip

    def _keys(self) -> list[tuple[int, bool]]:
        apart = [
            s for s in self.sizes if s > DECODES_APART_MIN_SEQS and self.features.decodes_apart
        ]
        return sorted([(s, True) for s in apart] + [(s, False) for s in self.sizes], reverse=True)

    def _forward(self, key: tuple[int, bool]) -> torch.Tensor:
        """[size, hidden]: the final norm's output of every token row; a stage before the last:
        its output [2, size, hidden]."""
        size, apart = key
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables,
            context_lens=self.context_lens,
            cu_query_lens=self.cu_query_lens,
            is_decode=False,
            shared_prefix=self.shared if apart else None,  # zeros: no prefix (see load)
            decodes_apart=apart,
        )
        return self._model(size, meta)

    def load(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        meta: AttentionMetadata,  # a step with prompt tokens
        pending_sources: torch.Tensor | None = None,  # [num_tokens] row in samples, -1 = known
        samples: torch.Tensor | None = None,  # the previous step's sampled tokens
        previous: torch.Tensor | None = None,  # [2, num_tokens, hidden]: the previous stage's
    ) -> tuple[int, bool] | None:
        """Copy the step into the buffers: the key of the graph to replay, or None if none
        fits."""
        from kvfleet_engine.kernels.graph_inputs import fill_graph_inputs

        size = self._size(input_ids.shape[0])
        num_seqs, width = meta.block_tables.shape
        if (
            size is None
            or num_seqs > self.context_lens.shape[0]
            or width > self.block_tables.shape[1]
        ):
            return None
        fill_graph_inputs(
            input_ids,
            positions,
            meta.slot_mapping,
            meta.context_lens,
            meta.cu_query_lens,
            meta.block_tables,
            pending_sources,
            samples,
            self.buffers,
            size,
            self.context_lens.shape[0],
        )
        self._load_previous(previous)
        apart = meta.decodes_apart and (size, True) in self.graphs
        if apart and self.features.shared_prefix_min:
            if meta.shared_prefix is None:
                self.shared.zero_()
            else:
                self.shared[: 2 + num_seqs].copy_(meta.shared_prefix)
        return size, apart

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pending_sources: torch.Tensor | None = None,
        samples: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """[num_tokens, hidden] of the whole model, or None if no graph fits (`load`'s
        arguments)."""
        key = self.load(input_ids, positions, meta, pending_sources, samples)
        if key is None:
            return None
        return self.replay(key)[: input_ids.shape[0]]
