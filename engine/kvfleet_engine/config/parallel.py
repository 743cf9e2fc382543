"""How the ranks split the model: tensor and pipeline parallel sizes, hosts, the leader's address;
and the check that the model's heads, MLP and layers divide over them."""

from __future__ import annotations

from dataclasses import dataclass

from kvfleet_engine.config.checks import check, is_int, is_number
from kvfleet_engine.config.model import ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    # Ranks that split every layer's heads, MLP and vocabulary (one process each).
    tensor_parallel_size: int = 1
    # Stages that split the layers between them (each stage is tensor_parallel_size ranks).
    pipeline_parallel_size: int = 1
    # Hosts the ranks span; each runs `kvfleet serve` with its own node_rank (0: the leader,
    # which schedules and serves HTTP; the others only compute).
    nnodes: int = 1
    # This host's index in [0, nnodes).
    node_rank: int = 0
    # The leader's address and port: torch.distributed meets there, and the leader's step
    # channel listens on master_port + 1.
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    # Seconds every rank may take to join and load its weights before start-up fails.
    join_timeout_s: float = 600.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this host runs."""
        return range(
            self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node
        )


def check_parallel(parallel: ParallelConfig) -> None:
    """The sizes, the host index, the port and the join timeout (before any model is read)."""
    tp, pp, nnodes = parallel.tensor_parallel_size, parallel.pipeline_parallel_size, parallel.nnodes
    check(is_int(tp) and tp >= 1, "tensor_parallel_size", tp, "an integer >= 1")
    check(is_int(pp) and pp >= 1, "pipeline_parallel_size", pp, "an integer >= 1")
    check(is_int(nnodes) and nnodes >= 1, "nnodes", nnodes, "an integer >= 1")
    check(
        parallel.world_size % nnodes == 0,
        "nnodes",
        nnodes,
        f"a divisor of the world size tensor_parallel_size x pipeline_parallel_size = "
        f"{tp} x {pp} = {parallel.world_size} (every node runs as many ranks)",
    )
    rank, port, addr = parallel.node_rank, parallel.master_port, parallel.master_addr
    check(is_int(rank) and 0 <= rank < nnodes, "node_rank", rank, f"an integer in [0, {nnodes})")
    check(is_int(port) and 1 <= port <= 65534, "master_port", port, "an integer in [1, 65534]")
    check(isinstance(addr, str) and addr.strip() != "", "master_addr", addr, "a host name or IP")
    timeout = parallel.join_timeout_s
    check(
        is_number(timeout) and timeout > 0,
        "parallel_join_timeout_s",
        timeout,
        "a finite number of seconds > 0",
    )


def check_model_split(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The model's heads, MLP and layers must split evenly over the ranks."""
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    cfg = model.hf_config
    heads, kv_heads = int(cfg["num_attention_heads"]), model.num_kv_heads
    if heads % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's num_attention_heads={heads}"
        )
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp} and the model's num_key_value_heads={kv_heads}: one "
            "must divide the other (KV heads are split, or replicated when fewer than ranks)"
        )
    inner = int(cfg.get("intermediate_size") or 0)
    if inner % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's intermediate_size={inner}"
        )
    if pp > model.num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp} is larger than the model's {model.num_layers} layers"
        )
