"""The driver's listener on the step channel: it accepts the other ranks' connections, and takes
each through the key's challenge in a thread of its own under a time limit, so a client that
connects and then says nothing (a stalled scanner, a half-open connection) or answers with
another key is refused with a warning while the ranks behind it join (torch-free)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

log = logging.getLogger(__name__)

# Seconds a connection has to answer the key's challenge (a rank's takes milliseconds).
HANDSHAKE_TIMEOUT_S = 10.0
_ACCEPT_POLL_S = 0.2  # how often the accept loop looks whether the listener was closed


class RankListener:
    """Listens on `address` from construction; `start()` begins accepting. `joined` is how many
    connections passed the challenge; `close()` stops listening and hands them over."""

    def __init__(
        self, address: tuple[str, int], key: bytes, handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S
    ) -> None:
        self._server = socket.create_server(address)  # SO_REUSEADDR, as multiprocessing's
        self._server.settimeout(_ACCEPT_POLL_S)
        self.address: tuple[str, int] = self._server.getsockname()[:2]
        self._key = key
        self._timeout = handshake_timeout_s
        self._lock = threading.Lock()
        self._joined: list[Connection] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="kvfleet-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def joined(self) -> int:
        with self._lock:
            return len(self._joined)

    def close(self) -> list[Connection]:
        """Stop accepting (a challenge still under way is refused when it ends) and return the
        connections that joined, in the order they did."""
        with self._lock:
            self._closed.set()
            joined, self._joined = self._joined, []
        self._server.close()
        if self._thread.is_alive():
            self._thread.join(_ACCEPT_POLL_S * 5)
        return joined

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except TimeoutError:
                continue
            except OSError as error:
                if self._closed.is_set():
                    return  # closed: start-up is over
                log.warning("the step channel's accept failed: %s", error)
                self._closed.wait(0.05)  # a listener that keeps failing does not spin
                continue
            sock.setblocking(True)
            threading.Thread(
                target=self._challenge, args=(sock, peer), name="kvfleet-challenge", daemon=True
            ).start()

    def _challenge(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        """The key's challenge both ways, as multiprocessing's Listener runs it, on a duplicate
        of the socket's descriptor: at the time limit the socket is shut down, which ends a
        read blocked on the duplicate."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

        timer = threading.Timer(self._timeout, expire)
        timer.start()
        conn = Connection(os.dup(sock.fileno()))
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            failure = None
        except (AuthenticationError, EOFError, OSError) as error:
            failure = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        finally:
            timer.cancel()
            sock.close()  # the duplicate stays open in conn
        if expired.is_set():
            failure = f"no answer to the key's challenge within {self._timeout:g} s"
        with self._lock:
            if failure is None and not self._closed.is_set():
                self._joined.append(conn)
                return
        conn.close()
        if failure is not None:
            log.warning("refused a connection to the step channel from %s: %s", peer[0], failure)
