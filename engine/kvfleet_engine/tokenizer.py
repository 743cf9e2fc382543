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
    """The model's tokenizer, its chat template compiled: a template that is not Jinja is refused
    here, naming its file, not at the first chat request."""
    if model.format == "gguf":
        from kvfleet_engine.loaders.gguf_tokenizer import gguf_tokenizer

        tokenizer = gguf_tokenizer(model.path)
        _compile_chat_template(tokenizer.chat_template, f"{model.path}: tokenizer.chat_template")
        return tokenizer
    from transformers import AutoTokenizer

    directory = Path(model.path)
    _check_json_files(directory)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model.path)
    except Exception as error:  # transformers raises whatever its file readers raise
        raise ValueError(
            f"model: {model.path}: the tokenizer files cannot be loaded: "
            f"{type(error).__name__}: {error}"
        ) from error
    templates = tokenizer.chat_template
    named = templates.items() if isinstance(templates, dict) else [(None, templates)]
    for name, template in named:
        _compile_chat_template(template, _template_source(directory, name))
    return tokenizer


def _compile_chat_template(template: Any, source: str) -> None:
    """Compile the template (None: the model has none) with transformers' compiler, whose cache
    `apply_chat_template` then reads at each chat request."""
    if template is None:
        return
    if not isinstance(template, str):
        raise ValueError(f"model: {source} must be a string, got {template!r:.80}")
    from jinja2 import TemplateSyntaxError

    try:  # private: a transformers without it leaves the template to the first chat request
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return
    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as error:
        raise ValueError(
            f"model: {source} is not a valid template: {error.message} (line {error.lineno})"
        ) from None


def _template_source(directory: Path, name: str | None) -> str:
    """Where transformers read the chat template named `name` (None: the only one) from: its
    .jinja file, else tokenizer_config.json's chat_template."""
    default = name in (None, "default")
    jinja = directory / (
        "chat_template.jinja" if default else f"additional_chat_templates/{name}.jinja"
    )
    if jinja.is_file():
        return f"{jinja}:"
    key = "chat_template" if name is None else f"chat_template {name!r}"
    return f"{directory / 'tokenizer_config.json'}: {key}"


# The tokenizer's JSON files (transformers names none of them when one is broken).
_JSON_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _check_json_files(directory: Path) -> None:
    """Each JSON file is an object; tokenizer_config.json's chat_template, where it has one, is
    a template or a list of named ones (transformers would fail on it with a KeyError, or keep
    it until a chat request)."""
    for file in (directory / name for name in _JSON_FILES):
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"model: {file} is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"model: {file} must hold a JSON object, got {type(value).__name__}")
        template = value.get("chat_template")
        if file.name == "tokenizer_config.json" and not _is_chat_template(template):
            raise ValueError(
                f'model: {file}: chat_template must be a string or a list of {{"name": ..., '
                f'"template": ...}} objects, got {template!r:.80}'
            )


def _is_chat_template(value: Any) -> bool:
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, list) and all(
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and isinstance(entry.get("template"), str)
        for entry in value
    )


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
