"""The command line both "around a load" tools share (`profile_split`, `serve_counters`): a
server URL, a label, and after `--` the load generator's own command, run to its end."""

from __future__ import annotations

import argparse
import subprocess


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--label", default="", help="a name for the load in the printout")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the load's command")


def load_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    command: list[str] = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("command: give the load's command after --")
    return command


def run(command: list[str]) -> int:
    """Run the load to its end; its exit status."""
    return subprocess.run(command, check=False).returncode
