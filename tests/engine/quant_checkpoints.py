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

import contextlib
import inspect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Scheme:
    """One llmcompressor recipe: the algorithm and the weight (and activation) quantization."""

    # "gptq" | "awq" | "rtn" (round to nearest: QuantizationModifier, no calibration search).
    algorithm: str
    # Weight bits: 4 or 8 integers, or 8 for fp8.
    num_bits: int
    # "int" | "float".
    type: str
    # "group" | "channel".
    strategy: str
    symmetric: bool
    # GPTQ activation ordering: None, or "weight" (columns quantized in order of activation
    # size; the layout is unchanged: compressed-tensors 0.19 removed "group", which wrote
    # weight_g_idx).
    actorder: str | None = None
    # Dynamic per-token fp8 activations (FP8_DYNAMIC).
    dynamic_fp8_activations: bool = False


SCHEMES: dict[str, Scheme] = {
    "gptq-w4a16": Scheme("gptq", 4, "int", "group", symmetric=True),
    "gptq-w4a16-asym": Scheme("gptq", 4, "int", "group", symmetric=False),
    "gptq-w4a16-actorder": Scheme("gptq", 4, "int", "group", symmetric=True, actorder="weight"),
    "awq-w4a16": Scheme("awq", 4, "int", "group", symmetric=False),
    "fp8-dynamic": Scheme("rtn", 8, "float", "channel", True, dynamic_fp8_activations=True),
    "w8a16": Scheme("gptq", 8, "int", "group", symmetric=True),
    "w8a16-channel": Scheme("rtn", 8, "int", "channel", symmetric=True),
}

# Fixed English calibration text for tiny models: stdlib docstrings (not pydoc_data.topics, the
# perplexity text). Python's own docs, so the same on every install of one Python version.
_CALIBRATION_MODULES = ("json", "textwrap", "argparse", "collections", "functools", "pathlib")


def calibration_texts(
    num_samples: int, modules: tuple[str, ...] = _CALIBRATION_MODULES
) -> list[str]:
    """num_samples paragraphs of stdlib docstrings, cycling over the modules' paragraphs."""
    import importlib

    paragraphs = []
    for name in modules:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        paragraphs += [p.strip() for p in doc.split("\n\n") if len(p.strip()) >= 40]
    if not paragraphs:
        raise ValueError(f"modules {modules} have no docstring paragraphs")
    return [paragraphs[i % len(paragraphs)] for i in range(num_samples)]


def recipe(scheme_name: str, group_size: int = 32, awq_grid: int = 20) -> Any:
    """The llmcompressor modifier for a named scheme (lm_head left unquantized); awq_grid: the
    number of scale exponents AWQ's search tries (llmcompressor's default 20)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if scheme_name not in SCHEMES:
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {scheme_name!r}")
    scheme = SCHEMES[scheme_name]
    weights = QuantizationArgs(
        num_bits=scheme.num_bits,
        type=scheme.type,
        strategy=scheme.strategy,
        group_size=group_size if scheme.strategy == "group" else None,
        symmetric=scheme.symmetric,
        dynamic=False,
        actorder=scheme.actorder,
    )
    activations = None
    if scheme.dynamic_fp8_activations:
        activations = QuantizationArgs(
            num_bits=8, type="float", strategy="token", symmetric=True, dynamic=True
        )
    groups = {
        "group_0": QuantizationScheme(
            targets=["Linear"], weights=weights, input_activations=activations
        )
    }
    if scheme.algorithm == "gptq":
        return GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder=scheme.actorder)
    if scheme.algorithm == "awq":
        return AWQModifier(config_groups=groups, ignore=["lm_head"], n_grid=awq_grid)
    return QuantizationModifier(config_groups=groups, ignore=["lm_head"])


def write_quantized(
    source: Path,
    destination: Path,
    scheme_name: str,
    *,
    group_size: int = 32,
    texts: list[str] | None = None,
    max_seq_length: int = 64,
    awq_grid: int = 4,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Quantize the checkpoint in `source` with llmcompressor's oneshot on the CPU and save it
    (compressed-tensors, with the tokenizer) to `destination`. texts: calibration samples
    (default: 8 of calibration_texts), each cut to max_seq_length tokens. The defaults suit
    tiny models (a few seconds per scheme); real models want more text and awq_grid=20."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    modifier = recipe(scheme_name, group_size, awq_grid)
    tokenizer = AutoTokenizer.from_pretrained(source)
    samples = calibration_texts(8) if texts is None else texts
    dataset = Dataset.from_dict({"text": samples}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=max_seq_length),
        remove_columns=["text"],
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    with _no_pinned_memory():
        oneshot(
            model=model,
            processor=tokenizer,
            dataset=dataset,
            recipe=modifier,
            max_seq_length=max_seq_length,
            num_calibration_samples=len(samples),
            output_dir=str(destination),
        )
    return destination


@contextlib.contextmanager
def _no_pinned_memory() -> Iterator[None]:
    """AWQ pins its cached activations unconditionally (a speed-up for host-to-GPU copies);
    a CUDA build of torch without a driver cannot pin, so skip it when there is no GPU."""
    from llmcompressor.pipelines.cache import IntermediatesCache

    if torch.cuda.is_available():
        yield
        return
    original = IntermediatesCache.pin_memory
    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        IntermediatesCache.pin_memory = original  # type: ignore[method-assign]


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
    samples = calibration_texts(16) if texts is None else texts
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
