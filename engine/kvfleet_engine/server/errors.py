"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes an `APIError` with a 4xx status and the name of the
offending field in `param`; the app's handlers turn it (and pydantic's validation errors) into
a JSON response, so a bad request never surfaces as a 500.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
    union type tags.

    ("body", "messages", 0, "content") -> "messages.0.content"
    """
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "query", "path"):
        parts = parts[1:]
    # Union members show up as type names inside the location ("prompt", "str", ...); keep the
    # path up to the first of them so the field reads the way the client spelled it.
    kept: list[str] = []
    for part in parts:
        if kept and not part.isdigit() and part in _UNION_TAGS:
            break
        kept.append(part)
    return ".".join(kept) if kept else "body"


_UNION_TAGS = {
    "str",
    "int",
    "float",
    "bool",
    "list",
    "list[int]",
    "list[str]",
    "list[list[int]]",
    "function-after",
    "function-before",
    "function-wrap",
    "literal['text']",
    "literal['image_url']",
}
