"""kopf wiring, and nothing else: every trigger ends in `reconcile`; the periodic resync and the
autoscalers run in `loops` (no kopf timers or daemons, so no finalizers on user objects)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
from typing import Any

import kopf

from kvfleet_operator import api, metrics
from kvfleet_operator.apply import Cluster, api_error_summary
from kvfleet_operator.autoscaling.autoscaler import run_autoscaler
from kvfleet_operator.header_cache import HeaderCache
from kvfleet_operator.leadership import Leadership
from kvfleet_operator.loops import Loops
from kvfleet_operator.reconcile import reconcile

log = logging.getLogger(__name__)

# A failed reconcile (an API error, a child the API server refuses) is retried after 10 s,
# doubling with each failure in a row up to 5 minutes: a policy that changes lets it through
# within that, and a refusal that stays does not log an error every 10 s for good.
RETRY_SECONDS = 10.0
RETRY_MAX_SECONDS = 300.0


def retry_delay(retry: int) -> float:
    """Seconds before retry number `retry` (0 after the first failure)."""
    return min(RETRY_SECONDS * 2 ** min(retry, 16), RETRY_MAX_SECONDS)


INFD = (api.GROUP, api.VERSION, api.INFERENCE_DEPLOYMENTS)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's bookkeeping goes to status.kopf, never to annotations on Git-managed objects.
    settings.persistence.progress_storage = kopf.StatusProgressStorage()
    settings.persistence.diffbase_storage = kopf.StatusDiffBaseStorage()
    # Our own events explain transitions; kopf's per-handler chatter is kept to warnings.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 120
    settings.watching.client_timeout = 150
    memo.cluster = await Cluster.connect()
    memo.headers = HeaderCache(memo.get("hf_endpoint", api.DEFAULT_HF_ENDPOINT))
    resync = functools.partial(
        reconcile, headers=memo.headers, host_path_prefixes=memo.get("host_path_prefixes")
    )
    memo.loops = Loops(memo.cluster, memo.get("namespaces", ()), resync, run_autoscaler)
    memo.leadership = None
    if memo.get("leader_namespace"):  # --leader-election: the loops start once this replica leads
        memo.leadership = Leadership(
            memo.cluster, memo.leader_namespace, memo.identity, memo.leader_election_id
        )
        memo.leadership_task = asyncio.create_task(memo.leadership.run(_stop_leading))
    else:
        metrics.LEADING.set(1)  # without --leader-election this replica always acts
    memo.loops_task = asyncio.create_task(_run_loops(memo))


async def _run_loops(memo: kopf.Memo) -> None:
    if memo.leadership is not None:
        await memo.leadership.acquired.wait()
    await memo.loops.run()


def _stop_leading(reason: str) -> None:
    """Leadership lost: end the process (kopf shuts down on SIGTERM); the pod restarts as a
    standby, with nothing left over from leading."""
    log.error("stopped leading (%s): exiting", reason)
    os.kill(os.getpid(), signal.SIGTERM)


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    await memo.loops.stop()
    if memo.leadership is not None:
        memo.leadership_task.cancel()
        if not memo.leadership.acquired.is_set():
            memo.loops_task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await memo.loops_task
    if memo.leadership is not None:
        await memo.leadership.release()
    await memo.cluster.close()


def _leading(memo: kopf.Memo) -> bool:
    """Whether this replica acts (always, without --leader-election)."""
    return memo.leadership is None or bool(memo.leadership.leading)


@kopf.on.resume(*INFD)
@kopf.on.create(*INFD)
@kopf.on.update(*INFD, field="spec")
async def spec_changed(
    namespace: str | None, name: str, memo: kopf.Memo, retry: int, **_: Any
) -> None:
    if not _leading(memo):
        return  # the leader acts (its resync covers what a standby saw first)
    await _reconcile(memo, namespace, name, retry)
    memo.loops.wake()  # start or stop its autoscaler now


@kopf.on.event("apps", "v1", "deployments", labels={api.DEPLOYMENT_LABEL: kopf.PRESENT})
@kopf.on.event("apps", "v1", "statefulsets", labels={api.DEPLOYMENT_LABEL: kopf.PRESENT})
async def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A child Deployment's or StatefulSet group's status moved (pods ready, a rank restarted,
    rollout done): refresh the owner."""
    if not _leading(memo):
        return
    for owner in body.metadata.get("ownerReferences", []):
        if owner.get("kind") == api.INFERENCE_DEPLOYMENT and owner.get("controller"):
            await _reconcile(memo, body.metadata["namespace"], owner["name"])


async def _reconcile(memo: kopf.Memo, namespace: str | None, name: str, retry: int = 0) -> None:
    assert namespace is not None, "InferenceDeployment is namespaced"
    try:
        await reconcile(
            memo.cluster, namespace, name, memo.headers,
            host_path_prefixes=memo.get("host_path_prefixes"),
        )  # fmt: skip
    except Exception as exc:  # API errors, timeouts: retried, not fatal
        message = f"reconcile failed: {api_error_summary(exc)}"
        raise kopf.TemporaryError(message, delay=retry_delay(retry)) from exc
