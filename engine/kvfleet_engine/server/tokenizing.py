"""Where a request's text is tokenized: on the event loop when it is short, on one worker thread
with its own copy of the tokenizer when it is long.

A megabyte of text takes seconds to tokenize, and /health, streams and other requests must not
wait on it; but a hop to a thread waits for the GIL behind the busy loop: at 256 streams on an
H100, with every prompt hopping, the first token's `sent` hop in GET /debug/profile took 18.9 ms
on average (0.11 ms in an earlier H200 run that tokenized on the loop), with nothing to tokenize
in token-id prompts. The worker tokenizes one text at a time, with a copy of the tokenizer,
since a fast tokenizer used from several threads at once can fail ("Already borrowed") and the
loop keeps using its own (short texts, detokenizing).
"""

from __future__ import annotations

import asyncio
import copy
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Text up to this many characters is tokenized on the loop: ~3 ms with SmolLM2's tokenizer
# (0.4 µs a character), about what parsing a body that size costs.
INLINE_TOKENIZE_CHARS = 8192


class PromptTokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._worker_tokenizer = copy.deepcopy(tokenizer)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvfleet-tokenize")

    async def run(self, chars: int, tokenize: Callable[..., T], *args: Any) -> T:
        """`tokenize(tokenizer, *args)` for a request of about `chars` characters of text."""
        if chars <= INLINE_TOKENIZE_CHARS:
            return tokenize(self.tokenizer, *args)
        return await asyncio.get_running_loop().run_in_executor(
            self._worker, functools.partial(tokenize, self._worker_tokenizer, *args)
        )
