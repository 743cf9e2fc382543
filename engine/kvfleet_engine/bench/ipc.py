"""The IPC micro-benchmark behind `core.records`: one step's output record, round trip.

    python -m kvfleet_engine.bench.ipc [--requests 256] [--round-trips 3000] [--runs 3]

A `StepOutputs` record for N requests (one new token each, as in a decode step) is encoded,
sent to a child process, decoded, encoded again, sent back and decoded: the median and p90 of
that round trip, for a `multiprocessing.Pipe` (a Unix socketpair) and, when pyzmq is
installed, a ZeroMQ PAIR socket on `ipc://`, runs interleaved. Codec costs alone (msgspec,
pickle, msgpack when installed) are printed first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import pickle
import tempfile
import time
import timeit
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kvfleet_engine.core.records import StepOutputs, encoder, from_core_decoder
from kvfleet_engine.outputs import SchedulerStats


def step_record(num_requests: int) -> StepOutputs:
    return StepOutputs(
        request_ids=[f"cmpl-{i:032x}-0" for i in range(num_requests)],
        new_token_ids=[[1000 + i] for i in range(num_requests)],
        timestamp=time.time(),
        stats=SchedulerStats(num_requests, 0, 0.5, 0, 10_000, 0, 10_000, 5_000, 1_000, 500),
    )


def _codecs() -> dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any], Any]]:
    record = step_record(256)
    plain = (
        record.request_ids,
        record.new_token_ids,
        record.timestamp,
        tuple(_stats_values(record)),
    )
    codecs: dict[str, tuple[Callable[[Any], bytes], Callable[[bytes], Any], Any]] = {
        "msgspec": (encoder().encode, from_core_decoder().decode, record),
        "pickle": (lambda o: pickle.dumps(o, protocol=5), pickle.loads, plain),
    }
    try:
        import msgpack
    except ImportError:
        return codecs
    codecs["msgpack"] = (msgpack.packb, msgpack.unpackb, plain)
    return codecs


def _stats_values(record: StepOutputs) -> list[float]:
    stats = record.stats
    return [float(getattr(stats, name)) for name in stats.__dataclass_fields__]


def _echo_pipe(conn: Connection) -> None:
    encode, decode = encoder().encode, from_core_decoder().decode
    while (data := conn.recv_bytes()) != b"stop":
        conn.send_bytes(encode(decode(data)))


def _echo_zmq(address: str) -> None:
    import zmq

    encode, decode = encoder().encode, from_core_decoder().decode
    socket = zmq.Context().socket(zmq.PAIR)
    socket.connect(address)
    while (data := socket.recv()) != b"stop":
        socket.send(encode(decode(data)))


def round_trip_us(transport: str, num_requests: int, round_trips: int) -> tuple[float, float]:
    """(median, p90) microseconds of one round trip."""
    context = multiprocessing.get_context("spawn")
    if transport == "pipe":
        conn, child_conn = context.Pipe()
        child = context.Process(target=_echo_pipe, args=(child_conn,))
        child.start()
        send: Callable[[bytes], Any] = conn.send_bytes
        recv: Callable[[], Any] = conn.recv_bytes
    else:
        import zmq

        address = f"ipc://{tempfile.mkdtemp()}/ipc.sock"
        socket = zmq.Context().socket(zmq.PAIR)
        socket.bind(address)
        child = context.Process(target=_echo_zmq, args=(address,))
        child.start()
        send, recv = socket.send, socket.recv
    encode, decode = encoder().encode, from_core_decoder().decode
    record = step_record(num_requests)
    times = []
    for _ in range(round_trips):
        start = time.perf_counter()
        send(encode(record))
        decode(recv())
        times.append(time.perf_counter() - start)
    send(b"stop")
    child.join()
    ordered = sorted(times[round_trips // 10 :])  # the first tenth warms up
    return ordered[len(ordered) // 2] * 1e6, ordered[int(len(ordered) * 0.9)] * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--round-trips", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    for name, (encode, decode, record) in _codecs().items():
        data = encode(record)
        enc = min(timeit.repeat(lambda: encode(record), number=2000, repeat=5)) / 2000  # noqa: B023
        dec = min(timeit.repeat(lambda: decode(data), number=2000, repeat=5)) / 2000  # noqa: B023
        print(f"{name:8} {len(data):6d} B  encode {enc * 1e6:6.1f} us  decode {dec * 1e6:6.1f} us")
    transports = ["pipe"]
    try:
        import zmq  # noqa: F401

        transports.append("zmq")
    except ImportError:
        pass
    results: dict[str, list[tuple[float, float]]] = {t: [] for t in transports}
    for _ in range(args.runs):
        for transport in transports:
            results[transport].append(round_trip_us(transport, args.requests, args.round_trips))
    for transport, runs in results.items():
        cells = "  ".join(f"p50 {p50:.0f} / p90 {p90:.0f} us" for p50, p90 in runs)
        print(f"{transport:5} round trip, {args.requests} requests: {cells}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
