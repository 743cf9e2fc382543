"""The router's aiohttp application: the OpenAI routes through the proxy, /health, /ready,
/metrics; its lifecycle starts discovery and load scraping and stops them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from kvfleet_router.auth import api_key_middleware, api_key_refusal
from kvfleet_router.discovery import KubernetesDiscovery, StaticDiscovery
from kvfleet_router.load import LoadScraper
from kvfleet_router.metrics import RouterMetrics
from kvfleet_router.proxy import Proxy
from kvfleet_router.replicas import ReplicaPool
from kvfleet_router.request_body import RequestBody, error_response
from kvfleet_router.server import RouterRunner
from kvfleet_router.settings import RouterSettings
from kvfleet_router.strategies import make_strategy
from kvfleet_router.waiting import WaitingQueue

log = logging.getLogger(__name__)


class ListenError(Exception):
    """The router's --host/--port cannot be bound (in use, an unknown host)."""


class Router:
    """All the parts of one router process, wired together."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.pool = ReplicaPool()
        self.queue = WaitingQueue(self.pool, settings.queue_size)
        self.strategy = make_strategy(settings)
        self.metrics = RouterMetrics(self.strategy.name, self.pool, self.queue)
        self.discovery: StaticDiscovery | KubernetesDiscovery
        if settings.deployment is not None:
            assert settings.namespace is not None, "checked by RouterSettings"
            self.discovery = KubernetesDiscovery(
                self.pool, settings.namespace, settings.deployment, settings.discovery
            )
        else:
            self.discovery = StaticDiscovery(self.pool, settings.backends)
        self.proxy: Proxy | None = None  # made at start-up, with the client session
        # Why a background task (discovery, scraper) stopped; /health then answers 503, so the
        # liveness probe restarts the pod instead of it waiting, never ready, without a word.
        self.failure: str | None = None

    def build_app(self) -> web.Application:
        key = self.settings.api_key
        key_refusal = api_key_refusal(key) if key is not None else None
        middlewares: list[Middleware] = [openai_errors]
        middlewares += [api_key_middleware(key_refusal)] if key_refusal is not None else []
        app = web.Application(
            client_max_size=self.settings.max_request_body_bytes, middlewares=middlewares
        )
        app.cleanup_ctx.append(self._lifecycle)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        # `Expect: 100-continue` gets the refusal the headers earn instead of "100 Continue",
        # a missing or wrong key's first (aiohttp calls it before the middlewares): a client
        # without the key is not invited to send its body.
        body_expect = RequestBody(self.settings).expect

        async def expect(request: web.Request) -> web.StreamResponse | None:
            refused = key_refusal(request) if key_refusal is not None else None
            return refused or await body_expect(request)

        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_post(path, self._completions, expect_handler=expect)
        return app

    def runner(self) -> RouterRunner:
        """The HTTP server over build_app(), as `kvfleet router` runs it (the tests too)."""
        return RouterRunner(
            self.build_app(),
            self.settings.header_timeout_s,
            keepalive_timeout=self.settings.keep_alive_timeout_s,
            handler_cancellation=True,  # a client that disconnects cancels its request
            access_log=None,
            auto_decompress=False,  # an encoded body is refused (415), as the engine does
        )

    async def _lifecycle(self, app: web.Application) -> AsyncIterator[None]:
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None, keepalive_timeout=30)
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.connect_timeout_s, sock_read=None
        )
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, auto_decompress=False, trust_env=False
        ) as session:
            self.proxy = Proxy(
                self.settings, self.pool, self.queue, self.strategy, self.metrics, session
            )
            scraper = LoadScraper(self.pool, session, self.settings.scrape_interval_s)
            tasks = [
                asyncio.create_task(self.discovery.run(), name="discovery"),
                asyncio.create_task(scraper.run(), name="scraper"),
            ]
            for task in tasks:
                task.add_done_callback(self._task_ended)
            try:
                yield
            finally:
                for task in tasks:
                    task.cancel()
                # Their own errors were logged when they ended (_task_ended).
                await asyncio.gather(*tasks, return_exceptions=True)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        error = None if task.cancelled() else task.exception()
        if error is None:
            return
        self.failure = f"{task.get_name()} stopped: {type(error).__name__}: {error}"
        log.error("the router's %s", self.failure, exc_info=error)

    async def _health(self, request: web.Request) -> web.Response:
        if self.failure is not None:
            return web.json_response({"status": "failed", "reason": self.failure}, status=503)
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        """Ready once discovery has its first list, replicas or not (at zero it queues)."""
        if self.discovery.synced:
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "discovering replicas"}, status=503)

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _models(self, request: web.Request) -> web.Response:
        assert self.proxy is not None, "set at start-up"
        return await self.proxy.models(request)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        assert self.proxy is not None, "set at start-up"
        return await self.proxy.completions(request)


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown path (404) or method (405, with `Allow`) in the OpenAI error shape, as the
    engine answers them, instead of aiohttp's plain text."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        message = f"method {request.method} is not allowed on {request.path}; allowed: {allowed}"
        return error_response(405, message, headers={"Allow": allowed})
    except web.HTTPNotFound:
        routes = ", ".join(resource.canonical for resource in request.app.router.resources())
        message = f"no route for {request.path[:200]!r}; the router serves {routes}"
        return error_response(404, message)


def run(settings: RouterSettings) -> None:
    """Serve until SIGINT/SIGTERM, on uvloop when it is installed."""
    loop_factory = None
    with contextlib.suppress(ImportError):
        import uvloop

        loop_factory = uvloop.new_event_loop
    router = Router(settings)
    log.info(
        "kvfleet router on %s:%d, strategy %s, replicas from %s",
        settings.host,
        settings.port,
        settings.strategy,
        f"{settings.namespace}/{settings.deployment}"
        if settings.deployment
        else ", ".join(settings.backends),
    )
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_serve(router, settings))


async def _serve(router: Router, settings: RouterSettings) -> None:
    runner = router.runner()
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        reason = exc.strerror or str(exc)
        raise ListenError(f"cannot listen on {settings.host}:{settings.port}: {reason}") from exc
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
