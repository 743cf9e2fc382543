"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes an `APIError` with a 4xx status and the name of the
offending field in `param`; the app's handlers turn it (and pydantic's validation errors) into
a JSON response, so a bad request never surfaces as a 500.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.responses import Response


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type_=self.type, param=self.param, code=self.code)


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def invalid_field(field: str, message: str) -> APIError:
    """400 naming `field`; `message` should say what is allowed."""
    return APIError(400, f"{field}: {message}", param=field)


def param_from_location(loc: Sequence[int | str]) -> str:
    """pydantic error location -> dotted field name, dropping the root ("body", "header") and
    the union members' type tags, so the field reads the way the client spelled it.

    ("body", "messages", 0, "content", "list[TextPart]", 0, "text") -> "messages.0.content.0.text"
    """
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "query", "path"):
        parts = parts[1:]
    kept = [part for part in parts if part.isdigit() or not _is_union_tag(part)]
    return ".".join(kept) if kept else "body"


def telling_error(errors: Sequence[Any]) -> dict[str, Any]:
    """The validation error to report. A value that fails every member of a union (prompt: a
    string, strings, token ids, ...) fails each in its own way; the member whose own check
    rejected it says more than the members of the wrong type."""
    if not errors:
        return {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
    for error in errors:
        if error.get("type") == "value_error":
            return dict(error)
    for error in errors:
        kind = str(error.get("type", ""))
        if not kind.endswith(("_type", "_parsing")) and kind != "string_unicode":
            return dict(error)
    return dict(errors[0])


def _is_union_tag(part: str) -> bool:
    return "[" in part or part in _UNION_TAGS


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "constrained-int", "TextPart"}


def error_response(
    body: dict[str, Any], status_code: int, headers: Mapping[str, str] | None = None
) -> Response:
    """A JSON error response. ASCII-escaped: messages may quote what the client sent, and a
    lone surrogate in it must not break the encoding of the answer."""
    content = json.dumps(body, separators=(",", ":")).encode()
    return Response(content, status_code, headers=headers, media_type="application/json")
