"""`kvfleet bench serve` workloads: the requests of the `random`, `jsonl` and `chat` datasets."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfleet_engine.bench.chat import QUESTIONS


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (random dataset: exact input lengths)
    num_prompt_tokens: int  # input length as the dataset knows it (0 if unknown)
    max_tokens: int  # output length asked for


def random_requests(
    num: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    token_range: tuple[int, int],
    seed: int,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """Prompts of random token ids; lengths uniform in [len*(1-ratio), len*(1+ratio)]. The first
    `prefix_len` tokens of every prompt are the same (a shared system prompt, say)."""
    rng = random.Random(seed)
    low, high = token_range
    prefix = [rng.randint(low, high) for _ in range(prefix_len)]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    requests = []
    for _ in range(num):
        n_in = max(length(input_len), prefix_len + 1)
        ids = prefix + [rng.randint(low, high) for _ in range(n_in - prefix_len)]
        requests.append(BenchRequest(ids, n_in, length(output_len)))
    return requests


def jsonl_requests(path: Path, num: int, default_output_len: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str or token ids, "output_len": int (optional)};
    ValueError naming the file, the line and the key otherwise."""
    requests = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f'{where}: expected {{"prompt": ...}}, got {line.strip()[:80]}')
            requests.append(_jsonl_request(where, row, default_output_len))
            if len(requests) == num:
                break
    if not requests:
        raise ValueError(f"{path}: no prompts found")
    return requests


def _jsonl_request(where: str, row: dict[str, Any], default_output_len: int) -> BenchRequest:
    prompt, output_len = row["prompt"], row.get("output_len", default_output_len)
    is_text = isinstance(prompt, str) and prompt != ""
    is_token_ids = isinstance(prompt, list) and prompt != [] and all(map(_is_count, prompt))
    if not (is_text or is_token_ids):
        raise ValueError(
            f'{where}: "prompt" must be a non-empty string or list of token ids, got {prompt!r}'
        )
    if not (_is_count(output_len) and output_len >= 1):
        raise ValueError(f'{where}: "output_len" must be an integer >= 1, got {output_len!r}')
    return BenchRequest(prompt, 0 if is_text else len(prompt), output_len)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def chat_requests(num: int, output_len: int) -> list[BenchRequest]:
    """The built-in chat questions in turn, each answered in at most `output_len` tokens."""
    return [BenchRequest(QUESTIONS[i % len(QUESTIONS)], 0, output_len) for i in range(num)]
