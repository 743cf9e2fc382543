"""Admission decisions: bounded queue, TTFT estimate, SLA token budget."""

import math

from kvfleet_engine.server.admission import (
    AdmissionConfig,
    AdmissionPolicy,
    QueueSnapshot,
    StepTimeModel,
    estimate_ttft_s,
    sla_token_budget,
)

MODEL = StepTimeModel(fixed_s=0.010, per_token_s=0.0001)  # 10 ms + 0.1 ms/token


def policy(**overrides: float | int | None) -> AdmissionPolicy:
    config = {"max_queued_requests": None, "max_queued_tokens": None}
    config.update({"ttft_slo_s": None, "tpot_slo_s": None})
    config.update(overrides)
    return AdmissionPolicy(AdmissionConfig(**config), max_num_batched_tokens=2048)  # type: ignore[arg-type]


def test_queue_bound_on_requests_refuses_with_retry_after() -> None:
    p = policy(max_queued_requests=2)
    assert p.check(QueueSnapshot(1, 100, 0), 10) is None
    rejection = p.check(QueueSnapshot(2, 100, 0), 10)
    assert rejection is not None and rejection.reason == "queue_full"
    assert "--max-queued-requests 2" in rejection.message
    assert rejection.retry_after_s >= 1


def test_queue_bound_on_tokens_and_empty_queue_always_admits() -> None:
    p = policy(max_queued_tokens=500)
    assert p.check(QueueSnapshot(1, 400, 0), 100) is None
    assert p.check(QueueSnapshot(1, 400, 0), 101) is not None
    # A single request larger than the bound still runs when nothing is waiting.
    assert p.check(QueueSnapshot(0, 0, 0), 10_000) is None


def test_ttft_estimate_counts_steps_of_leftover_budget() -> None:
    # budget 1000, 200 decodes running -> 800 prefill tokens per step; 1600 tokens = 2 steps.
    ttft = estimate_ttft_s(QueueSnapshot(3, 1500, 200), 100, MODEL, token_budget=1000)
    assert math.isclose(ttft, 2 * MODEL.step_seconds(1000))
    assert estimate_ttft_s(QueueSnapshot(0, 0, 1000), 1, MODEL, token_budget=1000) == math.inf


def test_sla_budget_holds_tpot_and_ttft_rejects_work_that_would_miss() -> None:
    assert sla_token_budget(MODEL, tpot_slo_s=0.050, max_num_batched_tokens=2048) == 400
    assert sla_token_budget(MODEL, tpot_slo_s=0.005, max_num_batched_tokens=2048) == 1
    p = policy(ttft_slo_s=0.2, tpot_slo_s=0.050)
    assert p.check(QueueSnapshot(5, 5000, 0), 100) is None  # not calibrated yet: no estimate
    assert p.calibrate(MODEL) == 400
    assert MODEL.step_seconds(p.token_budget) <= 0.050
    assert p.check(QueueSnapshot(0, 0, 0), 300) is None  # 1 step = 50 ms
    rejection = p.check(QueueSnapshot(5, 2000, 0), 100)  # 6 steps: 60 + 210 ms > 200 ms
    assert rejection is not None and rejection.reason == "ttft_slo"
    assert "exceeds the 200 ms target" in rejection.message


def test_ttft_estimate_charges_the_queued_tokens_not_a_full_budget_step() -> None:
    # 15 tokens in one step beside 4 decodes: 10 ms + (4 + 15) * 0.1 ms, not a 2,048-token step.
    ttft = estimate_ttft_s(QueueSnapshot(1, 10, 4), 5, MODEL, token_budget=2048)
    assert math.isclose(ttft, MODEL.step_seconds(19))


def test_a_tight_ttft_target_refuses_only_behind_a_queue() -> None:
    """--ttft-slo-ms 2 on a server whose steps take 10 ms: nothing could meet it, but an idle
    server must still serve (waiting would not help); behind a queue, the target refuses."""
    p = policy(ttft_slo_s=0.002)
    p.calibrate(MODEL)
    assert p.check(QueueSnapshot(0, 0, 0), 5) is None
    assert p.check(QueueSnapshot(0, 0, 3), 5_000) is None
    rejection = p.check(QueueSnapshot(1, 5, 0), 5)
    assert rejection is not None and rejection.reason == "ttft_slo"
