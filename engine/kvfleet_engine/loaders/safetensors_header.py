"""A Hugging Face checkpoint directory's *.safetensors files and their headers (each tensor's
name, dtype and shape), read without torch: config.py checks config.json against them before
anything is allocated. A header is checked as far as the engine trusts it: its length against
the file's, each tensor's bytes inside the file, each name in one file only."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> bytes per element
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


@dataclass(frozen=True)
class TensorHeader:
    # The file that holds the tensor.
    file: Path
    # safetensors dtype name, e.g. "BF16".
    dtype: str
    # The tensor's shape.
    shape: tuple[int, ...]

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def checkpoint_files(directory: Path) -> list[Path]:
    """The shards model.safetensors.index.json names, or every *.safetensors file."""
    index = directory / INDEX_FILE
    if index.is_file():
        return [directory / name for name in sorted(set(_weight_map(index).values()))]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors files in {directory}")
    return files


def checkpoint_headers(directory: Path) -> dict[str, TensorHeader]:
    """Every tensor of the checkpoint by name; a name in two files is a ValueError naming both."""
    headers: dict[str, TensorHeader] = {}
    for file in checkpoint_files(directory):
        for name, header in read_header(file).items():
            if name in headers:
                raise ValueError(
                    f"model: tensor {name!r} is in both {headers[name].file} and {file}"
                )
            headers[name] = header
    return headers


def read_header(file: Path) -> dict[str, TensorHeader]:
    """One file's tensors (its __metadata__ left out); a ValueError naming the file when the
    header is not one, or a tensor's bytes lie outside the file."""
    try:
        with file.open("rb") as stream:
            size = file.stat().st_size
            length = int.from_bytes(stream.read(8), "little")
            if size < 8 or length > min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"header length {length} does not fit the file ({size} bytes)")
            header = json.loads(stream.read(length))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        return {
            name: _tensor_header(file, name, entry, size - 8 - length)
            for name, entry in header.items()
            if name != "__metadata__"
        }
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError) as error:
        raise ValueError(f"model: {file} is not a readable safetensors file: {error}") from None


def _tensor_header(file: Path, name: str, entry: Any, data_bytes: int) -> TensorHeader:
    if not isinstance(entry, dict):
        raise ValueError(f"tensor {name!r} is not described by a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise ValueError(f"tensor {name!r} has dtype {dtype!r}; known: {', '.join(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise ValueError(f"tensor {name!r} has shape {shape!r}, not a list of sizes")
    header = TensorHeader(file, dtype, tuple(shape))
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_count(n) for n in offsets)
        or offsets[1] - offsets[0] != header.num_bytes
        or offsets[1] > data_bytes
    ):
        raise ValueError(
            f"tensor {name!r} ({dtype} {list(shape)}) has data_offsets {offsets!r}, which do "
            f"not hold its {header.num_bytes} bytes inside the file's {data_bytes} data bytes"
        )
    return header


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _weight_map(index: Path) -> dict[str, str]:
    """The index's tensor -> shard map; each shard a file inside the directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"model: {index} has no readable weight_map: {exc!r}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"model: {index}: weight_map must be a JSON object")
    for name, shard in weight_map.items():
        path = PurePosixPath(shard) if isinstance(shard, str) else None
        if path is None or path.is_absolute() or ".." in path.parts or "\\" in shard or not shard:
            raise ValueError(
                f"model: {index}: tensor {name!r} is mapped to {shard!r}; a shard must be a "
                "file name inside the model directory"
            )
        if not (index.parent / shard).is_file():
            raise ValueError(f"model: {index} names shard {shard!r}, which does not exist")
    return weight_map
