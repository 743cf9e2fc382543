"""Plain stats records in, Prometheus metrics out: the one module that imports prometheus_client.

Metric contract v1 (README "Metrics (contract v1)" lists it): the `kvfleet_` names are ours and
stable; the `vllm:` names mirror vLLM so the Gateway API Inference Extension, KEDA/HPA rules and
existing Grafana dashboards read kvfleet unchanged. Every metric carries `model_name`.

Gauges and token counters are read from the newest `SchedulerStats` snapshot at scrape time
(the engine keeps the totals), histograms and per-reason counters are fed one `IterationStats`
per engine step.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kvfleet_engine.outputs import STEP_KINDS, SchedulerStats

CONTRACT_VERSION = "v1"

FINISH_REASONS = ("stop", "length", "abort")
REJECT_REASONS = ("queue_full", "ttft_slo", "draining")

# Bucket edges follow vLLM's so dashboards built for it keep their resolution.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass(frozen=True)
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort"
    e2e_latency_s: float  # arrival -> finish
    queue_time_s: float | None  # arrival -> first scheduled; None if never scheduled


@dataclass(frozen=True)
class IterationStats:
    """What one engine step (or one batch of its outputs) adds to the histograms."""

    ttfts_s: list[float] = field(default_factory=list)  # one per request that got its 1st token
    inter_token_latencies_s: list[float] = field(default_factory=list)  # one per later token
    finished: list[FinishedRequestStats] = field(default_factory=list)


@dataclass(frozen=True)
class EngineInfo:
    model: str  # served model name
    version: str  # kvfleet version
    quantization: str  # the method running the weights ("none": plain weights)
    tensor_parallel_size: int
    world_size: int = 1  # ranks (processes) of the replica: tensor x pipeline parallel sizes


# Before the first engine step every gauge and counter reads 0 (and is present).
_NO_STATS = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)


class EngineMetrics:
    """All engine metrics in their own registry (so several engines can live in one process)."""

    def __init__(self, info: EngineInfo) -> None:
        self.info = info
        self.registry = CollectorRegistry(auto_describe=True)
        self._snapshot: SchedulerStats | None = None
        self._baseline: SchedulerStats = _NO_STATS  # totals before serving (self-benchmark)
        self._capacity_tokens_per_second: float | None = None
        self._cache_config: tuple[int, int] | None = None  # (block_size, num_gpu_blocks)
        labels = ["model_name"]
        self._ttft = _histogram_pair(
            self.registry, "time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS
        )
        self._itl = _histogram_pair(
            self.registry, "inter_token_latency_seconds", "Time between output tokens.", ITL_BUCKETS
        )
        self._e2e = _histogram_pair(
            self.registry, "e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS
        )
        self._queue = Histogram(
            "kvfleet_request_queue_time_seconds",
            "Arrival to first scheduled.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._success = Counter(
            "kvfleet_request_success",
            "Finished requests by finish reason.",
            [*labels, "finish_reason"],
            registry=self.registry,
        )
        self._rejected = Counter(
            "kvfleet_requests_rejected",
            "Requests turned away by admission control, by reason.",
            [*labels, "reason"],
            registry=self.registry,
        )
        model = info.model
        for reason in FINISH_REASONS:
            self._success.labels(model, reason)
        for reason in REJECT_REASONS:
            self._rejected.labels(model, reason)
        self._queue.labels(model)
        # The labelled children, resolved once: observe_iteration runs for every token, and
        # labels() costs more than observe() itself.
        self._ttft_children = [hist.labels(model) for hist in self._ttft]
        self._itl_children = [hist.labels(model) for hist in self._itl]
        self._e2e_children = [hist.labels(model) for hist in self._e2e]
        self.registry.register(_SnapshotCollector(self))

    # --- inputs ----------------------------------------------------------------------------

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        self._snapshot = stats

    def set_baseline(self, stats: SchedulerStats) -> None:
        """Leave the start-up self-benchmark's tokens out of the exported totals."""
        self._baseline = stats
        self._snapshot = stats

    def observe_iteration(self, stats: IterationStats) -> None:
        model = self.info.model
        for ttft in stats.ttfts_s:
            for child in self._ttft_children:
                child.observe(ttft)
        for itl in stats.inter_token_latencies_s:
            for child in self._itl_children:
                child.observe(itl)
        for done in stats.finished:
            for child in self._e2e_children:
                child.observe(done.e2e_latency_s)
            if done.queue_time_s is not None:
                self._queue.labels(model).observe(done.queue_time_s)
            self._success.labels(model, done.finish_reason).inc()

    def observe_rejected(self, reason: str) -> None:
        if reason not in REJECT_REASONS:
            raise ValueError(f"reason must be one of {REJECT_REASONS}, got {reason!r}")
        self._rejected.labels(self.info.model, reason).inc()

    def set_capacity(self, tokens_per_second: float) -> None:
        self._capacity_tokens_per_second = tokens_per_second

    def set_cache_config(self, block_size: int, num_gpu_blocks: int) -> None:
        """The KV cache's shape, for vllm:cache_config_info (what a GIE endpoint picker and
        kvfleet router read to size their prefix indexes)."""
        self._cache_config = (block_size, num_gpu_blocks)

    # --- output ----------------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """(exposition text, content type) for GET /metrics."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _histogram_pair(
    registry: CollectorRegistry, name: str, doc: str, buckets: Iterable[float]
) -> tuple[Histogram, Histogram]:
    """The same histogram under its kvfleet_ and its vllm: name."""
    edges = tuple(buckets)
    return (
        Histogram(f"kvfleet_{name}", doc, ["model_name"], buckets=edges, registry=registry),
        Histogram(f"vllm:{name}", doc, ["model_name"], buckets=edges, registry=registry),
    )


class _SnapshotCollector(Collector):
    """Gauges and engine-side totals, read from the newest scheduler snapshot at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterable[Metric]:
        return []  # names are only known at collect time; describe lazily

    def collect(self) -> Iterator[Metric]:
        m = self._metrics
        info = m.info
        labels = ["model_name"]
        value = [info.model]

        info_gauge = GaugeMetricFamily(
            "kvfleet_engine_info",
            "Static engine facts; value is always 1.",
            labels=["model", "version", "quantization", "tensor_parallel_size"],
        )
        info_gauge.add_metric(
            [info.model, info.version, info.quantization, str(info.tensor_parallel_size)], 1.0
        )
        yield info_gauge

        world = GaugeMetricFamily(
            "kvfleet_parallel_world_size",
            "Ranks (processes, GPUs) this replica runs on: tensor x pipeline parallel size.",
        )
        world.add_metric([], float(info.world_size))
        yield world

        if m._capacity_tokens_per_second is not None:
            capacity = GaugeMetricFamily(
                "kvfleet_engine_capacity_tokens_per_second",
                "Generation tokens/s this replica sustains, from the start-up self-benchmark.",
                labels=labels,
            )
            capacity.add_metric(value, m._capacity_tokens_per_second)
            yield capacity

        if m._cache_config is not None:
            block_size, num_gpu_blocks = m._cache_config
            cache_info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "KV-cache configuration (vLLM's names); value is always 1.",
                labels=["model_name", "block_size", "num_gpu_blocks"],
            )
            cache_info.add_metric([info.model, str(block_size), str(num_gpu_blocks)], 1.0)
            yield cache_info

        stats = m._snapshot or _NO_STATS
        base = m._baseline
        gauges = [
            ("kvfleet_requests_running", "Requests in the running batch.", stats.num_running),
            ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
            ("kvfleet_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("kvfleet_kv_cache_usage_ratio", "KV-cache blocks in use, 0..1.", stats.kv_cache_usage),
            ("vllm:kv_cache_usage_perc", "KV-cache usage; 1 means 100%.", stats.kv_cache_usage),
        ]
        for name, doc, number in gauges:
            gauge = GaugeMetricFamily(name, doc, labels=labels)
            gauge.add_metric(value, float(number))
            yield gauge

        def total(field: str) -> float:
            return float(getattr(stats, field) - getattr(base, field))

        prompt = total("num_prompt_tokens_total")
        generation = total("num_generation_tokens_total")
        counters = [
            ("kvfleet_prompt_tokens", "Prefilled prompt tokens.", prompt),
            ("vllm:prompt_tokens", "Prefilled prompt tokens.", prompt),
            ("kvfleet_generation_tokens", "Generated tokens.", generation),
            ("vllm:generation_tokens", "Generated tokens.", generation),
            (
                "kvfleet_preemptions",
                "Requests preempted (recomputed) for lack of KV blocks.",
                total("num_preemptions_total"),
            ),
            (
                "kvfleet_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                total("prefix_cache_queries_total"),
            ),
            (
                "kvfleet_prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                total("prefix_cache_hits_total"),
            ),
            (
                "kvfleet_shared_prefix_steps",
                "Steps whose decode rows read a prefix many of them share once.",
                total("shared_prefix_steps_total"),
            ),
        ]
        for name, doc, number in counters:
            counter = CounterMetricFamily(name, doc, labels=labels)
            counter.add_metric(value, float(number))
            yield counter

        steps = CounterMetricFamily(
            "kvfleet_engine_steps",
            "Engine steps by what they computed: prefill (only prompt tokens), mixed (prompt"
            " tokens beside decode rows), decode (only one generated token per request).",
            labels=[*labels, "kind"],
        )
        for kind in STEP_KINDS:
            steps.add_metric([*value, kind], total(f"{kind}_steps_total"))
        yield steps
