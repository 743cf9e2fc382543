"""The test-side GGUF quantizer: every type the engine reads round-trips through gguf-py's
dequantizer within `tolerance`, the bound is tight enough that a layout mistake breaks it, and
fewer bits cost more error."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape
from gguf_pack import SUPPORTED, T, quantize, tolerance


def sample_weights(rows: int, cols: int, seed: int) -> np.ndarray:
    """Normal rows (>= 4 of them), except: row 0 all zero, row 1 spanning seven decades, row 2
    all positive (nothing for a min to subtract), row 3 small enough for subnormal f16 scales."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, cols))  # [rows, cols]
    w[0] = 0
    w[1] *= 10.0 ** rng.uniform(-4, 3, cols)
    w[2] = np.abs(w[2]) + 0.5
    w[3] *= 1e-3
    return w.astype(np.float32)


def unit(qtype: T) -> int:
    """The column multiple a type needs: a 256-value super-block, else a 32-value block."""
    return max(GGML_QUANT_SIZES[qtype][0], 32)


def max_error(raw: np.ndarray, qtype: T, weights: np.ndarray) -> float:
    restored = dequantize(raw, qtype).reshape(weights.shape).astype(np.float64)
    return float(np.nan_to_num(np.abs(restored - weights), nan=np.inf).max())  # NaN: worst


FLOAT_ARRAYS = {T.F32: np.float32, T.F16: np.float16}  # stored as arrays; the rest as bytes


def test_supported_is_what_the_engine_reads() -> None:
    gguf_metadata = pytest.importorskip("kvfleet_engine.loaders.gguf_metadata")
    assert [t.name for t in SUPPORTED] == list(gguf_metadata.TENSOR_TYPES)


@pytest.mark.parametrize("rows, num_units", [(4, 1), (7, 2), (33, 4)])
@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_round_trip_is_within_tolerance(qtype: T, rows: int, num_units: int) -> None:
    w = sample_weights(rows, num_units * unit(qtype), seed=rows)
    raw = quantize(w, qtype)
    if qtype in FLOAT_ARRAYS:
        assert (raw.dtype, raw.shape) == (FLOAT_ARRAYS[qtype], w.shape)
    else:
        assert (raw.dtype, raw.shape) == (np.uint8, quant_shape_to_byte_shape(w.shape, qtype))
    for row, (weights, row_raw) in enumerate(zip(w, raw, strict=True)):
        error, bound = max_error(row_raw, qtype, weights), tolerance(weights[None], qtype)
        assert error <= bound, f"row {row}: error {error:.3g} > tolerance {bound:.3g}"


def test_written_gguf_file_reads_back(tmp_path: Path) -> None:
    w = sample_weights(4, 512, seed=1)
    raws = {qtype: quantize(w, qtype) for qtype in SUPPORTED}
    writer = gguf.GGUFWriter(tmp_path / "packed.gguf", "llama")
    for qtype, raw in raws.items():
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = gguf.GGUFReader(tmp_path / "packed.gguf").tensors
    assert [t.name for t in tensors] == [t.name for t in SUPPORTED]
    for tensor in tensors:
        qtype = GGMLQuantizationType[tensor.name]
        assert tensor.tensor_type == qtype
        assert [int(n) for n in reversed(tensor.shape)] == list(w.shape)  # innermost first
        read = dequantize(tensor.data, qtype).reshape(w.shape)
        np.testing.assert_array_equal(read, dequantize(raws[qtype], qtype).reshape(w.shape))


def fields_reversed(data: np.ndarray, bits: int) -> np.ndarray:
    """Each byte with its `bits`-wide fields in the opposite order (a packing-order mistake)."""
    fields = 8 // bits
    out = np.zeros_like(data)
    for f in range(fields):
        out |= ((data >> (bits * f)) & (2**bits - 1)) << (bits * (fields - 1 - f))
    return out


def halves_swapped(data: np.ndarray) -> np.ndarray:
    """The two halves exchanged: two neighbouring fields in the wrong order."""
    half = len(data) // 2
    return np.concatenate([data[half:], data[:half]])


def nibbles(data: np.ndarray) -> np.ndarray:
    return fields_reversed(data, 4)


def two_bit_fields(data: np.ndarray) -> np.ndarray:
    return fields_reversed(data, 2)


def bits(data: np.ndarray) -> np.ndarray:
    return fields_reversed(data, 1)


# (type, byte range within the first block, the mistake); offsets follow ggml-common.h.
LAYOUT_MISTAKES = [
    pytest.param(T.Q8_0, 2, 34, halves_swapped, id="Q8_0-value-order"),
    pytest.param(T.Q4_0, 2, 18, nibbles, id="Q4_0-nibble-order"),
    pytest.param(T.Q4_1, 4, 20, nibbles, id="Q4_1-nibble-order"),
    pytest.param(T.Q5_0, 2, 6, bits, id="Q5_0-high-bit-order"),
    pytest.param(T.Q5_1, 8, 24, nibbles, id="Q5_1-nibble-order"),
    pytest.param(T.Q2_K, 0, 16, nibbles, id="Q2_K-scale-and-min-swapped"),
    pytest.param(T.Q2_K, 16, 80, two_bit_fields, id="Q2_K-quant-order"),
    pytest.param(T.Q3_K, 0, 32, bits, id="Q3_K-high-bit-order"),
    pytest.param(T.Q3_K, 96, 104, nibbles, id="Q3_K-scale-nibble-order"),
    pytest.param(T.Q4_K, 0, 4, halves_swapped, id="Q4_K-d-and-dmin-swapped"),
    pytest.param(T.Q4_K, 16, 144, nibbles, id="Q4_K-nibble-order"),
    pytest.param(T.Q5_K, 16, 48, bits, id="Q5_K-high-bit-order"),
    pytest.param(T.Q6_K, 0, 128, nibbles, id="Q6_K-low-nibble-order"),
    pytest.param(T.Q6_K, 128, 192, two_bit_fields, id="Q6_K-high-bits-order"),
    pytest.param(T.Q6_K, 192, 208, halves_swapped, id="Q6_K-scale-order"),
]


@pytest.mark.parametrize("qtype, start, stop, mistake", LAYOUT_MISTAKES)
def test_a_layout_mistake_in_one_block_breaks_the_bound(
    qtype: T, start: int, stop: int, mistake: Callable[[np.ndarray], np.ndarray]
) -> None:
    w = np.random.default_rng(7).standard_normal((1, 2 * unit(qtype))).astype(np.float32)
    raw = quantize(w, qtype)
    raw[0, start:stop] = mistake(raw[0, start:stop])
    assert max_error(raw, qtype, w) > tolerance(w, qtype)


LADDERS = [  # same data; each type in a ladder has more bits than the one before
    (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K),
    (T.Q4_0, T.Q5_0, T.Q8_0),
    (T.Q4_1, T.Q5_1),
    (T.BF16, T.F16, T.F32),
]


@pytest.mark.parametrize("ladder", LADDERS, ids=lambda ladder: "<".join(t.name for t in ladder))
def test_fewer_bits_cost_more_error_and_the_bound_is_near_it(ladder: tuple[T, ...]) -> None:
    w = np.random.default_rng(3).standard_normal((16, 1024)).astype(np.float32)
    errors = [max_error(quantize(w, qtype), qtype, w) for qtype in ladder]
    assert all(fewer > more for fewer, more in pairwise(errors)), errors
    for qtype, error in zip(ladder, errors, strict=True):
        assert error >= tolerance(w, qtype) / 4, f"{qtype.name}: bound far above error {error}"


def test_rejects_what_it_cannot_write() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 128), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="float32"):
        quantize(np.zeros((2, 256)), T.Q4_K)
    with pytest.raises(ValueError, match="qtype"):
        tolerance(np.zeros((2, 256), np.float32), T.IQ2_XXS)
