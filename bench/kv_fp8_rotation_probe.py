"""What an fp8 KV cache loses in perplexity, and what transforms of K and V before quantizing
recover (a probe: the engine does not do these yet). On the reference backend (`attention_torch`,
float32, the CPU), every store and attention call of one `LLM` is wrapped:

- `fp8`: the cache as the engine stores it (e4m3, a scale per token and kv head);
- `fp8-kmean`: each layer's mean post-RoPE K (per kv head and channel, from a teacher-forced pass
  over stdlib docstrings, never the evaluation text) subtracted before quantizing; softmax
  ignores a per-query constant, so q · (k - m) ranks the keys as q · k does;
- `fp8-hadamard-k`: post-RoPE q and k both multiplied by the normalised Hadamard matrix H
  (orthonormal, so (qH) · (kH) = q · k), which spreads a channel's outlier over all of them
  before the per-token scale is taken; no calibration;
- `fp8-kmean-hadamard-k`: both;
- `fp8-hadamard-kv`: H on V as well, the attention output multiplied back by H (H H = I).

    PYTHONPATH=engine python bench/kv_fp8_rotation_probe.py MODEL [--max-tokens 8192] [--out F]

Perplexity as `kvfleet bench accuracy` measures it (`bench.perplexity`: windows of 2,048 tokens
every 1,024 over the first MAX_TOKENS tokens of pydoc_data.topics).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import email
import functools
import inspect
import itertools
import json
import logging
import pathlib
import re
import sys
import time
import typing
import unittest
from collections.abc import Callable
from typing import Any

import torch

from kvfleet_engine import LLM
from kvfleet_engine.bench.perplexity import evaluation_tokens, perplexity
from kvfleet_engine.layers import attention_torch as reference

MODES = ("auto", "fp8", "fp8-kmean", "fp8-hadamard-k", "fp8-kmean-hadamard-k", "fp8-hadamard-kv")
CALIBRATION_TOKENS = 2048


def calibration_text() -> str:
    """Docstrings of a few stdlib modules and their classes and functions."""
    modules = [collections, dataclasses, email, functools, inspect, itertools, json, logging]
    modules += [pathlib, re, typing, unittest, argparse]
    docs = []
    for module in modules:
        docs.append(module.__doc__ or "")
        for _, obj in sorted(vars(module).items()):
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and isinstance(obj.__doc__, str):
                docs.append(obj.__doc__)
    return "\n\n".join(docs)


@functools.cache
def hadamard(dim: int) -> torch.Tensor:
    """[dim, dim] Sylvester Hadamard matrix / sqrt(dim): symmetric and orthonormal."""
    h = torch.ones(1, 1)
    while h.shape[0] < dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / dim**0.5


def rotate(x: torch.Tensor) -> torch.Tensor:  # [..., dim] @ H
    return (x.float() @ hadamard(x.shape[-1])).to(x.dtype)


@dataclasses.dataclass
class Probe:
    """The transforms of the current mode, keyed by each layer's K cache tensor."""

    mode: str = "auto"
    recording: dict[int, list[Any]] | None = None
    k_mean: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

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
        layer = id(k_cache)
        if self.recording is not None:
            keep = slot_mapping >= 0
            total = self.recording.setdefault(layer, [0, 0.0])
            total[0] += int(keep.sum())
            total[1] = total[1] + key[keep].double().sum(0)
        if k_scales is not None:
            if "kmean" in self.mode:
                key = key - self.k_mean[layer].to(key.dtype)
            if "hadamard" in self.mode:
                key = rotate(key)
            if self.mode == "fp8-hadamard-kv":
                value = rotate(value)
        STORE(key, value, k_cache, v_cache, slot_mapping, k_scales=k_scales, v_scales=v_scales)

    def attention(self, function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """`function` (an attention call) with this mode's transforms of q and the output."""

        def call(
            query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *args: Any,
            **kwargs: Any,
        ) -> torch.Tensor:  # fmt: skip
            fp8 = kwargs.get("k_scales") is not None
            if fp8 and "hadamard" in self.mode:
                query = rotate(query)
            out = function(query, k_cache, v_cache, *args, **kwargs)
            if fp8 and self.mode == "fp8-hadamard-kv":
                out = rotate(out)
            return out

        return call


STORE = reference.store_kv
PROBE = Probe()
reference.store_kv = PROBE.store
reference.paged_decode_attention = PROBE.attention(reference.paged_decode_attention)
reference.prefill_attention = PROBE.attention(reference.prefill_attention)


def run(model: str, mode: str, max_tokens: int) -> float:
    cache = "auto" if mode == "auto" else "fp8"
    llm = LLM(
        model, device="cpu", attention_backend="torch", kv_cache_dtype=cache, max_model_len=2048
    )
    tokenizer = llm.get_tokenizer()
    PROBE.mode, PROBE.k_mean = "auto", {}
    if "kmean" in mode:
        PROBE.recording = {}
        ids = tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS]
        perplexity(llm, ids, CALIBRATION_TOKENS, CALIBRATION_TOKENS // 2)
        PROBE.k_mean = {layer: (s / n).float() for layer, (n, s) in PROBE.recording.items()}
        PROBE.recording = None
    PROBE.mode = mode
    return perplexity(llm, evaluation_tokens(tokenizer, max_tokens), 2048, 1024).perplexity


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=8192)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", help="write the results JSON here")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows = {}
    for mode in args.modes.split(","):
        started = time.perf_counter()
        rows[mode] = run(args.model, mode, args.max_tokens)
        gap = (rows[mode] / rows["auto"] - 1) * 100 if "auto" in rows else float("nan")
        print(f"{mode:22s} {rows[mode]:.4f} {gap:+.2f}%  ({time.perf_counter() - started:.0f} s)")
    result = {
        "command": "PYTHONPATH=engine python bench/kv_fp8_rotation_probe.py " + " ".join(argv),
        "model": pathlib.Path(args.model).name,
        "max_tokens": args.max_tokens,
        "perplexity": rows,
        "vs_auto_percent": {m: (v / rows["auto"] - 1) * 100 for m, v in rows.items()}
        if "auto" in rows
        else None,
    }
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
