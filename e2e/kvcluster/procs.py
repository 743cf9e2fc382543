"""Start, probe and stop the control-plane processes (plain POSIX processes, no supervisor)."""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True if something listens on host:port (a TIME_WAIT leftover does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            raise
    return False


def spawn(argv: tuple[str, ...], log_path: Path) -> int:
    """Start a process detached from our session (it outlives `cluster.py up`); returns its pid."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log_file:
        log_file.write(f"\n=== {time.strftime('%F %T')} {' '.join(argv)}\n".encode())
        log_file.flush()
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    return proc.pid


def is_alive(pid: int, binary: str | None = None) -> bool:
    """The process exists, is not a zombie, and (if given) runs `binary`."""
    _reap(pid)
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
        if state in (b"Z", b"X"):
            return False
        # /proc/<pid>/exe, not cmdline: right after exec the new cmdline can still read empty.
        if binary is not None:
            exe = os.readlink(f"/proc/{pid}/exe").removesuffix(" (deleted)")
            return exe == os.path.realpath(binary)
    except (OSError, IndexError):  # gone, or not ours to inspect
        return False
    return True


def _reap(pid: int) -> None:
    """Collect the exit status if `pid` is our own child, so it does not linger as a zombie."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def stop(pid: int, binary: str | None, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; returns once the process is gone."""
    if not is_alive(pid, binary):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_alive(pid):
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    while is_alive(pid):
        time.sleep(0.05)


def probe(url: str, ssl_context: ssl.SSLContext | None, timeout_s: float = 2.0) -> bool:
    """GET url answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=ssl_context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError, ssl.SSLError, OSError):
        return False


def client_ssl_context(ca_cert: Path, client_cert: Path, client_key: Path) -> ssl.SSLContext:
    """Trusts our CA and presents the admin certificate. Components whose serving certificate
    is self-generated are not verified (they only answer /healthz)."""
    context = ssl.create_default_context(cafile=str(ca_cert))
    context.load_cert_chain(str(client_cert), str(client_key))
    return context


def tail(path: Path, num_lines: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(lines[-num_lines:])


def stop_child(proc: subprocess.Popen[bytes], sig: signal.Signals, grace_s: float) -> None:
    """Send `sig` to a process we started, SIGKILL it after `grace_s`; returns once it exited."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


ENGINE_CORE = b"spawn_main"  # in `kvfleet serve`'s engine core's command line (spawned)


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def child_running(pid: int, marker: bytes) -> int:
    """The child of `pid` whose command line contains `marker` (ENGINE_CORE: kvfleet serve's
    engine core); LookupError if there is none."""
    for child in children(pid):
        try:
            if marker in Path(f"/proc/{child}/cmdline").read_bytes():
                return child
        except OSError:
            continue
    raise LookupError(f"no child of {pid} runs {marker!r}")


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """The pids still running (not zombies) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = [pid for pid in pids if is_alive(pid)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)


def kill_tree(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGKILL a process we started, then its children that outlive it by `grace_s` (they watch
    their parent and normally go on their own)."""
    kids = children(proc.pid)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in wait_gone(kids, grace_s):
        os.kill(pid, signal.SIGKILL)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (created, with its folder) for the block, so one
    process at a time runs it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
