"""OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can cause becomes an `APIError` with a 4xx status and the name of the
offending field in `param`; the app's handlers turn it (and pydantic's validation errors) into
a JSON response, so a bad request never surfaces as a 500.
"""

from __future__ import annotations

import json
import re
import sys
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


def excerpt(text: str, max_chars: int = 256) -> str:
    """`text` quoted, cut to `max_chars` with its length said: error messages quote what the
    client sent, and a 3 MB model name must not come back as a 3 MB error."""
    if len(text) <= max_chars:
        return repr(text)
    return f"{text[:max_chars]!r}... ({len(text):,} characters)"


def invalid_field(field: str, message: str) -> APIError:
    """400 naming `field`; `message` should say what is allowed."""
    return APIError(400, f"{field}: {message}", param=field)


def param_from_location(loc: Sequence[int | str]) -> str:
    """pydantic error location -> dotted field name, dropping the root ("body", "header") and
    the union members' type tags, so the field reads the way the client spelled it. An error
    in a mapping's key names the mapping (the key may not even be printable).

    ("body", "messages", 0, "content", "list[TextPart]", 0, "text") -> "messages.0.content.0.text"
    """
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "header", "query", "path"):
        parts = parts[1:]
    if "[key]" in parts:
        parts = parts[: max(parts.index("[key]") - 1, 0)]
    kept = [part for part in parts if part.isdigit() or not _is_union_tag(part)]
    return ".".join(kept) if kept else "body"


def telling_error(errors: Sequence[Any]) -> dict[str, Any]:
    """The validation error to report. A value that fails every member of a union (prompt: a
    string, strings, token ids, ...) fails each in its own way; the member whose own check
    rejected it says more than the members of the wrong type, and when every member refused
    the value's type, the message lists the forms the field takes."""
    if not errors:
        return {"loc": ("body",), "msg": "invalid request", "type": "invalid"}
    for error in errors:
        if error.get("type") in ("value_error", "string_unicode"):
            return dict(error)
    for error in errors:
        kind = str(error.get("type", ""))
        if not kind.endswith(("_type", "_parsing")):
            return dict(error)
    return _union_type_error(errors[0]) or dict(errors[0])


def invalid_request(errors: Sequence[Any], content_type: str | None) -> APIError:
    """The 400 for a request body that failed validation, naming the field."""
    error = telling_error(errors)
    kind = error.get("type")
    detail = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "json_invalid":  # FastAPI: loc ("body", offset), ctx {"error": the decoder's}
        loc, reason = error.get("loc", ()), (error.get("ctx") or {}).get("error")
        if reason:
            detail = str(reason)
            if len(loc) > 1 and isinstance(loc[1], int):
                detail += f" at character {loc[1]}"
        return APIError(400, f"request body is not valid JSON: {detail}", param="body")
    param = param_from_location(error.get("loc", ("body",)))
    if param == "body":
        return APIError(400, _body_message(kind, content_type), param="body")
    if kind == "string_unicode":
        detail = "must be valid Unicode text (it holds a lone UTF-16 surrogate)"
    elif kind == "extra_forbidden":
        detail = "unrecognized request argument"
    elif kind == "finite_number":
        detail = "must be a finite number"
    return invalid_field(param, detail)


def unparsable_body(cause: BaseException | None) -> APIError:
    """The 400 for a body the JSON decoder gave up on (`cause`: what it raised)."""
    if isinstance(cause, UnicodeDecodeError):
        message = f"request body is not UTF-8 text (invalid byte at offset {cause.start})"
    elif isinstance(cause, RecursionError):
        message = "request body is not accepted: its JSON nests arrays or objects too deeply"
    elif isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        limit = sys.get_int_max_str_digits()
        message = f"request body is not accepted: it holds an integer of more than {limit} digits"
    else:
        message = "request body is not valid JSON"
    return APIError(400, message, param="body")


_JSON_OBJECT_HINT = "send a JSON object with Content-Type: application/json"

# Fields that take several shapes: what each takes, for a value of none of those types.
_UNION_FORMS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "messages.*.content": 'a string, a list of {"type": "text", "text": "..."} parts, or null',
    "tool_choice": "a string or an object",
}


def _union_type_error(error: Any) -> dict[str, Any] | None:
    """For a type error inside a union: an error at the union's field listing its forms."""
    loc = tuple(error.get("loc", ()))
    tags = [k for k, part in enumerate(loc) if isinstance(part, str) and _is_union_tag(part)]
    if not tags:
        return None
    field_loc = loc[: tags[0]]
    field = re.sub(r"\.\d+(?=\.|$)", ".*", param_from_location(field_loc))
    forms = _UNION_FORMS.get(field)
    if forms is None:
        return None
    return {"loc": field_loc, "msg": f"must be {forms}", "type": "union_type"}


def _body_message(kind: object, content_type: str | None) -> str:
    if kind == "missing":
        return f"request body is empty: {_JSON_OBJECT_HINT}"
    if kind == "string_unicode":  # pydantic cannot read a key: the values are checked by name
        return (
            "request body is not valid: an object key holds a lone UTF-16 surrogate (such as "
            '"\\ud800"), which is not Unicode text'
        )
    if not _is_json(content_type):
        given = f"Content-Type: {content_type}" if content_type else "no Content-Type"
        return f"request body must be JSON ({given}): {_JSON_OBJECT_HINT}"
    return f"request body must be a JSON object: {_JSON_OBJECT_HINT}"


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "").split(";")[0].strip().lower()
    return media_type == "application/json" or (
        media_type.startswith("application/") and media_type.endswith("+json")
    )


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
