"""Tiny random checkpoints for each supported architecture and the transformers reference."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvfleet_engine.tiny_model import VOCAB_SIZE, build_byte_tokenizer

TIE = 1e-4  # two best transformers logits closer than this: either token is accepted

_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    bos_token_id=256,
    eos_token_id=257,
)

# name -> (transformers config class name, extra settings)
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    "llama2-tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, head_dim=32, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=32)),
}

_MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
}


def write_checkpoint(
    name: str, directory: Path, seed: int = 0, max_shard_size: str | None = None, **overrides: Any
) -> Any:
    """Save a tiny random model of the named architecture (every weight random, biases and
    norms included) with the byte tokenizer; returns the transformers model (float32, eval)."""
    import transformers

    config_name, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, _MODEL_CLASSES[config_name])(config).float().eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    if max_shard_size is None:
        model.save_pretrained(directory)
    else:
        model.save_pretrained(directory, max_shard_size=max_shard_size)
    build_byte_tokenizer().save_pretrained(directory)
    return model


@dataclass
class Reference:
    tokens: list[int]  # transformers' greedy tokens
    runner_up: list[int]  # second-best token at each step
    gaps: list[float]  # best logit minus second-best at each step
    first_logits: torch.Tensor  # [vocab] logits after the prompt


@torch.no_grad()
def reference_greedy(model: Any, prompt: list[int], max_tokens: int) -> Reference:
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    input_ids = torch.tensor([prompt], device=model.device)
    tokens, runner_up, gaps = [], [], []
    first_logits = None
    for _ in range(max_tokens):
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True)
        logits = out.logits[0, -1].float().cpu()
        if first_logits is None:
            first_logits = logits.clone()
        top = logits.topk(2)
        tokens.append(int(top.indices[0]))
        runner_up.append(int(top.indices[1]))
        gaps.append(float(top.values[0] - top.values[1]))
        input_ids = top.indices[:1][None].to(model.device)
    assert first_logits is not None
    return Reference(tokens, runner_up, gaps, first_logits)


def assert_greedy_equal(
    engine_tokens: list[int], ref: Reference, label: str = "", tie: float = TIE
) -> None:
    """Token for token, except that after a tie the engine may take the runner-up and the
    comparison stops following that sequence."""
    assert len(engine_tokens) == len(ref.tokens), (label, engine_tokens, ref.tokens)
    for step, token in enumerate(engine_tokens):
        if token == ref.tokens[step]:
            continue
        is_tie = ref.gaps[step] < tie and token == ref.runner_up[step]
        assert is_tie, (
            f"{label} step {step}: engine {token}, transformers {ref.tokens[step]} "
            f"(gap {ref.gaps[step]:.2e}); engine {engine_tokens}, transformers {ref.tokens}"
        )
        return


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def run_interpreted(script: str, *args: str, timeout: int) -> Any:
    """`python -c script args` with the Triton kernels under the interpreter (a fresh process:
    TRITON_INTERPRET is read at import); the JSON of its last line of output. `timeout` guards
    against a hang, not speed: an interpreted engine run takes 4-5 minutes on a 2-core machine
    whose other core runs the other test worker."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
