"""SLA mode end to end through the server state: a TTFT target turns work away with a 429."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from serverutil import MODEL_NAME, metric

from kvfleet_engine.server.admission import AdmissionConfig, StepTimeModel
from kvfleet_engine.server.errors import APIError
from kvfleet_engine.server.state import ServerState


def test_work_whose_ttft_would_miss_the_target_gets_429(live_server) -> None:  # type: ignore[no-untyped-def]
    live = live_server.state
    sla = AdmissionConfig(None, None, ttft_slo_s=0.5, tpot_slo_s=0.05)
    # One request with 3,000 prompt tokens already waits (an empty queue admits anything).
    engine = SimpleNamespace(num_queued_requests=1, num_queued_tokens=3000, num_running=0)
    settings = dataclasses.replace(live.settings, admission=sla)
    state = ServerState(settings, engine, live.metrics)  # type: ignore[arg-type]
    state.warmed_up = True
    budget = state.policy.calibrate(StepTimeModel(fixed_s=0.01, per_token_s=0.0001))
    assert budget == 400  # 10 ms + 400 * 0.1 ms = 50 ms: one step fits the TPOT target
    # 3,300 tokens to prefill: 9 steps of 10 ms plus 0.1 ms a token = 420 ms
    state.admit(num_prompt_tokens=300, num_requests=1)
    with pytest.raises(APIError) as refused:  # 5,000 tokens: 13 steps, 630 ms > 500 ms
        state.admit(num_prompt_tokens=2000, num_requests=1)
    assert refused.value.status_code == 429 and refused.value.code == "ttft_slo"
    assert int(refused.value.headers["Retry-After"]) >= 1
    text = live.metrics.render()[0].decode()
    label = f'kvfleet_requests_rejected_total{{model_name="{MODEL_NAME}",reason="ttft_slo"}}'
    assert metric(text, label) >= 1
