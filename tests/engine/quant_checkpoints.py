"""Quantized copies of a Hugging Face checkpoint, written by the ecosystem's own tools, and the
references the engine's quantized forward is compared with.

    write_quantized(source, destination, "gptq-w4a16")  # llmcompressor oneshot on the CPU
    reference_model(destination)       # transformers + compressed-tensors, weights decompressed
    dequantized_weights(destination)   # {module name: float32 [out, in]} as the reference sees it
    write_autoawq(source, destination)  # AutoAWQ's own GEMM layout (slow: ~1 min on the CPU)

llmcompressor writes the compressed-tensors layout (`quantization_config.format` in config.json):
"pack-quantized" for int4/int8 weights (`weight_packed` int32 [out, in // (32 // bits)],
`weight_scale` [out, in // group], `weight_zero_point` int32 [out // (32 // bits), in // group]
when asymmetric, `weight_shape` [2]) and
"float-quantized" for fp8 (`weight` float8_e4m3fn [out, in], `weight_scale` [out, 1]). lm_head
and the embeddings stay unquantized.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from kvfleet_engine.bench.quantize import SCHEMES, Scheme, calibration_texts, quantize, recipe

__all__ = [
    "SCHEMES",
    "Scheme",
    "autoawq_dequantized_weights",
    "autoawq_reference_model",
    "calibration_texts",
    "dequantized_weights",
    "quantization_config",
    "recipe",
    "reference_model",
    "write_autoawq",
    "write_quantized",
]

# Short calibration for tiny models: a few seconds per scheme.
TINY_SAMPLES, TINY_SEQ_LEN, TINY_AWQ_GRID = 8, 64, 4


def write_quantized(
    source: Path,
    destination: Path,
    scheme_name: str,
    *,
    group_size: int = 32,
    texts: list[str] | None = None,
    max_seq_length: int = TINY_SEQ_LEN,
    awq_grid: int = TINY_AWQ_GRID,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Quantize the checkpoint in `source` with llmcompressor's oneshot on the CPU and save it
    (compressed-tensors, with the tokenizer) to `destination`; the scheme is a key of SCHEMES.
    texts: calibration samples (default: 8 stdlib docstrings), each cut to max_seq_length
    tokens. The defaults suit tiny models; real models want more text and awq_grid=20."""
    samples = calibration_texts(TINY_SAMPLES) if texts is None else texts
    return quantize(
        source,
        destination,
        scheme_name,
        group_size=group_size,
        texts=samples,
        max_seq_length=max_seq_length,
        awq_grid=awq_grid,
        dtype=dtype,
    )


def quantization_config(directory: Path) -> dict[str, Any]:
    """config.json's quantization_config."""
    config = json.loads((directory / "config.json").read_text())
    return dict(config["quantization_config"])


def reference_model(
    directory: Path, dtype: torch.dtype = torch.float32, quantize_activations: bool = True
) -> Any:
    """transformers' model of a compressed-tensors checkpoint, its weights decompressed to
    `dtype` at load. quantize_activations: fp8-dynamic linears round their inputs to fp8 per
    token as the checkpoint's scheme says (compressed-tensors' fake quantization); False gives
    the weight-only dequantized forward. Eval mode."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        directory,
        dtype=dtype,
        quantization_config=CompressedTensorsConfig(run_compressed=False),
    ).eval()
    if not quantize_activations:
        for module in model.modules():
            module.quantization_enabled = False  # read by compressed-tensors' forward
    return model


def dequantized_weights(directory: Path) -> dict[str, torch.Tensor]:
    """{linear module name: float32 weight [out, in]} for every quantized linear, as
    compressed-tensors decompresses the checkpoint."""
    model = reference_model(directory)
    names = _quantized_module_names(directory)
    modules = dict(model.named_modules())
    return {name: modules[name].weight.detach().float().clone() for name in names}


def _quantized_module_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    names = set()
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as tensors:
            for key in tensors.keys():
                if key.endswith(("weight_packed", "weight_scale")):
                    names.add(key.rsplit(".", 1)[0])
    return sorted(names)


def write_autoawq(
    source: Path, destination: Path, *, group_size: int = 32, texts: list[str] | None = None
) -> Path:
    """Quantize with AutoAWQ itself (W4, zero point, GEMM layout: `qweight` int32
    [in, out // 8], `qzeros` int32 [in // group, out // 8], `scales` float16 [in // group, out],
    nibbles in AWQ's order 0 2 4 6 1 3 5 7). Clipping is off: its search needs out features
    that are multiples of 64, which tiny models lack. About a minute on 2 CPU cores."""
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoAWQForCausalLM.from_pretrained(str(source), device_map="cpu")
    # AutoAWQ drops samples longer than max_calib_seq_len tokens (bytes, for tiny models).
    samples = [t[:400] for t in calibration_texts(16)] if texts is None else texts
    model.quantize(
        tokenizer,
        quant_config={
            "zero_point": True,
            "q_group_size": group_size,
            "w_bit": 4,
            "version": "GEMM",
        },
        calib_data=samples,
        max_calib_seq_len=512,
        max_calib_samples=len(samples),
        n_parallel_calib_samples=4,
        apply_clip=False,
    )
    model.save_quantized(str(destination))
    tokenizer.save_pretrained(destination)
    return destination


def autoawq_dequantized_weights(directory: Path) -> dict[str, torch.Tensor]:
    """{linear module name: float32 weight [out, in]} of an AutoAWQ GEMM checkpoint, through
    AutoAWQ's own unpacking (awq.utils.packing_utils.dequantize_gemm)."""
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    config = quantization_config(directory)
    tensors = _load_all(directory, load_file)
    weights = {}
    for key in sorted(tensors):
        if key.endswith(".qweight"):
            name = key.removesuffix(".qweight")
            in_out = dequantize_gemm(
                tensors[key],
                tensors[f"{name}.qzeros"],
                tensors[f"{name}.scales"],
                config["bits"],
                config["group_size"],
            )  # [in, out]
            weights[name] = in_out.float().t().contiguous()
    return weights


def autoawq_reference_model(directory: Path) -> Any:
    """A float32 transformers model with an AutoAWQ checkpoint's weights dequantized (its
    unquantized tensors, the AWQ-scaled norms among them, as stored). Eval mode."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = _load_all(directory, load_file)
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(_AWQ_SUFFIXES)}
    state.update({f"{n}.weight": w for n, w in autoawq_dequantized_weights(directory).items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(key == "lm_head.weight" for key in missing), missing  # tied embeddings
    if missing:
        model.tie_weights()
    return model


_AWQ_SUFFIXES = (".qweight", ".qzeros", ".scales")


def _load_all(directory: Path, load_file: Any) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors
