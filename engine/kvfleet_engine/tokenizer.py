"""The model's tokenizer: from the Hugging Face directory, or built from the GGUF metadata; and
the raw bytes each token stands for (OpenAI's logprobs `bytes`)."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any

from kvfleet_engine.config import ModelConfig


def load_tokenizer(model: ModelConfig) -> Any:
    if model.format == "gguf":
        from kvfleet_engine.loaders.gguf_tokenizer import gguf_tokenizer

        return gguf_tokenizer(model.path)
    from transformers import AutoTokenizer

    _check_json_files(Path(model.path))
    try:
        return AutoTokenizer.from_pretrained(model.path)
    except Exception as error:  # transformers raises whatever its file readers raise
        raise ValueError(
            f"model: {model.path}: the tokenizer files cannot be loaded: "
            f"{type(error).__name__}: {error}"
        ) from error


# The tokenizer's JSON files (transformers names none of them when one is broken).
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _check_json_files(directory: Path) -> None:
    for file in (directory / name for name in _JSON_FILES):
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"model: {file} is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"model: {file} must hold a JSON object, got {type(value).__name__}")


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte 0..255 in byte-level BPE vocabularies (GPT-2's
    table): printable Latin-1 characters stand for themselves, the rest for chr(256 + k)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


@functools.cache
def _byte_of_symbol() -> dict[str, int]:
    return {symbol: byte for byte, symbol in enumerate(byte_symbols())}


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


class TokenBytes:
    """The UTF-8 bytes a token id stands for, which decoding it alone loses where it holds
    part of a character (decode gives U+FFFD): from its vocabulary piece, read through GPT-2's
    byte table (byte-level BPE), as one byte (SentencePiece's <0xNN>) or with "▁" as a space
    (other SentencePiece pieces); decoded text for added tokens outside those forms."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self.special = set(getattr(tokenizer, "all_special_tokens", ()))

    def __call__(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece not in self.special:
            if self.byte_level:
                table = _byte_of_symbol()
                if all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
            else:
                match = _BYTE_PIECE.fullmatch(piece)
                if match:
                    return bytes([int(match.group(1), 16)])
                return piece.replace("\u2581", " ").encode()
        text: str = self.tokenizer.decode([token_id])
        return text.encode()
