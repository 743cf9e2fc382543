"""Reading an engine's /metrics text, and the state's trip through the status subresource."""

from __future__ import annotations

import json
import math

import pytest
from autoscaling_fleet import Fleet

from kvfleet_operator.autoscaling.promtext import ParseError, engine_sample, parse
from kvfleet_operator.autoscaling.spec import AutoscalingSpec
from kvfleet_operator.autoscaling.state import ScalerState
from kvfleet_operator.autoscaling.window import quantile

METRICS = """\
# HELP kvfleet_generation_tokens_total Generated tokens.
# TYPE kvfleet_generation_tokens_total counter
kvfleet_generation_tokens_total 1234.0
kvfleet_generation_tokens_created 1.7e9
kvfleet_prompt_tokens_total 5678
kvfleet_kv_cache_usage_ratio 0.42
kvfleet_requests_waiting 3
kvfleet_requests_running 7
kvfleet_engine_capacity_tokens_per_second{kind="prompt"} 9000
kvfleet_engine_capacity_tokens_per_second{kind="generation"} 1500
kvfleet_time_to_first_token_seconds_bucket{le="0.1",model="m"} 2
kvfleet_time_to_first_token_seconds_bucket{le="1.0",model="m"} 9
kvfleet_time_to_first_token_seconds_bucket{le="+Inf",model="m"} 10
kvfleet_time_to_first_token_seconds_count{model="m"} 10
vllm:num_requests_waiting{model_name="a \\"quoted\\" name"} 3
"""


def test_parse_reads_names_labels_and_values() -> None:
    samples = parse(METRICS)
    assert samples[0].name == "kvfleet_generation_tokens_total"
    assert samples[0].value == 1234.0
    vllm = samples[-1]
    assert vllm.name == "vllm:num_requests_waiting"
    assert vllm.labels == {"model_name": 'a "quoted" name'}
    inf = [s for s in samples if s.labels.get("le") == "+Inf"]
    assert math.isinf(float(inf[0].labels["le"]))


def test_engine_sample_reads_the_metric_contract() -> None:
    sample = engine_sample(parse(METRICS), time=10.0)
    assert sample.generation_tokens_total == 1234.0
    assert sample.prompt_tokens_total == 5678.0
    assert sample.kv_cache_usage == 0.42
    assert sample.in_flight == 10.0
    assert (sample.capacity_prompt, sample.capacity_generation) == (9000.0, 1500.0)
    assert sample.ttft_buckets == ((0.1, 2.0), (1.0, 9.0), (math.inf, 10.0))


def test_unlabelled_capacity_is_generation_capacity() -> None:
    text = METRICS.replace('{kind="prompt"} 9000', " 800").replace(
        'kvfleet_engine_capacity_tokens_per_second{kind="generation"} 1500\n', ""
    )
    sample = engine_sample(parse(text), time=0.0)
    assert (sample.capacity_prompt, sample.capacity_generation) == (None, 800.0)


def test_missing_contract_metric_is_an_error_not_a_zero() -> None:
    text = METRICS.replace("kvfleet_kv_cache_usage_ratio 0.42\n", "")
    with pytest.raises(ParseError, match="kvfleet_kv_cache_usage_ratio"):
        engine_sample(parse(text), time=0.0)


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf"])
def test_a_contract_metric_that_is_not_finite_is_an_error(value: str) -> None:
    text = METRICS.replace("kvfleet_requests_waiting 3", f"kvfleet_requests_waiting {value}")
    message = r"kvfleet_requests_waiting is \S+ \(not a finite number\)"
    with pytest.raises(ParseError, match=message):
        engine_sample(parse(text), time=0.0)


def test_optional_series_that_are_not_finite_are_skipped() -> None:
    text = METRICS.replace("kvfleet_requests_running 7", "kvfleet_requests_running NaN").replace(
        '{kind="prompt"} 9000', '{kind="prompt"} +Inf'
    )
    sample = engine_sample(parse(text), time=0.0)
    assert sample.in_flight == 3.0 and sample.capacity_prompt is None


def test_garbage_is_rejected_with_the_line_number() -> None:
    with pytest.raises(ParseError, match="line 2"):
        parse("ok_metric 1\n<html>not metrics</html>\n")


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = ((0.1, 2.0), (1.0, 9.0), (math.inf, 10.0))
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.9 * (5 - 2) / 7)
    assert quantile(buckets, 0.95) == 1.0  # in the +Inf bucket: the last finite bound
    assert quantile(((1.0, 0.0), (math.inf, 0.0)), 0.9) is None


def test_state_survives_json_round_trip() -> None:
    spec = AutoscalingSpec.model_validate(
        {
            "maxReplicas": 5,
            "targets": {"generationTokenRate": {"tokensPerSecond": 100}, "ttft": {"seconds": 1}},
        }
    )
    fleet = Fleet(spec, demand=lambda t: 250)
    fleet.run(until=60)
    data = fleet.state.to_dict()
    text = json.dumps(data, allow_nan=False)  # the API server accepts no NaN/Infinity
    assert ScalerState.from_dict(json.loads(text)) == fleet.state
    assert ScalerState.from_dict({"ticks": "garbage"}) == ScalerState()
