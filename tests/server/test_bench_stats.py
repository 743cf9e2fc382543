"""`kvfleet bench serve` statistics (the load itself runs in test_openai_api.py)."""

import math

import pytest

from kvfleet_engine.bench.serve import main
from kvfleet_engine.bench.serve_counters import format_counters, load_counters, read_counters
from kvfleet_engine.bench.serve_load import RequestResult
from kvfleet_engine.bench.serve_stats import percentile, summarize
from kvfleet_engine.bench.serve_workload import random_requests


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_summary_throughput_tpot_and_goodput() -> None:
    fast = RequestResult(True, "", 10, 5, ttft_s=0.1, e2e_s=0.5, itls_s=[0.1] * 4)
    slow = RequestResult(True, "", 10, 5, ttft_s=1.0, e2e_s=3.0, itls_s=[0.5] * 4)
    failed = RequestResult(False, "HTTP 429: busy")
    s = summarize([fast, slow, failed], 2.0, [50, 99], {"ttft": 500.0})
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, {"HTTP 429: busy": 1})
    assert s["output_token_throughput"] == 5.0 and s["request_throughput"] == 1.0
    assert s["tpot_ms"]["p50"] == pytest.approx((100 + 500) / 2)
    assert s["request_goodput"] == 0.5  # only `fast` met TTFT <= 500 ms


def test_random_dataset_lengths_and_bad_flags() -> None:
    reqs = random_requests(20, 100, 10, 0.5, (3, 250), seed=1)
    assert all(
        50 <= r.num_prompt_tokens <= 150 and len(r.prompt) == r.num_prompt_tokens for r in reqs
    )
    assert all(3 <= t <= 250 for r in reqs for t in r.prompt)  # type: ignore[union-attr]
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://x", "--request-rate", "1", "--concurrency", "2"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--percentiles=150", "argument --percentiles: expected P,P,... each in [0, 100]"),
        ("--percentiles=50,x", "argument --percentiles: expected P,P,..."),
        ("--timeout=0", "argument --timeout: expected a positive number"),
        ("--timeout=-1", "argument --timeout: expected a positive number"),
        ("--random-token-range=50:10", "argument --random-token-range: expected 0 <= LOW <= HIGH"),
        ("--random-token-range=-5:10", "argument --random-token-range: expected 0 <= LOW"),
        ("--random-token-range=a:b", "argument --random-token-range: expected LOW:HIGH"),
        ("--goodput=ttft:-5", "argument --goodput: ttft: expected a positive number"),
    ],
)
def test_bad_flag_exits_2_naming_it_before_any_request(
    flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--url", "http://127.0.0.1:9", "--concurrency", "1", flag])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
# HELP vllm:num_preemptions_total Preemptions.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
"""


def test_server_counters_read_vllms_names_and_give_the_loads_share() -> None:
    before = read_counters(VLLM_METRICS)
    after = read_counters(VLLM_METRICS.replace("1000.0", "3000.0").replace("250.0", "1750.0"))
    record = load_counters(before, after)
    assert record == {
        "prefix_cache_queries": 2000,
        "prefix_cache_hits": 1500,
        "preemptions": 0,
        "prefix_cache_hit_ratio": 0.75,
    }
    lines = format_counters(record)
    assert lines[0].endswith("75.0% (1500 of 2000)")
    assert not any("engine steps" in line for line in lines)  # vLLM does not count them
    # A server that counts no cache lookups gives no record.
    assert load_counters({}, read_counters("# TYPE x_total counter\nx_total 1.0\n")) is None
