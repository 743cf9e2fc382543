"""A GGUF file's header walked before `gguf.GGUFReader` reads it. The reader trusts every count
and length it finds: it loops 2**62 times over an array's items (past the file's end it reads
empty items forever) and reshapes a tensor's data to dims of 2**40. Here each count and length is
checked against the bytes left in the file, and each tensor's bytes against the file's end, so a
hostile or cut-short file is a ValueError naming the field, in time linear in the header's size.
No numpy (the `gguf` package is imported only to size its tensor types)."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

# GGUF value type -> bytes, for the fixed-size ones (uint8 .. float64 and bool).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes of one key-value pair (key length, type, a one-byte value) and of one
# tensor's info (name length, dims count, type, offset).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
_DEFAULT_ALIGNMENT = 32


def check_gguf_header(path: Path) -> None:
    """The header fits the file and every tensor's data lies inside it; a ValueError saying
    which count, length or tensor does not (the caller names the file)."""
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        _Header(data).check()


class _Header:
    """A cursor over the file's bytes that checks each read against the file's end."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data = data
        self.offset = 0
        self.order = "<"
        self.alignment = _DEFAULT_ALIGNMENT

    def check(self) -> None:
        if self.data[:4] != b"GGUF":
            raise ValueError("it does not start with the GGUF magic")
        self.offset = 4
        version = self.number("the version", "I")
        if version & 0xFFFF == 0:  # written on a big-endian machine
            self.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in (2, 3):
            raise ValueError(f"version {version} is not 2 or 3")
        num_tensors = self.count("the tensor count", _MIN_TENSOR_INFO_BYTES)
        num_kvs = self.count("the key-value count", _MIN_KV_BYTES)
        for index in range(num_kvs):
            key = self.string(f"key-value {index}'s key").decode(errors="replace")
            self.value(key, self.number(f"{key}'s type", "I"))
        tensors = [self.tensor_info(index) for index in range(num_tensors)]
        data_start = -(-self.offset // self.alignment) * self.alignment
        for name, offset, num_bytes, description in tensors:
            if data_start + offset + num_bytes > len(self.data):
                raise ValueError(
                    f"tensor {name!r} ({description}) needs {num_bytes} bytes at byte "
                    f"{data_start + offset}, past the file's end ({len(self.data)} bytes)"
                )

    def value(self, key: str, value_type: int) -> None:
        if value_type in _SCALAR_BYTES:
            start = self.take(key, _SCALAR_BYTES[value_type])
            if key == "general.alignment" and value_type == _UINT32:
                alignment = struct.unpack_from(f"{self.order}I", self.data, start)[0]
                if alignment == 0 or alignment & (alignment - 1):
                    raise ValueError(f"general.alignment {alignment} is not a power of two")
                self.alignment = alignment
        elif value_type == _STRING:
            self.string(key)
        elif value_type == _ARRAY:
            item_type = self.number(f"{key}'s item type", "I")
            if item_type in _SCALAR_BYTES:
                num_items = self.count(f"{key}'s item count", _SCALAR_BYTES[item_type])
                self.take(key, num_items * _SCALAR_BYTES[item_type])
            elif item_type == _STRING:
                self.strings(key, self.count(f"{key}'s item count", 8))
            else:  # llama.cpp reads no arrays of arrays either
                raise ValueError(f"{key} is an array of type {item_type}, not numbers or strings")
        else:
            raise ValueError(f"{key} has type {value_type}, which GGUF does not define")

    def tensor_info(self, index: int) -> tuple[str, int, int, str]:
        """(name, offset in the data, bytes, a description) of one tensor."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        name = self.string(f"tensor {index}'s name").decode(errors="replace")
        num_dims = self.number(f"tensor {name!r}'s dims count", "I")
        if num_dims > _MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {num_dims} dims; at most {_MAX_DIMS}")
        dims = [self.number(f"tensor {name!r}'s dims", "Q") for _ in range(num_dims)]
        raw_type = self.number(f"tensor {name!r}'s type", "I")
        offset = self.number(f"tensor {name!r}'s offset", "Q")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ValueError(
                f"tensor {name!r} has type {raw_type}, which GGML does not define"
            ) from None
        block_values, block_bytes = GGML_QUANT_SIZES[tensor_type]
        description = f"{tensor_type.name} {dims}"
        if dims and dims[0] % block_values:
            raise ValueError(
                f"tensor {name!r} ({description}): a row of {dims[0]} values is not whole "
                f"{tensor_type.name} blocks of {block_values}"
            )
        return name, offset, math.prod(dims) // block_values * block_bytes, description

    def take(self, what: str, num_bytes: int) -> int:
        """Where `num_bytes` of `what` start; the cursor moves past them."""
        if num_bytes > len(self.data) - self.offset:
            raise ValueError(
                f"{what} needs {num_bytes} bytes at byte {self.offset}, past the file's end "
                f"({len(self.data)} bytes)"
            )
        start, self.offset = self.offset, self.offset + num_bytes
        return start

    def number(self, what: str, code: str) -> int:
        start = self.take(what, struct.calcsize(code))
        value: int = struct.unpack_from(self.order + code, self.data, start)[0]
        return value

    def count(self, what: str, min_item_bytes: int) -> int:
        """A count of items of at least `min_item_bytes` each, which the file's rest can hold."""
        value = self.number(what, "Q")
        left = len(self.data) - self.offset
        if value * min_item_bytes > left:
            raise ValueError(
                f"{what} is {value}, more than the {left} bytes left in the file can hold"
            )
        return value

    def strings(self, key: str, num_items: int) -> None:
        """Past an array of strings, in a loop of its own (a vocabulary and its merges, 300,000
        strings: 0.14 s); the first that does not fit is read again by `string`, which raises."""
        data, end, offset = self.data, len(self.data), self.offset
        read_length = struct.Struct(f"{self.order}Q").unpack_from
        for index in range(num_items):
            if offset + 8 > end or offset + 8 + read_length(data, offset)[0] > end:
                self.offset = offset
                self.string(f"{key}[{index}]")
            offset += 8 + read_length(data, offset)[0]
        self.offset = offset

    def string(self, what: str) -> bytes:
        length = self.count(f"{what}'s length", 1)
        start = self.take(what, length)
        return self.data[start : start + length]
