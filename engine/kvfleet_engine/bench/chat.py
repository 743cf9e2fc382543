"""`kvfleet bench chat`: a real model answering chat prompts, kvfleet against `transformers` on
the same file, device and prompts (default: the embedded SmolLM2 on the CPU).

Two figures per system, greedy, `--output-len` tokens per answer (EOS ignored, so both produce
the same number of tokens):
- batch-1 decode tokens/s: (output_len - 1) tokens over the time an output_len-token answer
  takes beyond a 1-token one (prefill and the first token);
- `--concurrency` chats at once: all output tokens over the wall time of the batch (prefill
  included). transformers runs them as one left-padded `generate` batch.

    kvfleet bench chat --device cpu --concurrency 8 --output-len 128 --output bench/results
"""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from kvfleet_engine.argtypes import positive_int

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is.",
    "Give me three tips for sleeping better.",
    "Why is the sky blue?",
    "What does a compiler do?",
    "Summarise the plot of Romeo and Juliet.",
    "What is photosynthesis?",
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet bench chat", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF file or model directory (default: SmolLM2)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--concurrency", type=positive_int, default=8)
    parser.add_argument("--output-len", type=positive_int, default=128)
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--output", type=Path, help="write the results JSON in this directory")
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be >= 2 (a decode rate needs two tokens)")
    import torch

    from kvfleet_engine.bench.results import Row, format_table, gpu_name, write_results
    from kvfleet_engine.model_store import DEFAULT_MODEL, fetch

    model = args.model or str(fetch(DEFAULT_MODEL))
    llm = _kvfleet(model, args.device)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
            )
        )
        for q in (QUESTIONS * args.concurrency)[: args.concurrency]
    ]
    concurrent = f"c{args.concurrency}_output_tokens_per_s"
    decode = _kvfleet_decode_rate(llm, prompts[0], args.output_len)
    batch = _kvfleet_batch_rate(llm, prompts, args.output_len)
    rows = [
        Row("kvfleet", "decode_tokens_per_s", decode, "tokens/s"),
        Row("kvfleet", concurrent, batch, "tokens/s"),
    ]
    del llm
    if not args.no_peer:
        from kvfleet_engine.bench import peers

        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        hf = _transformers(model, args.device, dtype)
        decode = peers.generate_decode_rate(hf, prompts[0], args.output_len)
        batch = _hf_batch_rate(hf, prompts, args.output_len, tokenizer.pad_token_id)
        rows += [
            Row("transformers-generate", "decode_tokens_per_s", decode, "tokens/s"),
            Row("transformers-generate", concurrent, batch, "tokens/s"),
        ]
    print(format_table(rows))
    if args.output is not None:
        workload = {
            "model": Path(model).name,
            "device": args.device,
            "threads": torch.get_num_threads(),
            "concurrency": args.concurrency,
            "prompt_lens": [len(p) for p in prompts],
            "output_len": args.output_len,
            "sampling": "greedy, ignore_eos",
        }
        command = shlex.join(["kvfleet", "bench", "chat", *argv])
        device = gpu_name(torch.device(args.device))
        what = "chat-smollm2" if args.model is None else f"chat-{Path(model).stem}"
        path = write_results(args.output, what, device, command, workload["model"], workload, rows)
        print(f"wrote {path}")
    return 0


def _kvfleet(model: str, device: str) -> Any:
    from kvfleet_engine import LLM

    return LLM(model, device=device, max_model_len=1024)


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds to answer the prompts, prefix cache emptied first (every prompt is computed)."""
    from kvfleet_engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.kv_cache.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    assert all(len(out.outputs[0].token_ids) == max_tokens for out in outputs)
    return time.perf_counter() - start


def _kvfleet_decode_rate(llm: Any, prompt: list[int], output_len: int) -> float:
    _generate(llm, [prompt], 4)  # warm-up
    first = _generate(llm, [prompt], 1)
    return (output_len - 1) / (_generate(llm, [prompt], output_len) - first)


def _kvfleet_batch_rate(llm: Any, prompts: list[list[int]], output_len: int) -> float:
    _generate(llm, prompts, 4)  # warm-up
    return len(prompts) * output_len / _generate(llm, prompts, output_len)


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


def _hf_batch_rate(hf: Any, prompts: list[list[int]], output_len: int, pad_id: int) -> float:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=hf.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf.device)

    def run(num_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=mask, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                do_sample=False, pad_token_id=pad_id,
            )  # fmt: skip
        assert out.shape[1] == width + num_tokens
        return time.perf_counter() - start

    run(4)  # warm-up
    return len(prompts) * output_len / run(output_len)
