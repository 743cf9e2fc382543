"""What fp8 W8A8 loses in perplexity, and what an orthonormal rotation of each linear's input
dimension recovers (a probe on the CPU reference path, SmolLM2). For a linear y = x Wᵀ and an
orthonormal R, y = (x R)(W R)ᵀ exactly; quantizing x R per token and W R per output channel
spreads a few large input channels (the activations' outliers) over the whole block before the
scales are taken, as QuaRot does. Modes:

- `auto`: the model's dtype, no quantization;
- `fp8`: the engine's W8A8 (e4m3 weights per output channel, activations per token);
- `fp8-weight-only`: the same weights, activations unquantized (what decode-sized products do);
- `fp8-hadamard`: W8A8 with R = the block-diagonal normalised Hadamard matrix (the largest
  power-of-two block that divides the input features);
- `fp8-hadamard-signs`: the same with random ±1 signs first (R = D H, QuaRot's randomised form).

    PYTHONPATH=engine python bench/w8a8_rotation_probe.py MODEL [--max-tokens 8192] [--out F]

Perplexity as `kvfleet bench accuracy` measures it (windows of 2,048 tokens every 1,024 over the
first MAX_TOKENS tokens of pydoc_data.topics).
"""

from __future__ import annotations

import functools
import sys

import probe_modes
import torch

from kvfleet_engine import LLM
from kvfleet_engine.bench.perplexity import evaluation_tokens, perplexity
from kvfleet_engine.quant import layout, linear

MODES = ("auto", "fp8", "fp8-weight-only", "fp8-hadamard", "fp8-hadamard-signs")
MODE = {"name": "auto"}


def block(features: int) -> int:
    size = 1
    while features % (size * 2) == 0:
        size *= 2
    return size


@functools.cache
def rotation(features: int, signs: bool) -> torch.Tensor:
    """[features, features] orthonormal: block-diagonal normalised Hadamard (times D)."""
    size = block(features)
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    r = torch.block_diag(*[h / size**0.5] * (features // size))
    if signs:
        generator = torch.Generator().manual_seed(features)
        d = torch.randint(0, 2, (features,), generator=generator).float() * 2 - 1
        r = d[:, None] * r
    return r


def rotates() -> bool:
    return MODE["name"].startswith("fp8-hadamard")


def rotated(x: torch.Tensor) -> torch.Tensor:
    r = rotation(x.shape[-1], MODE["name"].endswith("signs"))
    return (x.float() @ r).to(x.dtype)


QUANTIZE = layout.quantize_fp8


def quantize_fp8(weight: torch.Tensor) -> layout.Fp8Weight:
    return QUANTIZE(rotated(weight.float()) if rotates() else weight)


def fp8_linear(
    x: torch.Tensor, weight: layout.Fp8Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if MODE["name"] == "fp8-weight-only":
        return layout.fp8_weight_only_reference(x, weight, bias)
    return layout.fp8_linear_reference(rotated(x) if rotates() else x, weight, bias)


linear.quantize_fp8 = quantize_fp8
linear.fp8_linear_reference = fp8_linear


def run(model: str, mode: str, max_tokens: int) -> float:
    MODE["name"] = mode
    quantization = None if mode == "auto" else "fp8"
    llm = LLM(model, device="cpu", quantization=quantization, max_model_len=2048)
    ids = evaluation_tokens(llm.get_tokenizer(), max_tokens)
    return perplexity(llm, ids, 2048, 1024).perplexity


def main(argv: list[str]) -> int:
    return probe_modes.main(argv, "w8a8_rotation_probe.py", __doc__.split("\n\n")[0], MODES, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
