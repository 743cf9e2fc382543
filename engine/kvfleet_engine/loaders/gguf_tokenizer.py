"""The tokenizer a GGUF file carries in its metadata (`tokenizer.ggml.*`), as a Hugging Face
fast tokenizer with the file's chat template.

Two tokenizer models occur in the files people download: `gpt2` (byte-level BPE with merges:
Llama 3, Qwen2/3, SmolLM) and `llama` (SentencePiece BPE with scores and byte fallback: Llama 2,
Mistral). How a `gpt2` vocabulary splits text before BPE depends on the model family, which
llama.cpp records as `tokenizer.ggml.pre`; each family's split is the one its Hugging Face
tokenizer uses."""

from __future__ import annotations

from typing import Any

from kvfleet_engine.loaders.gguf_metadata import field, open_gguf

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str | None) -> Any:
    """The split before byte-level BPE for llama.cpp's `tokenizer.ggml.pre` value."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder", "refact"):  # each digit on its own, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    splits = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}
    if pre not in splits:
        supported = "default, gpt2, smollm, starcoder, refact, " + ", ".join(splits)
        raise ValueError(
            f"model: GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: {supported}"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(splits[pre]), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _byte_level_bpe(reader: Any, tokens: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models

    merges = [tuple(merge.split(" ", 1)) for merge in field(reader, "tokenizer.ggml.merges", [])]
    vocab = {token: index for index, token in enumerate(tokens)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    core.pre_tokenizer = _pre_tokenizer(field(reader, "tokenizer.ggml.pre"))
    core.decoder = decoders.ByteLevel()
    return core


def _sentencepiece_bpe(reader: Any, tokens: list[str], unk: str | None) -> Any:
    """SentencePiece BPE: merges ranked by the merged piece's score, unknown bytes as <0xNN>."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    vocab = {token: index for index, token in enumerate(tokens)}
    saved = field(reader, "tokenizer.ggml.merges")
    if saved:
        merges = [tuple(merge.split(" ", 1)) for merge in saved]
    else:
        ranked = []
        for piece, index in vocab.items():
            for cut in range(1, len(piece)):
                left, right = piece[:cut], piece[cut:]
                if left in vocab and right in vocab:
                    ranked.append((-scores[index], vocab[left], vocab[right], left, right))
        merges = [(left, right) for *_, left, right in sorted(ranked)]
    core = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
    )
    add_space_prefix = bool(field(reader, "tokenizer.ggml.add_space_prefix", True))
    steps: list[Any] = [normalizers.Prepend("▁")] if add_space_prefix else []
    core.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = 1 if add_space_prefix else 0
    core.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", strip, 0),
        ]
    )
    return core


def gguf_tokenizer(path: str) -> Any:
    """A `PreTrainedTokenizerFast` built from the file's vocabulary, with its special tokens,
    BOS/EOS handling and chat template."""
    from tokenizers import AddedToken, processors
    from transformers import PreTrainedTokenizerFast

    reader = open_gguf(path)
    model = field(reader, "tokenizer.ggml.model")
    tokens: list[str] = field(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ValueError(f"model: GGUF file {path!r} has no tokenizer (tokenizer.ggml.tokens)")
    types: list[int] = field(reader, "tokenizer.ggml.token_type") or [_NORMAL] * len(tokens)

    def token(key: str) -> str | None:
        index = field(reader, f"tokenizer.ggml.{key}_token_id")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos, unk, pad = token("bos"), token("eos"), token("unknown"), token("padding")
    if model == "gpt2":
        core = _byte_level_bpe(reader, tokens)
    elif model == "llama":
        core = _sentencepiece_bpe(reader, tokens, unk)
    else:
        raise ValueError(
            f"model: GGUF tokenizer model {model!r} is not supported; supported: gpt2, llama"
        )
    core.add_special_tokens(
        [
            AddedToken(text, special=kind == _CONTROL, normalized=False)
            for text, kind in zip(tokens, types, strict=True)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )
    add_bos = bool(field(reader, "tokenizer.ggml.add_bos_token", model == "llama"))
    add_eos = bool(field(reader, "tokenizer.ggml.add_eos_token", False))
    single = ([f"{bos}:0"] if add_bos and bos else []) + ["$A:0"]
    single += [f"{eos}:0"] if add_eos and eos else []
    special = [(t, tokens.index(t)) for t in {bos, eos} if t and f"{t}:0" in single]
    core.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=bos,
        eos_token=eos,
        unk_token=unk,
        pad_token=pad or eos,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = field(reader, "tokenizer.chat_template")
    return tokenizer
