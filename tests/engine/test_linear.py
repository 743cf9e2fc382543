"""Linear's CPU layouts give the products F.linear gives: one row of a wide float32 layer (the LM
head at batch-1 decode) through its [in, out] copy, a few rows through W · xᵀ."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvfleet_engine.layers.linear import Linear


def _loaded(out_features: int, in_features: int, dtype: torch.dtype) -> Linear:
    layer = Linear(in_features, out_features).to(dtype)
    torch.manual_seed(0)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, dtype=dtype) * 0.05)
    layer.finish_loading()
    return layer


def test_a_wide_float32_layer_answers_one_row_like_f_linear() -> None:
    layer = _loaded(20000, 64, torch.float32)
    assert layer.one_row_weight is not None
    assert layer.one_row_weight.shape == (64, 20000)
    for rows in (1, 2, 16, 40):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_narrow_or_half_precision_layers_keep_one_copy() -> None:
    assert _loaded(4096, 64, torch.float32).one_row_weight is None
    assert _loaded(20000, 64, torch.bfloat16).one_row_weight is None
