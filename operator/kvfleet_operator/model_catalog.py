"""Architecture numbers of a model, for memory planning without downloading configs, and where
they came from: `spec.model.hints` when given, else the built-in catalog, else (for an hf://
GGUF file) the file's header, which the reconciler reads through `header_cache`.

The catalog is looked up by the last path component of spec.model.uri, case-insensitively (so
hf://meta-llama/Llama-3.1-8B-Instruct and pvc://models/llama-3.1-8b-instruct both match).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import ValidationError

from kvfleet_operator.gguf_header import GGUFSummary, GGUFTensor, GGUFUnavailable
from kvfleet_operator.models import MemorySource, ModelHints, ModelSpec


@dataclass(frozen=True)
class ModelArchitecture:
    """The numbers the plan uses for one model."""

    numbers: ModelHints  # parameters, layers, heads, head dim, context
    source: MemorySource  # reported as status.memoryPlan.source
    weight_bytes: int | None = None  # the file's own bytes of weights (GGUF header), else None
    gguf_tensors: tuple[GGUFTensor, ...] = ()  # the GGUF header's tensors, else empty


@dataclass(frozen=True)
class UnknownModel:
    """No numbers for the model: memory is not planned."""

    reason: str  # why, and what to set; shown in the Planned condition


def _hints(
    params: int, layers: int, heads: int, kv_heads: int, head_dim: int, ctx: int, hidden: int,
    ffn: int,
) -> ModelHints:  # fmt: skip
    return ModelHints(
        num_parameters=params,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=ctx,
        hidden_size=hidden,
        intermediate_size=ffn,
    )


# params, layers, heads, KV heads, head dim, context, hidden, intermediate (each config.json).
_LLAMA_3_1_8B = _hints(8_030_261_248, 32, 32, 8, 128, 131072, 4096, 14336)
_LLAMA_3_1_70B = _hints(70_553_706_496, 80, 64, 8, 128, 131072, 8192, 28672)
_LLAMA_3_1_405B = _hints(405_853_388_800, 126, 128, 8, 128, 131072, 16384, 53248)
_LLAMA_3_2_1B = _hints(1_235_814_400, 16, 32, 8, 64, 131072, 2048, 8192)
_LLAMA_3_2_3B = _hints(3_212_749_824, 28, 24, 8, 128, 131072, 3072, 8192)
_QWEN2_5_0_5B = _hints(494_032_768, 24, 14, 2, 64, 32768, 896, 4864)
_QWEN2_5_7B = _hints(7_615_616_512, 28, 28, 4, 128, 32768, 3584, 18944)
_QWEN2_5_72B = _hints(72_706_203_648, 80, 64, 8, 128, 32768, 8192, 29568)
_QWEN3_8B = _hints(8_190_735_360, 36, 32, 8, 128, 40960, 4096, 12288)
_MISTRAL_7B = _hints(7_248_023_552, 32, 32, 8, 128, 32768, 4096, 14336)

MODEL_CATALOG: dict[str, ModelHints] = {
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-8b-instruct": _LLAMA_3_1_8B,
    "llama-3.1-70b": _LLAMA_3_1_70B,
    "llama-3.1-70b-instruct": _LLAMA_3_1_70B,
    "llama-3.3-70b-instruct": _LLAMA_3_1_70B,
    "llama-3.1-405b": _LLAMA_3_1_405B,
    "llama-3.1-405b-instruct": _LLAMA_3_1_405B,
    "llama-3.2-1b": _LLAMA_3_2_1B,
    "llama-3.2-1b-instruct": _LLAMA_3_2_1B,
    "llama-3.2-3b": _LLAMA_3_2_3B,
    "llama-3.2-3b-instruct": _LLAMA_3_2_3B,
    "qwen2.5-0.5b": _QWEN2_5_0_5B,
    "qwen2.5-0.5b-instruct": _QWEN2_5_0_5B,
    "qwen2.5-7b": _QWEN2_5_7B,
    "qwen2.5-7b-instruct": _QWEN2_5_7B,
    "qwen2.5-72b": _QWEN2_5_72B,
    "qwen2.5-72b-instruct": _QWEN2_5_72B,
    "qwen3-8b": _QWEN3_8B,
    "mistral-7b-instruct-v0.3": _MISTRAL_7B,
    "mistral-7b-v0.3": _MISTRAL_7B,
}


def _catalog_entry(model: ModelSpec) -> ModelHints | None:
    name = model.uri.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1].lower()
    return MODEL_CATALOG.get(name)


def reads_gguf_header(model: ModelSpec) -> bool:
    """Whether the numbers must come from the file's GGUF header: an hf:// .gguf file, without
    hints and not in the catalog."""
    return (
        model.is_gguf
        and model.uri.startswith("hf://")
        and model.hints is None
        and _catalog_entry(model) is None
    )


def model_architecture(
    model: ModelSpec, gguf: GGUFSummary | GGUFUnavailable | None = None
) -> ModelArchitecture | UnknownModel:
    """spec.model.hints when given, else the catalog entry for the URI's last path component,
    else the numbers in `gguf` (the header of an hf:// GGUF file, or why it could not be read)."""
    if model.hints is not None:
        return ModelArchitecture(model.hints, "hints")
    entry = _catalog_entry(model)
    if entry is not None:
        return ModelArchitecture(entry, "catalog")
    if isinstance(gguf, GGUFSummary):
        return _from_gguf(model, gguf)
    if isinstance(gguf, GGUFUnavailable):
        return UnknownModel(
            f"the GGUF header of {model.uri} could not be read: {gguf.reason}; set model.hints"
        )
    if model.is_gguf:
        scheme = model.uri.split("://", 1)[0]
        if scheme != "hf":
            return UnknownModel(
                f"the operator reads GGUF headers of hf:// files only, not {scheme}://: "
                "set model.hints"
            )
        return UnknownModel(f"the GGUF header of {model.uri} was not read: set model.hints")
    return UnknownModel("model not in the catalog: set model.hints")


def _from_gguf(model: ModelSpec, gguf: GGUFSummary) -> ModelArchitecture | UnknownModel:
    if gguf.split_count > 1:
        return UnknownModel(
            f"{model.uri} is one of {gguf.split_count} split GGUF files and its header "
            "describes only its own tensors: set model.hints"
        )
    arch = gguf.architecture
    required = {
        f"{arch}.block_count": gguf.block_count,
        f"{arch}.attention.head_count": gguf.head_count,
        f"{arch}.attention.head_count_kv": gguf.head_count_kv,
        f"{arch}.attention.key_length or {arch}.embedding_length": gguf.head_dim,
    }
    missing = [key for key, value in required.items() if not value]  # absent, or 0
    if gguf.num_parameters == 0:
        missing.append("tensors")
    if missing:
        return UnknownModel(
            f"the GGUF header of {model.uri} has no {', '.join(missing)}: set model.hints"
        )
    assert gguf.block_count and gguf.head_count and gguf.head_count_kv and gguf.head_dim
    try:  # a header anyone can publish: numbers no model has are the header's fault
        numbers = ModelHints(
            num_parameters=gguf.num_parameters,
            num_layers=gguf.block_count,
            num_attention_heads=gguf.head_count,
            num_key_value_heads=gguf.head_count_kv,
            head_dim=gguf.head_dim,
            max_position_embeddings=gguf.context_length or None,
        )
    except ValidationError as exc:
        problems = "; ".join(error["msg"].removeprefix("Value error, ") for error in exc.errors())
        return UnknownModel(
            f"the GGUF header of {model.uri} is not usable ({problems}): set model.hints"
        )
    return ModelArchitecture(
        numbers, "ggufHeader", weight_bytes=gguf.weight_bytes, gguf_tensors=gguf.tensors
    )
