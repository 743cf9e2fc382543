"""`kvfleet operator`: run the InferenceDeployment operator against $KUBECONFIG or, inside a pod,
its service account."""

from __future__ import annotations

import argparse
import logging


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvfleet operator", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable; glob patterns allowed); default: all namespaces",
    )
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="serve a liveness endpoint, e.g. http://0.0.0.0:8080/healthz",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    args = parser.parse_args(argv)

    import kopf

    import kvfleet_operator.handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    kopf.configure(verbose=args.verbose)
    kopf.run(
        standalone=True,
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=args.liveness,
        memo=kopf.Memo(namespaces=tuple(args.namespace)),
    )
    return 0
