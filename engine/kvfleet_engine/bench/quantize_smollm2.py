"""`python -m kvfleet_engine.bench.quantize_smollm2`: SmolLM2-135M-Instruct checkpoints for the
accuracy benchmark, written by the ecosystem's tools.

1. The embedded GGUF (Q4_1; `kvfleet fetch-model smollm2`) -> a bf16 Hugging Face directory,
   dequantized by transformers' GGUF reader (needs the `gguf` package): `smollm2-bf16`.
2. llmcompressor oneshot on that directory -> compressed-tensors checkpoints `smollm2-<scheme>`
   for GPTQ W4A16 (symmetric), AWQ W4A16 (asymmetric), FP8 dynamic and W8A16 (group size
   --group-size; SmolLM2's hidden size 576 is not a multiple of 128, so the default is 64).
   Without a GPU the model is calibrated in float32 (--calibration-dtype) and the saved
   checkpoint cast back to bf16: on a CPU without bf16 instructions (AVX2 only) a bf16 matmul
   runs about 8x slower than a float32 one.

AWQ runs --awq-grid forward passes of each smoothed parent (3 a layer) over every calibration
token, so its time grows with --samples x --seq-len: on two shared cores, 32 x 256 tokens take
14 minutes and the defaults hours. There, run with OMP_NUM_THREADS=1: two OpenMP threads on a
contended core wait at every barrier (GPTQ's solve of one module: 4-14 s against 0.2-0.3 s).

Calibration text (not the perplexity text): --samples docstrings of stdlib modules and their
public classes and functions (kvfleet_engine.bench.quantize.CALIBRATION_MODULES, 200+
characters each, in module then name order), each cut to --seq-len tokens.
Everything goes under --output (default $KVFLEET_CACHE_DIR/models); existing directories are
kept unless --force. Prints the `kvfleet bench accuracy` command that compares them.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int

log = logging.getLogger(__name__)

DEFAULT_SCHEMES = ("gptq-w4a16", "awq-w4a16", "fp8-dynamic", "w8a16")
# Accuracy-bench config name per scheme, and its perplexity bound in percent over bf16.
CONFIG_NAMES = {
    "gptq-w4a16": "gptq",
    "awq-w4a16": "awq",
    "fp8-dynamic": "fp8",
    "gptq-fp8-dynamic": "fp8gptq",
    "w8a16": "int8",
}
BOUNDS = {"gptq": 8.0, "awq": 8.0, "fp8": 1.5, "fp8gptq": 1.5, "int8": 1.5, "fp8kv": 0.5}


def write_bf16(gguf_file: Path, destination: Path) -> Path:
    """The GGUF model dequantized by transformers, saved as bf16 safetensors with its
    tokenizer (and chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(gguf_file.parent), gguf_file.name
    model: Any = AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.bfloat16
    )
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    # The weights are dequantized at load; only the GGUF marker stops save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)
    return destination


def cast_checkpoint(directory: Path, dtype: str) -> None:
    """Cast the floating-point tensors of a saved checkpoint (embeddings, norms, scales) to
    dtype, and record it in config.json: a checkpoint calibrated in float32 stores bf16 like
    the one it came from (packed integer weights and zero points are left as they are)."""
    import torch
    from safetensors.torch import load_file, save_file

    target = getattr(torch, dtype)
    for file in sorted(directory.glob("*.safetensors")):
        tensors = load_file(file)
        cast = {name: t.to(target) if t.is_floating_point() else t for name, t in tensors.items()}
        save_file(cast, file, metadata={"format": "pt"})
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    from kvfleet_engine.bench.quantize import SCHEMES, calibration_texts, quantize
    from kvfleet_engine.model_store import DEFAULT_MODEL, fetch, models_dir

    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="python -m kvfleet_engine.bench.quantize_smollm2",
        description=summary,  # the first paragraph, whole
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    parser.add_argument("--output", type=Path, help="default: $KVFLEET_CACHE_DIR/models")
    parser.add_argument("--gguf", type=Path, help="default: the fetched SmolLM2 GGUF")
    parser.add_argument("--schemes", default=",".join(DEFAULT_SCHEMES))
    parser.add_argument("--group-size", type=positive_int, default=64)
    parser.add_argument("--samples", type=positive_int, default=256)
    parser.add_argument("--seq-len", type=positive_int, default=512)
    parser.add_argument(
        "--awq-grid", type=positive_int, default=20, help="scale exponents AWQ's search tries"
    )
    parser.add_argument(
        "--calibration-dtype",
        choices=("auto", "float32", "bfloat16"),
        help="the model's dtype while calibrating; default: float32 without a GPU, else auto "
        "(the checkpoint's); the saved checkpoint keeps the checkpoint's dtype",
    )
    parser.add_argument(
        "--tag", help="appended to each quantized directory's name: smollm2-<scheme>-<tag>"
    )
    parser.add_argument("--force", action="store_true", help="rewrite existing directories")
    args = parser.parse_args(argv)
    schemes = [s for s in args.schemes.split(",") if s]
    unknown = sorted(set(schemes) - set(SCHEMES))
    if unknown:
        parser.error(f"--schemes: unknown {unknown}; one of {sorted(SCHEMES)}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    output: Path = args.output or models_dir()
    gguf_file = args.gguf or fetch(DEFAULT_MODEL)

    timings: dict[str, float] = {}
    bf16 = output / "smollm2-bf16"
    if args.force or not (bf16 / "config.json").exists():
        start = time.perf_counter()
        write_bf16(gguf_file, bf16)
        timings["bf16"] = time.perf_counter() - start
        log.info("wrote %s in %.0f s", bf16, timings["bf16"])
    saved_dtype = json.loads((bf16 / "config.json").read_text()).get("dtype", "bfloat16")
    calibration_dtype = args.calibration_dtype or _default_calibration_dtype()
    suffix = f"-{args.tag}" if args.tag else ""
    texts = calibration_texts(args.samples)
    for scheme in schemes:
        destination = output / f"smollm2-{scheme}{suffix}"
        if not args.force and (destination / "config.json").exists():
            log.info("%s exists (--force rewrites it)", destination)
            continue
        start = time.perf_counter()
        quantize(
            bf16,
            destination,
            scheme,
            group_size=args.group_size,
            texts=texts,
            max_seq_length=args.seq_len,
            awq_grid=args.awq_grid,
            dtype=calibration_dtype,
        )
        if calibration_dtype not in ("auto", saved_dtype):
            cast_checkpoint(destination, saved_dtype)
        timings[scheme] = time.perf_counter() - start
        log.info("wrote %s in %.0f s", destination, timings[scheme])
    (output / f"smollm2-quantize-timings{suffix}.json").write_text(
        json.dumps(timings, indent=2) + "\n"
    )
    command = ["kvfleet", "bench", "accuracy", "--config", f"bf16={bf16}"]
    for scheme in schemes:
        name = CONFIG_NAMES.get(scheme, scheme)
        command += ["--config", f"{name}={output / f'smollm2-{scheme}{suffix}'}"]
    command += ["--config", f"fp8kv={bf16}:kv_cache_dtype=fp8"]
    names = [CONFIG_NAMES.get(s, s) for s in schemes] + ["fp8kv"]
    command += [
        arg for name in names if name in BOUNDS for arg in ("--bound", f"{name}={BOUNDS[name]:g}")
    ]
    print(shlex.join(command))
    return 0


def _default_calibration_dtype() -> str:
    import torch

    return "auto" if torch.cuda.is_available() else "float32"


if __name__ == "__main__":
    sys.exit(main())
