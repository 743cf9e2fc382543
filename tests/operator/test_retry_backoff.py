"""A reconcile that keeps failing (a child the API server refuses: ApplyRejected) is retried
with backoff, not every 10 s for good."""

from __future__ import annotations

from kvfleet_operator.handlers import retry_delay


def test_retries_double_from_ten_seconds_up_to_five_minutes() -> None:
    assert [retry_delay(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert retry_delay(10_000) == 300  # a refusal that lasts days stays at one try in 5 min
