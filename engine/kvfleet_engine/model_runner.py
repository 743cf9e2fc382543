"""The model runner: owns the model, the KV cache tensors and the sampler; turns a
SchedulerOutput into batch tensors, runs one forward pass and samples.

A step is launched (inputs, forward, sampling and the copy of the samples to the host, all
queued on the device) and collected later (wait for the samples): between the two the engine
schedules and launches the next step, whose PENDING_TOKEN inputs are this step's samples,
gathered on the device."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.cuda_graphs import DecodeGraphs
from kvfleet_engine.layers.attention import Attention, AttentionMetadata, load_backend
from kvfleet_engine.layers.attention_torch import FP8_DTYPE, SCALE_DTYPE
from kvfleet_engine.layers.sampler import Penalties, Sampler, SamplingMetadata
from kvfleet_engine.models.loader import load_model, serving_dtype
from kvfleet_engine.outputs import ModelRunnerOutput
from kvfleet_engine.scheduler import PENDING_TOKEN, ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)

# KV cache memory when sizing it on the CPU (there is no memory probe worth trusting).
CPU_KV_CACHE_BYTES = 2 << 30
# Triton has an e4m3 type (float8e4nv) from this compute capability on (Ada, Hopper).
FP8_TRITON_MIN_CAPABILITY = (8, 9)


def resolve_kv_cache_dtype(
    setting: str, model_dtype: torch.dtype, device: torch.device, backend_name: str
) -> torch.dtype:
    """The cache's element type: the model's (auto), or e4m3 (fp8). The torch and sdpa backends
    read an fp8 cache on any device; the Triton kernels need an e4m3 type the GPU has."""
    if setting == "auto":
        return model_dtype
    if device.type == "cuda" and backend_name == "triton":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_TRITON_MIN_CAPABILITY:
            need = ".".join(map(str, FP8_TRITON_MIN_CAPABILITY))
            raise ValueError(
                f"kv_cache_dtype=fp8 needs compute capability >= {need} for the triton attention "
                f"backend; {device} ({torch.cuda.get_device_name(device)}) has "
                f"{capability[0]}.{capability[1]}: use kv_cache_dtype=auto"
            )
    return FP8_DTYPE


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


@dataclass
class ModelInputs:
    """One step's batch on the device."""

    # [num_tokens] int64: token ids, sequences back to back.
    input_ids: torch.Tensor
    # [num_tokens] int64: position of each token in its sequence.
    positions: torch.Tensor
    # Paged-cache addressing for the attention layers.
    attention: AttentionMetadata
    # [num_sampling_rows] int64: index into the tokens of each row whose logits are sampled.
    logits_indices: torch.Tensor
    # [num_tokens] int64: for a PENDING_TOKEN input, its row in the previous step's samples
    # (-1 for the others); None when the step has no pending input.
    pending_sources: torch.Tensor | None
    # Request id of each sampling row, in row order.
    sampling_request_ids: list[str]
    # Settings of each sampling row.
    sampling: SamplingMetadata
    # Top-n logprobs wanted per sampling row (None: none).
    num_logprobs: list[int | None]


@dataclass
class LaunchedStep:
    """A step queued on the device; its samples reach host memory when `done` fires."""

    # Request id of each sampling row, in row order.
    request_ids: list[str]
    # Top-n logprobs wanted per sampling row (None: none).
    num_logprobs: list[int | None]
    # [rows] int64 sampled tokens, in host memory once `done` (None: nothing was sampled).
    token_ids: torch.Tensor | None
    # Sampled-token logprob [rows], top ids and top logprobs [rows, n] (None: not asked).
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    # Recorded after the copies to the host (None on the CPU: already there).
    done: torch.cuda.Event | None


class ModelRunner:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.runner.device)
        self.dtype = serving_dtype(config.model, self.device)
        self.block_size = config.cache.block_size
        backend_name = config.runner.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "sdpa"
        self.backend = load_backend(backend_name)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, self.device, backend_name
        )
        torch.manual_seed(config.runner.seed)
        self.model = load_model(config.model, self.device, self.dtype)
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.sampler = Sampler()
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.runner.enforce_eager:
            max_blocks = -(-config.model.max_model_len // self.block_size)
            self.decode_graphs = DecodeGraphs(
                self.model, config.scheduler.max_num_seqs, max_blocks, self.device
            )
            self.decode_graphs.capture()
        self.generators: dict[str, torch.Generator] = {}
        self._empty_sampling = torch.empty(0, device=self.device)
        # The last launched step's samples on the device ([rows] int64) and each request's
        # row there: where the next step's PENDING_TOKEN inputs come from.
        self._last_samples = torch.empty(0, dtype=torch.int64, device=self.device)
        self._last_sample_rows: dict[str, int] = {}
        log.info(
            "model %s on %s (%s, attention %s), %d KV blocks of %d tokens, KV cache %s%s",
            config.model.architecture,
            self.device,
            self.dtype,
            backend_name,
            self.num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            " with bfloat16 scales per token and kv head" if self._fp8_cache else "",
        )

    # ---- the step -------------------------------------------------------------------------

    def execute(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its samples."""
        return self.collect(self.launch(scheduled))

    @torch.inference_mode()
    def launch(self, scheduled: SchedulerOutput) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it."""
        for request_id in scheduled.finished_request_ids:
            self.generators.pop(request_id, None)
        if not scheduled.requests:
            return LaunchedStep([], [], None, None, None)
        inputs = self.prepare_inputs(scheduled)
        logits, greedy = self.forward(inputs)
        sampled = self.sampler(logits, inputs.sampling, greedy)
        # May be a decode graph's output buffer, which the next replay overwrites: the next step
        # reads it (the fill of its inputs) before its own forward pass, in stream order.
        self._last_samples = sampled.token_ids
        self._last_sample_rows = {rid: row for row, rid in enumerate(inputs.sampling_request_ids)}
        logprobs = None
        if sampled.sampled_logprobs is not None:
            assert sampled.top_token_ids is not None and sampled.top_logprobs is not None
            logprobs = (sampled.sampled_logprobs, sampled.top_token_ids, sampled.top_logprobs)
        if self.device.type == "cpu":
            return LaunchedStep(
                inputs.sampling_request_ids, inputs.num_logprobs, sampled.token_ids, logprobs, None
            )
        token_ids = _to_host(sampled.token_ids)
        if logprobs is not None:
            logprobs = (_to_host(logprobs[0]), _to_host(logprobs[1]), _to_host(logprobs[2]))
        done = torch.cuda.Event()
        done.record()
        return LaunchedStep(
            inputs.sampling_request_ids, inputs.num_logprobs, token_ids, logprobs, done
        )

    def collect(self, step: LaunchedStep) -> ModelRunnerOutput:
        """Wait for a launched step's samples and hand them over as Python values."""
        if step.token_ids is None:
            return ModelRunnerOutput(sampled_token_ids={}, logprobs={})
        if step.done is not None:
            step.done.synchronize()
        token_ids = step.token_ids.tolist()
        request_ids = step.request_ids
        logprobs: dict[str, dict[int, float]] = {}
        if step.logprobs is not None:
            sampled_logprobs, top_ids, top_values = (t.tolist() for t in step.logprobs)
            for row, num in enumerate(step.num_logprobs):
                if num is None:
                    continue
                entry = dict(zip(top_ids[row][:num], top_values[row][:num], strict=True))
                entry[token_ids[row]] = sampled_logprobs[row]
                logprobs[request_ids[row]] = entry
        return ModelRunnerOutput(
            sampled_token_ids=dict(zip(request_ids, token_ids, strict=True)), logprobs=logprobs
        )

    def compute_logits(self, inputs: ModelInputs) -> torch.Tensor:  # [num_sampling_rows, vocab]
        return self.forward(inputs)[0]

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[num_sampling_rows, vocab] float32 logits, and each row's argmax when a decode graph
        computed it (None: the sampler takes it)."""
        if self.decode_graphs is not None and inputs.attention.is_decode:
            graph_out = self.decode_graphs.run(
                inputs.input_ids,
                inputs.positions,
                inputs.attention,
                inputs.pending_sources,
                self._last_samples,
            )
            if graph_out is not None:
                logits, greedy = graph_out
                if len(inputs.sampling_request_ids) == logits.shape[0]:
                    return logits, greedy  # every row samples (the usual decode step), in order
                return logits[inputs.logits_indices], greedy[inputs.logits_indices]
        input_ids = inputs.input_ids
        if inputs.pending_sources is not None:  # the previous step's samples, on the device
            sources = inputs.pending_sources
            sampled = self._last_samples.index_select(0, sources.clamp(min=0))
            input_ids = torch.where(sources >= 0, sampled, input_ids)
        hidden = self.model(input_ids, inputs.positions, inputs.attention)
        return self.model.compute_logits(hidden[inputs.logits_indices]).float(), None

    def prepare_inputs(self, scheduled: SchedulerOutput) -> ModelInputs:
        """The step's batch tensors, built with numpy in one host buffer (int64 segments, then
        int32 ones) that reaches the device in one copy."""
        items = scheduled.requests
        num_seqs = len(items)
        block_size = self.block_size
        lens = np.fromiter((len(item.token_ids) for item in items), np.int64, num_seqs)
        num_tokens = int(lens.sum())
        is_decode = num_tokens == num_seqs
        sample_rows = [row for row, item in enumerate(items) if item.sample]
        counts = np.fromiter((len(item.block_ids) for item in items), np.int64, num_seqs)
        width = int(counts.max())

        # One host buffer, one copy: int64 segments then int32 ones, each starting on 16 bytes
        # (Triton specialises kernels on pointer alignment: a view whose alignment changed with
        # the batch would compile a new variant mid-run).
        s64, size64 = _segments([num_tokens] * 3 + [len(sample_rows), num_tokens], 2)
        s32, size32 = _segments([num_seqs, num_seqs + 1, num_seqs * width], 4)
        size64 += size64 % 2  # the int32 part starts on 16 bytes too
        host, upload = self._staging(size64 + -(-size32 // 2))
        host32 = host[size64:].view(np.int32)
        input_ids, positions, slot_mapping, logits_indices, sources = (host[s] for s in s64)
        context_lens, cu_query_lens = host32[s32[0]], host32[s32[1]]
        block_tables = host32[s32[2]].reshape(num_seqs, width)

        starts = np.fromiter((item.start_position for item in items), np.int64, num_seqs)
        if is_decode:
            input_ids[:] = [item.token_ids[0] for item in items]
            positions[:] = starts
            cu_query_lens[:] = np.arange(num_seqs + 1)
            rows = np.arange(num_seqs)
        else:
            input_ids[:] = list(itertools.chain.from_iterable(item.token_ids for item in items))
            cu_query_lens[0] = 0
            np.cumsum(lens, out=cu_query_lens[1:])
            rows = np.repeat(np.arange(num_seqs), lens)
            positions[:] = np.arange(num_tokens) + (starts - cu_query_lens[:-1])[rows]
        context_lens[:] = starts + lens
        flat_blocks = np.fromiter(
            itertools.chain.from_iterable(item.block_ids for item in items),
            np.int32,
            int(counts.sum()),
        )
        block_tables[:] = 0
        block_tables[np.arange(width) < counts[:, None]] = flat_blocks  # row-major = chain order
        slot_mapping[:] = block_tables[rows, positions // block_size]
        slot_mapping *= block_size
        slot_mapping += positions % block_size
        logits_indices[:] = cu_query_lens[1:][sample_rows] - 1
        pending = np.flatnonzero(input_ids == PENDING_TOKEN)
        if pending.size:
            last_rows = self._last_sample_rows
            sources[:] = -1
            sources[pending] = [last_rows[items[row].request_id] for row in rows[pending].tolist()]

        dev64 = upload()
        dev32 = dev64[size64:].view(torch.int32)
        attention = AttentionMetadata(
            slot_mapping=dev64[s64[2]],
            block_tables=dev32[s32[2]].view(num_seqs, width),
            context_lens=dev32[s32[0]],
            cu_query_lens=dev32[s32[1]],
            is_decode=is_decode,
        )
        sampling_requests = [items[row] for row in sample_rows]
        return ModelInputs(
            input_ids=dev64[s64[0]],
            positions=dev64[s64[1]],
            attention=attention,
            logits_indices=dev64[s64[3]],
            pending_sources=dev64[s64[4]] if pending.size else None,
            sampling_request_ids=[item.request_id for item in sampling_requests],
            sampling=self._sampling_metadata(sampling_requests),
            num_logprobs=[item.params.logprobs for item in sampling_requests],
        )

    def _staging(self, size: int) -> tuple[np.ndarray, Callable[[], torch.Tensor]]:
        """A fresh int64 host buffer (pinned on a GPU; the caching host allocator reuses it once
        its copy is done) as numpy to fill, and a function that ships it to the device."""
        host = torch.empty(size, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if self.device.type == "cpu":
            return host.numpy(), lambda: host
        return host.numpy(), lambda: host.to(self.device, non_blocking=True)

    # ---- helpers --------------------------------------------------------------------------

    def _tensor(self, data: list[Any], dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.tensor(data, dtype=dtype)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def _sampling_metadata(self, requests: list[ScheduledRequest]) -> SamplingMetadata:
        params = [item.params for item in requests]
        vocab_size = self.config.model.vocab_size
        generators = {}
        for row, item in enumerate(requests):
            if item.params.seed is not None and not item.params.greedy:
                generators[row] = self._generator(item.request_id, item.params.seed)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        all_greedy = all(p.greedy for p in params)
        if all_greedy and not any(p.has_penalties for p in params):
            empty = self._empty_sampling
            return SamplingMetadata(
                temperatures=empty,  # unread when every row is greedy
                top_ks=empty,
                top_ps=empty,
                min_ps=empty,
                all_greedy=True,
                generators={},
                penalties=None,
                max_num_logprobs=max(wanted) if wanted else None,
            )
        return SamplingMetadata(
            temperatures=self._tensor([p.temperature for p in params], torch.float32),
            top_ks=self._tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64
            ),
            top_ps=self._tensor([p.top_p for p in params], torch.float32),
            min_ps=self._tensor([p.min_p for p in params], torch.float32),
            all_greedy=all(p.greedy for p in params),
            generators=generators,
            penalties=self._penalties(requests) if any(p.has_penalties for p in params) else None,
            max_num_logprobs=max(wanted) if wanted else None,
        )

    def _penalties(self, requests: list[ScheduledRequest]) -> Penalties:
        vocab_size = self.config.model.vocab_size
        num_rows = len(requests)
        prompt_mask = torch.zeros(num_rows, vocab_size, dtype=torch.bool)
        output_counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32)
        for row, item in enumerate(requests):
            prompt_mask[row, torch.tensor(item.prompt_token_ids, dtype=torch.int64)] = True
            if item.output_token_ids:
                tokens = torch.tensor(item.output_token_ids, dtype=torch.int64)
                output_counts[row].index_add_(0, tokens, torch.ones_like(tokens, dtype=torch.int32))
        params = [item.params for item in requests]
        return Penalties(
            repetition=self._tensor([p.repetition_penalty for p in params], torch.float32),
            presence=self._tensor([p.presence_penalty for p in params], torch.float32),
            frequency=self._tensor([p.frequency_penalty for p in params], torch.float32),
            prompt_mask=prompt_mask.to(self.device),
            output_counts=output_counts.to(self.device),
        )

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self.generators[request_id] = generator
        return generator

    # ---- KV cache -------------------------------------------------------------------------

    @property
    def _fp8_cache(self) -> bool:
        return self.kv_cache_dtype == FP8_DTYPE

    def _block_bytes(self) -> int:
        """K and V of one block in every layer, with an fp8 cache's scales."""
        model = self.config.model
        row_bytes = model.head_dim * self.kv_cache_dtype.itemsize  # one token's K of one kv head
        if self._fp8_cache:
            row_bytes += SCALE_DTYPE.itemsize
        return 2 * model.num_layers * model.num_kv_heads * row_bytes * self.block_size

    def _num_kv_blocks(self) -> int:
        requested = self.config.cache.num_blocks
        max_model_len = self.config.model.max_model_len
        # Blocks beyond every sequence at full length would only grow the prefix cache, and a
        # tiny model would otherwise get tens of millions of them.
        blocks_per_seq = -(-max_model_len // self.block_size)
        enough = 2 * blocks_per_seq * self.config.scheduler.max_num_seqs
        if requested is not None:
            num_blocks = requested
        elif self.device.type == "cuda":
            num_blocks = min(self._profile_free_blocks(), enough)
        else:
            num_blocks = min(enough // 2, CPU_KV_CACHE_BYTES // self._block_bytes())
        if num_blocks * self.block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks x {self.block_size} tokens = "
                f"{num_blocks * self.block_size} tokens, fewer than max_model_len "
                f"({max_model_len}); raise kv_cache_blocks / gpu_memory_utilization or lower "
                f"max_model_len"
            )
        return num_blocks

    def _profile_free_blocks(self) -> int:
        """Run the largest step once to measure peak activation memory, then give the KV cache
        what gpu_memory_utilization leaves."""
        tokens = self.config.scheduler.max_num_batched_tokens
        seq_len = min(tokens, self.config.model.max_model_len)
        num_seqs = -(-tokens // seq_len)
        scratch_blocks = num_seqs * -(-seq_len // self.block_size)
        self.kv_caches = self._allocate_kv_cache(scratch_blocks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self._dummy_prefill(num_seqs, seq_len, tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        scratch_bytes = scratch_blocks * self._block_bytes()
        self.kv_caches = []
        for layer in self.attention_layers:
            layer.bind(torch.empty(0), torch.empty(0), self.backend)
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - (peak - scratch_bytes)
        return max(int(budget // self._block_bytes()), 0)

    @torch.inference_mode()
    def _dummy_prefill(self, num_seqs: int, seq_len: int, num_tokens: int) -> None:
        blocks_per_seq = -(-seq_len // self.block_size)
        lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
        block_tables = [
            list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)
        ]
        positions = [p for n in lens for p in range(n)]
        slots = [
            block_tables[i][p // self.block_size] * self.block_size + p % self.block_size
            for i, n in enumerate(lens)
            for p in range(n)
        ]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(block_tables, torch.int32),
            context_lens=self._tensor(lens, torch.int32),
            cu_query_lens=self._tensor(cu, torch.int32),
            is_decode=False,
        )
        input_ids = torch.zeros(len(positions), dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, self._tensor(positions, torch.int64), meta)
        logits = self.model.compute_logits(hidden[torch.tensor(cu[1:], device=self.device) - 1])
        self.sampler.forward(
            logits,
            SamplingMetadata(
                temperatures=torch.ones(num_seqs, device=self.device),
                top_ks=torch.full((num_seqs,), 1, device=self.device),
                top_ps=torch.full((num_seqs,), 0.9, device=self.device),
                min_ps=torch.zeros(num_seqs, device=self.device),
                all_greedy=False,
                generators={},
                penalties=None,
                max_num_logprobs=None,
            ),
        )

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        """Each layer's K and V caches [num_blocks, block_size, kv_heads, head_dim] and, for an
        fp8 cache, their scales [num_blocks, kv_heads, block_size], bound to the layer."""
        model = self.config.model
        shape = (num_blocks, self.block_size, model.num_kv_heads, model.head_dim)
        scales_shape = (num_blocks, model.num_kv_heads, self.block_size)
        caches: list[tuple[torch.Tensor, ...]] = []
        for layer in self.attention_layers:
            k_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            v_cache = torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)
            scales: tuple[torch.Tensor, ...] = ()
            if self._fp8_cache:
                k_scales = torch.zeros(scales_shape, dtype=SCALE_DTYPE, device=self.device)
                scales = (k_scales, torch.zeros_like(k_scales))
            layer.bind(k_cache, v_cache, self.backend, *scales)
            caches.append((k_cache, v_cache, *scales))
        return caches


def _segments(sizes: list[int], align: int) -> tuple[list[slice], int]:
    """Segments of the given sizes packed in order, each starting at a multiple of `align`
    elements, and the total size."""
    segments, end = [], 0
    for size in sizes:
        start = -(-end // align) * align
        end = start + size
        segments.append(slice(start, end))
    return segments, end


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a device tensor into fresh pinned host memory."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
