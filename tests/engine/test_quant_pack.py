"""The test-side packers write what the real tools write: AutoAWQ's own WQLinear_GEMM packing and
dequantization, compressed-tensors' own pack_to_int32 and decompressor."""

from __future__ import annotations

import pytest
import torch
from quant_pack import Int4Groups, pack_awq, pack_compressed_tensors, quantize_int4


def _groups(symmetric: bool, group_size: int = 32, seed: int = 0, **kw: object) -> Int4Groups:
    torch.manual_seed(seed)
    # 64 output features: AutoAWQ packs whole words of 32 output bits
    return quantize_int4(torch.randn(64, 128) * 0.1, group_size, symmetric, **kw)  # type: ignore[arg-type]


def test_awq_packing_is_autoawqs() -> None:
    pytest.importorskip("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    q = _groups(symmetric=False)
    ours = pack_awq(q)
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(q.dequantize())
    theirs = WQLinear_GEMM.from_linear(
        linear, 4, 32, scales=q.scales.t().contiguous(), zeros=q.zeros.t().contiguous()
    )
    assert torch.equal(ours["qweight"], theirs.qweight)
    assert torch.equal(ours["qzeros"], theirs.qzeros)
    dequantized = dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"], 4, 32)
    torch.testing.assert_close(dequantized.float().t(), q.dequantize(), rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
def test_compressed_tensors_packing_is_compressed_tensors(symmetric: bool) -> None:
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    q = _groups(symmetric, scale_dtype=torch.bfloat16)
    ours = pack_compressed_tensors(q, symmetric)
    signed = (q.codes - 8).to(torch.int8)
    assert torch.equal(ours["weight_packed"], pack_to_int32(signed, 4))
    if not symmetric:
        zero_points = (q.zeros - 8).to(torch.int8)
        assert torch.equal(ours["weight_zero_point"], pack_to_int32(zero_points, 4, packed_dim=0))
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=32
        ),
    )
    weight = PackedQuantizationCompressor.decompress(dict(ours), scheme)["weight"]
    torch.testing.assert_close(weight.float(), q.dequantize(), rtol=1e-2, atol=1e-3)


def test_act_order_groups_hold_group_size_columns_each() -> None:
    q = _groups(symmetric=True, act_order_seed=7)
    assert torch.bincount(q.g_idx.long()).tolist() == [32] * 4
    assert not torch.equal(q.g_idx, torch.arange(128, dtype=torch.int32) // 32)
