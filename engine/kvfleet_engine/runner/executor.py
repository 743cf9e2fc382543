"""One rank's model: its weights (its part of them under tensor parallelism, its stage's layers
under pipeline parallelism), its KV cache (its own layers only), its CUDA graphs (decode steps,
short prompt steps; under pipeline parallelism its stage's part of them) and the forward pass
to logits. Every rank has one; the driver samples, or under pipeline parallelism the last
stage's first rank."""

from __future__ import annotations

import logging

import torch

from kvfleet_engine.config import EngineConfig
from kvfleet_engine.config.runner import check_backend_device
from kvfleet_engine.cuda_graphs import (
    DecodeGraphs,
    GraphStage,
    PromptGraphs,
    prompt_bucket_sizes,
)
from kvfleet_engine.layers.attention import Attention, AttentionMetadata, load_backend
from kvfleet_engine.layers.attention_torch import FP8_DTYPE, KV_CODES
from kvfleet_engine.layers.sampler import Sampler, SamplingMetadata
from kvfleet_engine.models.loader import load_model, serving_dtype
from kvfleet_engine.parallel.groups import Groups
from kvfleet_engine.parallel.pipeline import StageLayers, intermediate_shape
from kvfleet_engine.quant.linear import QuantLinear
from kvfleet_engine.runner import kv_calibration, kv_memory
from kvfleet_engine.runner.inputs import (
    SHARED_PREFIX_MIN_TOKENS,
    AttentionFeatures,
    ModelInputs,
)
from kvfleet_engine.runner.kv_memory import (
    allocate_kv_cache,
    block_bytes,
    check_holds_a_sequence,
    unbind_kv_cache,
)

log = logging.getLogger(__name__)

# Triton has an e4m3 type (float8e4nv) from this compute capability on (Ada, Hopper).
FP8_TRITON_MIN_CAPABILITY = (8, 9)


def resolve_kv_cache_dtype(
    setting: str, model_dtype: torch.dtype, device: torch.device, backend_name: str
) -> torch.dtype:
    """The cache's element type: the model's (auto), e4m3 (fp8) or int8. The torch and sdpa
    backends read an fp8 cache on any device; the Triton kernels need an e4m3 type the GPU has.
    int8 runs everywhere."""
    if setting == "auto":
        return model_dtype
    codes = KV_CODES[setting]
    if codes == FP8_DTYPE and device.type == "cuda" and backend_name == "triton":
        capability = torch.cuda.get_device_capability(device)
        if capability < FP8_TRITON_MIN_CAPABILITY:
            need = ".".join(map(str, FP8_TRITON_MIN_CAPABILITY))
            raise ValueError(
                f"kv_cache_dtype=fp8 needs compute capability >= {need} for the triton attention "
                f"backend; {device} ({torch.cuda.get_device_name(device)}) has "
                f"{capability[0]}.{capability[1]}: use kv_cache_dtype=int8 or auto"
            )
    return codes


def resolve_device(name: str, local_rank: int = 0, ranks_per_node: int = 1) -> torch.device:
    """The device setting; with several ranks on a host, GPU `local_rank` of the visible ones."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and ranks_per_node > 1:
        visible = torch.cuda.device_count()
        if ranks_per_node > visible:
            raise ValueError(
                f"{ranks_per_node} ranks on this host (tensor_parallel_size x "
                f"pipeline_parallel_size / nnodes) need {ranks_per_node} GPUs; {visible} visible"
            )
        device = torch.device("cuda", local_rank)
    return device


class ModelExecutor:
    def __init__(self, config: EngineConfig, groups: Groups | None = None) -> None:
        self.config = config
        self.groups = groups
        parallel = config.parallel
        local_rank = groups.place.local_rank if groups is not None else 0
        self.device = (
            groups.device
            if groups is not None
            else resolve_device(config.runner.device, local_rank, parallel.ranks_per_node)
        )
        self.dtype = serving_dtype(config.model, self.device)
        self.block_size = config.cache.block_size
        backend_name = config.runner.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "sdpa"
        check_backend_device(backend_name, self.device.type)  # device "auto" resolved here
        self.backend_name = backend_name
        self.backend = load_backend(backend_name)
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            config.cache.kv_cache_dtype, self.dtype, self.device, backend_name
        )
        # What each step may ask of the attention kernels (`runner.inputs`): a shared prefix read
        # once per tile of sequences (the setting, with prefix caching and a backend that has
        # the kernel), a mixed step's decodes apart from its prompts (the backend).
        shares = (
            config.runner.shared_prefix_attention
            and config.cache.enable_prefix_caching
            and getattr(self.backend, "SHARED_PREFIX", False)
        )
        self.attention_features = AttentionFeatures(
            shared_prefix_min=SHARED_PREFIX_MIN_TOKENS if shares else 0,
            decodes_apart=getattr(self.backend, "DECODES_APART", False),
        )
        torch.manual_seed(config.runner.seed)
        self.model = load_model(config.model, self.device, self.dtype, groups)
        if self.device.type == "cuda":  # PDL pays where the products are our kernels, not cuBLAS's
            from kvfleet_engine.kernels import pdl

            pdl.set_default(any(isinstance(m, QuantLinear) for m in self.model.modules()))
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        # This rank's pipeline stage (None: one stage, the whole model).
        self.stage: StageLayers | None = self.model.model.stage
        self.hidden_size = int(config.model.hf_config["hidden_size"])
        self.sampler = Sampler()
        self.num_blocks = 0
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.prompt_graphs: PromptGraphs | None = None
        # The last launched step's samples on the device ([rows] int64) and each request's
        # row there: where the next step's PENDING_TOKEN inputs come from.
        self.last_samples = torch.empty(0, dtype=torch.int64, device=self.device)
        self.last_sample_rows: dict[str, int] = {}

    # ---- start-up -----------------------------------------------------------------------------

    def measure_num_blocks(self) -> int:
        """KV blocks this rank's memory holds (kv_cache_blocks if set); on a GPU it runs the
        largest step once (every rank at once: the step has collectives)."""
        return self._local_num_blocks()

    def allocate(self, num_blocks: int) -> None:
        """Allocate `num_blocks` KV blocks (the smallest any rank measured) and capture the
        decode graphs (every rank in lockstep)."""
        check_holds_a_sequence(num_blocks, self.block_size, self.config.model.max_model_len)
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate(num_blocks)
        if self.config.cache.kv_cache_calibration is not None:
            place = self.groups.place if self.groups is not None else None
            kv_calibration.bind_moments(
                self.attention_layers,
                self.config.cache.kv_cache_calibration,
                self.device,
                self.config.model.num_layers,
                first_layer=self.stage.start if self.stage is not None else 0,
                tp=(place.tp_rank, place.tp_size) if place is not None else (0, 1),
            )
        if self.captures_graphs:
            self.decode_graphs, self.prompt_graphs = self.make_graphs()
            self.decode_graphs.capture()
            self.prompt_graphs.capture()

    def make_graphs(self) -> tuple[DecodeGraphs, PromptGraphs]:
        """This rank's decode and prompt graphs, not captured yet (under pipeline parallelism
        its stage's part of each step)."""
        max_blocks = -(-self.config.model.max_model_len // self.block_size)
        scheduler = self.config.scheduler
        stage = None
        if self.stage is not None:
            stage = GraphStage(self.stage, self.hidden_size, self.dtype)
        decode = DecodeGraphs(
            self.model,
            scheduler.max_num_seqs,
            max_blocks,
            self.device,
            shared_prefix=self.attention_features.shared_prefix_min > 0,
            stage=stage,
        )
        prompt = PromptGraphs(
            self.model,
            scheduler.max_num_batched_tokens,
            scheduler.max_num_seqs,
            max_blocks,
            self.device,
            self.attention_features,
            stage=stage,
        )
        return decode, prompt

    @property
    def captures_graphs(self) -> bool:
        return self.device.type == "cuda" and not self.config.runner.enforce_eager

    @property
    def block_bytes(self) -> int:
        return block_bytes(self.attention_layers, self.block_size, self.kv_cache_dtype)

    def _allocate(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        return allocate_kv_cache(
            self.attention_layers,
            num_blocks,
            self.block_size,
            self.kv_cache_dtype,
            self.backend,
            self.device,
        )

    def _local_num_blocks(self) -> int:
        requested = self.config.cache.num_blocks
        # Blocks beyond every sequence at full length would only grow the prefix cache, and a
        # tiny model would otherwise get tens of millions of them.
        blocks_per_seq = -(-self.config.model.max_model_len // self.block_size)
        enough = 2 * blocks_per_seq * self.config.scheduler.max_num_seqs
        if requested is not None:
            kv_memory.check_fits(requested, self.block_bytes, self.device)
            return requested
        if self.device.type == "cuda":
            return min(self._profile_free_blocks(), enough)
        return min(enough // 2, kv_memory.CPU_KV_CACHE_BYTES // self.block_bytes)

    def _profile_free_blocks(self) -> int:
        """Run the largest step once to measure peak activation memory, then give the KV cache
        what gpu_memory_utilization leaves."""
        tokens = self.config.scheduler.max_num_batched_tokens
        seq_len = min(tokens, self.config.model.max_model_len)
        num_seqs = -(-tokens // seq_len)
        scratch_blocks = num_seqs * -(-seq_len // self.block_size)
        self.kv_caches = self._allocate(scratch_blocks)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._dummy_prefill(num_seqs, seq_len, tokens)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        scratch_bytes = scratch_blocks * self.block_bytes
        # The prompt graphs keep the activations of their largest step for good (one pool):
        # the profiled step's, scaled to its token count (activations grow with the tokens).
        graph_bytes = 0
        if self.captures_graphs:
            graph_tokens = prompt_bucket_sizes(tokens)[-1]
            graph_bytes = (peak - before) * graph_tokens // tokens
            log.info("keeping %.0f MiB for the prompt graphs' activations", graph_bytes / 2**20)
        self.kv_caches = []
        unbind_kv_cache(self.attention_layers, self.backend)
        torch.cuda.empty_cache()
        _, total = torch.cuda.mem_get_info(self.device)
        used = peak - scratch_bytes + graph_bytes
        budget = total * self.config.cache.gpu_memory_utilization - used
        return max(int(budget // self.block_bytes), 0)

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
        positions_tensor = self._tensor(positions, torch.int64)
        if self.stage is None:
            hidden = self.model(input_ids, positions_tensor, meta)
        else:  # this stage alone, on zeros for the previous stage's output
            shape = intermediate_shape(len(positions), self.hidden_size)
            previous = torch.zeros(shape, dtype=self.dtype, device=self.device)
            hidden = self.model.forward_stage(input_ids, positions_tensor, meta, previous)
            if not self.stage.is_last:
                return
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

    def _tensor(self, data: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype).to(self.device)

    # ---- the forward pass ---------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[num_sampling_rows, vocab] logits in the model's dtype (the sampler casts what it
        samples), and each row's argmax when a decode graph computed it (None: the sampler
        takes it)."""
        if self.decode_graphs is not None and inputs.attention.is_decode:
            graph_out = self.decode_graphs.run(
                inputs.input_ids,
                inputs.positions,
                inputs.attention,
                inputs.pending_sources,
                self.last_samples,
            )
            if graph_out is not None:
                logits, argmax_ids = graph_out
                if len(inputs.sampling_request_ids) == logits.shape[0]:
                    return logits, argmax_ids  # every row samples (the usual decode step), in order
                return logits[inputs.logits_indices], argmax_ids[inputs.logits_indices]
        if self.prompt_graphs is not None and not inputs.attention.is_decode:
            hidden = self.prompt_graphs.run(
                inputs.input_ids,
                inputs.positions,
                inputs.attention,
                inputs.pending_sources,
                self.last_samples,
            )
            if hidden is not None:
                return self.model.compute_logits(hidden[inputs.logits_indices]), None
        input_ids = inputs.input_ids
        if inputs.pending_sources is not None:  # the previous step's samples, on the device
            sources = inputs.pending_sources
            sampled = self.last_samples.index_select(0, sources.clamp(min=0))
            input_ids = torch.where(sources >= 0, sampled, input_ids)
        hidden = self.model(input_ids, inputs.positions, inputs.attention)
        return self.model.compute_logits(hidden[inputs.logits_indices]), None

    @torch.inference_mode()
    def forward_stage(self, inputs: ModelInputs, previous: torch.Tensor | None) -> torch.Tensor:
        """This pipeline stage's part of the step, from the previous stage's output [2,
        num_tokens, hidden] (None on the first stage, which embeds the input ids): the output
        for the next stage (the caller's to keep: an asynchronous send may read it while the
        next step runs), or on the last stage the [num_sampling_rows, vocab] logits in the
        model's dtype. Through this stage's graphs where one fits the step."""
        stage = self.stage
        assert stage is not None
        meta, rows = inputs.attention, inputs.input_ids.shape[0]
        graphs = self.decode_graphs if meta.is_decode else self.prompt_graphs
        key = None
        if graphs is not None:
            key = graphs.load(inputs.input_ids, inputs.positions, meta, previous=previous)
        if key is None:
            out = self.model.forward_stage(inputs.input_ids, inputs.positions, meta, previous)
            if not stage.is_last:
                return out
        else:
            assert graphs is not None
            graphed = graphs.replay(key)
            if not stage.is_last:
                return graphed[:, :rows].clone()  # graph memory: the next replay overwrites it
            if meta.is_decode:  # the decode graph's logits, every row's
                return graphed[0][inputs.logits_indices]
            out = graphed[:rows]
        return self.model.compute_logits(out[inputs.logits_indices])

    def keep_samples(self, token_ids: torch.Tensor, request_ids: list[str]) -> None:
        """This step's samples [rows] on the device: the next step's pending inputs."""
        self.last_samples = token_ids
        self.last_sample_rows = {request_id: row for row, request_id in enumerate(request_ids)}
