"""Incremental detokenization and stop strings, with the byte-level tokenizer."""

from __future__ import annotations

import pytest

from kvfleet_engine.detokenizer import IncrementalDetokenizer
from kvfleet_engine.sampling import SamplingParams
from kvfleet_engine.tiny_model import build_byte_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_byte_tokenizer()


def feed(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    texts = []
    for token_id in ids:
        detok.update([token_id])
        texts.append(detok.output_text(finished=False))
    return texts


def test_text_grows_token_by_token_and_waits_for_whole_characters(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("say: "), SamplingParams())
    texts = feed(detok, tokenizer.encode("hé!"))
    assert texts == ["h", "h", "hé", "hé!"]  # "é" is two bytes


def test_special_tokens_are_skipped_unless_asked(tokenizer) -> None:  # type: ignore[no-untyped-def]
    ids = [*tokenizer.encode("ok"), tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, [65], SamplingParams())
    skip.update(ids)
    keep = IncrementalDetokenizer(tokenizer, [65], SamplingParams(skip_special_tokens=False))
    keep.update(ids)
    assert skip.output_text(True) == "ok" and keep.output_text(True) == "ok</s>"


def test_stop_string_is_found_across_tokens_and_left_out(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, [65], SamplingParams(stop=["lo w", "zzz"]))
    matched = None
    for token_id in tokenizer.encode("hello world"):
        matched = detok.update([token_id])
        if matched:
            break
    assert matched == "lo w"
    assert detok.output_text(finished=True) == "hel"


def test_running_text_holds_back_a_possible_stop_prefix(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, [65], SamplingParams(stop=["END"]))
    texts = feed(detok, tokenizer.encode("abcEN"))
    assert texts[-1] == "abc"  # "EN" might become "END"
    assert detok.output_text(finished=True) == "abcEN"


def test_incomplete_bytes_are_flushed_when_generation_ends(tokenizer) -> None:  # type: ignore[no-untyped-def]
    detok = IncrementalDetokenizer(tokenizer, [65], SamplingParams())
    detok.update([104, 0xC3])  # "h", then the first byte of a two-byte character
    assert detok.output_text(finished=False) == "h"
    detok.update([0xFF], final=True)
    assert detok.output_text(finished=True) == tokenizer.decode([104, 0xC3, 0xFF])


def test_decoding_all_at_the_end_gives_the_token_by_token_text(tokenizer) -> None:  # type: ignore[no-untyped-def]
    prompt = tokenizer.encode("prompt é")
    outputs = [*tokenizer.encode("añb €x"), 0xE2, 0x82, 104, 0xC3, tokenizer.eos_token_id]
    outputs += [0xE2]  # ends inside a character: flushed at the end either way
    streamed = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for index, token_id in enumerate(outputs):
        streamed.update([token_id], final=index == len(outputs) - 1)
    at_end = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    assert at_end.decode_all(outputs) == streamed.output_text(finished=True)
    assert "ñ" in at_end.text and "€" in at_end.text
