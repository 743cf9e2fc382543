"""`kvfleet operator`: run the InferenceDeployment operator against $KUBECONFIG or, inside a pod,
its service account."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys

from kvfleet_operator import api, flags

PREFLIGHT_TIMEOUT_SECONDS = 30.0
DESCRIPTION = (
    "Run the InferenceDeployment operator against $KUBECONFIG (or, inside a pod, its service "
    "account)."
)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet operator", description=DESCRIPTION)
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable; glob patterns allowed); default: all namespaces",
    )
    parser.add_argument(
        "--liveness",
        type=flags.liveness_url,
        default=None,
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument(
        "--metrics-port",
        type=flags.port,
        default=None,
        metavar="PORT",
        help="serve the autoscaler's metrics at http://0.0.0.0:PORT/metrics (default: off)",
    )
    parser.add_argument(
        "--hf-endpoint",
        default=None,
        metavar="URL",
        help="Hugging Face endpoint (or mirror) from which GGUF headers of hf:// files are "
        f"read; default $HF_ENDPOINT, else {api.DEFAULT_HF_ENDPOINT}",
    )
    parser.add_argument(
        "--host-path-prefix",
        action="append",
        default=None,
        metavar="DIR",
        help="mount file:// models only from node directories under DIR (repeatable; an "
        "absolute path); default: any node directory, which whoever may create an "
        "InferenceDeployment can then read",
    )
    parser.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: only the one holding the Lease "
        "--leader-election-id in $POD_NAMESPACE acts, the others take over when it goes "
        "(identity: $POD_NAME)",
    )
    parser.add_argument(
        "--leader-election-id",
        default=None,
        metavar="NAME",
        help="the Lease's name (default kvfleet-operator; one per install)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    args = parser.parse_args(argv)
    problem = flags.argument_problem(args)
    if problem:
        parser.error(problem)
    prefixes = args.host_path_prefix
    hf_endpoint = args.hf_endpoint or os.environ.get("HF_ENDPOINT") or api.DEFAULT_HF_ENDPOINT
    leader_namespace = os.environ["POD_NAMESPACE"] if args.leader_election else ""
    identity = os.environ["POD_NAME"] if args.leader_election else socket.gethostname()

    problem = asyncio.run(_preflight_with_timeout())
    if problem:
        print(f"kvfleet operator: {problem}", file=sys.stderr)
        return 2

    import kopf

    import kvfleet_operator.handlers  # noqa: F401  (registers the handlers)

    if args.metrics_port is not None:
        from kvfleet_operator import metrics

        try:
            metrics.serve(args.metrics_port)
        except OSError as exc:
            reason = exc.strerror or exc
            print(f"kvfleet operator: --metrics-port: cannot serve {args.metrics_port}: {reason}",
                  file=sys.stderr)  # fmt: skip
            return 2

    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(
            namespaces=tuple(args.namespace),
            hf_endpoint=hf_endpoint,
            host_path_prefixes=tuple(prefixes) if prefixes is not None else None,
            leader_namespace=leader_namespace,
            leader_election_id=args.leader_election_id or "kvfleet-operator",
            identity=identity,
        ),
    )
    return 0


async def _preflight_with_timeout() -> str | None:
    try:
        return await asyncio.wait_for(_preflight(), PREFLIGHT_TIMEOUT_SECONDS)
    except TimeoutError:
        return f"the API server did not answer within {PREFLIGHT_TIMEOUT_SECONDS:.0f} s"


async def _preflight() -> str | None:
    """A clear message instead of a retry loop when there is no cluster or no CRD."""
    from kvfleet_operator.apply import Cluster

    try:
        cluster = await Cluster.connect()
    except Exception as exc:
        return f"no Kubernetes cluster configured ({exc}); set KUBECONFIG"
    try:
        crd = f"{api.INFERENCE_DEPLOYMENTS}.{api.GROUP}"
        if not await cluster.has_crd(crd):
            return f"CRD {crd} is not installed: kubectl apply --server-side -f crds/"
    except Exception as exc:
        return f"cannot reach the API server: {exc}"
    finally:
        await cluster.close()
    return None
