"""FastAPI app factory: routes, error handlers, and the start-up warm-up."""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvfleet_engine.server.auth import APIKeyAuth
from kvfleet_engine.server.body_limit import BodyLimit
from kvfleet_engine.server.errors import (
    APIError,
    error_body,
    error_response,
    excerpt,
    invalid_request,
    unparsable_body,
)
from kvfleet_engine.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from kvfleet_engine.server.request_log import RequestLog
from kvfleet_engine.server.serving import RECEIVED_KEY, OpenAIServing
from kvfleet_engine.server.state import ServerState

log = logging.getLogger(__name__)

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 404, 429, 503)
}
_PriorityHeader = Annotated[
    int | None,
    Header(
        alias="X-Priority",
        ge=-(2**31),
        le=2**31 - 1,
        description="Scheduling priority (lower runs first); the body's `priority` wins.",
    ),
]


def build_app(state: ServerState) -> FastAPI:
    """The HTTP app over `state.engine`; its lifespan attaches to the engine core (started
    already) and warms it up, and at the end shuts the core down."""
    engine = state.engine
    serving = OpenAIServing(engine, state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        warm_up = asyncio.create_task(_warm_up(state))
        try:
            yield
        finally:
            warm_up.cancel()
            engine.shutdown()

    # No redirect from "/v1/completions/" to "/v1/completions": Starlette builds its Location
    # from the Host header, which the client chooses. Such a path is a 404.
    app = FastAPI(
        title="kvfleet engine",
        version=state.metrics.info.version,
        lifespan=lifespan,
        redirect_slashes=False,
    )
    # Outermost last: stamp, log, authenticate, bound the body, then route.
    app.add_middleware(
        BodyLimit,
        max_bytes=state.settings.max_request_body_bytes,
        idle_timeout_s=state.settings.body_timeout_s,
    )
    if state.settings.api_key is not None:
        app.add_middleware(APIKeyAuth, api_key=state.settings.api_key)
    if state.settings.log_requests:
        app.add_middleware(RequestLog)
    app.add_middleware(StampReceived)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc.body(), exc.status_code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        error = invalid_request(exc.errors(), request.headers.get("content-type"))
        return error_response(error.body(), error.status_code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:  # the JSON decoder gave up on the body
            error = unparsable_body(exc.__cause__)
            return error_response(error.body(), error.status_code)
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {excerpt(request.url.path)}"
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"method {request.method} is not allowed on {request.url.path}"
            message += f"; allowed: {allowed}" if allowed else ""
        body = error_body(message, type_="invalid_request_error")
        return error_response(body, exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # The message may quote the request (prompt text): the frames go to the log, the
        # message only at debug level.
        log.error(
            "unhandled %s on %s:\n%s",
            type(exc).__name__,
            request.url.path,
            "".join(traceback.format_tb(exc.__traceback__)),
        )
        log.debug("unhandled error on %s", request.url.path, exc_info=exc)
        message = f"internal error ({type(exc).__name__}); the server log has the traceback"
        return error_response(error_body(message, type_="internal_error"), 500)

    @app.get("/health", summary="Liveness: the engine core process is running")
    async def health() -> JSONResponse:
        reason = str(engine.error) if engine.error is not None else state.startup_error
        if reason is not None:  # the core (or one of its ranks) died, or warm-up failed
            return JSONResponse({"status": "unhealthy", "reason": reason, "error": reason}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready", summary="Readiness: weights loaded, warmed up, not draining")
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ready"})
        reason = "draining" if state.draining else "starting"
        if engine.error is not None:
            reason = "dead"
        return JSONResponse({"status": reason}, 503)

    @app.get("/metrics", summary="Prometheus metrics (contract v1)")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get(
        "/debug/profile",
        summary="Where each serving process's time went so far (phases, CPU, GC, first tokens)",
    )
    async def profile() -> JSONResponse:
        try:
            core = await engine.core_profile()
        except Exception as exc:  # the core died: the API process's side still helps
            return JSONResponse({"api": _plain(engine.profile.snapshot()), "core_error": str(exc)})
        return JSONResponse({"api": _plain(engine.profile.snapshot()), "core": _plain(core)})

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(
            id=state.settings.served_model_name,
            created=int(state.started_at),
            max_model_len=state.settings.max_model_len,
        )
        return ModelList(data=[card])

    @app.post(
        "/v1/completions",
        response_model=CompletionResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    )
    async def completions(
        body: CompletionRequest, request: Request, x_priority: _PriorityHeader = None
    ) -> Any:
        return await serving.completions(body, request, x_priority)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletionResponse,
        responses={**_ERRORS, 200: {"content": {"text/event-stream": {}}}},
    )
    async def chat_completions(
        body: ChatCompletionRequest, request: Request, x_priority: _PriorityHeader = None
    ) -> Any:
        return await serving.chat(body, request, x_priority)

    answer_head_on_get_routes(app)
    return app


def answer_head_on_get_routes(app: FastAPI) -> None:
    """HEAD on every GET route, as HTTP asks: the GET's status and headers, without the body
    (uvicorn drops it). FastAPI's routes, unlike Starlette's, take only the methods they name;
    the HEAD routes stay out of the schema, where they would repeat the GETs' operations."""
    for route in list(app.routes):
        if isinstance(route, APIRoute) and "GET" in (route.methods or ()):
            app.add_api_route(
                route.path,
                route.endpoint,
                methods=["HEAD"],
                response_model=route.response_model,
                include_in_schema=False,
            )


class StampReceived:
    """Stamps each HTTP request's scope with when its ASGI call began (the first-token trace's
    "received"); nothing else, so it costs a clock read per request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RECEIVED_KEY] = time.time()
        await self.app(scope, receive, send)


def _plain(record: object) -> Any:
    import msgspec

    return msgspec.to_builtins(record)


async def _warm_up(state: ServerState) -> None:
    """Self-benchmark in the core, apply the SLA token budget, publish capacity; then report
    ready. On failure, `state.startup_error` says why (`kvfleet serve` then exits 1)."""
    engine = state.engine
    settings = state.settings
    prefill_tokens = min(settings.max_num_batched_tokens, 512)  # measure_capacity fits the context
    decode_batches = (min(settings.max_num_seqs, 8), min(settings.max_num_seqs, 64))
    try:
        report = await engine.measure_capacity(decode_batches, prefill_tokens)
        log.info(
            "self-benchmark in the engine core: step = %.3f ms + %.4f ms/token; prefill of %d "
            "tokens %.2f ms (%.1f s)",
            report.step_model.fixed_s * 1e3,
            report.step_model.per_token_s * 1e3,
            report.prefill_tokens,
            report.prefill_step_s * 1e3,
            report.elapsed_s,
        )
        budget = state.policy.calibrate(report.step_model)
        if budget is not None:
            await engine.set_token_budget(budget)
            log.info("SLA mode: step token budget %d to hold TPOT", budget)
        max_batch = min(settings.max_num_seqs, state.policy.token_budget)
        state.metrics.set_capacity(report.capacity_tokens_per_second(max_batch))
        state.metrics.set_baseline(await engine.stats())
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # the core's traceback is in its own log
        state.startup_error = f"start-up self-benchmark failed: {exc}"
        log.error("%s; the server cannot become ready", state.startup_error)
        return
    state.warmed_up = True
    log.info("ready: serving %s", settings.served_model_name)
