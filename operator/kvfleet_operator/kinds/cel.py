"""CEL rules in a model's JSON schema: they run in the API server (kubectl sees the message)."""

from __future__ import annotations

from typing import Any


def cel(*rules: tuple[str, str]) -> dict[str, Any]:
    """x-kubernetes-validations for a model's JSON schema: (rule, message) pairs."""
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}
