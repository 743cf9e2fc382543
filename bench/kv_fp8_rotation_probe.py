"""What an 8-bit KV cache loses in perplexity, and what transforms of K and V before rounding
recover (a probe). On the reference backend (`attention_torch`, float32, the CPU), every store
and attention call of one `LLM` is wrapped. Since 594f199 the engine itself stores an fp8 cache's
K rotated by the normalised Hadamard matrix H after RoPE (queries likewise, `layers.kv_rotation`),
so the wrapped calls see q H and k H; H H = I undoes it where a mode needs the plain K.

- `fp8`: the cache as the engine stores it (e4m3, a scale per token and kv head, K rotated);
- `fp8-unrotated`: the same codes of the plain K (the engine before 594f199);
- `fp8-signs`: K and q times D H instead of H, D a fixed random ±1 diagonal (QuaRot's form);
- `fake-k`, `fake-v`: a cache in the model's dtype holding K (or V) rounded as the fp8 cache
  rounds it and the other exact, which splits the gap between the two; `fake-k-hadamard`: K
  rotated, then rounded;
- `fake-k-int8-hadamard`, `fake-k-e3m4-hadamard`: K rotated, then rounded to other 8-bit codes
  with a scale per token and kv head: symmetric integers (amax -> 127), or a float with 3
  exponent and 4 mantissa bits (amax -> 31, subnormals below 1/4); `fake-v-int8`: V as integers;
- `fake-k-shaped-hadamard` (session 22): K rotated, then rounded to e4m3 with the error shaped
  away from where the queries look. A score's error for query q is q . d (d the key's rounding
  error), whose mean square over queries is d^T M d, M the second moment of the layer's rotated
  queries in the key's kv-head group (calibrated first on 4,096 tokens of stdlib docstrings,
  `bench.quantize.calibration_texts`, never the perplexity text; each M over its trace). From
  round-to-nearest, each row takes up to 16 greedy moves: the one element whose other
  neighbouring code lowers d^T M d most flips to it (none when no flip lowers it); the engine's
  `layers.kv_shaping`, which `kv_cache_calibration` turns on.

The modes of session 18 (`fp8-kmean`: each layer's mean K subtracted; `fp8-hadamard-k`: the
rotation the engine now does; `fp8-hadamard-kv`: V rotated as well) ran on the tree before
594f199 (this file at 91cccdd; their JSON:
bench/results/2026-12-04-cpu-kv-fp8-rotation-probe-smollm2-8k.json).

    PYTHONPATH=engine python bench/kv_fp8_rotation_probe.py MODEL [--max-tokens 8192] [--out F]

Perplexity as `kvfleet bench accuracy` measures it (`bench.perplexity`: windows of 2,048 tokens
every 1,024 over the first MAX_TOKENS tokens of pydoc_data.topics).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from typing import Any

import probe_modes
import torch

from kvfleet_engine import LLM
from kvfleet_engine.bench.perplexity import evaluation_tokens, perplexity
from kvfleet_engine.bench.quantize import calibration_texts
from kvfleet_engine.layers import attention_torch as reference
from kvfleet_engine.layers import kv_shaping

MODES = ("auto", "fp8", "fp8-unrotated", "fp8-signs", "fake-k", "fake-v", "fake-k-hadamard")
MODES += ("fake-k-int8-hadamard", "fake-k-e3m4-hadamard", "fake-v-int8", "fake-k-shaped-hadamard")
CALIBRATION_TOKENS = 4096


@functools.cache
def hadamard(dim: int) -> torch.Tensor:
    """[dim, dim] Sylvester Hadamard matrix / sqrt(dim): symmetric and orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / dim**0.5


@functools.cache
def signs(dim: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(dim)
    return torch.randint(0, 2, (dim,), generator=generator).float() * 2 - 1


def rotate(x: torch.Tensor) -> torch.Tensor:  # [..., dim] @ H
    return (x.float() @ hadamard(x.shape[-1])).to(x.dtype)


def resign(x: torch.Tensor) -> torch.Tensor:
    """x H (as the engine rotated it) -> x D H: times H (undoing it), D, then H again."""
    dim = x.shape[-1]
    return (((x.float() @ hadamard(dim)) * signs(dim)) @ hadamard(dim)).to(x.dtype)


def fake_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the fp8 cache stores it (codes times their row's scale)."""
    codes, scale = reference.quantize_kv(x)
    return reference.dequantize_kv(codes, scale).to(x.dtype)


def fake_codes(x: torch.Tensor, codes: str) -> torch.Tensor:
    """x rounded to 8-bit `codes` ("int8" or "e3m4") with a scale per row (its amax maps to the
    largest code), back in x's dtype."""
    f = x.float()
    amax = f.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12)
    if codes == "int8":
        scale = amax / 127
        return ((f / scale).round().clamp(-127, 127) * scale).to(x.dtype)
    top = 31.0  # e3m4 with bias 3: (1 + m / 16) * 2^(e - 3), e = 1..7; subnormals below 2^-2
    y = f / (amax / top)
    exponent = torch.floor(torch.log2(y.abs().clamp(min=1e-30))).clamp(min=-2)
    step = torch.exp2(exponent - 4)
    return ((y / step).round() * step).clamp(-top, top).mul(amax / top).to(x.dtype)


def fake_fp8_shaped(x: torch.Tensor, moment: kv_shaping.KMoment) -> torch.Tensor:
    """x rounded as a calibrated fp8 cache stores it (`kv_shaping.shaped_e4m3`), in x's dtype."""
    nearest, scales = reference.quantize_kv(x)
    codes = kv_shaping.shaped_e4m3(x, nearest, scales, moment)
    return reference.dequantize_kv(codes, scales).to(x.dtype)


@dataclasses.dataclass
class Probe:
    """The transforms of the current mode."""

    mode: str = "auto"
    num_layers: int = 0
    layer: int = -1  # of the last store call (layers store in order, one call a forward each)
    calibrating: bool = False
    moments: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # [kv heads, d, d]
    factored: dict[int, kv_shaping.KMoment] = dataclasses.field(default_factory=dict)  # as stored

    def transform_k(self, key: torch.Tensor, fp8: bool) -> torch.Tensor:
        """What this mode does to a key (or query) the engine hands over (rotated if fp8)."""
        if fp8 and self.mode == "fp8-unrotated":
            return rotate(key)
        if fp8 and self.mode == "fp8-signs":
            return resign(key)
        if not fp8 and self.mode.startswith("fake") and "hadamard" in self.mode:
            return rotate(key)
        return key

    def store(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        k_scales: torch.Tensor | None = None,
        v_scales: torch.Tensor | None = None,
    ) -> None:
        """`attention_torch.store_kv`, after this mode's transforms of K and V."""
        self.layer = (self.layer + 1) % self.num_layers
        key = self.transform_k(key, k_scales is not None)
        if self.mode == "fake-k-shaped-hadamard" and not self.calibrating:
            key = fake_fp8_shaped(key, self.factored[self.layer])
        elif self.mode.startswith("fake"):
            codes = next((c for c in ("int8", "e3m4") if c in self.mode), None)
            fake = fake_fp8 if codes is None else functools.partial(fake_codes, codes=codes)
            key = fake(key) if "-k" in self.mode else key
            value = fake(value) if "-v" in self.mode else value
        STORE(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)

    def attention(self, function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`function` (an attention call) with this mode's transform of q."""

        def call(
            query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:  # fmt: skip
            query = self.transform_k(query, kwargs.get("k_scales") is not None)
            if self.calibrating:
                moment = kv_shaping.query_moment(query, k_cache.shape[2])
                self.moments[self.layer] = self.moments.get(self.layer, 0) + moment
            return function(query, k_cache, v_cache, *args, **kwargs)

        return call


STORE = reference.store_kv
PROBE = Probe()
reference.store_kv = PROBE.store
reference.paged_decode_attention = PROBE.attention(reference.paged_decode_attention)
reference.prefill_attention = PROBE.attention(reference.prefill_attention)


def run(model: str, mode: str, max_tokens: int) -> float:
    cache = "fp8" if mode.startswith("fp8") else "auto"
    llm = LLM(
        model, device="cpu", attention_backend="torch", kv_cache_dtype=cache, max_model_len=2048
    )
    PROBE.mode, PROBE.layer, PROBE.moments, PROBE.factored = mode, -1, {}, {}
    PROBE.num_layers = llm.engine.model_config.num_layers
    if mode == "fake-k-shaped-hadamard":
        PROBE.calibrating = True
        text = "\n\n".join(calibration_texts(256))
        perplexity(
            llm,
            llm.get_tokenizer().encode(text, add_special_tokens=False)[:CALIBRATION_TOKENS],
            2048,
            1024,
        )
        PROBE.calibrating = False
        for layer, moment in PROBE.moments.items():  # scaled to trace 1 per head
            trace = torch.diagonal(moment, dim1=-2, dim2=-1).sum(-1)[:, None, None]
            PROBE.factored[layer] = kv_shaping.factor(moment / trace)
    tokens = evaluation_tokens(llm.get_tokenizer(), max_tokens)
    return perplexity(llm, tokens, 2048, 1024).perplexity


def main(argv: list[str]) -> int:
    torch.manual_seed(0)
    return probe_modes.main(argv, "kv_fp8_rotation_probe.py", __doc__.split("\n\n")[0], MODES, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
