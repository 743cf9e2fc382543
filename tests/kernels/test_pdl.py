"""Programmatic dependent launch: where it is off, and the contract that makes it safe — every
kernel that can be launched with it waits for the kernels before it before touching memory."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kvfleet_engine.kernels import pdl

KERNELS = Path(pdl.__file__).parent


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    pdl.set_default(True)
    yield
    pdl.set_default(True)


def test_pdl_is_off_on_the_cpu_and_when_the_setting_says_so(monkeypatch) -> None:
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    pdl.enabled.cache_clear()
    assert pdl.launch_options(torch.device("cuda")) == {"PDL": False}


def test_the_setting_is_read_again_once_the_cache_is_cleared(monkeypatch) -> None:
    """A device with PDL: on by default, then off once PDL_ENV says 0 and `enabled` is asked
    again (an A/B in one process, as the GPU tests run it); the pair goes off with it."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(pdl, "_capable", lambda device: True)
    assert pdl.launch_options(cuda) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    pdl.enabled.cache_clear()
    assert pdl.launch_options(cuda) == {"PDL": False}
    assert pdl.pair_options(cuda) == {"PDL": False}


def test_float_models_default_to_no_pdl() -> None:
    """The runner turns it off for float linears (cuBLAS products: slower with PDL)."""
    pdl.set_default(False)
    assert pdl.launch_options(torch.device("cuda")) == {"PDL": False}


def _kernels_with_pdl() -> dict[str, ast.FunctionDef]:
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                arg.arg == "PDL" for arg in node.args.args
            ):
                found[f"{path.name}:{node.name}"] = node
    return found


def _is_start(statement: ast.stmt) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    return (
        isinstance(call, ast.Call)
        and getattr(call.func, "id", None) == "_start"
        and [getattr(a, "id", None) for a in call.args][:1] == ["PDL"]
    )


def _late_wait_of(node: ast.FunctionDef, start: ast.stmt) -> str | None:
    """The LATE_WAIT argument of a kernel's `_start(PDL, LATE_WAIT)`, if it passes one."""
    args = start.value.args  # type: ignore[attr-defined]
    return getattr(args[1], "id", None) if len(args) > 1 else None


def _memory_calls(statements: list[ast.stmt]) -> list[str]:
    """Calls that may read or write memory: tl.load / store / atomics, and helpers."""
    found = []
    for statement in statements:
        for node in ast.walk(statement):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and (
                func.attr in ("load", "store") or func.attr.startswith("atomic")
            ):
                found.append(func.attr)
            elif isinstance(func, ast.Name) and func.id.startswith("_"):
                found.append(func.id)
    return found


def test_every_kernel_that_takes_pdl_waits_before_touching_memory() -> None:
    kernels = _kernels_with_pdl()
    # The decode step's kernels: norms, attention, activation, the one-row products, split sums.
    for name in (
        "rms_norm.py:_rms_norm_kernel",
        "decode_kernels.py:decode_split_kernel",
        "activation.py:_silu_and_mul_kernel",
        "int_gemv_half2.py:_gemv_half2_kernel",
        "fp8_gemv.py:_fp8_gemv_kernel",
        "split_k.py:_sum_splits_kernel",
    ):
        assert name in kernels
    for name, node in kernels.items():
        if name.startswith("pdl.py:"):
            continue
        starts = [i for i, statement in enumerate(node.body) if _is_start(statement)]
        assert starts, f"{name} takes PDL but never calls _start(PDL) in its body"
        before = _memory_calls(node.body[: starts[0]])
        assert not before, f"{name} calls {before} before _start(PDL)"
        late = _late_wait_of(node, node.body[starts[0]])
        if late is not None:  # it waits before merging what the kernel before it wrote
            waits = [
                call
                for call in ast.walk(node)
                if isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "_late_wait"
                and [getattr(a, "id", None) for a in call.args] == [late]
            ]
            assert waits, f"{name} starts with {late} but never calls _late_wait({late})"


def test_the_prefix_kernel_and_the_merging_split_kernel_overlap_wherever_pdl_is(
    monkeypatch,
) -> None:
    """The pair (`pdl`, `decode_attention`) launches with PDL even where a float model turned
    the default off, and not where PDL_ENV says 0 or on the CPU."""
    pdl.set_default(False)
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        assert pdl.pair_options(torch.device("cuda")) == {"PDL": True, "launch_pdl": True}
    assert pdl.pair_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pair_options(torch.device("cuda")) == {"PDL": False}
