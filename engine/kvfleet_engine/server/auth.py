"""`APIKeyAuth`: every route but the probes and the metrics needs `Authorization: Bearer <key>`.

The key is compared in constant time and appears in no log line and no response.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from kvfleet_engine.server.errors import error_body, error_response

# Kubernetes probes and Prometheus scrape these without credentials.
API_KEY_ENV = "KVFLEET_API_KEY"  # the API key, when --api-key is not given
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})


class APIKeyAuth:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        if not api_key:
            raise ValueError("api_key: must be a non-empty string (or leave it unset)")
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        given = _authorization(scope)
        token = None if given is None else _bearer_token(given)
        if token is not None and hmac.compare_digest(token, self._expected):
            await self.app(scope, receive, send)
            return
        message = _refusal(given, token)
        body = error_body(message, type_="invalid_request_error", code="invalid_api_key")
        response = error_response(body, 401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value)
    return None


def _refusal(given: bytes | None, token: bytes | None) -> str:
    if given is None:
        return "missing API key: send it as the header 'Authorization: Bearer <key>'"
    if token is None:
        return "malformed Authorization header: expected 'Authorization: Bearer <key>'"
    return "incorrect API key provided"


def _bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = authorization.partition(b" ")
    token = token.strip(b" ")
    if scheme.lower() != b"bearer" or not token:
        return None
    return token
