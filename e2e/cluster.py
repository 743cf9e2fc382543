"""Local Kubernetes control plane for kvfleet's e2e tests: `python e2e/cluster.py up|down|status`.

`up` builds the binaries if they are not cached (~/.cache/kvfleet/bin), starts etcd,
kube-apiserver, kube-controller-manager, kube-scheduler and kwok on 127.0.0.1, creates fake GPU
nodes, and prints `export KUBECONFIG=...`. `down` stops every process it started. State, logs
and the kubeconfig live in .kvfleet/cluster/ (or $KVFLEET_CLUSTER_DIR).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvcluster import controlplane
from kvcluster.binaries import INTEGRATION_SPECS, TOOL_SPECS, BuildError, ensure_binaries
from kvcluster.config import ClusterConfig, default_config
from kvcluster.kubectl import KubectlError

GPU_COLUMNS = (
    "NAME:.metadata.name,"
    "READY:.status.conditions[?(@.type=='Ready')].status,"
    "GPUS:.status.allocatable.nvidia\\.com/gpu,"
    "PRODUCT:.metadata.labels.nvidia\\.com/gpu\\.product,"
    "POD-CIDR:.spec.podCIDR"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cluster.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the control plane (build binaries if needed)")
    up.add_argument("--nodes", type=int, default=2, help="fake GPU nodes to create (default 2)")
    build = sub.add_parser("build", help="build the binaries if they are not cached yet")
    build.add_argument(
        "--integrations",
        action="store_true",
        help="also Prometheus and KEDA (for `make test-integrations`)",
    )
    sub.add_parser("down", help="stop every process `up` started")
    sub.add_parser("status", help="show the processes and the nodes")
    sub.add_parser("nodes", help="show the GPU nodes (kubectl get nodes with GPU columns)")
    args = parser.parse_args(argv)

    if args.command == "up" and not 1 <= args.nodes <= 64:
        parser.error(f"--nodes must be between 1 and 64, got {args.nodes}")
    try:
        config = default_config(num_nodes=getattr(args, "nodes", 2))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.command == "up":
        return _up(config)
    if args.command == "build":
        return _build(config, integrations=args.integrations)
    if args.command == "down":
        controlplane.down(config)
        return 0
    if args.command == "nodes":
        return _show_nodes(config)
    return _status(config)


def _up(config: ClusterConfig) -> int:
    try:
        controlplane.up(config, owner="cli", report=lambda line: print(line, file=sys.stderr))
    except controlplane.ClusterError as exc:
        print(f"cluster-up failed: {exc}", file=sys.stderr)
        print("Everything started was stopped.", file=sys.stderr)
        return 1
    print(f"export KUBECONFIG={config.kubeconfig}")
    return 0


def _build(config: ClusterConfig, integrations: bool) -> int:
    specs = (*TOOL_SPECS, *INTEGRATION_SPECS) if integrations else TOOL_SPECS
    try:
        paths = ensure_binaries(config.bin_root, specs)
    except BuildError as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    print(f"binaries ready in {sorted({str(p.parent) for p in paths.values()})}", file=sys.stderr)
    return 0


def _status(config: ClusterConfig) -> int:
    """What runs; exit 1 only where something is wrong (a started process died, or the API
    server does not answer): a control plane that was never started, or stopped, is an answer."""
    states = controlplane.status(config)
    if not states:
        print(f"control plane not running (state dir: {config.state_dir}); start it with "
              "`make cluster-up`")  # fmt: skip
        return 0
    for state in states:
        word = "running" if state.alive else "DEAD"
        print(f"{state.name:<25} pid {state.pid:<8} {word:<8} log {config.log_path(state.name)}")
    running = controlplane.is_running(config)
    print(f"kubeconfig: {config.kubeconfig}  API server ready: {'yes' if running else 'no'}")
    return _show_nodes(config) if running else 1


def _show_nodes(config: ClusterConfig) -> int:
    try:
        kubectl = controlplane.kubectl_for(config)
        print(kubectl("get", "nodes", "-o", f"custom-columns={GPU_COLUMNS}"), end="")
    except KubectlError as exc:
        print(f"cannot list nodes: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
