"""The persistent-chain probe (kvfleet_engine.bench.persistent_chain) computes the chain it
times: its one launch and the engine's kernel per product give the float32 chain's output. Under
TRITON_INTERPRET=1 the launch is one program walking every tile in list order, waiting on
counters its own earlier tiles filled; on a GPU, one program per SM and more."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_triton_kernels import ON_GPU


def _modules():
    """activation and the probe, made in this run's mode (a module binds the Triton helpers of
    those it imports, so both are reloaded if the probe's kernel is stale)."""
    names = ["kvfleet_engine.kernels.activation", "kvfleet_engine.bench.persistent_chain"]
    modules = [importlib.import_module(name) for name in names]
    if (type(modules[1]._chain_kernel).__name__ == "InterpretedFunction") == ON_GPU:
        modules = [importlib.reload(module) for module in modules]
    return modules


_, probe = _modules()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
TINY = [
    probe.Product("qkv", 96, 32, 2),
    probe.Product("o", 32, 32, 2),
    probe.Product("gate_up", 64, 32, 1),
    probe.Product("down", 32, 32, 2),
]


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("per_sm", [1, 3] if ON_GPU else [1])
def test_the_persistent_launch_computes_the_chain(per_sm: int) -> None:
    chain = probe.Chain(TINY, layers=3, device=DEVICE, block_n=16, block_k=16)
    expected = chain.reference()
    assert expected.abs().max() > 0.1  # the scales keep the chain's values near 1, not 0
    step, programs = chain.persistent(per_sm)
    assert programs >= 1
    assert relative_error(step(), expected) < 2e-2  # bf16 inputs to the dot, float32 between
    assert relative_error(step(), expected) < 2e-2  # again: the counters start from zero


@pytest.mark.parametrize("per_sm", [1, 3] if ON_GPU else [1])
@pytest.mark.parametrize("gate_up_splits", [1, 2])
def test_the_launch_waiting_for_the_rows_each_tile_reads_computes_the_chain(
    per_sm: int, gate_up_splits: int
) -> None:
    """Slice by slice, each tile waiting on its slice's counter, gate and up blocks alternating,
    down adding to the residual stream once the layer before wrote its rows."""
    chain = probe.Chain(TINY, layers=3, device=DEVICE, block_n=16, block_k=16)
    expected = chain.reference()
    step, _ = chain.persistent(per_sm, segments=True, splits={"gate_up": gate_up_splits})
    assert relative_error(step(), expected) < 2e-2
    assert relative_error(step(), expected) < 2e-2


def test_splits_that_do_not_tile_are_refused_at_launch() -> None:
    chain = probe.Chain(TINY, layers=1, device=DEVICE, block_n=16, block_k=16)
    with pytest.raises(ValueError, match="gate_up: 64 x 32 / 4 does not tile"):
        chain.persistent(1, segments=True, splits={"gate_up": 4})


def test_the_kernel_per_product_path_computes_the_chain() -> None:
    chain = probe.Chain(TINY, layers=3, device=DEVICE, block_n=16, block_k=16)
    assert relative_error(chain.kernels()(), chain.reference()) < 5e-2  # bf16 between


def test_products_that_do_not_chain_or_tile_are_refused() -> None:
    with pytest.raises(ValueError, match="do not chain"):
        probe.Chain([*TINY[:3], probe.Product("down", 32, 16, 1)], 1, DEVICE, 16, 16)
    with pytest.raises(ValueError, match="o: 32 x 32 / 4 does not tile"):
        probe.Chain([TINY[0], probe.Product("o", 32, 32, 4), *TINY[2:]], 1, DEVICE, 16, 16)
