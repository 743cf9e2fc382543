"""`make demo`, autoscaling part: watch the operator scale an InferenceDeployment on the token
rate its engines report, on the local control plane (it must be up: `make cluster-up`).

Real engines (tiny model, CPU) stand in for the kwok pods, bound at each pod's IP; `kvfleet bench
serve` loads the first one until the new replicas' engines serve, then the load stops. A table
shows, every few seconds, the Deployment's replicas, the engines serving, the autoscaler's mode,
its reading of the token rate against the target and the reason of its last decision; the
decision history is printed at the end.
Everything it creates lives in the namespace `kvfleet-demo`, deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rich.console import Console
from rich.live import Live
from rich.table import Table

from autoscaling_scenario import NAME, inference_deployment, start_load
from engine_pods import EnginePods
from kvcluster import controlplane
from kvcluster.config import default_config
from kvcluster.kubectl import Kubectl, KubectlError
from kvcluster.procs import stop_child

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "kvfleet-demo"
console = Console()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="demo_autoscaling.py", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=240.0,
        help="longest load; it stops 10 s after every new replica's engine serves",
    )
    parser.add_argument("--target", type=float, default=40.0, help="tokens/s per replica")
    args = parser.parse_args(argv)
    config = default_config()
    if not controlplane.is_running(config):
        console.print("[red]the local control plane is not running: make cluster-up[/red]")
        return 1
    kubectl = controlplane.kubectl_for(config)
    with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as tmp_dir:
        tmp = Path(tmp_dir)
        kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        kubectl("create", "namespace", NAMESPACE, check=False)
        model = tmp / "model"
        _run([sys.executable, "-m", "kvfleet_cli", "tiny-model", str(model)])
        operator = subprocess.Popen(
            [sys.executable, "-m", "kvfleet_cli", "operator", "--namespace", NAMESPACE],
            env={**os.environ, "KUBECONFIG": str(config.kubeconfig)},
            stdout=(tmp / "operator.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            return _demo(kubectl, model, tmp, args.load_seconds, args.target)
        finally:
            stop_child(operator, signal.SIGTERM, 30)
            kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)


def _demo(kubectl: Kubectl, model: Path, tmp: Path, load_seconds: float, target: float) -> int:
    manifest = inference_deployment(NAMESPACE, model, target)
    console.print(f"[bold]kubectl apply[/bold] InferenceDeployment {NAME}: autoscaling 1-3 on "
                  f"generation tokens/s, target {target:g} per replica")  # fmt: skip
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))
    with EnginePods(kubectl, NAMESPACE, NAME, model, tmp) as engines:
        with console.status("starting the first engine (tiny model, CPU self-benchmark)..."):
            _until(lambda: engines.ready_ips(), 300)
        url = f"http://{engines.ready_ips()[0]}:8000"
        console.print(
            f"[bold]kvfleet bench serve[/bold] --url {url} --concurrency 8, until the new "
            f"replicas serve (at most {load_seconds:g}s)"
        )
        bench = start_load(url, subprocess.DEVNULL)
        started = time.time()
        load_end = started + load_seconds  # moved earlier once every new replica serves
        with Live(_table([]), console=console, refresh_per_second=2) as live:
            rows: list[tuple[str, ...]] = []
            while True:
                now = time.time()
                obj, replicas = _read(kubectl)
                serving = len(engines.ready_ips())
                if bench.poll() is None and replicas >= 2 and serving == replicas:
                    load_end = min(load_end, now + 10)  # show them serving, then stop
                if bench.poll() is None and now >= load_end:
                    stop_child(bench, signal.SIGINT, 30)
                rows.append(_row(now - started, obj, replicas, serving, loaded=now < load_end))
                live.update(_table(rows[-20:]))
                if now > load_end + 25 and replicas == 1:
                    break
                if now > load_end + 180:
                    console.print("[red]no scale-down within 180 s of the load's end[/red]")
                    return 1
                time.sleep(2)
    obj, _ = _read(kubectl)
    console.print("[bold]status.autoscaling.history[/bold] (what the operator decided, and why):")
    for entry in (obj.get("status", {}).get("autoscaling") or {}).get("history", []):
        console.print(f"  {entry['time']}  {entry['fromReplicas']} -> {entry['toReplicas']}  "
                      f"{entry['reason']}")  # fmt: skip
    console.print(f"spec unchanged: generation {obj['metadata']['generation']} (the autoscaler "
                  "wrote only the Deployment's replicas and the status)")  # fmt: skip
    return 0


def _read(kubectl: Kubectl) -> tuple[dict[str, Any], int]:
    try:
        obj = kubectl.json("get", "infd", NAME, "-n", NAMESPACE)
        deployment = kubectl.json("get", "deployment", NAME, "-n", NAMESPACE)
        return obj, int(deployment["spec"].get("replicas", 1))
    except KubectlError:
        return {}, 0


def _row(
    elapsed: float, obj: dict[str, Any], replicas: int, serving: int, loaded: bool
) -> tuple[str, ...]:
    auto = (obj.get("status") or {}).get("autoscaling") or {}
    signal_ = (auto.get("signals") or [{}])[0]
    value = signal_.get("value")
    reading = "-" if value is None else f"{value:.0f} / {signal_.get('target', 0):.0f}"
    return (
        f"{elapsed:5.0f}s",
        "on" if loaded else "off",
        str(replicas),
        str(serving),
        auto.get("mode", "-"),
        reading,
        auto.get("reason") or "",
    )


def _table(rows: list[tuple[str, ...]]) -> Table:
    table = Table(title=f"InferenceDeployment {NAMESPACE}/{NAME}")
    for column in ("t", "load", "replicas", "serving", "mode", "gen tok/s/replica"):
        table.add_column(column, no_wrap=True)
    table.add_column("last decision", no_wrap=True, overflow="ellipsis", max_width=60)
    for row in rows:
        table.add_row(*row)
    return table


def _until(check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out after {timeout:.0f}s")


def _run(command: list[str]) -> None:
    subprocess.run(command, check=True, capture_output=True)


if __name__ == "__main__":
    raise SystemExit(main())
