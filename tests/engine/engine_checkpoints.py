"""Tiny random checkpoints for the engine tests, made once a session (the `checkpoints` fixture
of conftest.py; tests import the type from here, not from `conftest`, which names a different
module in each test directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine_cases import Reference, reference_greedy, write_checkpoint


class Checkpoints:
    """Tiny random checkpoints (one per architecture) and transformers references, made once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, tuple[Path, Any]] = {}
        self.references: dict[tuple[str, tuple[int, ...], int], Reference] = {}

    def path(self, name: str) -> Path:
        return self._get(name)[0]

    def reference(self, name: str, prompt: list[int], max_tokens: int) -> Reference:
        key = (name, tuple(prompt), max_tokens)
        if key not in self.references:
            self.references[key] = reference_greedy(self._get(name)[1], prompt, max_tokens)
        return self.references[key]

    def _get(self, name: str) -> tuple[Path, Any]:
        if name not in self.models:
            directory = self.root / name
            directory.mkdir()
            self.models[name] = (directory, write_checkpoint(name, directory))
        return self.models[name]
