"""`kvfleet bench chat`: a real model answering chat prompts, kvfleet against `transformers` on
the same file, device and prompts (default: the embedded SmolLM2 on the CPU).

Two figures per system, greedy, `--output-len` tokens per answer (EOS ignored, so both produce
the same number of tokens):
- batch-1 decode tokens/s: (output_len - 1) tokens over the time an output_len-token answer
  takes beyond a 1-token one (prefill and the first token);
- `--concurrency` chats at once: all output tokens over the wall time of the batch (prefill
  included). transformers runs them as one left-padded `generate` batch.

Both models are loaded first, then every measurement takes turns, kvfleet then transformers,
for `--rounds` rounds: on a shared machine background load hits both alike. Each figure is the
median over the rounds, and each ratio the median of the rounds' own kvfleet/transformers
ratios (the two halves of a round ran seconds apart).

    kvfleet bench chat --device cpu --concurrency 8 --output-len 128 --rounds 5 \
        --output bench/results
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int
from kvfleet_engine.bench.accuracy_config import device_choice
from kvfleet_engine.bench.accuracy_prompts import PROMPTS
from kvfleet_engine.bench.results import writable_dir

# The first of bench accuracy's fixed chat prompts.
QUESTIONS = PROMPTS[:8]
KVFLEET, TRANSFORMERS = "kvfleet", "transformers-generate"
DECODE = "decode_tokens_per_s"


@dataclass
class Contestant:
    """One system: seconds to answer prompts with n greedy tokens each."""

    system: str
    # (prompts, num_tokens) -> seconds; every call computes every prompt (no cached prefix).
    generate: Callable[[list[list[int]], int], float]


def main(argv: list[str]) -> int:
    summary = " ".join(__doc__.split("\n\n", 1)[0].split())  # the first paragraph, whole
    parser = argparse.ArgumentParser(prog="kvfleet bench chat", description=summary)
    parser.add_argument("--model", help="GGUF file or model directory (default: SmolLM2)")
    parser.add_argument(
        "--device", type=device_choice, default="cpu", help="auto | cpu | cuda | cuda:N"
    )
    parser.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--rounds", type=positive_int, default=3, help="turns per measurement")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument(
        "--output", type=writable_dir, help="write the results JSON in this directory"
    )
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (a decode rate needs two tokens)")
    import torch

    from kvfleet_engine.bench.results import Row, format_table, gpu_name, write_results
    from kvfleet_engine.model_runner import resolve_device
    from kvfleet_engine.model_store import DEFAULT_MODEL, FetchError, fetch

    try:
        model = args.model or str(fetch(DEFAULT_MODEL))
    except FetchError as error:
        parser.exit(2, f"{parser.prog}: error: no --model given and {error}\n")
    try:
        resolve_device(args.device)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: --device: {error}\n")
    try:
        llm = _kvfleet(model, args.device)
    except ValueError as error:  # the model's own files (the message names them): no usage block
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        )
        for q in (QUESTIONS * args.concurrency)[: args.concurrency]
    ]
    room = llm.engine.model_config.max_model_len - max(len(p) for p in prompts)
    if args.output_len > room:
        parser.exit(
            2,
            f"{parser.prog}: error: --output-len ({args.output_len}) must be <= {room}: the "
            f"longest chat prompt and its answer must fit max_model_len "
            f"({llm.engine.model_config.max_model_len})\n",
        )
    contestants = [Contestant(KVFLEET, lambda p, n: _kvfleet_generate(llm, p, n))]
    if not args.no_peer:
        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        hf = _transformers(model, args.device, dtype)
        pad_id = tokenizer.pad_token_id
        contestants.append(Contestant(TRANSFORMERS, lambda p, n: _hf_generate(hf, p, n, pad_id)))

    concurrent = f"c{args.concurrency}_output_tokens_per_s"
    per_round = take_turns(contestants, prompts, args.output_len, args.rounds, concurrent)
    rows = [
        Row(system, metric, statistics.median(values), "tokens/s")
        for system, metrics in per_round.items()
        for metric, values in metrics.items()
    ]
    ratios = paired_ratios(per_round)
    print(format_table(rows))
    for metric, ratio in ratios.items():
        print(f"kvfleet / transformers, {metric}: {ratio:.2f} (median of {args.rounds} rounds)")
    if args.output is not None:
        workload = {
            "model": Path(model).name,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "concurrency": args.concurrency,
            "prompt_lens": [len(p) for p in prompts],
            "output_len": args.output_len,
            "sampling": "greedy, ignore_eos",
            "rounds": args.rounds,
            "order": "each round: every system's decode, then every system's batch",
            "per_round": per_round,
            "ratios_kvfleet_over_transformers": ratios,
        }
        command = shlex.join(["kvfleet", "bench", "chat", *argv])
        device = gpu_name(torch.device(args.device))
        what = "chat-smollm2" if args.model is None else f"chat-{Path(model).stem}"
        path = write_results(args.output, what, device, command, workload["model"], workload, rows)
        print(f"wrote {path}")
    return 0


def take_turns(
    contestants: list[Contestant],
    prompts: list[list[int]],
    output_len: int,
    rounds: int,
    concurrent: str,
) -> dict[str, dict[str, list[float]]]:
    """system -> metric -> the rate of each round. Each contestant warms up once; then every
    round times each one's batch-1 decode in turn, then each one's concurrent batch in turn."""
    for contestant in contestants:
        contestant.generate([prompts[0]], 4)
        contestant.generate(prompts, 4)
    rates: dict[str, dict[str, list[float]]] = {
        c.system: {DECODE: [], concurrent: []} for c in contestants
    }
    for round_number in range(1, rounds + 1):
        for contestant in contestants:
            first = contestant.generate([prompts[0]], 1)
            full = contestant.generate([prompts[0]], output_len)
            rates[contestant.system][DECODE].append((output_len - 1) / (full - first))
        for contestant in contestants:
            seconds = contestant.generate(prompts, output_len)
            rates[contestant.system][concurrent].append(len(prompts) * output_len / seconds)
        done = ", ".join(
            f"{system} {metrics[DECODE][-1]:.2f} / {metrics[concurrent][-1]:.1f}"
            for system, metrics in rates.items()
        )
        print(
            f"round {round_number}/{rounds} (decode / {concurrent} tokens/s): {done}",
            file=sys.stderr,
        )
    return rates


def paired_ratios(per_round: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    """metric -> median over rounds of kvfleet's rate / transformers' (empty without a peer)."""
    if KVFLEET not in per_round or TRANSFORMERS not in per_round:
        return {}
    ours, theirs = per_round[KVFLEET], per_round[TRANSFORMERS]
    return {
        metric: statistics.median(a / b for a, b in zip(ours[metric], theirs[metric], strict=True))
        for metric in ours
    }


def _kvfleet(model: str, device: str) -> Any:
    from kvfleet_engine import LLM

    return LLM(model, device=device, max_model_len=1024)


def _kvfleet_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to answer the prompts, prefix cache emptied first (every prompt is computed)."""
    from kvfleet_engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.kv_cache.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(out.outputs[0].token_ids) == max_tokens for out in outputs)
    return elapsed


def _transformers(model: str, device: str, dtype: Any) -> Any:
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    return hf.to(device).eval()  # type: ignore[arg-type]


def _hf_generate(hf: Any, prompts: list[list[int]], num_tokens: int, pad_id: int | None) -> float:
    """Seconds for one `generate` call over the prompts, left-padded into one batch."""
    import torch

    pad = 0 if pad_id is None else pad_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)
    _sync(hf.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            do_sample=False, pad_token_id=pad,
        )  # fmt: skip
    _sync(hf.device)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + num_tokens
    return elapsed


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
