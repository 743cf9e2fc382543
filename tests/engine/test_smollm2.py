"""SmolLM2-135M-Instruct, the embedded model (a real Q4_1 GGUF file), against transformers
loading the same file with its own GGUF loader: on CPU in float32 the greedy tokens of 20 chat
prompts are identical, 64 tokens each, including a prompt of more than 1,000 tokens, prompts
served from the prefix cache and requests preempted for lack of KV blocks. transformers' side is
computed once per model file, torch and transformers version, and kept on disk
(`~/.cache/kvfleet/test-references/`, or under $KVFLEET_CACHE_DIR)."""

from __future__ import annotations

import hashlib
import json
import pydoc_data.topics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import Reference, assert_greedy_equal

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.model_store import DEFAULT_MODEL, fetch, models_dir

pytestmark = pytest.mark.slow

NEW_TOKENS = 64
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish and German.",
    "What is the difference between weather and climate?",
    "Name the planets of the solar system in order.",
    "How do I reverse a list in Python?",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "What does a compiler do?",
    "Summarise the plot of Romeo and Juliet.",
    "What are the primary colours?",
    "How many legs does a spider have?",
    "Write a short apology for being late to a meeting.",
    "What is photosynthesis?",
    "Describe a cat to someone who has never seen one.",
]
# A follow-up turn: its prompt extends the first conversation's, so it is served from the cache.
FOLLOW_UP = [
    {"role": "user", "content": QUESTIONS[0]},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And what is it famous for?"},
]
LONG_TEXT = pydoc_data.topics.topics["for"] + pydoc_data.topics.topics["with"]  # ~1,270 tokens


def _long_question(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{LONG_TEXT}\n\n{question}"}]


def _conversations() -> list[list[dict[str, str]]]:
    single = [[{"role": "user", "content": q}] for q in QUESTIONS]
    longs = [_long_question("Summarise the text above."), _long_question("What is it about?")]
    # Two waves of 10: the second starts by extending a first-wave conversation and repeating the
    # long text (admitted first, they find those blocks before the rest of the wave evicts them).
    return [*single[:9], longs[0], FOLLOW_UP, longs[1], *single[9:]]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return fetch(DEFAULT_MODEL)


def transformers_greedy(
    smollm2: Path, waves: list[list[list[int]]], pad_id: int
) -> list[Reference]:
    """transformers loading the same file: each wave's greedy references, one batch a wave."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32
    ).eval()
    return [ref for wave in waves for ref in reference_greedy_batch(model, wave, pad_id)]


def cached_references(
    smollm2: Path, prompts: list[list[int]], pad_id: int, compute: Callable[[], list[Reference]]
) -> list[Reference]:
    """`compute()`'s greedy tokens, runner-ups and gaps, kept on disk beside the cached model
    and keyed by everything they depend on (the file's bytes, the torch and transformers
    versions, the prompts, the pad id, NEW_TOKENS): transformers' batches take 5-10 minutes
    of the CI machine's CPU, and they come out the same every time."""
    import transformers

    key = hashlib.sha256()
    with smollm2.open("rb") as model_file:
        for chunk in iter(lambda: model_file.read(1 << 20), b""):
            key.update(chunk)
    key.update(json.dumps([torch.__version__, transformers.__version__]).encode())
    key.update(json.dumps([prompts, pad_id, NEW_TOKENS]).encode())
    path = models_dir().parent / "test-references" / f"smollm2-greedy-{key.hexdigest()[:24]}.json"
    if path.exists():
        rows = json.loads(path.read_text())
        return [Reference(r["tokens"], r["runner_up"], r["gaps"], torch.empty(0)) for r in rows]
    references = compute()
    rows = [{"tokens": r.tokens, "runner_up": r.runner_up, "gaps": r.gaps} for r in references]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(rows))
    partial.replace(path)
    return references


def test_chat_answer_is_real(smollm2: Path) -> None:
    llm = LLM(str(smollm2), device="cpu", max_model_len=512)
    chat = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
    )
    out = llm.generate([chat], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


def reference_greedy_batch(model: Any, prompts: list[list[int]], pad_id: int) -> list[Reference]:
    """transformers' greedy tokens for each prompt, NEW_TOKENS each (EOS an ordinary token), the
    prompts left-padded into one batch, with each step's runner-up and logit gap (for ties)."""
    from transformers import DynamicCache

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor(
        [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
    )  # [prompts, width]
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    steps = []  # [prompts, vocab] logits of each step
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            out = model(
                input_ids=ids, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            )  # fmt: skip
            steps.append(out.logits[:, -1].float())
            ids = steps[-1].argmax(dim=-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
            positions = positions[:, -1:] + 1
    logits = torch.stack(steps, dim=1)  # [prompts, NEW_TOKENS, vocab]
    top = logits.topk(2, dim=-1)
    return [
        Reference(
            tokens=top.indices[row, :, 0].tolist(),
            runner_up=top.indices[row, :, 1].tolist(),
            gaps=(top.values[row, :, 0] - top.values[row, :, 1]).tolist(),
            first_logits=logits[row, 0],
        )
        for row in range(len(prompts))
    ]


@pytest.mark.timeout(1800)  # uncached, transformers' batches took > 600 s beside another worker
def test_greedy_tokens_match_transformers(smollm2: Path) -> None:
    # 128 blocks of 16 = one 2,048-token sequence: the waves need more, so requests are
    # preempted and recomputed.
    llm = LLM(str(smollm2), device="cpu", dtype="float32", max_model_len=2048, kv_cache_blocks=128)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
        for messages in _conversations()
    ]
    assert len(prompts) == 20 and max(len(p) for p in prompts) > 1000
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    half = len(prompts) // 2
    outputs = llm.generate(prompt_token_ids=prompts[:half], sampling_params=params, use_tqdm=False)
    outputs += llm.generate(prompt_token_ids=prompts[half:], sampling_params=params, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.num_preemptions_total > 0
    cached = {i: out.num_cached_tokens for i, out in enumerate(outputs) if out.num_cached_tokens}
    assert cached.get(half, 0) >= 32, cached  # the follow-up turn
    assert cached.get(half + 1, 0) > 1000, cached  # the long text, second time
    pad = tokenizer.pad_token_id
    waves = [prompts[:half], prompts[half:]]
    expected = cached_references(
        smollm2, prompts, pad, lambda: transformers_greedy(smollm2, waves, pad)
    )
    for index, (out, ref) in enumerate(zip(outputs, expected, strict=True)):
        assert_greedy_equal(list(out.outputs[0].token_ids), ref, f"prompt {index}")


def test_tokenizer_matches_transformers_gguf_tokenizer(smollm2: Path) -> None:
    """Same ids as transformers' GGUF tokenizer on text without digits; digits are split one by
    one, as SmolLM2's own tokenizer.json and llama.cpp (`tokenizer.ggml.pre = smollm`) do."""
    from transformers import AutoTokenizer

    ours = LLM(str(smollm2), device="cpu", max_model_len=512).get_tokenizer()
    theirs = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    for messages in _conversations():
        text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert text == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        if not any(ch.isdigit() for ch in text):
            assert ours.encode(text) == theirs.encode(text)
    assert ours.encode("2026") == [ours.convert_tokens_to_ids(d) for d in "2026"]
    assert ours.decode(ours.encode("Hello, wörld 42!")) == "Hello, wörld 42!"


@pytest.mark.gpu
def test_gpu_bfloat16_agreement_with_transformers(smollm2: Path) -> None:
    """bf16 on the GPU (CUDA graphs, Triton kernels) against transformers in bf16 on the same
    GPU: rounding differs, so greedy paths may part after a while; the matched prefix of each of
    the 20 prompts is printed (run with -s); the median must be 8 tokens or more, and the first
    token must agree for 16 of the 20 prompts. (Greedy equality is checked on the CPU, in
    float32, by test_greedy_tokens_match_transformers.)"""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(
        str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.bfloat16
    ).to("cuda")
    llm = LLM(str(smollm2), device="cuda", dtype="bfloat16", max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )
        for messages in _conversations()
    ]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    matched = []
    for prompt, out in zip(prompts, outputs, strict=True):
        theirs = reference_greedy_batch(reference, [prompt], tokenizer.pad_token_id)[0].tokens
        ours = list(out.outputs[0].token_ids)
        pairs = enumerate(zip(ours, theirs, strict=True))
        matched.append(next((i for i, (a, b) in pairs if a != b), NEW_TOKENS))
    print(f"\nbf16 matched prefix of {NEW_TOKENS} tokens, per prompt: {matched}")
    print(f"mean {sum(matched) / len(matched):.1f}, full matches {matched.count(NEW_TOKENS)}/20")
    # Two H200 runs (2026-12-01): means 31.8 and 18.9 tokens, medians 18 and 15; bf16 rounding of
    # a 576-wide model flips near-ties, even the first token of 2 of 20 prompts in one run.
    assert sorted(matched)[len(matched) // 2] >= 8
    assert sum(m >= 1 for m in matched) >= 16
