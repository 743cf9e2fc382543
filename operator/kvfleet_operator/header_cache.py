"""GGUF headers of hf:// model files, read with ranged GETs and kept per (uri, revision,
credentials), so that a resync does not fetch them again. The only place the operator reads a
model file. A header read with one namespace's token is that namespace's Secret's to see: a
deployment elsewhere, or one without credentials, reads the file itself (a private repository
then answers 401 to it).

The file is `{endpoint}/ORG/REPO/resolve/REVISION/FILE` (the Hub's download URL; the endpoint is
`--hf-endpoint`, default $HF_ENDPOINT or https://huggingface.co, for mirrors). The first MiB is
asked for, then twice as much each time the header does not end inside what was read, up to
MAX_HEADER_BYTES. A read that fails is reported and tried again after RETRY_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from urllib.parse import quote

import httpx

from kvfleet_operator import api
from kvfleet_operator.gguf_header import (
    GGUFHeaderError,
    GGUFSummary,
    GGUFUnavailable,
    parse_gguf_header,
)
from kvfleet_operator.models import ModelSpec

log = logging.getLogger(__name__)

FIRST_RANGE_BYTES = 1 << 20
MAX_HEADER_BYTES = 64 << 20  # large vocabularies take a few MiB; more means something is wrong
RETRY_SECONDS = 300.0
READ_TIMEOUT_SECONDS = 60.0  # the whole read, every range
REQUEST_TIMEOUT_SECONDS = 20.0  # one range

Key = tuple[str, str | None, str | None]  # (uri, revision, "NAMESPACE/SECRET" or None)
TokenSource = Callable[[], Awaitable[str | None]]  # the HF_TOKEN to send, read only when needed


class HeaderCache:
    """The GGUF header summary of each hf:// GGUF file, read once."""

    def __init__(
        self,
        endpoint: str = api.DEFAULT_HF_ENDPOINT,
        *,
        max_bytes: int = MAX_HEADER_BYTES,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._endpoint = endpoint.rstrip("/")
        self._max_bytes = max_bytes
        self._transport = transport  # tests pass an httpx.MockTransport
        self._clock = clock
        self._summaries: dict[Key, GGUFSummary] = {}
        self._failures: dict[Key, tuple[float, GGUFUnavailable]] = {}
        self._locks: defaultdict[Key, asyncio.Lock] = defaultdict(asyncio.Lock)

    def url(self, model: ModelSpec) -> str:
        repo, path = model.hf_file()
        revision = quote(model.revision or "main", safe="")
        return f"{self._endpoint}/{repo}/resolve/{revision}/{quote(path)}"

    async def summary(
        self, model: ModelSpec, token: TokenSource, *, credentials: str | None
    ) -> GGUFSummary | GGUFUnavailable:
        """The header of `model` (an hf:// .gguf URI): from the cache, else read now.
        `credentials` names the Secret `token` reads ("NAMESPACE/NAME"; None: no token)."""
        key = (model.uri, model.revision, credentials)
        async with self._locks[key]:
            if key in self._summaries:
                return self._summaries[key]
            failed = self._failures.get(key)
            if failed is not None and self._clock() - failed[0] < RETRY_SECONDS:
                return failed[1]
            url = self.url(model)
            try:
                async with asyncio.timeout(READ_TIMEOUT_SECONDS):
                    summary = await self._read(url, await token())
            except (httpx.HTTPError, GGUFHeaderError, TimeoutError) as exc:
                unavailable = GGUFUnavailable(_describe(url, exc))
                log.warning("GGUF header of %s not read: %s", model.uri, unavailable.reason)
                self._failures[key] = (self._clock(), unavailable)
                return unavailable
            self._failures.pop(key, None)
            self._summaries[key] = summary
            log.info(
                "GGUF header of %s: %s, %d parameters, %d bytes of weights",
                model.uri,
                summary.architecture,
                summary.num_parameters,
                summary.weight_bytes,
            )
            return summary

    async def _read(self, url: str, token: str | None) -> GGUFSummary:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with httpx.AsyncClient(
            transport=self._transport, follow_redirects=True, timeout=REQUEST_TIMEOUT_SECONDS
        ) as http:
            data = b""
            end = min(FIRST_RANGE_BYTES, self._max_bytes)
            while True:
                data += await _read_range(http, url, len(data), end, headers)
                summary = parse_gguf_header(data)
                if summary is not None:
                    return summary
                if len(data) < end:
                    raise GGUFHeaderError(f"the file ends after {len(data)} bytes, in its header")
                if end >= self._max_bytes:
                    raise GGUFHeaderError(
                        f"no complete GGUF header in the first {self._max_bytes} bytes"
                    )
                end = min(2 * end, self._max_bytes)


async def _read_range(
    http: httpx.AsyncClient, url: str, start: int, end: int, headers: dict[str, str]
) -> bytes:
    """Bytes [start, end) of the file (fewer at its end). From a server that ignores Range and
    sends the whole file, only as much as needed is read."""
    ranged = {**headers, "Range": f"bytes={start}-{end - 1}"}
    async with http.stream("GET", url, headers=ranged) as response:
        if response.status_code == 416:  # start is at or past the end of the file
            return b""
        response.raise_for_status()
        skip = start if response.status_code == 200 else 0
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) >= skip + end - start:
                break
        return bytes(data[skip : skip + end - start])


def _describe(url: str, exc: Exception) -> str:
    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        text = f"GET {url}: HTTP {code}"
        if code in (401, 403):
            text += (
                " (a gated or private repository needs HF_TOKEN in model.credentialsSecret, "
                "readable by the operator)"
            )
        return text
    if isinstance(exc, TimeoutError):
        return f"GET {url}: no complete header within {READ_TIMEOUT_SECONDS:.0f} s"
    if isinstance(exc, httpx.HTTPError):
        return f"GET {url}: {type(exc).__name__}: {exc}"
    return str(exc)
