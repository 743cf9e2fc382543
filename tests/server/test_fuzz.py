"""schemathesis fuzzes every operation of the app's own OpenAPI schema: no 5xx, ever."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

EXAMPLES_PER_OPERATION = 20


def bounded(body: Any) -> Any:
    """Keep generated work small (the tiny model runs on CPU): few tokens, few choices."""
    if isinstance(body, dict):
        for key, cap in (("max_tokens", 3), ("max_completion_tokens", 3), ("n", 2)):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool):
                body[key] = min(body[key], cap)
    return body


def test_no_operation_answers_5xx(live_server) -> None:  # type: ignore[no-untyped-def]
    schema = schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def check(case: schemathesis.Case) -> None:
            case.body = bounded(case.body)
            response = case.call(base_url=live_server.url, timeout=60)
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} "
                f"{response.text[:500]}"
            )
            if response.status_code >= 400:
                assert "error" in response.json(), response.text[:500]

        check()
