"""`kvfleet router`: the flags, read once into RouterSettings."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from kvfleet_router.auth import API_KEY_ENV
from kvfleet_router.settings import ENGINE_PORT, STRATEGY_NAMES, RouterSettings

DEFAULTS = RouterSettings(backends=("http://localhost",))  # only to show the defaults


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvfleet router",
        description="OpenAI-compatible router in front of an InferenceDeployment's engine "
        "replicas: prefix- and load-aware, retries, holds requests while scaling from zero.",
    )
    where = parser.add_argument_group("replicas (one of)")
    where.add_argument(
        "--deployment",
        help="InferenceDeployment whose engine Service's EndpointSlices list the replicas",
    )
    where.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL, e.g. http://127.0.0.1:8001 (repeat for several)",
    )
    parser.add_argument(
        "--namespace", help="namespace of --deployment (default: this pod's namespace)"
    )
    parser.add_argument(
        "--discovery",
        choices=("endpointslices", "pods"),
        default="endpointslices",
        help="with --deployment: the ready endpoints of its Service's EndpointSlices, or its "
        "ready pods (needs pods get/list/watch; for clusters whose EndpointSlices cannot hold "
        "the pod IPs)",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="model name clients use (repeatable); other names get 404. Default: the names "
        "the replicas report",
    )
    parser.add_argument("--strategy", choices=STRATEGY_NAMES, default=DEFAULTS.strategy)
    parser.add_argument("--host", default=DEFAULTS.host)
    parser.add_argument("--port", type=int, default=ENGINE_PORT)
    parser.add_argument(
        "--queue-size",
        type=int,
        default=DEFAULTS.queue_size,
        help="requests that may wait for a replica; beyond it 503 at once",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=DEFAULTS.queue_timeout_s,
        metavar="SECONDS",
        help="longest wait for a replica (scale from zero); then 503 with Retry-After",
    )
    parser.add_argument(
        "--scrape-interval",
        type=float,
        default=DEFAULTS.scrape_interval_s,
        metavar="SECONDS",
        help="how often each replica's /metrics is read (at most 0.1: >= 10 Hz)",
    )
    parser.add_argument(
        "--max-attempts",
        type=int,
        default=DEFAULTS.max_attempts,
        help="replicas tried per request when they answer 429, close the connection "
        "unanswered or time out (on 503 or a refused connection a request waits for another "
        "replica until --queue-timeout)",
    )
    parser.add_argument(
        "--upstream-first-byte-timeout",
        type=float,
        default=DEFAULTS.upstream_first_byte_timeout_s,
        metavar="SECONDS",
        help="longest wait for a replica's answer headers once the request was sent; then the "
        "next replica (within --max-attempts), else 504. A non-streamed answer's headers come "
        "when it is complete: raise it for longer generations",
    )
    parser.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=DEFAULTS.upstream_idle_timeout_s,
        metavar="SECONDS",
        help="longest wait for the next bytes of a replica's answer; a stream then ends with "
        "an error",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULTS.header_timeout_s,
        metavar="SECONDS",
        help="seconds from a connection's open, or from its next request's first byte, to the "
        "end of the request's headers; past it the connection is closed (a stalled client)",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULTS.body_timeout_s,
        metavar="SECONDS",
        help="seconds the router waits for a request body's next bytes; past it the request "
        "gets 408 and its connection is closed (a client that stalled after its headers)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULTS.keep_alive_timeout_s,
        metavar="SECONDS",
        help="seconds an idle client connection stays open; keep it above the idle timeout of "
        "the proxies in front (60 s for most)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULTS.max_request_body_bytes,
        help="larger request bodies get a 413 (default: the engine's own limit, 4 MiB; raise "
        "both together)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /ready and "
        "/metrics, and send it to the engines (default: the "
        f"{API_KEY_ENV} environment variable; unset: no authentication)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    namespace = args.namespace
    if args.deployment and namespace is None:
        namespace = _pod_namespace()
    try:
        settings = RouterSettings(
            deployment=args.deployment,
            namespace=namespace,
            discovery=args.discovery,
            backends=tuple(args.backend),
            served_model_names=tuple(args.served_model_name),
            strategy=args.strategy,
            host=args.host,
            port=args.port,
            queue_size=args.queue_size,
            queue_timeout_s=args.queue_timeout,
            scrape_interval_s=args.scrape_interval,
            max_attempts=args.max_attempts,
            upstream_first_byte_timeout_s=args.upstream_first_byte_timeout,
            upstream_idle_timeout_s=args.upstream_idle_timeout,
            header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout,
            keep_alive_timeout_s=args.keep_alive_timeout,
            max_request_body_bytes=args.max_request_body_bytes,
            api_key=args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV),
        )
    except ValueError as exc:
        parser.error(_flag_message(str(exc), key_from_environment=args.api_key is None))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from kvfleet_router.app import ListenError, run

    try:
        run(settings)
    except ListenError as exc:  # the address is taken or unknown: one line, as `kvfleet serve`
        print(f"kvfleet router: {exc}", file=sys.stderr)
        return 2
    return 0


_FLAGS = {
    "deployment": "--deployment",
    "backends": "--backend",
    "namespace": "--namespace",
    "strategy": "--strategy",
    "port": "--port",
    "queue_size": "--queue-size",
    "queue_timeout_s": "--queue-timeout",
    "scrape_interval_s": "--scrape-interval",
    "max_attempts": "--max-attempts",
    "upstream_first_byte_timeout_s": "--upstream-first-byte-timeout",
    "upstream_idle_timeout_s": "--upstream-idle-timeout",
    "header_timeout_s": "--header-timeout",
    "body_timeout_s": "--body-timeout",
    "keep_alive_timeout_s": "--keep-alive-timeout",
    "max_request_body_bytes": "--max-request-body-bytes",
}


def _flag_message(message: str, *, key_from_environment: bool) -> str:
    """A settings error in flag names: 'queue_size: ...' -> '--queue-size: ...' (the key read
    from the environment: '$KVFLEET_API_KEY: ...')."""
    field, sep, rest = message.partition(": ")
    if sep and field == "api_key":
        return f"{'$' + API_KEY_ENV if key_from_environment else '--api-key'}: {rest}"
    if sep and field in _FLAGS:
        return f"{_FLAGS[field]}: {rest}"
    if message.startswith("set either deployment"):
        return "set either --deployment (with --namespace) or --backend, not both"
    if message.startswith("set deployment"):
        return "set --deployment (with --namespace) or --backend: no replicas to route to"
    return message


def _pod_namespace() -> str | None:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or None
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
