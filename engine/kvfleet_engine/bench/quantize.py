"""Quantized copies of a Hugging Face checkpoint written by llmcompressor's `oneshot` (the
compressed-tensors format vLLM and kvfleet read), one named scheme at a time.

    quantize(source_dir, destination_dir, "gptq-w4a16", group_size=128, texts=...)

llmcompressor (a dev dependency) is imported only when a function here runs.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    # The same format, each weight column rounded by GPTQ against the calibration Hessian.
    "gptq-fp8-dynamic": Scheme("gptq", 8, "float", "channel", True, dynamic_fp8_activations=True),
    "w8a16": Scheme("gptq", 8, "int", "group", symmetric=True),
    "w8a16-channel": Scheme("rtn", 8, "int", "channel", symmetric=True),
}

# Stdlib modules whose docstrings are the calibration text: fixed English prose that is not
# pydoc_data.topics (the perplexity text), the same on every install of one Python version.
CALIBRATION_MODULES = (
    "argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "fractions",
    "functools", "http", "itertools", "json", "logging", "pathlib", "shutil", "sqlite3",
    "statistics", "subprocess", "tarfile", "textwrap", "threading", "unittest", "urllib",
    "zipfile",
)  # fmt: skip


def calibration_texts(
    num_samples: int, modules: tuple[str, ...] = CALIBRATION_MODULES, min_chars: int = 200
) -> list[str]:
    """num_samples docstrings (of the modules and their public classes and functions, each at
    least min_chars long, in module then name order), cycling when there are fewer."""
    docs = []
    for module_name in modules:
        module = importlib.import_module(module_name)
        objects = [module] + [
            value
            for name, value in sorted(vars(module).items())
            if not name.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value))
        ]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= min_chars and doc not in docs:
                docs.append(doc)
    if not docs:
        raise ValueError(f"modules {modules} have no docstrings of {min_chars}+ characters")
    return [docs[i % len(docs)] for i in range(num_samples)]


def recipe(scheme_name: str, group_size: int, awq_grid: int = 20) -> Any:
    """The llmcompressor recipe for a named scheme (lm_head left unquantized): one modifier, or
    for AWQ its scale search then the quantization (llmcompressor 0.14's split of the old
    `AWQModifier`); awq_grid: the number of scale exponents AWQ's search tries (its default 20)."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

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
        return [
            AWQModifier(n_grid=awq_grid),
            QuantizationModifier(config_groups=groups, ignore=["lm_head"]),
        ]
    return QuantizationModifier(config_groups=groups, ignore=["lm_head"])


def quantize(
    source: Path,
    destination: Path,
    scheme_name: str,
    *,
    group_size: int,
    texts: list[str],
    max_seq_length: int,
    awq_grid: int = 20,
    dtype: Any = None,
) -> Path:
    """Quantize the checkpoint in `source` with llmcompressor's oneshot (on the GPU when there
    is one) and save it, compressed-tensors with the tokenizer, to `destination`. texts:
    calibration samples, each cut to max_seq_length tokens; dtype: the model's while
    calibrating (default: the checkpoint's)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    modifier = recipe(scheme_name, group_size, awq_grid)
    tokenizer: Any = AutoTokenizer.from_pretrained(source)
    dataset = Dataset.from_dict({"text": texts}).map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=max_seq_length),
        remove_columns=["text"],
    )
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype or "auto")
    with _no_pinned_memory():
        oneshot(
            model=model,
            processor=tokenizer,
            dataset=dataset,
            recipe=modifier,
            max_seq_length=max_seq_length,
            num_calibration_samples=len(texts),
            output_dir=str(destination),
        )
    return destination


@contextlib.contextmanager
def _no_pinned_memory() -> Iterator[None]:
    """AWQ pins its cached activations unconditionally (a speed-up for host-to-GPU copies);
    a CUDA build of torch without a driver cannot pin, so skip it when there is no GPU."""
    import torch
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
