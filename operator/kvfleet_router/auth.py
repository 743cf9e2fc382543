"""API-key authentication at the router: every route but the probes and the metrics needs
`Authorization: Bearer <key>`, the key the engines behind it require (spec.auth's Secret, in
$KVFLEET_API_KEY); the router then sends that key upstream itself.

The key is compared in constant time and appears in no log line and no response. The 401 is the
engine's (kvfleet_engine.server.auth), so a client sees one answer whichever it reached.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

API_KEY_ENV = "KVFLEET_API_KEY"  # as `kvfleet serve`, from the same Secret
# Kubernetes probes, Prometheus and the operator's autoscaler read these without credentials.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics"})


def bearer(api_key: str) -> str:
    """The Authorization header value for `api_key`."""
    return f"Bearer {api_key}"


def api_key_middleware(api_key: str) -> Middleware:
    """An aiohttp middleware that answers 401 to a request without `api_key`."""
    if not api_key:
        raise ValueError("api_key: must be a non-empty string (or leave it unset)")
    expected = bearer(api_key).encode()

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in PUBLIC_PATHS:
            return await handler(request)
        given = request.headers.get("Authorization")
        # Header bytes that are not UTF-8 reach here as surrogates: never the key, never a 500.
        if given is not None and hmac.compare_digest(
            given.encode("utf-8", "surrogateescape"), expected
        ):
            return await handler(request)
        message = (
            "missing API key: send it as the header 'Authorization: Bearer <key>'"
            if given is None
            else "incorrect API key provided"
        )
        error = {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
        return web.json_response(
            {"error": error}, status=401, headers={"WWW-Authenticate": "Bearer"}
        )

    return require_api_key
