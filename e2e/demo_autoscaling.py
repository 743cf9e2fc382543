"""`make demo`, autoscaling part: ask an InferenceDeployment's engine a question, then watch the
operator scale it on the token rate its engines report, on the local control plane (it must be
up: `make cluster-up`).

Real engines serving SmolLM2-135M-Instruct (GGUF, CPU) stand in for the kwok pods, bound at each
pod's IP. Once the first one serves, one chat question goes to its /v1/chat/completions (at the
pod's IP: this control plane runs no kube-proxy, so the Service's ClusterIP routes nowhere) and
the answer is printed with the time it took. Then `kvfleet bench serve --dataset chat` keeps 8
chat questions in flight on that engine until all 3 replicas' engines serve, and stops. Every
few seconds a tick shows the Deployment's replicas, the engines serving, the autoscaler's mode,
its reading of the token rate against the target and the reason of its last decision: a live
table in a terminal, else (piped, redirected) one plain line per tick that changed something,
80 columns wide. The decision history is printed at the end.
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from autoscaling_scenario import CHAT_QUESTIONS, MAX_REPLICAS, inference_deployment, start_load
from engine_pods import EnginePods
from kvcluster import controlplane
from kvcluster.config import default_config
from kvcluster.kubectl import Kubectl, KubectlError
from kvcluster.procs import stop_child
from kvfleet_engine.model_store import DEFAULT_MODEL, fetch

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "kvfleet-demo"
NAME = "smollm2"
QUESTION = "What is the capital of France?"
WIDTH = 80  # of the output when stdout is not a terminal
TABLE_ROWS = 15  # latest ticks the live table shows


def _console() -> Console:
    console = Console()
    return console if console.is_terminal else Console(width=WIDTH)


console = _console()


@dataclass(frozen=True)
class Tick:
    """What the demo saw at one moment."""

    elapsed_s: float  # since the load started
    loaded: bool  # the load is running
    replicas: int  # the Deployment's spec.replicas
    serving: int  # engines answering /ready
    mode: str  # the autoscaler's Stable or Panic; "-" before its first decision
    reading: str  # generation tokens/s per replica / target, e.g. "16.2/4"; "-" without data
    reason: str  # why the autoscaler decided what it did last


def main(argv: list[str] | None = None) -> int:
    summary = " ".join(__doc__.split("\n\n", 1)[0].split())  # the first paragraph, whole
    parser = argparse.ArgumentParser(prog="demo_autoscaling.py", description=summary)
    parser.add_argument(
        "--load-seconds",
        type=float,
        default=240.0,
        help="longest load; it stops 10 s after all 3 replicas' engines serve",
    )
    parser.add_argument("--target", type=float, default=2.0, help="tokens/s per replica")
    args = parser.parse_args(argv)
    config = default_config()
    if not controlplane.is_running(config):
        console.print("[red]the local control plane is not running: make cluster-up[/red]")
        return 1
    kubectl = controlplane.kubectl_for(config)
    model = fetch(DEFAULT_MODEL)
    with tempfile.TemporaryDirectory(prefix="kvfleet-demo-") as tmp_dir:
        tmp = Path(tmp_dir)
        kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
        kubectl("create", "namespace", NAMESPACE, check=False)
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
    served = DEFAULT_MODEL.served_name
    manifest = inference_deployment(NAMESPACE, model, target, NAME, served)
    console.print(f"[bold]kubectl apply[/bold] InferenceDeployment {NAME}: {model.name}")
    console.print(f"  autoscaling 1-{MAX_REPLICAS} on generation tokens/s, {target:g} per replica")
    kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))
    applied = time.monotonic()
    with EnginePods(kubectl, NAMESPACE, NAME, model, tmp, served) as engines:
        with _waiting("starting the first engine (SmolLM2 on the CPU, then its self-benchmark)"):
            _until(lambda: engines.ready_ips(), 300)
        console.print(f"first engine serving {time.monotonic() - applied:.0f} s after the apply")
        url = f"http://{engines.ready_ips()[0]}:8000"
        answer, seconds = ask(url, served, QUESTION)
        console.print(f"[bold]POST[/bold] {url}/v1/chat/completions, temperature 0")
        console.print(f"  [bold]Q:[/bold] {QUESTION}")
        console.print(f"  [bold]A:[/bold] {escape(answer)}")
        console.print(f"  answered in {seconds:.1f} s")
        console.print(
            f"[bold]kvfleet bench serve[/bold] --url {url} --dataset chat --concurrency 8"
        )
        console.print(f"  until the new replicas serve, at most {load_seconds:g} s")
        bench = start_load(url, subprocess.DEVNULL, CHAT_QUESTIONS)
        started = time.time()
        load_end = started + load_seconds  # moved earlier once every new replica serves
        with _showing_ticks() as show:
            ticks: list[Tick] = []
            while True:
                now = time.time()
                obj, replicas = _read(kubectl)
                serving = len(engines.ready_ips())
                if bench.poll() is None and serving == MAX_REPLICAS:
                    load_end = min(load_end, now + 10)  # show them serving, then stop
                if bench.poll() is None and now >= load_end:
                    stop_child(bench, signal.SIGINT, 30)
                ticks.append(read_tick(now - started, obj, replicas, serving, now < load_end))
                show(ticks)
                if now > load_end + 25 and replicas == serving == 1:
                    break
                if now > load_end + 180:
                    console.print("[red]no scale-down within 180 s of the load's end[/red]")
                    return 1
                time.sleep(2)
    obj, _ = _read(kubectl)
    console.print("[bold]status.autoscaling.history[/bold] (what the operator decided, and why):")
    console.print(
        render_history((obj.get("status", {}).get("autoscaling") or {}).get("history", []))
    )
    console.print(f"spec unchanged: generation {obj['metadata']['generation']}")
    console.print("  (the autoscaler wrote only the Deployment's replicas and the status)")
    return 0


def ask(url: str, model: str, question: str) -> tuple[str, float]:
    """`model`'s answer to `question` (one user message, temperature 0) and the seconds from
    sending the request to having the whole answer."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 64,
    }
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    response.raise_for_status()
    answer = str(response.json()["choices"][0]["message"]["content"]).strip()
    return answer, time.perf_counter() - started


def _read(kubectl: Kubectl) -> tuple[dict[str, Any], int]:
    try:
        obj = kubectl.json("get", "infd", NAME, "-n", NAMESPACE)
        deployment = kubectl.json("get", "deployment", NAME, "-n", NAMESPACE)
        return obj, int(deployment["spec"].get("replicas", 1))
    except KubectlError:
        return {}, 0


def read_tick(
    elapsed_s: float, obj: dict[str, Any], replicas: int, serving: int, loaded: bool
) -> Tick:
    """The tick shown for the InferenceDeployment `obj` (its status.autoscaling) at `elapsed_s`."""
    auto = (obj.get("status") or {}).get("autoscaling") or {}
    signal_ = (auto.get("signals") or [{}])[0]
    value = signal_.get("value")
    reading = "-" if value is None else f"{value:.3g}/{signal_.get('target', 0):g}"
    # Shorter, to fit 80 columns: the one signal is generation tokens/s per replica.
    reason = auto.get("reason") or ""
    for long, short in (("generationTokenRate", "gen"), (" per replica", ""), (" replica(s)", "")):
        reason = reason.replace(long, short)
    return Tick(elapsed_s, loaded, replicas, serving, auto.get("mode", "-"), reading, reason)


# Columns: header, width (0: the rest of the line, the text cut with "…"), the tick's value.
COLUMNS: tuple[tuple[str, int, Callable[[Tick], str]], ...] = (
    ("t", 5, lambda t: f"{t.elapsed_s:.0f}s"),
    ("load", 4, lambda t: "on" if t.loaded else "off"),
    ("replicas", 8, lambda t: str(t.replicas)),
    ("serving", 7, lambda t: str(t.serving)),
    ("mode", 6, lambda t: t.mode),
    ("tok/s", 7, lambda t: t.reading),
    ("last decision", 0, lambda t: t.reason),
)
CAPTION = "tok/s: generated tokens/s per replica / the target"


def render_table(ticks: list[Tick]) -> Table:
    """The live table of `ticks`, one row each, as wide as the console; the last decision is cut
    with "…" where it does not fit."""
    table = Table(
        title=f"InferenceDeployment {NAMESPACE}/{NAME}",
        caption=CAPTION,
        box=None,
        padding=(0, 1, 0, 0),
        pad_edge=False,
        expand=True,
    )
    for header, width, _ in COLUMNS:
        if width:
            table.add_column(
                header, no_wrap=True, width=width, justify="right" if header == "t" else "left"
            )
        else:
            table.add_column(header, no_wrap=True, overflow="ellipsis", ratio=1)
    for tick in ticks:
        table.add_row(*(value(tick) for _, _, value in COLUMNS))
    return table


def render_line(tick: Tick | None, width: int = WIDTH) -> str:
    """One tick as a plain line of at most `width` columns, the table's columns in the same
    order (None: the header line); the last decision is cut with "…" where it does not fit."""
    cells = [header if tick is None else value(tick) for header, _, value in COLUMNS]
    fixed = [
        cell.rjust(w) if header == "t" else cell.ljust(w)
        for cell, (header, w, _) in zip(cells[:-1], COLUMNS[:-1], strict=True)
    ]
    line = " ".join([*fixed, cells[-1]]).rstrip()
    return line if len(line) <= width else line[: width - 1] + "…"


def render_history(history: list[dict[str, Any]]) -> Table:
    """status.autoscaling.history: time, replicas from -> to, the reason wrapped to the width."""
    table = Table(box=None, padding=(0, 1, 0, 0), show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for entry in history:
        clock = str(entry["time"])[11:19]  # 2026-12-01T09:10:54Z -> 09:10:54
        change = f"{entry['fromReplicas']} -> {entry['toReplicas']}"
        table.add_row(f"  {clock}", change, escape(str(entry["reason"])))
    return table


@contextmanager
def _showing_ticks() -> Iterator[Callable[[list[Tick]], None]]:
    """A function that shows the ticks so far: as a live table in a terminal, else by printing
    the latest one as a line when something other than the clock changed."""
    if console.is_terminal:
        with Live(render_table([]), console=console, refresh_per_second=2) as live:
            yield lambda ticks: live.update(render_table(ticks[-TABLE_ROWS:]))
        return
    console.out(render_line(None), highlight=False)
    printed: list[Tick] = []

    def show(ticks: list[Tick]) -> None:
        latest = ticks[-1]
        if printed and replace(latest, elapsed_s=0) == replace(printed[-1], elapsed_s=0):
            return
        printed.append(latest)
        console.out(render_line(latest), highlight=False)

    yield show


@contextmanager
def _waiting(what: str) -> Iterator[None]:
    """A spinner in a terminal; else the line `what...`."""
    if console.is_terminal:
        with console.status(f"{what}..."):
            yield
    else:
        console.out(f"{what}...", highlight=False)
        yield


def _until(check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise SystemExit(f"timed out after {timeout:.0f}s")


if __name__ == "__main__":
    raise SystemExit(main())
