"""The quantized test checkpoints (quant_checkpoints, quant_fixtures): the files have the layout
their formats document, and transformers loads them and computes nearly what the unquantized
model computes."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from quant_checkpoints import (
    SCHEMES,
    autoawq_dequantized_weights,
    dequantized_weights,
    quantization_config,
    reference_model,
)
from safetensors.torch import load_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
# Bound on the relative RMS error of the quantized model's logits against the unquantized
# model's, by weight type (tiny random models, two layers; measured on llama3: int4 g32
# 0.17-0.28, fp8 0.10, int8 0.01-0.017).
LOGITS_ERROR = {("int", 4): 0.4, ("float", 8): 0.2, ("int", 8): 0.04}
PROMPT = [256, *b"The quick brown fox"]


def _tensors(directory: Any) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _original(checkpoints: Any, architecture: str) -> Any:
    from transformers import AutoModelForCausalLM

    path = checkpoints.path(architecture)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _linear_shapes(model: Any) -> dict[str, tuple[int, int]]:
    """{module name: (out, in)} of the decoder layers' linears."""
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in LINEARS
    }


def _unpack(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """compressed-tensors' pack-quantized: 32 // bits values per int32 along `dim`, lowest bits
    first, each stored as value + 2 ** (bits - 1)."""
    per_word = 32 // bits
    fields = [(packed >> (bits * i)) & (2**bits - 1) for i in range(per_word)]
    values = torch.stack(fields, dim=dim + 1).flatten(dim, dim + 1)
    return values - 2 ** (bits - 1)


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compressed_tensors_layout(quantized_checkpoints: Any, checkpoints: Any, scheme: str):
    spec = SCHEMES[scheme]
    directory = quantized_checkpoints.path("llama3", scheme)
    config = quantization_config(directory)
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == ("float-quantized" if spec.type == "float" else "pack-quantized")
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["type"], weights["strategy"]) == (
        spec.num_bits,
        spec.type,
        spec.strategy,
    )
    assert weights["symmetric"] == spec.symmetric
    assert config["ignore"] == ["lm_head"]

    tensors = _tensors(directory)
    source = _tensors(checkpoints.path("llama3"))
    shapes = _linear_shapes(quantized_checkpoints.reference("llama3", scheme))
    assert len(shapes) == 2 * len(LINEARS)
    decompressed = dequantized_weights(directory)
    assert sorted(decompressed) == sorted(shapes)
    for name, (out_features, in_features) in shapes.items():
        scale = tensors[f"{name}.weight_scale"]
        num_groups = in_features // GROUP if spec.strategy == "group" else 1
        assert scale.shape == (out_features, num_groups), name
        if spec.type == "float":
            weight = tensors[f"{name}.weight"]
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == (
                out_features,
                in_features,
            )
            dequantized = weight.float() * scale
        else:
            assert f"{name}.weight" not in tensors
            packed = tensors[f"{name}.weight_packed"]
            per_word = 32 // spec.num_bits
            assert packed.dtype == torch.int32
            assert packed.shape == (out_features, in_features // per_word), name
            assert tensors[f"{name}.weight_shape"].tolist() == [out_features, in_features]
            values = _unpack(packed, spec.num_bits, dim=1).float()  # [out, in]
            if spec.symmetric:
                assert f"{name}.weight_zero_point" not in tensors
            else:
                zero_point = tensors[f"{name}.weight_zero_point"]
                assert zero_point.dtype == torch.int32
                assert zero_point.shape == (-(-out_features // per_word), num_groups), name
                zeros = _unpack(zero_point, spec.num_bits, dim=0)[:out_features]
                values = values - zeros.repeat_interleave(in_features // num_groups, 1)
            dequantized = values * scale.repeat_interleave(in_features // num_groups, 1)
        # The documented formula is what compressed-tensors itself decompresses.
        torch.testing.assert_close(dequantized, decompressed[name], rtol=0, atol=0)
    # Embeddings and lm_head are kept as they were.
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(tensors[name], source[name], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("architecture", "scheme"),
    [("llama3", scheme) for scheme in sorted(SCHEMES)]
    + [("qwen2", "gptq-w4a16"), ("qwen2", "fp8-dynamic"), ("qwen3", "awq-w4a16")],
)
@torch.no_grad()
def test_transformers_loads_and_generates(
    quantized_checkpoints: Any, checkpoints: Any, architecture: str, scheme: str
):
    original = _original(checkpoints, architecture)
    model = quantized_checkpoints.reference(architecture, scheme)
    input_ids = torch.tensor([PROMPT])
    error = _relative_error(model(input_ids).logits, original(input_ids).logits)
    spec = SCHEMES[scheme]
    assert 0 < error < LOGITS_ERROR[spec.type, spec.num_bits], error
    generated = model.generate(input_ids, max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert generated.shape == (1, len(PROMPT) + 8)
    # Biases (qwen2's q/k/v) stay unquantized and equal to the source's.
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            torch.testing.assert_close(param, dict(original.named_parameters())[name])


@torch.no_grad()
def test_fp8_dynamic_reference_with_and_without_activation_rounding(quantized_checkpoints: Any):
    directory = quantized_checkpoints.path("llama3", "fp8-dynamic")
    weight_only = reference_model(directory, quantize_activations=False)
    rounded = quantized_checkpoints.reference("llama3", "fp8-dynamic")
    input_ids = torch.tensor([PROMPT])
    error = _relative_error(rounded(input_ids).logits, weight_only(input_ids).logits)
    assert 0 < error < 0.15, error  # fp8 e4m3 keeps 3 mantissa bits (measured 0.07)


@pytest.mark.slow
@torch.no_grad()
def test_autoawq_gemm_layout_and_reference(quantized_checkpoints: Any, checkpoints: Any):
    directory = quantized_checkpoints.path("llama3", "autoawq-gemm")
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    assert config == {
        **config,
        "quant_method": "awq",
        "version": "gemm",
        "bits": 4,
        "group_size": GROUP,
        "zero_point": True,
    }
    tensors = _tensors(directory)
    model = quantized_checkpoints.reference("llama3", "autoawq-gemm")
    shapes = _linear_shapes(model)
    dequantized = autoawq_dequantized_weights(directory)
    assert sorted(dequantized) == sorted(shapes)
    for name, (out_features, in_features) in shapes.items():
        assert tensors[f"{name}.qweight"].shape == (in_features, out_features // 8)
        assert tensors[f"{name}.qweight"].dtype == torch.int32
        assert tensors[f"{name}.qzeros"].shape == (in_features // GROUP, out_features // 8)
        assert tensors[f"{name}.scales"].shape == (in_features // GROUP, out_features)
        assert tensors[f"{name}.scales"].dtype == torch.float16
        assert dequantized[name].shape == (out_features, in_features)
        torch.testing.assert_close(
            dict(model.named_parameters())[f"{name}.weight"], dequantized[name]
        )
    input_ids = torch.tensor([PROMPT])
    original = _original(checkpoints, "llama3")
    error = _relative_error(model(input_ids).logits, original(input_ids).logits)
    assert 0 < error < LOGITS_ERROR["int", 4], error
