"""Where the step channel listens and how a rank reaches it (torch-free: the compute-only
hosts' launcher uses it too)."""

from __future__ import annotations

import logging
import os
import time
from multiprocessing.connection import Client, Connection

from kvfleet_engine.config import ParallelConfig

# The channel's shared key (HMAC challenge on connect); set the same on every host to change it.
# The operator gives each multi-node deployment a random one (its Secret NAME-group-key).
AUTHKEY_ENV = "KVFLEET_PARALLEL_AUTHKEY"
DEFAULT_AUTHKEY = b"kvfleet-parallel"

log = logging.getLogger(__name__)


def authkey() -> bytes:
    return os.environ.get(AUTHKEY_ENV, "").encode() or DEFAULT_AUTHKEY


def warn_if_default_key(parallel: ParallelConfig) -> None:
    """Where other hosts join over the network on the default key, anyone who reaches the
    port can join a group and read its steps: say so, and how to set a key."""
    if parallel.nnodes > 1 and authkey() == DEFAULT_AUTHKEY:
        log.warning(
            "the step channel accepts other hosts on its default key: set %s to the same "
            "secret on every host (the operator sets it from the Secret NAME-group-key)",
            AUTHKEY_ENV,
        )


def channel_address(parallel: ParallelConfig) -> tuple[str, int]:
    """The driver's step channel: master_addr, the port after master_port."""
    return parallel.master_addr, parallel.master_port + 1


def listen_address(parallel: ParallelConfig) -> tuple[str, int]:
    """Where the driver listens: every interface when other hosts connect."""
    host = "0.0.0.0" if parallel.nnodes > 1 else parallel.master_addr
    return host, parallel.master_port + 1


def connect(parallel: ParallelConfig, deadline: float) -> Connection:
    """Connect to the driver, retrying until `deadline` (time.monotonic()): the leader's host
    may start after this one."""
    address = channel_address(parallel)
    while True:
        try:
            return Client(address, authkey=authkey())
        except (ConnectionRefusedError, ConnectionResetError, OSError) as error:
            if time.monotonic() >= deadline:
                raise OSError(
                    f"could not reach the leader's step channel at {address[0]}:{address[1]} "
                    f"within {parallel.join_timeout_s:.0f} s: {error}"
                ) from error
            time.sleep(0.2)
