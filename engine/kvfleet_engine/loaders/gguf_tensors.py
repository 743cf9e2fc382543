"""A GGUF file's tensors under Hugging Face names: dequantized to float32, or, for the linears
the quantization keeps quantized, Q8_0 / Q4_0 / Q4_1 / Q4_K blocks repacked into the canonical
codes / scales / offsets of quant/layout.py (group 32, weight = code * scale + offset):

    Q8_0  block of 32: fp16 d, 32 int8 q                      w = d * q
    Q4_0  block of 32: fp16 d, 16 bytes of nibbles            w = d * q - 8 d
    Q4_1  block of 32: fp16 d, fp16 m, 16 bytes of nibbles    w = d * q + m
    Q4_K  block of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit sub-block scales sc and mins m,
          128 bytes of nibbles; per 32-value sub-block j      w = (d sc_j) q - dmin m_j

In a 32-value block byte i holds value i (low nibble) and value i + 16 (high); in a Q4_K block
byte i of each 32-byte run c holds value 64c + i of sub-block 2c (low) and 64c + 32 + i (high).
Every product and sum above is exact in float32 (d has 11 significant bits, sc and m 6, q 4 or
8), so the repacked weights dequantize to gguf.quants.dequantize's values.

For the `llama` architecture llama.cpp permutes the rows of the query and key projections (it
stores each head's rotary pairs interleaved; Hugging Face checkpoints keep them in halves). That
is undone here on whole rows (of floats, or of codes, scales and offsets), so the model code
loads a GGUF file exactly like a safetensors directory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from kvfleet_engine.loaders.gguf_metadata import TENSOR_TYPES, field, head_counts, open_gguf
from kvfleet_engine.loaders.gguf_names import CONFIG_TENSORS, hf_name

GROUP = 32  # values per scale in the repacked layout
# Bytes of one block and values in it, for the types repacked.
_BLOCKS = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q4_K": (144, 256)}


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's query/key row permutation: per head, rows [x0, y0, x1, y1, ...] back to
    [x0, x1, ..., y0, y1, ...] (weight: [num_heads * head_dim, ...] or a bias [num_heads *
    head_dim])."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def gguf_tensors(
    path: str, keep_quantized: frozenset[str] = frozenset()
) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, array in the Hugging Face shape) for every model tensor: float32,
    except the weights of the modules in `keep_quantized` (e.g. model.layers.0.mlp.up_proj),
    which come as `<module>.codes` ([out, in] uint8 0..15 for Q4_*, int8 for Q8_0),
    `<module>.scales` and, for Q4_*, `<module>.offsets` (float32 [out, in // 32])."""
    import gguf

    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    num_heads, num_kv_heads = head_counts(reader, arch) if arch == "llama" else (0, 0)
    for tensor in reader.tensors:
        if tensor.name in CONFIG_TENSORS:
            continue
        name = hf_name(tensor.name)
        heads = 0
        if arch == "llama" and ".q_proj." in name:
            heads = num_heads
        elif arch == "llama" and ".k_proj." in name:
            heads = num_kv_heads
        module = name.removesuffix(".weight")
        if module in keep_quantized:
            for part, values in repack(tensor).items():
                yield f"{module}.{part}", unpermute_rows(values, heads) if heads else values
            continue
        weight = _dequantize(tensor, gguf)
        yield name, unpermute_rows(weight, heads) if heads else weight


def repack(tensor: Any) -> dict[str, np.ndarray]:
    """One Q8_0 / Q4_0 / Q4_1 / Q4_K tensor (a gguf.ReaderTensor) as {"codes", "scales"} (Q8_0)
    or {"codes", "scales", "offsets"} (Q4_*), rows [out, ...] in the file's row order."""
    type_name = tensor.tensor_type.name
    if type_name not in _BLOCKS:
        raise ValueError(
            f"GGUF tensor {tensor.name!r}: {type_name} blocks cannot stay quantized; supported: "
            f"{', '.join(_BLOCKS)}"
        )
    rows, cols = (int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    block_bytes, block_values = _BLOCKS[type_name]
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(-1)
    if cols % block_values or raw.size != rows * cols // block_values * block_bytes:
        raise ValueError(
            f"GGUF tensor {tensor.name!r}: {type_name} data does not hold shape {(rows, cols)}"
        )
    blocks = raw.reshape(rows, cols // block_values, block_bytes)  # [rows, blocks, bytes]
    if type_name == "Q8_0":
        return {
            "codes": blocks[..., 2:].view(np.int8).reshape(rows, cols),
            "scales": _f16(blocks[..., 0:2]),  # [rows, cols // 32]
        }
    if type_name == "Q4_K":
        return _repack_q4_k(blocks, rows, cols)
    d = _f16(blocks[..., 0:2])  # [rows, cols // 32]
    nibbles = blocks[..., -16:]  # [rows, blocks, 16]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(rows, cols)
    offsets = -8 * d if type_name == "Q4_0" else _f16(blocks[..., 2:4])
    return {"codes": codes, "scales": d, "offsets": offsets}


def _repack_q4_k(blocks: np.ndarray, rows: int, cols: int) -> dict[str, np.ndarray]:
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # [rows, blocks]
    s = blocks[..., 4:16].astype(np.uint32)  # [rows, blocks, 12]
    # Sub-blocks 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); 4-7: bytes 8-11's
    # low (scales) and high (mins) nibbles, with the top 2 bits of bytes 0-3 / 4-7 above them.
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | (s[..., 0:4] >> 6 << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6 << 4)], -1)
    qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)  # [rows, blocks, runs, 1, 32]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=3)  # [rows, blocks, runs, 2, 32]
    scales = d[..., None] * sc.astype(np.float32)  # [rows, blocks, 8]
    offsets = -(dmin[..., None] * m.astype(np.float32))
    return {
        "codes": codes.reshape(rows, cols),
        "scales": scales.reshape(rows, cols // GROUP),
        "offsets": offsets.reshape(rows, cols // GROUP),
    }


def _f16(pairs: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian float16 bytes -> float32 [...]."""
    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _dequantize(tensor: Any, gguf: Any) -> np.ndarray:
    type_name = tensor.tensor_type.name
    if type_name not in TENSOR_TYPES:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {type_name}, which kvfleet does not read; "
            f"supported: {', '.join(TENSOR_TYPES)}"
        )
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # F32 tensors come back as read-only views of the memory map: copy those.
        return np.array(
            values, dtype=np.float32, copy=True if not values.flags.writeable else None
        ).reshape(shape)
    except ValueError as error:  # a short (truncated) data region
        raise ValueError(
            f"GGUF tensor {tensor.name!r}: {type_name} data does not hold shape {shape} ({error})"
        ) from error
