"""`kvfleet serve`: load a model, warm up, serve it over HTTP; drain on SIGTERM.

    kvfleet serve [--model PATH] [--served-model-name N] [--host H] [--port P] [engine flags]

Without --model it serves the embedded model, SmolLM2-135M-Instruct (fetched and cached on first
use: `kvfleet fetch-model`), as "smollm2-135m-instruct".
With --nnodes N, every host runs `kvfleet serve` with its --node-rank: node 0 (the leader) does
all of the above; another node only computes (its ranks) and answers /health and /ready on
--port (`kvfleet_engine.parallel.node`).
SIGTERM: /ready turns 503, new requests get 503, in-flight requests finish (up to
--drain-timeout seconds, then they are aborted), and the process exits 0.

The engine core (model, scheduler, step loop) runs in a child process; this process serves
HTTP, tokenizes and detokenizes. If the core dies, /health turns 503, in-flight requests end
with an error, and this process exits 1 (so Kubernetes restarts the pod). If this process dies,
however it dies, the core notices the closed pipe and exits too.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from kvfleet_engine import logs
from kvfleet_engine.argtypes import (
    api_key,
    api_key_or_environment,
    non_negative_seconds,
    port_number,
    positive_float,
    positive_int,
    served_model_name,
)
from kvfleet_engine.core import heap
from kvfleet_engine.server.admission import AdmissionConfig
from kvfleet_engine.server.auth import API_KEY_ENV
from kvfleet_engine.server.body_limit import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_REQUEST_BODY_BYTES

if TYPE_CHECKING:
    from kvfleet_engine.config import EngineConfig

log = logging.getLogger(__name__)

# uvicorn's own default is 5 s: a load balancer or ingress (AWS ALB, nginx: 60 s idle) would reuse
# connections the server is closing, and its clients would see resets.
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 75
# A request head (request line and headers) takes one round trip from any real client; one that
# never completes is a slowloris holding a connection.
DEFAULT_HEADER_TIMEOUT_S = 10.0


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends a flag's default to its help, unless the help already says it or there is none
    (no "(default: None)", no second "(default: ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from kvfleet_engine.config import EngineConfig

    parser = argparse.ArgumentParser(
        prog="kvfleet serve",
        description="Serve a model over an OpenAI-compatible HTTP API.",
        formatter_class=_DefaultsHelpFormatter,
        # No prefixes of flags: `--quant fp8` in an InferenceDeployment's engine.extraArgs would
        # set --quantization past the admission rule that refuses the flags the operator sets.
        allow_abbrev=False,
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--served-model-name",
        type=served_model_name,
        help="model name clients send (default: --model)",
    )
    server.add_argument("--host", default="0.0.0.0", help="address to listen on")
    server.add_argument("--port", type=port_number, default=8000, help="port to listen on")
    server.add_argument(
        "--max-queued-requests",
        type=positive_int,
        help="requests that may wait for their first token; beyond it: 429 (default: no limit)",
    )
    server.add_argument(
        "--max-queued-tokens",
        type=positive_int,
        help="prompt tokens that may wait; beyond it: 429 (default: no limit)",
    )
    server.add_argument(
        "--ttft-slo-ms",
        type=positive_float,
        help="SLA mode: refuse (429) requests whose estimated time to first token exceeds this",
    )
    server.add_argument(
        "--tpot-slo-ms",
        type=positive_float,
        help="SLA mode: cap each step's token budget so time per output token stays below this",
    )
    server.add_argument(
        "--drain-timeout",
        type=non_negative_seconds,
        default=30.0,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    server.add_argument(
        "--keep-alive-timeout",
        type=positive_int,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help="seconds an idle client connection stays open; keep it above the idle timeout of "
        "the proxies in front (60 s for most), or one may reuse a connection as it closes",
    )
    server.add_argument(
        "--header-timeout",
        type=positive_float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds from a connection's open, or from the next request's first byte, to the "
        "end of the request's headers; past it the connection is closed (a stalled client)",
    )
    server.add_argument(
        "--body-timeout",
        type=positive_float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds the server waits for a request body's next bytes; past it the request "
        "gets 408 and its connection is closed (a client that stalled after its headers)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    server.add_argument(
        "--api-key",
        type=api_key,
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ready and "
        f"/metrics (default: the {API_KEY_ENV} environment variable; unset: no authentication)",
    )
    server.add_argument(
        "--max-request-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies get 413",
    )
    server.add_argument(
        "--log-requests",
        action="store_true",
        help="log one JSON line per request: id, status, token counts, timings (never text)",
    )
    EngineConfig.add_cli_args(parser)
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.api_key = api_key_or_environment(parser, args.api_key, API_KEY_ENV)
    logs.configure(args.log_level)
    if args.model is None:
        from kvfleet_engine.model_store import DEFAULT_MODEL, FetchError, fetch

        try:
            args.model = str(fetch(DEFAULT_MODEL))
        except FetchError as error:
            print(f"kvfleet serve: no --model given and {error}", file=sys.stderr)
            return 1
        args.served_model_name = args.served_model_name or DEFAULT_MODEL.served_name
        log.info("no --model given: serving the embedded model from %s", args.model)
    return _serve(parser, args)


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.config.cli import in_flag_words

    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as exc:  # one line: the flags were fine, the model or a setting is not
        parser.exit(2, f"{parser.prog}: error: {in_flag_words(str(exc))}\n")
    if config.parallel.node_rank > 0:  # a compute-only host of a multi-node replica
        from kvfleet_engine.parallel import node

        return node.serve(config, args.host, args.port, args.log_level)
    try:
        listener = _listening_socket(args.host, args.port)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        print(f"kvfleet serve: cannot listen on {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    try:
        return _serve_on(listener, args, config)
    finally:
        listener.close()


def _serve_on(listener: socket.socket, args: argparse.Namespace, config: EngineConfig) -> int:
    from kvfleet_engine.async_engine import AsyncEngine
    from kvfleet_engine.client.core_client import CoreClient, CoreStartError
    from kvfleet_engine.config.cli import in_flag_words
    from kvfleet_engine.metrics import EngineInfo, EngineMetrics
    from kvfleet_engine.server.app import build_app
    from kvfleet_engine.server.draining import DrainingServer
    from kvfleet_engine.server.header_timeout import http_protocol
    from kvfleet_engine.server.state import ServerSettings, ServerState
    from kvfleet_engine.tokenizer import load_tokenizer

    client = CoreClient(config, log_level=args.log_level)
    # The tokenizer (transformers, and the torch it imports: most of this process's start-up)
    # loads while the core loads the model, instead of after it.
    tokenizer_loader = _Background(load_tokenizer, config.model)
    try:
        client.start()
    except CoreStartError as exc:  # user error: a checkpoint that does not match its config
        if not exc.user_error:
            print(f"kvfleet serve: {exc}", file=sys.stderr)
            return 1
        print(f"kvfleet serve: {in_flag_words(str(exc))}", file=sys.stderr)
        return 2
    try:
        tokenizer = tokenizer_loader.result()
    except Exception as exc:
        client.shutdown()
        print(f"kvfleet serve: {_tokenizer_error(config.model.path, exc)}", file=sys.stderr)
        return 1
    except BaseException:
        client.shutdown()
        raise
    served_name = args.served_model_name or args.model
    metrics = EngineMetrics(
        EngineInfo(
            model=served_name,
            version=_version(),
            quantization=config.model.quantization_name,
            tensor_parallel_size=args.tensor_parallel_size,
            world_size=config.parallel.world_size,
        )
    )
    assert client.ready is not None, "set by client.start()"
    metrics.set_cache_config(client.ready.block_size, client.ready.num_blocks)
    settings = ServerSettings(
        served_model_name=served_name,
        max_model_len=config.model.max_model_len,
        vocab_size=config.model.vocab_size,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        max_num_seqs=config.scheduler.max_num_seqs,
        admission=AdmissionConfig(
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens,
            ttft_slo_s=args.ttft_slo_ms / 1000 if args.ttft_slo_ms else None,
            tpot_slo_s=args.tpot_slo_ms / 1000 if args.tpot_slo_ms else None,
        ),
        drain_timeout_s=args.drain_timeout,
        max_request_body_bytes=args.max_request_body_bytes,
        body_timeout_s=args.body_timeout,
        api_key=args.api_key,
        log_requests=args.log_requests,
    )
    engine = AsyncEngine(client, tokenizer, metrics)
    state = ServerState(settings, engine, metrics)
    app = build_app(state)
    heap.settle()  # start-up objects (tokenizer, app, imports) out of every collection
    engine.profile.track_gc()
    server = DrainingServer(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_keep_alive=args.keep_alive_timeout,
            http=http_protocol(args.header_timeout),
        ),
        state,
    )
    try:
        server.run(sockets=[listener])
    finally:
        client.shutdown()  # whatever ended the server, the core goes with it
    log.info("server stopped (exit code %d)", server.exit_code)
    return server.exit_code


def _listening_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound before the model loads, so a port in use or an address this
    machine does not have is one line at once rather than a uvicorn error after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


# What a Hugging Face tokenizer loads from: one of these at least.
_TOKENIZER_FILES = ("tokenizer.json", "*.model", "vocab.*")


def _tokenizer_error(model_path: str, exc: Exception) -> str:
    """One line: why the tokenizer of --model did not load."""
    directory = Path(model_path)
    if directory.is_dir() and not any(any(directory.glob(p)) for p in _TOKENIZER_FILES):
        return (
            f"--model {model_path}: no tokenizer files there (none of "
            f"{', '.join(_TOKENIZER_FILES)}); copy them from the model's repository"
        )
    lines = str(exc).strip().splitlines()
    if isinstance(exc, ValueError) and lines and lines[0].startswith("model: "):
        return lines[0]  # load_tokenizer's own message names the file and what is wrong in it
    return f"--model {model_path}: cannot load its tokenizer: {lines[0] if lines else repr(exc)}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvfleet")
    except PackageNotFoundError:
        return "unknown"


class _Background:
    """`function(*args)` on a daemon thread; `result()` waits for it and returns its value or
    raises its exception. Daemon, so a start-up that fails elsewhere does not wait for it."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(function, args), name="kvfleet-start-up", daemon=True
        )
        self._thread.start()

    def _run(self, function: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = function(*args)
        except BaseException as exc:  # re-raised in result(), on the caller's thread
            self._error = exc

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
