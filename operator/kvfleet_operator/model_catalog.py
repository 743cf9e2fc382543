"""Architecture numbers of well-known models, for memory planning without downloading configs.

Looked up by the last path component of spec.model.uri, case-insensitively (so
hf://meta-llama/Llama-3.1-8B-Instruct and pvc://models/llama-3.1-8b-instruct both match).
`spec.model.hints` covers every other model.
"""

from __future__ import annotations

from kvfleet_operator.models import ModelHints, ModelSpec


def _m(params: int, layers: int, heads: int, kv_heads: int, head_dim: int, ctx: int) -> ModelHints:
    return ModelHints(
        num_parameters=params,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=ctx,
    )


_LLAMA_3_1_8B = _m(8_030_261_248, 32, 32, 8, 128, 131072)
_LLAMA_3_1_70B = _m(70_553_706_496, 80, 64, 8, 128, 131072)
_LLAMA_3_1_405B = _m(405_853_388_800, 126, 128, 8, 128, 131072)
_LLAMA_3_2_1B = _m(1_235_814_400, 16, 32, 8, 64, 131072)
_LLAMA_3_2_3B = _m(3_212_749_824, 28, 24, 8, 128, 131072)
_QWEN2_5_0_5B = _m(494_032_768, 24, 14, 2, 64, 32768)
_QWEN2_5_7B = _m(7_615_616_512, 28, 28, 4, 128, 32768)
_QWEN2_5_72B = _m(72_706_203_648, 80, 64, 8, 128, 32768)
_QWEN3_8B = _m(8_190_735_360, 36, 32, 8, 128, 40960)
_MISTRAL_7B = _m(7_248_023_552, 32, 32, 8, 128, 32768)

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


def model_architecture(model: ModelSpec) -> ModelHints | None:
    """spec.model.hints when given, else the catalog entry for the URI's last path component."""
    if model.hints is not None:
        return model.hints
    name = model.uri.split("://", 1)[1].rstrip("/").rsplit("/", 1)[-1].lower()
    return MODEL_CATALOG.get(name)
