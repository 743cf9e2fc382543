"""Build a model on the meta device, materialise it on the target device, load its weights from
the checkpoint (safetensors directory or GGUF file)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from kvfleet_engine.config import ModelConfig
from kvfleet_engine.layers.attention import AttentionMetadata
from kvfleet_engine.models.registry import model_class
from kvfleet_engine.parallel.groups import Groups
from kvfleet_engine.parallel.pipeline import (
    MissingLayer,
    apply_pipeline_stage,
    is_missing,
    missing_prefixes,
)
from kvfleet_engine.parallel.tensor import apply_tensor_parallel
from kvfleet_engine.quant.linear import QuantLinear
from kvfleet_engine.quant.swap import check_device, checkpoint_names, quantize_linears

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CausalLM(Protocol):
    """What the runner needs from a model module."""

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor: ...  # [num_tokens, hidden]

    def forward_stage(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: torch.Tensor | None,
    ) -> torch.Tensor: ...  # [2, num_tokens, hidden], or on the last stage [num_tokens, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [rows, vocab]

    @property
    def model(self) -> Any: ...  # the decoder stack (its `stage`: pipeline parallelism)

    def modules(self) -> Iterator[nn.Module]: ...


def serving_dtype(config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in. `auto` is left open only for GGUF files, whose
    tensors are quantized: float32 on the CPU, bfloat16 on a GPU."""
    if config.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return DTYPES[config.dtype]


def load_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, groups: Groups | None = None
) -> CausalLM:
    """Build on meta -> swap quantized linears -> split for this rank (tensor parallelism) ->
    keep this rank's pipeline stage -> materialise -> load (each split layer cuts the
    checkpoint's tensors to its part) -> convert the loaded checkpoint layouts to the kernels'
    (finish_loading)."""
    quant = config.quantization
    if quant is not None and quant.cuda_only and device.type != "cuda":
        quant = None  # a GGUF file on the CPU: dequantized at load (faster there, and exact)
    if quant is not None:
        check_device(quant, device)
    cls = model_class(config.architecture)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    kept: frozenset[str] = frozenset()  # checkpoint linears loaded in their quantized layout
    try:
        with torch.device("meta"):
            model = cls(config.hf_config, config.architecture)
            if quant is not None:
                replaced = quantize_linears(model, quant, dtype)
                kept = frozenset(_checkpoint_linears(model, replaced))
                log.info("%s: %d linear layers quantized", quant.method, len(replaced))
            if groups is not None:
                apply_tensor_parallel(model, groups)
                apply_pipeline_stage(model, groups.place)
    finally:
        torch.set_default_dtype(default_dtype)
    model = model.to_empty(device=device)
    if getattr(model, "tie_word_embeddings", False) and not isinstance(model.lm_head, MissingLayer):
        model.lm_head.weight = model.model.embed_tokens.weight  # to_empty unties parameters
    for module in model.modules():
        for hook in ("reset_buffers", "attach_weight_loaders"):  # what to_empty dropped
            method = getattr(module, hook, None)
            if method is not None:
                method()
    load_weights(model, checkpoint_tensors(config, device, kept), config.path)
    for module in model.modules():
        finish = getattr(module, "finish_loading", None)
        if finish is not None:
            finish()
    model.eval()
    return model


def checkpoint_tensors(
    config: ModelConfig, device: torch.device, kept: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (Hugging Face name, tensor) pairs, whatever its format; a GGUF file's
    linears named in `kept` come as their repacked blocks (loaders/gguf_tensors.py)."""
    if config.format == "gguf":
        from kvfleet_engine.loaders.gguf_tensors import gguf_tensors

        for name, array in gguf_tensors(config.path, kept):
            yield name, torch.from_numpy(array)
    else:
        from kvfleet_engine.loaders.safetensors import safetensors_tensors

        yield from safetensors_tensors(Path(config.path), device)


def _checkpoint_linears(model: nn.Module, replaced: list[str]) -> Iterator[str]:
    """The checkpoint module names (q_proj, up_proj, ...) behind the replaced model modules."""
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    for name in replaced:
        module = model.get_submodule(name)
        assert isinstance(module, QuantLinear)
        yield from checkpoint_names(name, module, packed).values()


@torch.no_grad()
def load_weights(
    model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str
) -> None:
    """Hand each checkpoint tensor to its parameter's own `weight_loader(param, tensor, shard)`
    (fused q/k/v and gate/up shards, packed quantized tensors: the layer knows its layout);
    every parameter must be filled, each shard of a fused one by its own tensor. Tensors of
    the modules another pipeline stage owns are skipped."""
    params = dict(model.named_parameters())
    elsewhere = missing_prefixes(model)
    packed: dict[str, tuple[str, str]] = getattr(model, "packed_modules", {})
    modules = dict(model.named_modules())
    unloaded = {  # (parameter, shard)
        (name, shard)
        for name, param in params.items()
        if not getattr(param, "optional", False)
        for shard in _shards(modules[name.rsplit(".", 1)[0]])
    }
    for name, tensor in tensors:
        target, shard = name, None
        for part, (fused, shard_name) in packed.items():
            if f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{fused}."), shard_name
                break
        param = params.get(target)
        if param is None:
            if is_missing(target, elsewhere):
                continue
            if name == "lm_head.weight" and "lm_head.weight" not in params:
                continue
            raise ValueError(
                f"model: {source}: checkpoint tensor {name!r} has no place in the model"
            )
        try:
            getattr(param, "weight_loader", _copy_whole)(param, tensor, shard)
        except ValueError as error:
            raise ValueError(f"model: {source}: checkpoint tensor {name!r}: {error}") from error
        unloaded.discard((target, shard))
    if getattr(model, "tie_word_embeddings", False):
        unloaded.discard(("lm_head.weight", None))
    if unloaded:
        missing = sorted(name if shard is None else f"{name} ({shard})" for name, shard in unloaded)
        raise ValueError(f"model: {source}: the checkpoint lacks weights for: {missing[:5]}")


def _copy_whole(param: torch.Tensor, loaded: torch.Tensor, shard: str | None) -> None:
    """The loader of a parameter that has none of its own (norms, embeddings)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} != {tuple(param.shape)}")
    param.copy_(loaded)


def _shards(module: nn.Module) -> list[str | None]:
    """The checkpoint tensors that fill one parameter: one per shard of a fused linear."""
    shard_offsets = getattr(module, "shard_offsets", None)
    return list(shard_offsets()) if shard_offsets is not None and shard_offsets() else [None]
