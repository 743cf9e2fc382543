"""`RequestLog` (`kvfleet serve --log-requests`): one JSON line per HTTP request (probes and
scrapes aside), written when its response ends: method, path, status, duration, and for
generation requests the request id, token counts, finish reasons and time to first token. Never
prompt or completion text.

The serving layer adds its fields to the dict under `RECORD_KEY` in the ASGI scope; without the
flag there is no dict and nothing is recorded.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

RECORD_KEY = "kvfleet.request_record"
PROBE_PATHS = frozenset({"/health", "/ready", "/metrics"})  # polled every few seconds: not logged


class RequestLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        record: dict[str, Any] = {}
        scope[RECORD_KEY] = record
        status = 0  # 0: no response started (the client went away first)
        began = time.perf_counter()

        async def send_noting_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_noting_status)
        finally:
            line = {
                "method": scope["method"],
                "path": scope["path"],
                "status": status,
                "duration_ms": round((time.perf_counter() - began) * 1e3, 2),
                **record,
            }
            log.info("%s", json.dumps(line, separators=(",", ":")))


def note(scope: Scope, **fields: Any) -> None:
    """Add fields to the request's log line (a no-op without --log-requests)."""
    record = scope.get(RECORD_KEY)
    if record is not None:
        record.update(fields)
