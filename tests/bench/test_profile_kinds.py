"""The decode-step profile names each of the engine's kernels by its kind."""

import pytest

from kvfleet_engine.bench.profile import kernel_kind
from kvfleet_engine.kernels.activation import _silu_and_mul_kernel
from kvfleet_engine.kernels.decode_kernels import decode_split_kernel
from kvfleet_engine.kernels.fused import _rotary_store_kv_kernel
from kvfleet_engine.kernels.partial_merge import decode_merge_kernel
from kvfleet_engine.kernels.prefill_attention import _prefill_kernel
from kvfleet_engine.kernels.rms_norm import _rms_norm_kernel
from kvfleet_engine.kernels.shared_prefix import shared_prefix_kernel


@pytest.mark.parametrize(
    "kernel, kind",
    [
        (decode_split_kernel, "attention"),
        (decode_merge_kernel, "attention"),
        (shared_prefix_kernel, "attention"),
        (_prefill_kernel, "attention"),
        (_rotary_store_kv_kernel, "rotary+kv store"),
        (_silu_and_mul_kernel, "silu*mul"),
        (_rms_norm_kernel, "rmsnorm+add"),
    ],
)
def test_each_engine_kernel_has_its_kind(kernel: object, kind: str) -> None:
    assert kernel_kind(kernel.__name__) == kind  # type: ignore[attr-defined]
    assert kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTN") == "matmul"
