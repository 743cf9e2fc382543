"""GGUF headers, pure: the architecture numbers, parameter count and bytes of weights of a GGUF
file (llama.cpp's format), read from the first bytes of the file without numpy or gguf.

Layout, v2 and v3 (v3 adds big-endian files, recognised by the byte order of the version):
  magic "GGUF" · version u32 · tensor count u64 · metadata count u64
  metadata × count: key (string) · value type u32 · value
  tensor info × count: name (string) · n_dims u32 · dims u64 × n_dims · ggml type u32 · offset u64
  (tensor data follows, aligned; it is not needed here)
A string is a u64 byte length and UTF-8 bytes; an array is an element type u32, a u64 count and
the elements.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Any

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
GGML_MAX_DIMS = 4
MAX_COUNT = 1 << 24  # tensors or metadata entries beyond this mean a corrupt header
QK_K = 256

# ggml type id -> (name, elements per block, bytes per block); from gguf-py's GGML_QUANT_SIZES.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 2 + 16),
    3: ("Q4_1", 32, 2 + 2 + 16),
    6: ("Q5_0", 32, 2 + 4 + 16),
    7: ("Q5_1", 32, 2 + 2 + 4 + 16),
    8: ("Q8_0", 32, 2 + 32),
    9: ("Q8_1", 32, 4 + 4 + 32),
    10: ("Q2_K", 256, 2 + 2 + QK_K // 16 + QK_K // 4),
    11: ("Q3_K", 256, 2 + QK_K // 4 + QK_K // 8 + 12),
    12: ("Q4_K", 256, 2 + 2 + QK_K // 2 + 12),
    13: ("Q5_K", 256, 2 + 2 + QK_K // 2 + QK_K // 8 + 12),
    14: ("Q6_K", 256, 2 + QK_K // 2 + QK_K // 4 + QK_K // 16),
    15: ("Q8_K", 256, 4 + QK_K + QK_K // 8),
    16: ("IQ2_XXS", 256, 2 + QK_K // 4),
    17: ("IQ2_XS", 256, 2 + QK_K // 4 + QK_K // 32),
    18: ("IQ3_XXS", 256, 2 + QK_K // 4 + QK_K // 8),
    19: ("IQ1_S", 256, 2 + QK_K // 8 + QK_K // 16),
    20: ("IQ4_NL", 32, 2 + 16),
    21: ("IQ3_S", 256, 2 + QK_K // 4 + QK_K // 8 + QK_K // 32 + 4),
    22: ("IQ2_S", 256, 2 + QK_K // 4 + QK_K // 16),
    23: ("IQ4_XS", 256, 2 + 2 + QK_K // 2 + QK_K // 64),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, QK_K // 8 + QK_K // 16 + QK_K // 32),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 2 + 4 * 13),
    35: ("TQ2_0", 256, 2 + 64),
    39: ("MXFP4", 32, 1 + 16),
    40: ("NVFP4", 64, 4 + 32),
    41: ("Q1_0", 128, 2 + 16),
}

# Metadata value type id -> struct format of a fixed-size value; 8 is a string, 9 an array.
_SCALARS = {
    0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"
}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Array-valued metadata worth decoding (per-layer head counts); every other array is skipped.
_KEPT_ARRAY_SUFFIXES = (".attention.head_count", ".attention.head_count_kv")


class GGUFHeaderError(ValueError):
    """The bytes are not a GGUF file, or its header is corrupt; the message says where."""


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor info of the header."""

    name: str  # e.g. "blk.0.attn_q.weight"
    type_name: str  # ggml type, e.g. "Q4_K"
    elements: int


@dataclass(frozen=True)
class GGUFSummary:
    """What the memory plan needs from a GGUF header. Architecture numbers are None when the
    file does not carry them."""

    version: int  # GGUF version, 2 or 3
    architecture: str  # general.architecture, e.g. "llama"
    block_count: int | None  # {arch}.block_count: transformer layers
    embedding_length: int | None  # {arch}.embedding_length: hidden size
    head_count: int | None  # {arch}.attention.head_count: query heads (largest layer's)
    head_count_kv: int | None  # {arch}.attention.head_count_kv; head_count when absent
    head_dim: int | None  # {arch}.attention.key_length, else embedding_length / head_count
    context_length: int | None  # {arch}.context_length: longest context trained for
    split_count: int  # split.count: files the model is split over (1: one file)
    num_tensors: int  # tensors described in this file
    num_parameters: int  # elements of every tensor in this file
    weight_bytes: int  # bytes of every tensor in this file, from each ggml type's block size
    header_bytes: int  # bytes from the start of the file to the end of the tensor infos
    tensors: tuple[GGUFTensor, ...] = ()  # every tensor described in this file, in file order


@dataclass(frozen=True)
class GGUFUnavailable:
    """A GGUF header the operator tried to read and could not."""

    reason: str  # e.g. "GET https://huggingface.co/...: HTTP 401"


class _Truncated(Exception):
    """The buffer ends inside the header."""


class _Reader:
    def __init__(self, data: bytes, byte_order: str) -> None:
        self.data = data
        self.offset = 0
        self.byte_order = byte_order  # "<" or ">"

    def take(self, size: int) -> bytes:
        end = self.offset + size
        if end > len(self.data):
            raise _Truncated
        chunk = self.data[self.offset : end]
        self.offset = end
        return chunk

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(self.byte_order + fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        value: int = self.scalar("Q")
        if value > MAX_COUNT:
            raise GGUFHeaderError(f"{what} {value} at byte {self.offset - 8} is not plausible")
        return value

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFHeaderError(
                f"{what} ending at byte {self.offset} is not UTF-8: {raw[:40]!r}"
            ) from None

    def value(self, value_type: int, key: str, keep: bool) -> Any:
        """The value of metadata `key`; None, without decoding it, when `keep` is false."""
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type]
            raw = self.take(struct.calcsize(fmt))
            return struct.unpack(self.byte_order + fmt, raw)[0] if keep else None
        if value_type == _STRING:
            if keep:
                return self.string(f"value of {key}")
            self.take(self.scalar("Q"))
            return None
        if value_type == _ARRAY:
            element_type = self.scalar("I")
            length = self.count(f"length of {key}")
            if element_type in _SCALARS and not keep:
                self.take(length * struct.calcsize(_SCALARS[element_type]))
                return None
            items = [self.value(element_type, key, keep) for _ in range(length)]
            return items if keep else None
        raise GGUFHeaderError(f"metadata {key}: unknown value type {value_type}")


def parse_gguf_header(data: bytes) -> GGUFSummary | None:
    """The summary of the GGUF header at the start of `data`; None when `data` ends before the
    tensor infos do (read more of the file and call again). Raises GGUFHeaderError when the bytes
    are not GGUF or the header is corrupt."""
    if len(data) >= 4 and data[:4] != MAGIC:
        raise GGUFHeaderError(f"not a GGUF file: it starts with {data[:4]!r}, not {MAGIC!r}")
    try:
        return _parse(data)
    except _Truncated:
        return None


def _parse(data: bytes) -> GGUFSummary:
    reader = _Reader(data, "<")
    reader.take(len(MAGIC))
    version = reader.scalar("I")
    if version & 0xFFFF == 0:  # a big-endian file: the version's bytes are swapped
        reader.byte_order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in SUPPORTED_VERSIONS:
        raise GGUFHeaderError(
            f"GGUF version {version} is not supported (versions {SUPPORTED_VERSIONS} are)"
        )
    num_tensors = reader.count("tensor count")
    num_metadata = reader.count("metadata count")

    metadata: dict[str, Any] = {}
    for _ in range(num_metadata):
        key = reader.string("metadata key")
        value_type = reader.scalar("I")
        keep = value_type != _ARRAY or key.endswith(_KEPT_ARRAY_SUFFIXES)
        metadata[key] = reader.value(value_type, key, keep)

    num_parameters = weight_bytes = 0
    tensors = []
    for _ in range(num_tensors):
        name = reader.string("tensor name")
        n_dims = reader.scalar("I")
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise GGUFHeaderError(f"tensor {name}: {n_dims} dimensions (1 to {GGML_MAX_DIMS})")
        dims = [reader.scalar("Q") for _ in range(n_dims)]
        ggml_type = reader.scalar("I")
        reader.take(8)  # offset of the data, relative to the data section
        elements, size = _tensor_size(name, dims, ggml_type)
        num_parameters += elements
        weight_bytes += size
        tensors.append(GGUFTensor(name, GGML_TYPES[ggml_type][0], elements))
    summary = _summary(version, metadata, num_tensors, num_parameters, weight_bytes, reader.offset)
    return dataclasses.replace(summary, tensors=tuple(tensors))


def _tensor_size(name: str, dims: list[int], ggml_type: int) -> tuple[int, int]:
    """(elements, bytes) of one tensor; rows (dims[0]) are whole blocks of its type."""
    if ggml_type not in GGML_TYPES:
        raise GGUFHeaderError(f"tensor {name}: unknown or removed ggml type {ggml_type}")
    type_name, block_size, block_bytes = GGML_TYPES[ggml_type]
    if dims[0] % block_size:
        raise GGUFHeaderError(
            f"tensor {name}: row of {dims[0]} elements is not a whole number of {type_name} "
            f"blocks of {block_size}"
        )
    elements = math.prod(dims)
    return elements, elements // block_size * block_bytes


def _summary(
    version: int,
    metadata: dict[str, Any],
    num_tensors: int,
    num_parameters: int,
    weight_bytes: int,
    header_bytes: int,
) -> GGUFSummary:
    architecture = metadata.get("general.architecture")
    if not isinstance(architecture, str):
        raise GGUFHeaderError("metadata general.architecture is missing or not a string")

    def number(key: str) -> int | None:
        value = metadata.get(f"{architecture}.{key}")
        if isinstance(value, list):  # per layer: the largest sizes the plan
            value = max((v for v in value if isinstance(v, int)), default=None)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            return None
        return value

    embedding_length = number("embedding_length")
    head_count = number("attention.head_count")
    head_dim = number("attention.key_length")
    if head_dim is None and embedding_length and head_count:
        head_dim = embedding_length // head_count
    split_count = metadata.get("split.count")
    return GGUFSummary(
        version=version,
        architecture=architecture,
        block_count=number("block_count"),
        embedding_length=embedding_length,
        head_count=head_count,
        head_count_kv=number("attention.head_count_kv") or head_count,
        head_dim=head_dim,
        context_length=number("context_length"),
        split_count=split_count if isinstance(split_count, int) and split_count > 1 else 1,
        num_tensors=num_tensors,
        num_parameters=num_parameters,
        weight_bytes=weight_bytes,
        header_bytes=header_bytes,
    )
