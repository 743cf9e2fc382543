"""The operator's background work: a periodic resync of every watched InferenceDeployment, and one
autoscaler task per autoscaled one.

These are plain asyncio tasks rather than kopf timers and daemons on purpose: kopf puts a
finalizer on every object that has a timer or daemon. That needs write access to the resource
itself (not just its status) and makes `kubectl delete` hang while the operator is down, both of
which a GitOps-managed resource should not suffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from kvfleet_operator import api
from kvfleet_operator.apply import Cluster, api_error_summary

log = logging.getLogger(__name__)

RESYNC_SECONDS = 15.0
STOP_TIMEOUT_SECONDS = 10.0
Key = tuple[str, str]  # (namespace, name)
Reconcile = Callable[[Cluster, str, str], Coroutine[Any, Any, None]]
Autoscale = Callable[[Cluster, str, str, "Flag"], Coroutine[Any, Any, None]]


class Flag:
    """A stop flag with the shape of kopf's DaemonStopped: falsy until set; `wait` sleeps until
    it is set or the timeout passes."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float | None = None) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        return self._event.is_set()


class Loops:
    """Resync every RESYNC_SECONDS (or sooner after `wake`); keep one autoscaler task per
    autoscaled InferenceDeployment in the watched namespaces."""

    def __init__(
        self,
        cluster: Cluster,
        namespaces: Sequence[str],
        reconcile: Reconcile,
        autoscale: Autoscale,
    ) -> None:
        self._cluster = cluster
        self._namespaces = tuple(namespaces)  # glob patterns; empty: all namespaces
        self._reconcile = reconcile
        self._autoscale = autoscale
        self._wake = asyncio.Event()
        self._stopped = Flag()
        self._autoscalers: dict[Key, tuple[Flag, asyncio.Task[None]]] = {}

    def wake(self) -> None:
        """Run the next pass now (a spec changed: start or stop its autoscaler promptly)."""
        self._wake.set()

    async def run(self) -> None:
        woken = False
        while not self._stopped:
            try:
                await self.run_once(reconcile=not woken)
            except Exception as exc:  # one line: an API error's text is its headers and body
                log.warning(
                    "resync pass failed (%s); retrying in %.0f s",
                    api_error_summary(exc),
                    RESYNC_SECONDS,
                )
            woken = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), RESYNC_SECONDS)
                woken = True
            self._wake.clear()
        await self._stop_autoscalers(set(self._autoscalers))

    async def stop(self) -> None:
        self._stopped.set()
        self._wake.set()

    async def run_once(self, *, reconcile: bool = True) -> None:
        """Reconcile every watched object (unless only woken for autoscalers), then start and
        stop autoscalers to match."""
        objects = [
            obj
            for obj in await self._cluster.list(api.API_VERSION, api.INFERENCE_DEPLOYMENT)
            if self._watched(obj["metadata"]["namespace"])
        ]
        autoscaled = set()
        for obj in objects:
            key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
            if reconcile:
                try:
                    await self._reconcile(self._cluster, *key)
                except Exception as exc:
                    log.warning("resync of %s/%s failed: %s", *key, api_error_summary(exc))
            if _autoscaled(obj):
                autoscaled.add(key)
        for key in autoscaled:
            running = self._autoscalers.get(key)
            if running is None or running[1].done():
                self._start_autoscaler(key)
        await self._stop_autoscalers(set(self._autoscalers) - autoscaled)

    def _watched(self, namespace: str) -> bool:
        return not self._namespaces or any(
            fnmatch.fnmatchcase(namespace, pattern) for pattern in self._namespaces
        )

    def _start_autoscaler(self, key: Key) -> None:
        flag = Flag()
        task = asyncio.create_task(self._autoscale(self._cluster, *key, flag))
        task.add_done_callback(lambda t: _log_end(key, t))
        self._autoscalers[key] = (flag, task)
        log.info("autoscaler started for %s/%s", *key)

    async def _stop_autoscalers(self, keys: set[Key]) -> None:
        for key in keys:
            flag, task = self._autoscalers.pop(key)
            flag.set()
            try:
                await asyncio.wait_for(task, STOP_TIMEOUT_SECONDS)
            except TimeoutError:
                log.warning("autoscaler for %s/%s did not stop in time; cancelled", *key)
            except Exception:
                pass  # already logged by _log_end
            log.info("autoscaler stopped for %s/%s", *key)


def _autoscaled(obj: dict[str, Any]) -> bool:
    spec = obj.get("spec") or {}
    deleting = obj["metadata"].get("deletionTimestamp")
    return bool(spec.get("autoscaling")) and not spec.get("suspend") and not deleting


def _log_end(key: Key, task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("autoscaler for %s/%s crashed: %s", *key, task.exception())
