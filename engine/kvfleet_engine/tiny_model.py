"""`kvfleet tiny-model DIR`: write a tiny random Llama checkpoint with a byte-level tokenizer and
a chat template. It generates noise, but exercises every code path: the embedded default model
for demos and tests."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from kvfleet_engine import argtypes
from kvfleet_engine.tokenizer import byte_symbols

log = logging.getLogger(__name__)

BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END)
# 256 byte tokens, then the special tokens.
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer (every UTF-8 byte is one token, no merges) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    for offset, special in enumerate(SPECIAL_TOKENS):
        vocab[special] = 256 + offset
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama_config(**overrides: Any) -> Any:
    from transformers import LlamaConfig

    tokenizer_ids = {special: 256 + i for i, special in enumerate(SPECIAL_TOKENS)}
    settings: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer_ids[BOS],
        eos_token_id=[tokenizer_ids[EOS], tokenizer_ids[IM_END]],
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)


def write_tiny_model(directory: Path, seed: int = 0, **config_overrides: Any) -> Path:
    """Save a random tiny Llama (float32 safetensors) plus tokenizer to directory."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = tiny_llama_config(**config_overrides)
    model = LlamaForCausalLM(config)  # float32
    model.save_pretrained(directory)
    build_byte_tokenizer().save_pretrained(directory)
    return directory


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet tiny-model",
        description="Write a tiny random Llama checkpoint (byte-level tokenizer, chat template).",
    )
    parser.add_argument("directory", type=Path, help="where to write it (created if missing)")
    parser.add_argument("--seed", type=argtypes.seed, default=0, help="seed of the random weights")
    parser.add_argument("--force", action="store_true", help="overwrite a non-empty directory")
    args = parser.parse_args(argv)
    directory: Path = args.directory
    if directory.exists() and not directory.is_dir():
        print(f"kvfleet tiny-model: {directory} exists and is not a directory", file=sys.stderr)
        return 2
    if directory.is_dir() and any(directory.iterdir()) and not args.force:
        print(
            f"kvfleet tiny-model: {directory} is not empty (use --force to overwrite)",
            file=sys.stderr,
        )
        return 2
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"kvfleet tiny-model: cannot create {directory}: {error.strerror}", file=sys.stderr)
        return 2
    write_tiny_model(directory, seed=args.seed)
    print(f"wrote a tiny random Llama to {directory}")
    return 0
