"""The step diff: the driver turns each SchedulerOutput into a `Step` holding only what the
workers do not have yet (`StepEncoder`); each worker keeps the block tables and rebuilds the
batch's items from it (`StepDecoder`). Under pipeline parallelism the last stage samples, so
the diff also carries each request's sampling settings once (and, for a request with
penalties, its output tokens every step it samples)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvfleet_engine.parallel.messages import SamplingRow, Step
from kvfleet_engine.step import ScheduledRequest, SchedulerOutput


class StepEncoder:
    def __init__(self, with_sampling: bool = False) -> None:
        # True: the workers sample (a pipeline's last stage): send the sampling settings.
        self.with_sampling = with_sampling
        # Requests whose sampling settings the workers hold.
        self.sent_sampling: set[str] = set()
        # request id -> the block table the workers hold for it.
        self.sent_tables: dict[str, list[int]] = {}
        # Requests finished since the last step sent (empty steps are not sent).
        self._finished: list[str] = []

    def finish(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            if self.sent_tables.pop(request_id, None) is not None:
                self._finished.append(request_id)
            self.sent_sampling.discard(request_id)

    def encode(self, scheduled: SchedulerOutput) -> Step:
        """The diff of a step with requests (after finish() of its finished ids)."""
        items = scheduled.requests
        new_block_ids: list[list[int]] = []
        reset_rows: list[int] = []
        tables = self.sent_tables
        for row, item in enumerate(items):
            blocks = item.block_ids
            sent = tables.get(item.request_id)
            num_sent = len(sent) if sent is not None else 0
            if sent is None or len(blocks) < num_sent or blocks[:num_sent] != sent:
                reset_rows.append(row)  # new, or re-admitted after a preemption with new blocks
                tables[item.request_id] = list(blocks)
                new_block_ids.append(list(blocks))
            else:
                new = blocks[num_sent:]
                sent.extend(new)
                new_block_ids.append(new)
        finished, self._finished = self._finished, []
        step = Step(
            request_ids=[item.request_id for item in items],
            token_ids=[item.token_ids for item in items],
            start_positions=[item.start_position for item in items],
            new_block_ids=new_block_ids,
            reset_rows=reset_rows,
            sample_rows=[row for row, item in enumerate(items) if item.sample],
            finished_request_ids=finished,
        )
        if self.with_sampling:
            self._add_sampling(step, items)
        return step

    def _add_sampling(self, step: Step, items: list[ScheduledRequest]) -> None:
        for row in step.sample_rows:
            item = items[row]
            params = item.params
            if item.request_id not in self.sent_sampling:
                self.sent_sampling.add(item.request_id)
                step.new_sampling[row] = SamplingRow(
                    temperature=params.temperature,
                    top_p=params.top_p,
                    top_k=params.top_k,
                    min_p=params.min_p,
                    seed=params.seed,
                    repetition_penalty=params.repetition_penalty,
                    presence_penalty=params.presence_penalty,
                    frequency_penalty=params.frequency_penalty,
                    logprobs=params.logprobs,
                    prompt_token_ids=list(item.prompt_token_ids) if params.has_penalties else [],
                )
            if params.has_penalties:
                step.penalty_output_ids[row] = list(item.output_token_ids)


@dataclass(frozen=True, slots=True)
class WorkerItem:
    """One request's share of a step, as a worker rebuilds it (runner.inputs.BatchItem)."""

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool


class StepDecoder:
    def __init__(self) -> None:
        # request id -> its block table.
        self.tables: dict[str, list[int]] = {}

    def apply(self, step: Step) -> list[WorkerItem]:
        tables = self.tables
        for request_id in step.finished_request_ids:
            tables.pop(request_id, None)
        resets, samples = set(step.reset_rows), set(step.sample_rows)
        items = []
        for row, request_id in enumerate(step.request_ids):
            if row in resets:
                table = tables[request_id] = step.new_block_ids[row]
            else:
                table = tables[request_id]
                table.extend(step.new_block_ids[row])
            items.append(
                WorkerItem(
                    request_id,
                    step.token_ids[row],
                    step.start_positions[row],
                    table,
                    row in samples,
                )
            )
        return items
