"""CUDA graphs of the decode forward pass (model, LM head and each row's most likely token), one
per bucketed batch size.

A decode step launches hundreds of small kernels; replaying a captured graph launches them all
at once. Inputs live in persistent buffers that each step copies into (padding rows get slot -1,
so nothing is stored, and context length 0, so attention returns zeros); the attention kernels
read lengths and block tables on the device, so one capture serves every step of its size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvfleet_engine.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to and including max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self, model: Any, max_num_seqs: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.model = model
        self.sizes = bucket_sizes(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n]
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [n]
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)  # [n]
        self.cu_query_lens = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n + 1]
        # [n, max_blocks_per_seq]: rows are overwritten up to each step's width; stale entries
        # past a sequence's context are never read.
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # batch size -> [size, vocab] float32 output
        self.greedy: dict[int, torch.Tensor] = {}  # batch size -> [size] int64 argmax of logits

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            context_lens=self.context_lens[:size],
            cu_query_lens=self.cu_query_lens[: size + 1],
            is_decode=True,
        )
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta)
        logits = self.model.compute_logits(hidden).float()
        return logits, logits.argmax(dim=-1)  # greedy rows' tokens without a launch of their own

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, all graphs sharing one memory pool (replays never overlap)."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # compiles the kernels outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size], self.greedy[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def run(
        self,
        input_ids: torch.Tensor,  # [num_seqs] int64
        positions: torch.Tensor,  # [num_seqs] int64
        meta: AttentionMetadata,  # a decode step: one query token per sequence
        pending_sources: torch.Tensor | None = None,  # [num_seqs] row in samples, -1 = known
        samples: torch.Tensor | None = None,  # the previous step's sampled tokens
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """([num_seqs, vocab] float32 logits, [num_seqs] int64 argmax), or None if no graph fits."""
        from kvfleet_engine.kernels.graph_inputs import fill_decode_graph_inputs

        num_seqs = input_ids.shape[0]
        width = meta.block_tables.shape[1]
        size = next((s for s in self.sizes if s >= num_seqs), None)
        if size is None or width > self.block_tables.shape[1]:
            return None
        buffers = (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.context_lens,
            self.block_tables,
        )
        fill_decode_graph_inputs(
            input_ids,
            positions,
            meta.slot_mapping,
            meta.context_lens,
            meta.block_tables,
            pending_sources,
            samples,
            buffers,
            size,
        )
        self.graphs[size].replay()
        return self.logits[size][:num_seqs], self.greedy[size][:num_seqs]
