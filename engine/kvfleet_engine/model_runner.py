"""The model runner (the driver, rank 0): turns a SchedulerOutput into batch tensors, runs one
forward pass and samples. Its parts: `runner.inputs` (batch tensors), `runner.sampling_inputs`
(sampling settings), `runner.executor` (the model, its KV cache and decode graphs). With
tensor parallelism it also starts and drives the other ranks (`parallel.workers`): each step
they get the step's diff first, then every rank computes its part; the driver samples and
broadcasts the tokens on the device, so every rank's next step can take them as inputs.

A step is launched (inputs, forward, sampling and the copy of the samples to the host, all
queued on the device) and collected later (wait for the samples): between the two the engine
schedules and launches the next step, whose PENDING_TOKEN inputs are this step's samples,
gathered on the device.

Under pipeline parallelism the driver is the first stage's first rank: launching a step runs
the first stage's layers, starts sending their output to the next stage and starts receiving
the step's samples from the last stage, which samples; collecting it waits for them. The
engine keeps one step per stage in flight (micro-batches of disjoint requests, so no step
waits for a token another has not sampled yet)."""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.cuda_graphs import DecodeGraphs
from kvfleet_engine.layers.attention import Attention
from kvfleet_engine.layers.attention_torch import CODE_MAX
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.parallel.groups import Groups, RankPlace
from kvfleet_engine.parallel.messages import Allocate, Loaded, Measure, Measured, Ready
from kvfleet_engine.parallel.pipeline import StageLayers
from kvfleet_engine.parallel.step_diff import StepEncoder
from kvfleet_engine.parallel.workers import RankFailed, WorkerGroup
from kvfleet_engine.runner.executor import (
    ModelExecutor,
    resolve_device,
    resolve_kv_cache_dtype,
)
from kvfleet_engine.runner.inputs import ModelInputs, build_inputs
from kvfleet_engine.runner.kv_memory import CPU_KV_CACHE_BYTES
from kvfleet_engine.runner.launched import (
    NOTHING_LAUNCHED,
    DeviceSpan,
    LaunchedStep,
    runner_output,
    sample_buffers,
    to_host,
)
from kvfleet_engine.runner.sampling_inputs import SamplingInputs
from kvfleet_engine.step import SchedulerOutput

__all__ = [
    "CPU_KV_CACHE_BYTES",
    "LaunchedStep",
    "ModelInputs",
    "ModelRunner",
    "RankFailed",
    "resolve_device",
    "resolve_kv_cache_dtype",
]

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, log_level: str = "INFO") -> None:
        self.config = config
        self.workers: WorkerGroup | None = None
        self.groups: Groups | None = None
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank must be 0 for the engine (the leader, rank 0), got "
                f"{parallel.node_rank}: node {parallel.node_rank} of {parallel.nnodes} only "
                f"computes, with `kvfleet serve --nnodes {parallel.nnodes} --node-rank "
                f"{parallel.node_rank}`"
            )
        if parallel.world_size > 1:
            self.workers = WorkerGroup(config, log_level)
            weakref.finalize(self, self.workers.shutdown)  # the ranks stop with their driver
        try:
            self.executor = self._start()
        except BaseException:
            if self.workers is not None:
                self.workers.shutdown()
            if self.groups is not None:
                self.groups.leave()
            raise
        executor = self.executor
        self.device, self.dtype, self.block_size = (
            executor.device,
            executor.dtype,
            executor.block_size,
        )
        self.kv_cache_dtype = executor.kv_cache_dtype
        self.sampler = executor.sampler
        self.sampling_inputs = SamplingInputs(self.device, config.model.vocab_size)
        # Steps whose decode rows read a shared prefix once (`kernels.shared_prefix`).
        self.shared_prefix_steps_total = 0
        # This rank's pipeline stage (None: one stage); its last send and what it reads.
        self.stage: StageLayers | None = executor.stage
        self._sending: tuple[Any, torch.Tensor] | None = None
        self.step_encoder = (
            StepEncoder(with_sampling=self.stage is not None) if self.workers is not None else None
        )
        # Set to a list (benchmarks, `bench.step_timing`): each step launched on a GPU appends
        # its span on the device, two timing events a step. None: nothing is recorded.
        self.timeline: list[DeviceSpan] | None = None
        log.info(
            "model %s on %s (%s, attention %s), %d KV blocks of %d tokens, KV cache %s%s%s",
            config.model.architecture,
            self.device,
            self.dtype,
            executor.backend_name,
            self.num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            " with bfloat16 scales per token and kv head" if self._quantized_cache else "",
            f", {parallel.world_size} ranks (tensor parallel {parallel.tensor_parallel_size}, "
            f"pipeline parallel {parallel.pipeline_parallel_size})"
            if self.workers is not None
            else "",
        )

    def _start(self) -> ModelExecutor:
        """Load the model (with every other rank), size and allocate the KV cache, capture."""
        workers = self.workers
        if workers is None:
            executor = ModelExecutor(self.config)
            executor.allocate(executor.measure_num_blocks())
            return executor
        parallel = self.config.parallel
        workers.start()
        device = resolve_device(self.config.runner.device, 0, parallel.ranks_per_node)
        self.groups = Groups.join(parallel, RankPlace.of(parallel, 0), device)
        executor = ModelExecutor(self.config, self.groups)
        workers.expect(Loaded)
        workers.send(Measure())
        num_blocks = executor.measure_num_blocks()
        measured = workers.expect(Measured)
        num_blocks = min(num_blocks, *(record.num_blocks for record in measured.values()))
        workers.send(Allocate(num_blocks))
        executor.allocate(num_blocks)
        workers.expect(Ready)
        workers.watch()
        return executor

    # ---- what the engine and the tests read -----------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        return self.executor.model  # type: ignore[return-value]

    @property
    def attention_layers(self) -> list[Attention]:
        return self.executor.attention_layers

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        return self.executor.decode_graphs

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, ...]]:
        return self.executor.kv_caches

    @property
    def num_blocks(self) -> int:
        return self.executor.num_blocks

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    @property
    def _quantized_cache(self) -> bool:
        return self.kv_cache_dtype in CODE_MAX

    # ---- the step -------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its samples."""
        return self.collect(self.launch(scheduled))

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it."""
        timeline = self.timeline
        if timeline is None or not scheduled.requests or self.device.type != "cuda":
            return self._queue(scheduled)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launched = self._queue(scheduled)
        end.record()
        prompt = scheduled.num_batched_tokens > len(scheduled.requests)
        timeline.append(DeviceSpan(start, end, prompt))
        return launched

    def _queue(self, scheduled: SchedulerOutput) -> LaunchedStep:
        self.sampling_inputs.drop(scheduled.finished_request_ids)
        if self.workers is None:
            return self._launch(scheduled)
        assert self.step_encoder is not None
        with self.workers.step("a collective"):
            self.step_encoder.finish(scheduled.finished_request_ids)
            if scheduled.requests:
                self.workers.send(self.step_encoder.encode(scheduled))
            if self.stage is not None:
                return self._launch_stage(scheduled)
            return self._launch(scheduled)

    def _launch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        if not scheduled.requests:
            return NOTHING_LAUNCHED
        inputs = self.prepare_inputs(scheduled)
        assert inputs.sampling is not None and inputs.num_logprobs is not None
        logits, argmax_ids = self.executor.forward(inputs)
        sampled = self.sampler(logits, inputs.sampling, argmax_ids)
        if self.groups is not None:  # the other ranks' next pending inputs
            self.groups.broadcast_from_driver(sampled.token_ids)
        # May be a decode graph's output buffer, which the next replay overwrites: the next step
        # reads it (the fill of its inputs) before its own forward pass, in stream order.
        self.executor.keep_samples(sampled.token_ids, inputs.sampling_request_ids)
        logprobs = None
        if sampled.sampled_logprobs is not None:
            assert sampled.top_token_ids is not None and sampled.top_logprobs is not None
            logprobs = (sampled.sampled_logprobs, sampled.top_token_ids, sampled.top_logprobs)
        if self.device.type == "cpu":
            return LaunchedStep(
                inputs.sampling_request_ids, inputs.num_logprobs, sampled.token_ids, logprobs, None
            )
        token_ids = to_host(sampled.token_ids)
        if logprobs is not None:
            logprobs = (to_host(logprobs[0]), to_host(logprobs[1]), to_host(logprobs[2]))
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(
            inputs.sampling_request_ids, inputs.num_logprobs, token_ids, logprobs, done
        )

    def _launch_stage(self, scheduled: SchedulerOutput) -> LaunchedStep:
        """The first pipeline stage's part of a step; the samples come from the last stage."""
        if not scheduled.requests:
            return NOTHING_LAUNCHED
        assert self.groups is not None
        executor = self.executor
        inputs = build_inputs(
            scheduled.requests, self.block_size, self.device, {}, executor.attention_features
        )
        self.shared_prefix_steps_total += inputs.attention.shared_prefix is not None
        out = executor.forward_stage(inputs, None)  # [2, num_tokens, hidden]
        self._wait_sent()
        self._sending = (self.groups.send_next_stage(out), out)
        num_logprobs = [item.params.logprobs for item in scheduled.requests if item.sample]
        if not num_logprobs:
            return NOTHING_LAUNCHED
        token_ids, logprobs = sample_buffers(num_logprobs, self.device)
        buffers = [token_ids, *(logprobs or ())]
        receiving = tuple(self.groups.recv_sampling_rank(buffers))
        return LaunchedStep(
            inputs.sampling_request_ids, num_logprobs, token_ids, logprobs, None, receiving
        )

    def _wait_sent(self) -> None:
        if self._sending is not None:
            self._sending[0].wait()
            self._sending = None

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's samples and hand them over as Python values."""
        if step.token_ids is not None:
            if step.receiving:
                self._receive(step)
            if step.done is not None:
                step.done.synchronize()
        return runner_output(step)

    def compute_logits(self, inputs: ModelInputs) -> torch.Tensor:
        """[num_sampling_rows, vocab] float32 logits of one step (tests, perplexity)."""
        return self.forward(inputs)[0].float()

    def forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[num_sampling_rows, vocab] logits in the model's dtype, and each row's argmax when a
        decode graph computed it (None: the sampler takes it). Single rank only (the others
        would not join)."""
        assert self.workers is None, "forward() alone runs one rank; launch() runs them all"
        return self.executor.forward(inputs)

    def prepare_inputs(self, scheduled: SchedulerOutput) -> ModelInputs:
        """The step's batch tensors and the sampling settings of its rows."""
        inputs = build_inputs(
            scheduled.requests,
            self.block_size,
            self.device,
            self.executor.last_sample_rows,
            self.executor.attention_features,
        )
        self.shared_prefix_steps_total += inputs.attention.shared_prefix is not None
        sampling_requests = [item for item in scheduled.requests if item.sample]
        inputs.sampling = self.sampling_inputs.metadata(sampling_requests)
        inputs.num_logprobs = [item.params.logprobs for item in sampling_requests]
        return inputs

    # ---- the other ranks ----------------------------------------------------------------------

    def _receive(self, step: LaunchedStep) -> None:
        """Wait for the last pipeline stage's samples of `step`."""
        assert self.workers is not None
        with self.workers.step("a receive"):  # the last stage's
            for work in step.receiving:
                work.wait()

    def shutdown(self) -> None:
        """Stop the other ranks (no-op with one)."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.groups is not None:
            self.groups.leave()
            self.groups = None
