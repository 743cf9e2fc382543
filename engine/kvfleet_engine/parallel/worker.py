"""A worker rank's process: join the replica, load its part of the model, then compute every
step the driver sends (`messages.Step`) until `Stop` or the driver goes away.

A worker never schedules: it rebuilds each step's batch from the diff, runs the forward pass
with its collectives, and receives the driver's sampled tokens (a broadcast on the device),
which the next step's pending inputs read. Under pipeline parallelism it runs its stage
(`StageWorker`): the last stage's first rank samples and sends the tokens to the driver.
Started by the engine itself (the driver for its host's ranks, `kvfleet serve --node-rank R`
on other hosts), never by torchrun."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import TypeVar

import torch
import torch.distributed as dist

from kvfleet_engine import logs
from kvfleet_engine.config import EngineConfig
from kvfleet_engine.parallel import messages
from kvfleet_engine.parallel.channel import connect
from kvfleet_engine.parallel.groups import Groups, RankPlace
from kvfleet_engine.parallel.messages import (
    Allocate,
    Failed,
    Hello,
    Loaded,
    Measure,
    Measured,
    Ready,
    Step,
    Stop,
)
from kvfleet_engine.parallel.pipeline import intermediate_shape
from kvfleet_engine.parallel.stage_sampling import StageSampling
from kvfleet_engine.parallel.step_diff import StepDecoder
from kvfleet_engine.runner.executor import ModelExecutor, resolve_device
from kvfleet_engine.runner.inputs import ModelInputs, build_inputs

log = logging.getLogger(__name__)

R = TypeVar("R")


def run_worker(
    config: EngineConfig, rank: int, status: Connection | None = None, log_level: str = "INFO"
) -> None:
    """A worker process's entry point (multiprocessing target). `status`, from the host's
    launcher (a duplex pipe it never writes to): gets "ready" once this rank can compute, or
    the reason it failed; its end closing means the launcher died, and this rank exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group; the driver stops it
    logs.configure(log_level, f"rank {rank}")
    if status is not None:
        threading.Thread(
            target=_exit_with_launcher, args=(status, rank), name="kvfleet-launcher", daemon=True
        ).start()
    parallel = config.parallel
    try:
        conn = connect(parallel, time.monotonic() + parallel.join_timeout_s)
    except OSError as error:
        log.error("%s", error)
        _report(status, f"rank {rank}: {error}")
        raise SystemExit(1) from error
    conn.send_bytes(messages.encode(Hello(rank, os.getpid())))
    try:
        Worker(config, rank, conn, status).run()
    except (EOFError, OSError):
        log.error("the driver went away; rank %d exits", rank)
        _report(status, f"rank {rank}: the driver went away")
        raise SystemExit(1) from None
    except Exception as error:
        log.exception("rank %d failed", rank)
        reason = (
            f"{type(error).__name__}: {error}" if not isinstance(error, ValueError) else str(error)
        )
        try:
            conn.send_bytes(messages.encode(Failed(rank, reason, isinstance(error, ValueError))))
        except OSError:
            pass
        _report(status, f"rank {rank}: {reason}")
        raise SystemExit(1) from error


def _exit_with_launcher(status: Connection, rank: int) -> None:
    """Block until the launcher's end of `status` closes (it died, however it died), then end
    this rank at once: its step channel closes, so the driver sees the rank gone."""
    try:
        status.recv()
    except (EOFError, OSError):
        pass
    log.error("the launcher of rank %d went away; rank %d exits", rank, rank)
    os._exit(1)


def _report(status: Connection | None, message: str) -> None:
    if status is not None:
        try:
            status.send(message)
        except OSError:
            pass


class Worker:
    def __init__(
        self, config: EngineConfig, rank: int, conn: Connection, status: Connection | None
    ) -> None:
        self.config = config
        self.rank = rank
        self.conn = conn
        self.status = status
        self.decoder = StepDecoder()
        self.stage: StageWorker | None = None  # pipeline parallelism: this rank's stage

    def run(self) -> None:
        parallel = self.config.parallel
        place = RankPlace.of(parallel, self.rank)
        device = resolve_device(
            self.config.runner.device, place.local_rank, parallel.ranks_per_node
        )
        self.groups = Groups.join(parallel, place, device)
        self.executor = ModelExecutor(self.config, self.groups)
        if self.executor.stage is not None:
            self.stage = StageWorker(self.executor, self.groups, self.config.model.vocab_size)
        self._send(Loaded(self.rank))
        self._expect(Measure)
        self._send(Measured(self.rank, self.executor.measure_num_blocks()))
        allocate = self._expect(Allocate)
        self.executor.allocate(allocate.num_blocks)
        self._send(Ready(self.rank))
        _report(self.status, "ready")
        decode = messages.to_worker.decode
        while True:
            record = decode(self.conn.recv_bytes())
            if isinstance(record, Stop):  # the process's exit closes its groups
                log.info("rank %d stopping", self.rank)
                return
            if isinstance(record, Step):
                self.step(record)

    @torch.inference_mode()
    def step(self, step: Step) -> None:
        executor = self.executor
        items = self.decoder.apply(step)
        inputs = build_inputs(
            items,
            executor.block_size,
            executor.device,
            executor.last_sample_rows,
            executor.attention_features,
        )
        if self.stage is not None:
            self.stage.step(step, inputs)
            return
        executor.forward(inputs)
        samples = torch.empty(len(step.sample_rows), dtype=torch.int64, device=executor.device)
        self.groups.broadcast_from_driver(samples)  # [rows]: the driver's sampled tokens
        executor.keep_samples(samples, inputs.sampling_request_ids)

    def _send(self, record: messages.FromWorker) -> None:
        self.conn.send_bytes(messages.encode(record))

    def _expect(self, kind: type[R]) -> R:
        record = messages.to_worker.decode(self.conn.recv_bytes())
        if isinstance(record, Stop):
            raise SystemExit(0)
        if not isinstance(record, kind):
            raise RuntimeError(f"expected {kind.__name__} from the driver, got {record!r}")
        return record


class StageWorker:
    """A pipeline stage's step on one rank: the previous stage's hidden state and residual in
    (blocking: stages run the steps in order), this stage's layers, then out to the next stage
    or, on the last stage, the logits sampled (by its first rank) and the tokens sent to the
    driver. A send is waited for just before the next one, so the step after it overlaps."""

    def __init__(self, executor: ModelExecutor, groups: Groups, vocab_size: int) -> None:
        assert executor.stage is not None
        self.executor = executor
        self.groups = groups
        self.stage = executor.stage
        self.samples = self.stage.is_last and groups.place.tp_rank == 0
        self.sampling = StageSampling(executor.device, vocab_size) if self.samples else None
        # The last send and the tensors it reads (kept until it is done).
        self.sending: tuple[list[dist.Work], list[torch.Tensor]] = ([], [])

    def step(self, step: Step, inputs: ModelInputs) -> None:
        executor = self.executor
        previous = None
        if not self.stage.is_first:
            shape = intermediate_shape(inputs.input_ids.shape[0], executor.hidden_size)
            previous = torch.empty(shape, dtype=executor.dtype, device=executor.device)
            self.groups.recv_previous_stage(previous)
        out = executor.forward_stage(inputs, previous)
        if not self.stage.is_last:
            self._wait_sent()
            self.sending = ([self.groups.send_next_stage(out)], [out])
            return
        if self.sampling is None:
            return
        metadata = self.sampling.metadata(step)
        if not step.sample_rows:
            return
        sampled = executor.sampler(out, metadata, None)
        tensors = [sampled.token_ids]
        if metadata.max_num_logprobs is not None:
            assert sampled.sampled_logprobs is not None
            assert sampled.top_token_ids is not None and sampled.top_logprobs is not None
            tensors += [sampled.sampled_logprobs, sampled.top_token_ids, sampled.top_logprobs]
        tensors = [tensor.contiguous() for tensor in tensors]
        self._wait_sent()
        self.sending = (self.groups.send_driver(tensors), tensors)

    def _wait_sent(self) -> None:
        for work in self.sending[0]:
            work.wait()
        self.sending = ([], [])
