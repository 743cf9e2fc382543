"""CEL rules in a model's JSON schema: they run in the API server (kubectl sees the message)."""

from __future__ import annotations

from typing import Any


def cel(*rules: tuple[str, str] | tuple[str, str, str]) -> dict[str, Any]:
    """x-kubernetes-validations for a model's JSON schema: (rule, message) pairs, or
    (rule, message, messageExpression) where the message should name the offending value: the
    API server shows the expression's string, and the message when the expression fails."""
    validations = []
    for rule, message, *expression in rules:
        validation = {"rule": rule, "message": message}
        if expression:
            validation["messageExpression"] = expression[0]
        validations.append(validation)
    return {"x-kubernetes-validations": validations}
