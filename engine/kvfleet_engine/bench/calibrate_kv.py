"""Write the `kv_cache_calibration` file of a model: each attention layer's query moment, by
which an fp8 cache rounds K toward the queries (`layers.kv_shaping`, `runner.kv_calibration`).

    python -m kvfleet_engine.bench.calibrate_kv MODEL [--output FILE] [--tokens 4096]
        [--device cpu] [--dtype auto]

It runs `--tokens` tokens of calibration text (stdlib docstrings, `bench.quantize
.calibration_texts`: never the perplexity text) through the model with an fp8 cache on the
reference attention backend, in windows of 2,048 tokens (or the model's longest) every half
window (as `bench.perplexity` reads), summing the rotated queries' q q^T per layer and kv head.
SmolLM2-135M takes about a minute on two CPU cores. The file is small (layers x kv heads x
head_dim^2 float32: 1.5 MB for SmolLM2, 17 MB for a Llama-3.1-8B shape). Progress and the
file's path go to stderr."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from kvfleet_engine.bench.perplexity import perplexity
from kvfleet_engine.bench.quantize import calibration_texts
from kvfleet_engine.runner import kv_calibration

log = logging.getLogger("kvfleet.calibrate_kv")
WINDOW = 2048  # tokens a window holds at most


def calibration_tokens(tokenizer: object, num_tokens: int) -> list[int]:
    """The first num_tokens tokens of the calibration docstrings, joined by blank lines."""
    text = "\n\n".join(calibration_texts(max(64, num_tokens // 16)))
    token_ids = list(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[attr-defined]
    if len(token_ids) < num_tokens:
        raise ValueError(f"--tokens {num_tokens}: the calibration text has {len(token_ids)}")
    return token_ids[:num_tokens]


@torch.inference_mode()
def calibrate(model: str, num_tokens: int, device: str, dtype: str) -> list[torch.Tensor]:
    """Each attention layer's sum of q q^T over the calibration tokens' rotated queries."""
    from kvfleet_engine import LLM

    llm = LLM(
        model,
        device=device,
        dtype=dtype,
        kv_cache_dtype="fp8",
        attention_backend="torch",
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    layers = llm.engine.model_runner.attention_layers
    for layer in layers:
        layer.query_moments = torch.zeros(
            layer.num_kv_heads, layer.head_dim, layer.head_dim, device=layer.k_cache.device
        )
    window = min(WINDOW, llm.engine.model_config.max_model_len)
    perplexity(llm, calibration_tokens(llm.get_tokenizer(), num_tokens), window, window // 2)
    moments = [layer.query_moments for layer in layers]
    for layer in layers:
        layer.query_moments = None
    return moments  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="checkpoint directory or GGUF file")
    parser.add_argument(
        "--output",
        type=Path,
        help="the file to write (default: MODEL + .kv-calibration.safetensors)",
    )
    parser.add_argument("--tokens", type=int, default=4096, help="calibration tokens")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="auto", help="auto (the checkpoint's) | float32 | ...")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    model = Path(args.model)
    output = args.output or model.with_name(model.name + ".kv-calibration.safetensors")
    started = time.perf_counter()
    try:
        moments = calibrate(str(model), args.tokens, args.device, args.dtype)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    kv_calibration.save(output, moments, model.name, args.tokens)
    log.info(
        "wrote %s: %d layers, %d tokens, %.0f s",
        output,
        len(moments),
        args.tokens,
        time.perf_counter() - started,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
