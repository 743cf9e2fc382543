"""`kvfleet operator`'s flags and the environment they read, checked before the operator looks
for a cluster: each problem is one line naming the flag or the variable (argparse's error, exit
2). Pure but for one probe: --liveness's address is bound once to see that kopf can serve it."""

from __future__ import annotations

import argparse
import os
import re
import socket
import urllib.parse

from kvfleet_operator.wire import DNS_LABEL, DNS_SUBDOMAIN, IMAGE_PATTERN

# What a --namespace pattern may hold: a namespace's characters, kopf's globs (* ? [...]),
# its exclusions (!) and its commas. Anything else matches no namespace, ever.
NAMESPACE_PATTERN = r"^[-a-z0-9*?!,\[\] ]+$"
# The images the operator puts in pods of InferenceDeployments that name none.
IMAGE_VARIABLES = ("KVFLEET_ENGINE_IMAGE", "KVFLEET_ROUTER_IMAGE")


def port(value: str) -> int:
    """--metrics-port: a TCP port."""
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise argparse.ArgumentTypeError(f"a port 1..65535, got {value!r}")
    return int(value)


def liveness_url(value: str) -> str:
    """--liveness: what kopf serves, http://HOST:PORT/PATH, checked before kopf starts."""
    parts = urllib.parse.urlsplit(value)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None or port == 0:
        raise argparse.ArgumentTypeError(f"http://HOST:PORT/PATH, got {value!r}")
    if not parts.path.startswith("/") or parts.query or parts.fragment:
        raise argparse.ArgumentTypeError(f"a path such as /healthz after the port, got {value!r}")
    return value


def argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags and the environment they read, naming the flag or variable;
    None when the operator can start."""
    for pattern in args.namespace:
        if not re.match(NAMESPACE_PATTERN, pattern):
            return (f"--namespace: a namespace or a glob pattern of one (lower-case letters, "
                    f"digits, '-', '*', '?', '[...]', '!'), got {pattern!r}")  # fmt: skip
    for prefix in args.host_path_prefix or ():
        if not prefix.startswith("/") or "/../" in prefix + "/" or prefix.rstrip("/") == "":
            return f"--host-path-prefix: an absolute directory other than /, got {prefix!r}"
    if args.hf_endpoint is not None:
        source, endpoint = "--hf-endpoint", args.hf_endpoint
    else:
        source, endpoint = "$HF_ENDPOINT", os.environ.get("HF_ENDPOINT", "")
    if (source == "--hf-endpoint" or endpoint) and not _is_http_url(endpoint):
        return f"{source}: an http:// or https:// URL, got {endpoint!r}"
    for variable in IMAGE_VARIABLES:
        image = os.environ.get(variable, "")
        if image and not re.match(IMAGE_PATTERN, image):
            return f"${variable}: an image reference without whitespace, got {image!r}"
    if args.liveness is not None:
        problem = _liveness_problem(args.liveness, args.metrics_port)
        if problem:
            return problem
    return _leader_election_problem(args)


def _is_http_url(value: str) -> bool:
    parts = urllib.parse.urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.hostname) and value.strip() == value


def _liveness_problem(url: str, metrics_port: int | None) -> str | None:
    """Whether kopf can serve --liveness: its port is not the metrics port and can be bound
    (kopf binds it only once the operator runs, and a failure there is a traceback)."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or 0
    if port == metrics_port:
        return f"--liveness: port {port} is --metrics-port too; give them different ports"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except OSError as exc:
        return f"--liveness: cannot serve {url}: {exc.strerror or exc}"
    return None


def _leader_election_problem(args: argparse.Namespace) -> str | None:
    lease = args.leader_election_id
    if not args.leader_election:
        if lease is not None:
            return "--leader-election-id: names the Lease of --leader-election; add that flag"
        return None
    if lease is not None and (len(lease) > 253 or not re.fullmatch(DNS_SUBDOMAIN, lease)):
        return (f"--leader-election-id: a Lease name (lower-case letters, digits, '-' and '.', "
                f"253 at most), got {lease!r}")  # fmt: skip
    namespace = os.environ.get("POD_NAMESPACE", "")
    if not namespace:
        return ("--leader-election: set $POD_NAMESPACE (the downward API's metadata.namespace) "
                "to the namespace of the Lease")  # fmt: skip
    if len(namespace) > 63 or not re.match(DNS_LABEL, namespace):
        return f"$POD_NAMESPACE: the namespace of the Lease (a DNS label), got {namespace!r}"
    if not os.environ.get("POD_NAME", "").strip():
        return ("--leader-election: set $POD_NAME (the downward API's metadata.name), this "
                "replica's identity in the Lease (replicas of one identity all lead)")  # fmt: skip
    return None
