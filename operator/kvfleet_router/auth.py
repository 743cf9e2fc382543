"""API-key authentication at the router: every route but the probes and the metrics needs
`Authorization: Bearer <key>`, the key the engines behind it require (spec.auth's Secret, in
$KVFLEET_API_KEY); the router then sends that key upstream itself.

The key is compared in constant time and appears in no log line and no response. The header is
read and the 401 written as the engine's kvfleet_engine.server.auth does (the router does not
import the engine: the rule is copied, and tests/router/test_router_auth.py runs one table of
headers through both), so a client sees one answer whichever it reached.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvfleet_router.request_body import error_response

API_KEY_ENV = "KVFLEET_API_KEY"  # as `kvfleet serve`, from the same Secret
# Kubernetes probes, Prometheus and the operator's autoscaler read these without credentials.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})


def bearer(api_key: str) -> str:
    """The Authorization header value for `api_key`."""
    return f"Bearer {api_key}"


def api_key_refusal(api_key: str) -> Callable[[web.Request], web.Response | None]:
    """A check of a request's key: the 401 it earns, or None (a public path, the right key)."""
    if not api_key:
        raise ValueError("api_key: must be a non-empty string (or leave it unset)")
    expected = api_key.encode()

    def refused(request: web.Request) -> web.Response | None:
        if request.path in PUBLIC_PATHS:
            return None
        header = request.headers.get("Authorization")
        # Header bytes that are not UTF-8 reach here as surrogates: back to the bytes sent.
        given = None if header is None else header.encode("utf-8", "surrogateescape")
        token = None if given is None else bearer_token(given)
        if token is not None and hmac.compare_digest(token, expected):
            return None
        challenge = {"WWW-Authenticate": "Bearer"}
        return error_response(401, refusal(given, token), code="invalid_api_key", headers=challenge)

    return refused


def api_key_middleware(refused: Callable[[web.Request], web.Response | None]) -> Middleware:
    """An aiohttp middleware that answers what `refused` (api_key_refusal's check) says."""

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        return refused(request) or await handler(request)

    return require_api_key


def refusal(given: bytes | None, token: bytes | None) -> str:
    """Why a request with Authorization header `given` (None: none) and its `token` is refused."""
    if given is None:
        return "missing API key: send it as the header 'Authorization: Bearer <key>'"
    if token is None:
        return "malformed Authorization header: expected 'Authorization: Bearer <key>'"
    return "incorrect API key provided"


def bearer_token(authorization: bytes) -> bytes | None:
    """The credentials of `Bearer <token>`; the scheme is case-insensitive (RFC 7235)."""
    scheme, _, token = authorization.partition(b" ")
    token = token.strip(b" ")
    if scheme.lower() != b"bearer" or not token:
        return None
    return token
