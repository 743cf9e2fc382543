"""The process groups of one replica: every rank, and its tensor-parallel group.

Ranks are numbered stage-major: rank = pp_rank * tp_size + tp_rank, so a stage's ranks are
neighbours (on one host when a host holds a whole stage). The engine starts the ranks itself
(no torchrun): each joins torch.distributed at master_addr:master_port with its own rank. On
the CPU the backend is gloo; on GPUs NCCL, plus a gloo group for host-side agreement.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvfleet_engine.config import ParallelConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the replica."""

    rank: int  # in [0, world_size)
    world_size: int  # tensor_parallel_size * pipeline_parallel_size
    tp_rank: int  # in [0, tp_size): its part of every split layer
    tp_size: int
    pp_rank: int  # in [0, pp_size): its stage (a range of layers)
    pp_size: int
    local_rank: int  # its index on its host (its GPU there)

    @classmethod
    def of(cls, parallel: ParallelConfig, rank: int) -> RankPlace:
        tp = parallel.tensor_parallel_size
        return cls(
            rank=rank,
            world_size=parallel.world_size,
            tp_rank=rank % tp,
            tp_size=tp,
            pp_rank=rank // tp,
            pp_size=parallel.pipeline_parallel_size,
            local_rank=rank % parallel.ranks_per_node,
        )

    @property
    def is_driver(self) -> bool:
        return self.rank == 0


class Groups:
    """The joined process groups of one rank."""

    def __init__(self, place: RankPlace, device: torch.device, timeout_s: float) -> None:
        self.place = place
        self.device = device
        self.tp_group: dist.ProcessGroup | None = None
        # Every stage's ranks, in stage order (the pipeline's neighbours).
        self.stage_ranks: list[list[int]] = []
        self.timeout_s = timeout_s

    @classmethod
    def join(cls, parallel: ParallelConfig, place: RankPlace, device: torch.device) -> Groups:
        """Join torch.distributed (blocks until every rank has) and build the groups."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The host's cores shared by its ranks, not each rank all of them (an explicit
            # OMP_NUM_THREADS wins: hosts that share one machine's cores set it).
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parallel.ranks_per_node))
        timeout = datetime.timedelta(seconds=parallel.join_timeout_s)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{parallel.master_addr}:{parallel.master_port}",
            rank=place.rank,
            world_size=place.world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
        groups = cls(place, device, parallel.join_timeout_s)
        tp = place.tp_size
        groups.stage_ranks = [list(range(s * tp, (s + 1) * tp)) for s in range(place.pp_size)]
        for ranks in groups.stage_ranks:  # every rank creates every group, in the same order
            group = dist.new_group(ranks, backend=backend, timeout=timeout)
            if place.rank in ranks:
                groups.tp_group = group
        log.info(
            "rank %d of %d joined (%s): tensor-parallel rank %d of %d, stage %d of %d",
            place.rank,
            place.world_size,
            backend,
            place.tp_rank,
            tp,
            place.pp_rank,
            place.pp_size,
        )
        return groups

    # ---- collectives over the tensor-parallel group -----------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over the stage's ranks, in place."""
        dist.all_reduce(tensor, group=self.tp_group)
        return tensor

    def all_gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """[rows, n] on each rank -> [rows, tp_size * n], rank order along the last dim."""
        tp = self.place.tp_size
        rows, n = tensor.shape
        gathered = torch.empty((tp * rows, n), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(gathered, tensor.contiguous(), group=self.tp_group)
        return gathered.view(tp, rows, n).transpose(0, 1).reshape(rows, tp * n)

    def broadcast_from_driver(self, tensor: torch.Tensor) -> torch.Tensor:
        """The stage's first rank's tensor on every rank of the stage, in place."""
        src = self.stage_ranks[self.place.pp_rank][0]
        dist.broadcast(tensor, src=src, group=self.tp_group)
        return tensor

    # ---- point to point between pipeline stages (on the world group) -------------------------

    @property
    def next_stage_rank(self) -> int:
        """The rank of the same tp_rank in the next stage."""
        return self.place.rank + self.place.tp_size

    @property
    def previous_stage_rank(self) -> int:
        return self.place.rank - self.place.tp_size

    @property
    def sampling_rank(self) -> int:
        """The last stage's first rank: it samples and sends the tokens to the driver."""
        return (self.place.pp_size - 1) * self.place.tp_size

    def send_next_stage(self, tensor: torch.Tensor) -> dist.Work:
        """Start sending to the next stage; keep `tensor` until the returned work is done."""
        work = dist.isend(tensor, dst=self.next_stage_rank)
        assert work is not None
        return work

    def recv_previous_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """Fill `tensor` from the previous stage (blocks until it came)."""
        dist.recv(tensor, src=self.previous_stage_rank)
        return tensor

    def send_driver(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        """Start sending the samples to the driver, in order."""
        works = [dist.isend(tensor, dst=0) for tensor in tensors]
        return [work for work in works if work is not None]

    def recv_sampling_rank(self, tensors: list[torch.Tensor]) -> list[dist.Work]:
        """Start receiving the last stage's samples into `tensors`, in order (the driver)."""
        works = [dist.irecv(tensor, src=self.sampling_rank) for tensor in tensors]
        return [work for work in works if work is not None]

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
