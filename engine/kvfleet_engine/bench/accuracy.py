"""`kvfleet bench accuracy`: perplexity and greedy agreement of several engine configurations
(checkpoints, quantizations, KV-cache dtypes) against a baseline, all through kvfleet's engine.

    kvfleet bench accuracy --config bf16=DIR --config gptq=DIR2 \\
        --config fp8kv=DIR:kv_cache_dtype=fp8 --bound gptq=8 --bound fp8kv=0.5

--config NAME=PATH[:KEY=VALUE,...]: PATH is a model directory or GGUF file; KEY=VALUE are LLM()
keywords (dtype=bfloat16, kv_cache_dtype=fp8, quantization=...). The first config is the
baseline unless --baseline names another.
- perplexity: the first --max-tokens tokens of pydoc_data.topics, strided windows, teacher-forced
  through the engine's runner (method: kvfleet_engine.bench.perplexity);
- agreement: greedy answers (--new-tokens, EOS honoured) to --prompts fixed chat prompts;
  the fraction identical to the baseline's, and the mean length of the common prefix.
Prints a table, writes JSON to --output (bench/results by default); exits 1 when a --bound
(percent perplexity increase over the baseline) is exceeded.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import re
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int
from kvfleet_engine.bench.accuracy_config import Config, device_choice, parse_bound, parse_config
from kvfleet_engine.bench.accuracy_prompts import PROMPTS, chat_prompts
from kvfleet_engine.bench.results import writable_dir


@dataclass
class Result:
    config: str
    path: str
    options: dict[str, Any]
    perplexity: float
    num_scored: int
    mean_nll: float
    # Answers to the prompts, one token list each.
    answers: list[list[int]]
    # Seconds to load, score and answer.
    seconds: float
    # Relative perplexity change against the baseline, in percent (None: the tokenizations of
    # the evaluation text differ, so the figures are not comparable).
    delta_percent: float | None = None
    # Fraction of prompts answered exactly as the baseline did.
    agreement: float | None = None
    # Mean number of leading tokens equal to the baseline's answer.
    mean_matched_prefix: float | None = None
    # Perplexity bound (percent over the baseline) from --bound, and whether it held.
    bound_percent: float | None = None
    within_bound: bool | None = None
    # Hash of the evaluation token ids (configs with different tokenizers are not compared).
    tokens_digest: str = ""


def main(argv: list[str]) -> int:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        prog="kvfleet bench accuracy",
        description=summary,  # the first paragraph, whole
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=details,
    )
    parser.add_argument("--config", action="append", required=True, metavar="NAME=PATH[:K=V]")
    parser.add_argument(
        "--baseline", help="the config the others are compared with (default: first)"
    )
    parser.add_argument("--bound", action="append", default=[], metavar="NAME=PERCENT")
    parser.add_argument(
        "--device", type=device_choice, default="auto", help="auto | cpu | cuda | cuda:N"
    )
    parser.add_argument("--max-tokens", type=positive_int, default=65536, help="text tokens")
    parser.add_argument("--window", type=positive_int, default=2048, help="tokens per window")
    parser.add_argument("--stride", type=positive_int, default=1024, help="window step")
    parser.add_argument("--chunk", type=positive_int, default=512, help="prefill chunk")
    parser.add_argument("--prompts", type=positive_int, default=len(PROMPTS))
    parser.add_argument("--new-tokens", type=positive_int, default=64)
    parser.add_argument(
        "--output", type=writable_dir, default="bench/results", help="where the JSON goes"
    )
    args = parser.parse_args(argv)
    try:
        configs = [parse_config(text) for text in args.config]
        bounds = dict(parse_bound(text) for text in args.bound)
    except ValueError as error:
        parser.error(str(error))
    names = [c.name for c in configs]
    if len(set(names)) != len(names):
        parser.error(f"--config names must differ, got {names}")
    baseline = args.baseline or names[0]
    for name in [baseline, *bounds]:
        if name not in names:
            parser.error(f"{name!r} is not a --config name; one of {names}")
    if args.stride >= args.window:
        parser.error(f"--stride ({args.stride}) must be < --window ({args.window})")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (every token but the first is scored)")
    if args.prompts > len(PROMPTS):
        parser.error(f"--prompts must be <= {len(PROMPTS)}")
    from kvfleet_engine.model_runner import resolve_device

    try:
        resolve_device(args.device)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: --device: {error}\n")
    try:
        for config in configs:
            check_config(config, args)
    except ValueError as error:  # the model's own files, not the command line: no usage block
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    results = [run_config(config, args) for config in configs]
    compare(results, next(r for r in results if r.config == baseline), bounds)
    print(format_table(results, baseline))
    path = write_json(args, argv, results, baseline)
    print(f"wrote {path}")
    return 1 if any(r.within_bound is False for r in results) else 0


def check_config(config: Config, args: argparse.Namespace) -> None:
    """What LLM(...) and the chat prompts would fail on, from the config file and tokenizer
    alone (no weights loaded); ValueError naming the --config or the flag."""
    from kvfleet_engine.bench.perplexity import evaluation_tokens
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.tokenizer import load_tokenizer

    try:
        engine = EngineConfig.create(config.path, **{"device": args.device, **config.options})
        tokenizer = load_tokenizer(engine.model)
        prompts = chat_prompts(tokenizer, args.prompts)
    except (ValueError, TypeError, OSError) as error:
        raise ValueError(f"--config {config.name}: {error}") from None
    try:
        evaluation_tokens(tokenizer, args.max_tokens)
    except ValueError as error:
        raise ValueError(f"--max-tokens: {error} (--config {config.name})") from None
    limit = engine.model.max_model_len
    if args.window > limit:
        raise ValueError(f"--window ({args.window}) must be <= {limit} (--config {config.name})")
    # The run's max_model_len: the config's own, else --window.
    setting, max_model_len = (
        (f"--config {config.name}: max_model_len", limit)
        if "max_model_len" in config.options
        else ("--window", args.window)
    )
    longest = max(len(prompt) for prompt in prompts)
    if longest >= max_model_len:
        raise ValueError(
            f"{setting} ({max_model_len}) must be > {longest}, the longest chat prompt of "
            f"--config {config.name} in tokens"
        )


def run_config(config: Config, args: argparse.Namespace) -> Result:
    import hashlib

    import torch

    from kvfleet_engine import LLM
    from kvfleet_engine.bench.perplexity import evaluation_tokens, perplexity
    from kvfleet_engine.sampling import SamplingParams

    print(f"[{config.name}] {config.path} {config.options or ''}", flush=True)
    start = time.perf_counter()
    options = {"device": args.device, "max_model_len": args.window, **config.options}
    llm = LLM(config.path, **options)
    tokenizer = llm.get_tokenizer()
    token_ids = evaluation_tokens(tokenizer, args.max_tokens)
    scored = perplexity(llm, token_ids, args.window, args.stride, args.chunk)
    prompts = chat_prompts(tokenizer, args.prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    answers = [list(out.outputs[0].token_ids) for out in outputs]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    digest = hashlib.sha256(json.dumps(token_ids).encode()).hexdigest()[:16]
    result = Result(
        config=config.name,
        path=config.path,
        options=config.options,
        perplexity=scored.perplexity,
        num_scored=scored.num_scored,
        mean_nll=scored.mean_nll,
        answers=answers,
        seconds=time.perf_counter() - start,
        tokens_digest=digest,
    )
    print(f"[{config.name}] perplexity {result.perplexity:.4f} ({result.seconds:.0f} s)")
    return result


def compare(results: list[Result], baseline: Result, bounds: dict[str, float]) -> None:
    """Fill each result's figures relative to the baseline."""
    for result in results:
        if result.tokens_digest == baseline.tokens_digest:
            result.delta_percent = 100.0 * (result.perplexity / baseline.perplexity - 1.0)
        pairs = list(zip(result.answers, baseline.answers, strict=True))
        result.agreement = sum(a == b for a, b in pairs) / len(pairs)
        result.mean_matched_prefix = sum(_common_prefix(a, b) for a, b in pairs) / len(pairs)
        if result.config in bounds:
            result.bound_percent = bounds[result.config]
            result.within_bound = (
                result.delta_percent is not None and result.delta_percent <= result.bound_percent
            )


def _common_prefix(a: list[int], b: list[int]) -> int:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return min(len(a), len(b))


def format_table(results: list[Result], baseline: str) -> str:
    header = (
        f"{'config':<12} {'perplexity':>10} {'vs ' + baseline:>12} {'bound':>7} "
        f"{'greedy same':>11} {'mean prefix':>11} {'seconds':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        delta = "n/a" if r.delta_percent is None else f"{r.delta_percent:+.2f}%"
        bound = ""
        if r.bound_percent is not None:
            bound = f"{'ok' if r.within_bound else 'OVER'} {r.bound_percent:g}%"
        lines.append(
            f"{r.config:<12} {r.perplexity:>10.4f} {delta:>12} {bound:>7} "
            f"{r.agreement:>11.0%} {r.mean_matched_prefix:>11.1f} {r.seconds:>8.0f}"
        )
    return "\n".join(lines)


def write_json(
    args: argparse.Namespace, argv: list[str], results: list[Result], baseline: str
) -> Path:
    """<output>/<date>-<device>-accuracy.json (keys as the other benchmarks' results)."""
    import torch

    from kvfleet_engine.bench.results import gpu_name
    from kvfleet_engine.model_runner import resolve_device

    device = gpu_name(resolve_device(args.device))
    now = datetime.datetime.now(datetime.UTC)
    slug = re.sub(r"[^a-z0-9.]+", "-", device.lower()).strip("-")
    args.output.mkdir(parents=True, exist_ok=True)
    path = args.output / f"{now:%Y-%m-%d}-{slug}-accuracy.json"
    document = {
        "gpu": device,
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["kvfleet", "bench", "accuracy", *argv]),
        "shape": Path(results[0].path).name,
        "workload": {
            "text": "pydoc_data.topics, values in sorted key order joined by newlines",
            "max_tokens": args.max_tokens,
            "window": args.window,
            "stride": args.stride,
            "chunk": args.chunk,
            "prompts": args.prompts,
            "new_tokens": args.new_tokens,
            "baseline": baseline,
            "threads": torch.get_num_threads(),
        },
        "results": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")
    return path
