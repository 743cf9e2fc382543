"""The scheduler: each step, a token budget shared by every request that has tokens to compute.

There is no prefill or decode phase. Each request has num_computed_tokens (KV in the cache) and
num_tokens (prompt + generated); a step gives it tokens so the first catches up with the second.
A long prompt is thereby computed in chunks, and decodes share steps with prefills. Running
requests go first, by (priority, arrival); when blocks run out the lowest-priority, newest running
request is preempted (its KV is freed and recomputed later). Waiting requests are admitted in the
same order while nothing was preempted; the head of the queue is never skipped, so nobody starves.

A scheduled step counts as computed at once (steps run in order on one device stream), so with
async scheduling the engine schedules step n+1 before step n's tokens reach the host: a request
sampled at step n has one pending token, which step n+1 takes as its input on the device
(PENDING_TOKEN in token_ids), and update() fills it in afterwards.

Under pipeline parallelism (`num_micro_batches` P > 1) the engine keeps up to P steps in flight,
one per stage. A request whose token is on the way is not scheduled again until update() has it
(its next step's input would be a token the last stage has not sampled yet); a prompt's next
chunk may be (each stage runs the steps in order, so the chunk before it is in the cache). Each
step takes at most 1/P of the unfinished requests, so the micro-batches stay even.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Iterable

from kvfleet_engine.config import SchedulerConfig
from kvfleet_engine.kv_cache import KVCacheManager
from kvfleet_engine.outputs import STEP_KINDS, ModelRunnerOutput, SchedulerStats
from kvfleet_engine.request import Request, RequestStatus
from kvfleet_engine.step import PENDING_TOKEN, ScheduledRequest, SchedulerOutput

log = logging.getLogger(__name__)


def _step_kind(num_decode_rows: int, num_rows: int) -> str:
    if num_decode_rows == num_rows:
        return "decode"
    return "mixed" if num_decode_rows else "prefill"


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        num_micro_batches: int = 1,
    ) -> None:
        self.config = config
        # Steps in flight at once (pipeline parallelism's stages; 1: a step's requests may be
        # scheduled again, with a pending token, before its tokens reach the host).
        self.num_micro_batches = num_micro_batches
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        # running is in sort_key order (admissions append and clear it; removals keep order).
        self._running_sorted = True
        self.waiting: list[tuple[tuple[int, float, int], Request]] = []  # heap by sort_key
        self.finished_request_ids: set[str] = set()
        self._seq_numbers = itertools.count()
        self.num_preemptions_total = 0
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.num_steps_total = dict.fromkeys(STEP_KINDS, 0)
        # Tokens one step may compute; the server's SLA mode lowers it (set_token_budget).
        self.token_budget = config.max_num_batched_tokens

    def set_token_budget(self, num_tokens: int) -> None:
        """Cap each step at `num_tokens` (<= max_num_batched_tokens), so a step's time, and with
        it every decode's time per output token, stays under a target (server SLA mode)."""
        if not 1 <= num_tokens <= self.config.max_num_batched_tokens:
            raise ValueError(
                f"token budget must be in [1, {self.config.max_num_batched_tokens}], "
                f"got {num_tokens}"
            )
        self.token_budget = num_tokens

    # ---- queue verbs -------------------------------------------------------------------

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.seq_no = next(self._seq_numbers)
        self.requests[request.request_id] = request
        self._push_waiting(request)

    def finish(
        self,
        request_ids: Iterable[str],
        status: RequestStatus,
        stop_reason: int | str | None = None,
    ) -> list[Request]:
        """End requests now (abort, or a stop string found by the detokenizer); frees blocks.
        Unknown or already finished ids are ignored. Returns the requests that ended."""
        assert status.is_finished
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            request.stop_reason = stop_reason
            self._finish(request, status)
            ended.append(request)
        return ended

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.token_budget
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        if not self._running_sorted:
            self.running.sort(key=Request.sort_key)
            self._running_sorted = True
        index = 0
        micro_batches = self.num_micro_batches
        max_seqs = self.config.max_num_seqs
        if micro_batches > 1:  # this step's share of the unfinished requests
            max_seqs = min(max_seqs, -(-len(self.requests) // micro_batches))
        while index < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            request = self.running[index]
            if request.num_pending_tokens and (
                request.reaches_limit(self.max_model_len) or micro_batches > 1
            ):
                index += 1  # its last token is on the way (update() may finish it), or in a
                continue  # step still in flight through the pipeline's stages
            num_new_tokens = min(request.num_scheduled_tokens - request.num_computed_tokens, budget)
            while self.kv_cache.allocate_slots(request, num_new_tokens) is None:
                victim = self.running.pop()  # lowest priority, newest
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                scheduled.append((request, num_new_tokens))
                budget -= num_new_tokens
                index += 1

        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and len(scheduled) < max_seqs
        ):
            request = self.waiting[0][1]
            if request.is_finished:  # aborted while waiting
                heapq.heappop(self.waiting)
                continue
            if request.num_pending_tokens:
                break  # preempted while its last token was in flight: next step, with the token
            computed_block_ids = self.kv_cache.get_computed_blocks(request)
            num_cached_tokens = len(computed_block_ids) * self.kv_cache.block_size
            num_new_tokens = min(request.num_tokens - num_cached_tokens, budget)
            if self.kv_cache.allocate_slots(request, num_new_tokens, computed_block_ids) is None:
                break  # the head waits for blocks; nobody behind it jumps the queue
            heapq.heappop(self.waiting)
            self._admit(request, num_cached_tokens)
            scheduled.append((request, num_new_tokens))
            budget -= num_new_tokens

        items = []
        num_decode_rows = 0
        for request, num_new_tokens in scheduled:
            num_decode_rows += (
                num_new_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens
            )
            item = self._scheduled_request(request, num_new_tokens)
            request.num_computed_tokens += num_new_tokens
            request.num_pending_tokens += item.sample
            items.append(item)
        if items:
            self.num_steps_total[_step_kind(num_decode_rows, len(items))] += 1
        finished_ids = frozenset(self.finished_request_ids)
        self.finished_request_ids.clear()
        return SchedulerOutput(
            requests=items,
            num_batched_tokens=self.token_budget - budget,
            finished_request_ids=finished_ids,
        )

    def update(self, scheduled: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Append a step's sampled tokens and finish stopped requests. Returns the requests that
        got a new token, finished or not; a request that ended while the step ran (a stop found
        in the step before, an abort) drops its token."""
        now = time.time()
        progressed = []
        requests, sampled, all_logprobs = self.requests, result.sampled_token_ids, result.logprobs
        for item in scheduled.requests:
            if not item.sample:
                continue
            request = requests.get(item.request_id)
            if request is None:
                continue
            request.num_pending_tokens -= 1
            token_id = sampled[item.request_id]
            request.append_output_token(token_id)
            if all_logprobs:
                logprobs = all_logprobs.get(item.request_id)
                if logprobs is not None:
                    request.output_logprobs.append(logprobs)
                    request.cumulative_logprob += logprobs[token_id]
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            status = self._stop_status(request, token_id)
            if status is not None:
                if request.status == RequestStatus.RUNNING:  # not preempted meanwhile
                    self.running.remove(request)
                self._finish(request, status)
            progressed.append(request)
        self.num_generation_tokens_total += len(progressed)
        return progressed

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache.usage,
            num_preemptions_total=self.num_preemptions_total,
            prefix_cache_queries_total=self.kv_cache.prefix_cache_queries_total,
            prefix_cache_hits_total=self.kv_cache.prefix_cache_hits_total,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            num_blocks_total=self.kv_cache.num_blocks,
            num_blocks_free=self.kv_cache.num_free_blocks,
            prefill_steps_total=self.num_steps_total["prefill"],
            mixed_steps_total=self.num_steps_total["mixed"],
            decode_steps_total=self.num_steps_total["decode"],
        )

    # ---- internals --------------------------------------------------------------------

    def _push_waiting(self, request: Request) -> None:
        heapq.heappush(self.waiting, (request.sort_key(), request))

    def _admit(self, request: Request, num_cached_tokens: int) -> None:
        request.num_computed_tokens = num_cached_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self._running_sorted = False
        if request.num_cached_tokens < 0:  # first admission, not a resume after preemption
            request.num_cached_tokens = num_cached_tokens
            request.metrics.first_scheduled_time = time.time()
            self.num_prompt_tokens_total += request.num_prompt_tokens
            self.kv_cache.record_prefix_query(request.num_tokens, num_cached_tokens)

    def _preempt(self, request: Request) -> None:
        log.debug("preempting %s (%d tokens)", request.request_id, request.num_tokens)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._push_waiting(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.metrics.finished_time = time.time()
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self.finished_request_ids.add(request.request_id)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.params
        if token_id in request.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _scheduled_request(request: Request, num_new_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + num_new_tokens
        tokens = request.all_token_ids
        token_ids = tokens[start:end]
        if end > len(tokens):
            token_ids += [PENDING_TOKEN] * (end - len(tokens))
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            block_ids=request.block_ids,
            sample=end == request.num_scheduled_tokens,
            params=request.params,
            prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids,
        )
