"""The API process's end of the engine-core pipe under the event loops `kvfleet serve` runs:
uvloop (uvicorn picks it when it imports) and asyncio's own. A record that arrives in pieces is
read whole, not taken for the core's exit; sends into a full pipe arrive whole and in order."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import pytest
import uvloop

from kvfleet_engine.client.core_client import CoreClient
from kvfleet_engine.core.profile import PhaseProfile
from kvfleet_engine.core.records import (
    AddRequest,
    FromCore,
    StepOutputs,
    encoder,
    to_core_decoder,
)
from kvfleet_engine.outputs import SchedulerStats

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "uvloop": uvloop.new_event_loop,
    "asyncio": asyncio.new_event_loop,
}


class _LiveProcess:
    """Stands in for the core's process: alive (no exit code) the whole test."""

    exitcode = None
    pid = 0

    def join(self, timeout: float | None = None) -> None:
        return None

    def is_alive(self) -> bool:
        return False  # shutdown() then only closes the pipe


def _client_on_pipe() -> tuple[CoreClient, Connection]:
    """A CoreClient wired to one end of a pipe (the core's end returned), as start() wires it."""
    ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=True)
    client = CoreClient(config=None)  # type: ignore[arg-type]  # start() is not called
    client._conn, client._process = ours, _LiveProcess()  # type: ignore[assignment]
    return client, theirs


def _big_step(num_requests: int) -> StepOutputs:
    stats = SchedulerStats(num_requests, 0, 0.5, 0, 0, 0, 0, 0, 10_000, 5_000)
    ids = [f"cmpl-{k:032x}-0" for k in range(num_requests)]
    return StepOutputs(ids, [[k % 50_000] for k in range(num_requests)], time.time(), stats)


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_a_record_arriving_in_pieces_is_read_whole(loop_name: str) -> None:
    client, core_end = _client_on_pipe()
    record = _big_step(4096)  # a c1024-sized step's record, and then some
    payload = encoder().encode(record)
    got: list[FromCore] = []
    exits: list[int | None] = []

    def core_writer() -> None:  # the core's write as a busy host delivers it: in two pieces
        fd = core_end.fileno()
        half = len(payload) // 2
        os.write(fd, struct.pack("!i", len(payload)) + payload[:half])  # header and part
        time.sleep(0.2)
        os.write(fd, payload[half:])

    writer = threading.Thread(target=core_writer, daemon=True)
    loop = LOOPS[loop_name]()
    try:

        async def scenario() -> None:
            client.attach(
                asyncio.get_running_loop(),
                got.append,
                exits.append,
                PhaseProfile("api", ("records",)),
            )
            writer.start()
            for _ in range(100):
                if got or exits:
                    break
                await asyncio.sleep(0.02)

        loop.run_until_complete(scenario())
        writer.join(timeout=10)
    finally:
        client.shutdown()
        loop.close()
        core_end.close()
    assert exits == [], "a record still arriving was taken for the core's exit"
    assert got == [record]


@pytest.mark.parametrize("loop_name", sorted(LOOPS))
def test_sends_into_a_full_pipe_arrive_whole_and_in_order(loop_name: str) -> None:
    client, core_end = _client_on_pipe()
    num_records = 1500  # ~5 MB of 512-token prompts: many times what the pipe buffers
    received: list[Any] = []

    def core_reader() -> None:  # the core's input thread, late to start as on a busy core
        decode = to_core_decoder().decode
        time.sleep(0.3)
        while len(received) < num_records:
            received.append(decode(core_end.recv_bytes()))

    reader = threading.Thread(target=core_reader, daemon=True)
    loop = LOOPS[loop_name]()
    sent = [
        AddRequest(f"cmpl-{k}-0", list(range(k, k + 512)), {"max_tokens": 16}, 0, 0.0)
        for k in range(num_records)
    ]
    try:

        async def scenario() -> None:
            client.attach(
                asyncio.get_running_loop(),
                lambda _: None,
                lambda _: None,
                PhaseProfile("api", ("records",)),
            )
            reader.start()
            for record in sent:
                client.send(record)

        loop.run_until_complete(scenario())
        reader.join(timeout=30)
    finally:
        client.shutdown()
        loop.close()
        core_end.close()
    assert [r.request_id for r in received] == [r.request_id for r in sent]
    assert received == sent
