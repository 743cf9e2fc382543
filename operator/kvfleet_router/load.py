"""Each replica's load: its /metrics read every `scrape_interval_s` (>= 10 Hz; less often past
MAX_SCRAPES_PER_S for the whole fleet), one task per replica so a slow engine delays only its
own reads.

The router reads the kvfleet names and falls back to the vLLM ones, so it fronts vLLM engines as
well: `kvfleet_requests_waiting` (`vllm:num_requests_waiting`), `kvfleet_requests_running`
(`vllm:num_requests_running`), `kvfleet_kv_cache_usage_ratio` (`vllm:kv_cache_usage_perc`) and
`vllm:cache_config_info{block_size, num_gpu_blocks}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time

import aiohttp

from kvfleet_router.replicas import LoadSample, Replica, ReplicaPool

log = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 1.0
# A replica that times out this many reads in a row is taken out (a refused connection: at once).
MAX_MISSED_SCRAPES = 3
# All replicas together are read at most this often (a second): 2,000 endpoints at 10 Hz kept
# the router's one event loop busy 60% of the time with refused connections alone. Past 100
# replicas each is read less often than `scrape_interval_s`.
MAX_SCRAPES_PER_S = 1000.0
# A larger /metrics answer is not an engine's (vLLM's, histograms and all, is ~100 KB): one
# that never ended was read whole for the scrape's second, hundreds of MB ten times a second.
MAX_METRICS_BYTES = 4 << 20

_GAUGES = {
    "kvfleet_requests_waiting": "waiting",
    "vllm:num_requests_waiting": "waiting",
    "kvfleet_requests_running": "running",
    "vllm:num_requests_running": "running",
    "kvfleet_kv_cache_usage_ratio": "kv_usage",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
_CACHE_INFO = "vllm:cache_config_info"
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_load(text: str) -> LoadSample:
    """The router's gauges out of a Prometheus text exposition. Raises ValueError when the
    queue gauge is absent or a gauge is NaN, infinite or negative: such an endpoint is not an
    engine the router can route to. A KV usage past 1 reads as 1."""
    values: dict[str, float] = {}
    first: dict[str, str] = {}  # gauge kind -> the metric name that gave it (kvfleet_ first)
    models: set[str] = set()
    cache: dict[str, str] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        name = line[:brace] if brace >= 0 else line.split(" ", 1)[0]
        kind = _GAUGES.get(name)
        if kind is None and name != _CACHE_INFO:
            continue
        labels = dict(_LABEL.findall(line[brace : line.rfind("}") + 1])) if brace >= 0 else {}
        if kind is None:
            cache = labels
            continue
        if kind in first and first[kind] != name:
            continue  # both names are exported: keep the one read first
        first[kind] = name
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            raise ValueError(f"bad sample line: {line[:80]!r}") from None
        if not value >= 0 or value == math.inf:
            # A NaN made every load comparison false, a negative queue drew all the traffic.
            raise ValueError(f"{name} is {value}: no engine exports that")
        values[kind] = (
            max(values.get(kind, 0.0), value)
            if kind == "kv_usage"
            else (values.get(kind, 0.0) + value)
        )
        if "model_name" in labels:
            models.add(labels["model_name"])
    if "waiting" not in values:
        raise ValueError("no kvfleet_requests_waiting / vllm:num_requests_waiting gauge")
    return LoadSample(
        waiting=values["waiting"],
        running=values.get("running", 0.0),
        kv_usage=min(values.get("kv_usage", 0.0), 1.0),
        num_gpu_blocks=_positive_int(cache.get("num_gpu_blocks")),
        block_size=_positive_int(cache.get("block_size")),
        model_names=frozenset(models),
    )


def _positive_int(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number >= 1 else None


class LoadScraper:
    """Keeps one scraping task per pool member."""

    def __init__(self, pool: ReplicaPool, session: aiohttp.ClientSession, interval_s: float):
        self._pool = pool
        self._session = session
        self._interval_s = interval_s
        # address -> the member object its task scrapes, and the task
        self._tasks: dict[str, tuple[Replica, asyncio.Task[None]]] = {}

    async def run(self) -> None:
        """Follow membership changes until cancelled."""
        try:
            while True:
                self.sync()
                await self._pool.wait_changed(timeout=1.0)
        finally:
            for _, task in self._tasks.values():
                task.cancel()
            for _, task in self._tasks.values():
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def sync(self) -> None:
        """Start tasks for new members, stop those of members that left. A member that left and
        came back between two syncs is a new object: its task is replaced, or the old task
        would go on scraping into the object the pool dropped."""
        members = self._pool.members
        for address, (scraped, task) in list(self._tasks.items()):
            if members.get(address) is not scraped or task.done():
                del self._tasks[address]
                task.cancel()
        for address, replica in members.items():
            if address not in self._tasks:
                self._tasks[address] = (replica, asyncio.create_task(self._scrape_forever(replica)))

    async def _scrape_forever(self, replica: Replica) -> None:
        missed = 0
        url = f"{replica.url}/metrics"
        timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
        while True:
            started = time.monotonic()
            sample: LoadSample | None = None
            refused = False
            failure = "timed out"
            try:
                async with self._session.get(url, timeout=timeout) as response:
                    if response.status == 200:
                        sample = parse_load(await _read_text(response, MAX_METRICS_BYTES))
                    else:
                        failure = f"answered {response.status}"
            except (TimeoutError, ValueError, aiohttp.ClientPayloadError) as exc:
                log.debug("scrape of %s failed: %s", url, exc)  # busy, or not an engine
                failure = str(exc) or type(exc).__name__
            except aiohttp.ClientError as exc:
                refused = True  # nothing listens there (any more)
                failure = str(exc) or type(exc).__name__
            missed = 0 if sample is not None else missed + 1
            if sample is not None or refused or missed >= MAX_MISSED_SCRAPES:
                was = replica.reachable
                self._pool.observe_scrape(replica, sample)
                if was and not replica.reachable:
                    log.warning("replica %s (%s) out: its /metrics %s", replica.name, url, failure)
            elapsed = time.monotonic() - started
            interval = max(self._interval_s, len(self._pool.members) / MAX_SCRAPES_PER_S)
            await asyncio.sleep(max(0.0, interval - elapsed))


async def _read_text(response: aiohttp.ClientResponse, limit: int) -> str:
    """The body as text, if it is at most `limit` bytes (ValueError past that)."""
    data = bytearray()
    while chunk := await response.content.read(limit + 1 - len(data)):
        data += chunk
        if len(data) > limit:
            raise ValueError(f"answer is over {limit} bytes")
    return data.decode("utf-8", "replace")
