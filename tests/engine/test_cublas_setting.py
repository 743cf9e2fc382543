"""Importing the engine sets cuBLAS to run without a workspace (no split-K reduce kernels),
unless the environment already chose a setting."""

from __future__ import annotations

import os
import subprocess
import sys

PRINT_SETTING = (
    "import kvfleet_engine, os; "
    "print(os.environ['CUBLAS_WORKSPACE_CONFIG'], os.environ.get('CUBLASLT_WORKSPACE_SIZE'))"
)
SETTINGS = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")


def _setting_after_import(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    out = subprocess.run(
        [sys.executable, "-c", PRINT_SETTING],
        env={**base, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_import_turns_the_cublas_workspace_off() -> None:
    assert _setting_after_import() == ":0:0 0"


def test_a_setting_already_in_the_environment_wins() -> None:
    assert _setting_after_import(CUBLAS_WORKSPACE_CONFIG=":4096:8") == ":4096:8 None"
