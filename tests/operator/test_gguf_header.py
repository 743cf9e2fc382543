"""The GGUF header parser, on files written by the real gguf package (gguf-py)."""

from __future__ import annotations

import re
import struct
import subprocess
import sys

import pytest

from kvfleet_operator.gguf_header import GGML_TYPES, GGUFHeaderError, parse_gguf_header

gguf = pytest.importorskip("gguf")


def test_ggml_type_table_matches_gguf_py() -> None:
    sizes = {int(t): (t.name, *size) for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert sizes == GGML_TYPES


def test_tiny_llama_numbers_match_gguf_reader(write_gguf) -> None:
    path = write_gguf(vocab_tokens=300)
    summary = parse_gguf_header(path.read_bytes())
    assert summary is not None
    reader = gguf.GGUFReader(path)
    assert (summary.version, summary.architecture, summary.num_tensors) == (3, "llama", 21)
    assert (summary.block_count, summary.embedding_length, summary.context_length) == (2, 256, 4096)
    assert (summary.head_count, summary.head_count_kv, summary.head_dim) == (4, 2, 64)
    assert summary.split_count == 1
    assert summary.num_parameters == sum(int(t.n_elements) for t in reader.tensors)
    assert summary.weight_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in reader.tensors}
    assert types == {"F32", "F16", "Q4_1", "Q4_K", "Q6_K", "Q8_0"}
    # The tensor infos end where the (aligned) tensor data begins.
    assert summary.header_bytes <= reader.data_offset < summary.header_bytes + 32


def test_key_length_is_the_head_dim_when_present(write_gguf) -> None:
    summary = parse_gguf_header(write_gguf(key_length=128, with_data=False).read_bytes())
    assert summary is not None and summary.head_dim == 128


def test_every_truncation_asks_for_more_bytes(write_gguf) -> None:
    data = write_gguf(vocab_tokens=50).read_bytes()
    complete = parse_gguf_header(data)
    assert complete is not None
    end = complete.header_bytes
    for size in [0, 3, 4, 8, 23, 24, 100, end // 2, end - 30, end - 1]:
        assert parse_gguf_header(data[:size]) is None, size
    assert parse_gguf_header(data[:end]) == complete


def test_not_gguf_is_named() -> None:
    safetensors = struct.pack("<Q", 2) + b"{}" + b"\0" * 16
    with pytest.raises(GGUFHeaderError, match="not a GGUF file: it starts with"):
        parse_gguf_header(safetensors)
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        parse_gguf_header(b"<!DOCTYPE html><html>")


def test_version_1_and_unknown_versions_are_refused(write_gguf) -> None:
    data = bytearray(write_gguf(with_data=False).read_bytes())
    for version in (1, 4):
        data[4:8] = struct.pack("<I", version)
        with pytest.raises(GGUFHeaderError, match=f"GGUF version {version} is not supported"):
            parse_gguf_header(bytes(data))


def test_version_2_reads_like_version_3(write_gguf) -> None:
    data = bytearray(write_gguf(with_data=False).read_bytes())
    v3 = parse_gguf_header(bytes(data))
    data[4:8] = struct.pack("<I", 2)
    v2 = parse_gguf_header(bytes(data))
    assert v2 is not None and v3 is not None
    assert (v2.version, v2.weight_bytes, v2.num_parameters) == (
        2,
        v3.weight_bytes,
        v3.num_parameters,
    )


def test_big_endian_file(write_gguf) -> None:
    little = parse_gguf_header(write_gguf(name="le.gguf", with_data=False).read_bytes())
    big = parse_gguf_header(
        write_gguf(name="be.gguf", with_data=False, big_endian=True).read_bytes()
    )
    assert big == little


def test_corrupt_tensor_info_names_the_tensor(write_gguf) -> None:
    data = write_gguf(with_data=False).read_bytes()
    summary = parse_gguf_header(data)
    assert summary is not None
    # The last tensor info is output.weight: ... type u32, offset u64, then the end.
    end = summary.header_bytes
    unknown_type = data[: end - 12] + struct.pack("<I", 4) + data[end - 8 :]  # Q4_2, removed
    with pytest.raises(
        GGUFHeaderError, match=re.escape("tensor output.weight: unknown or removed ggml type 4")
    ):
        parse_gguf_header(unknown_type)
    name = b"output.weight"
    at = data.rindex(name) + len(name)  # n_dims u32 follows the name
    too_many_dims = data[:at] + struct.pack("<I", 9) + data[at + 4 :]
    with pytest.raises(GGUFHeaderError, match=re.escape("tensor output.weight: 9 dimensions")):
        parse_gguf_header(too_many_dims)


def test_unknown_metadata_type_and_implausible_counts(write_gguf) -> None:
    data = write_gguf(with_data=False).read_bytes()
    key = b"general.architecture"
    at = data.index(key) + len(key)  # value type u32 follows the key
    with pytest.raises(
        GGUFHeaderError, match=re.escape("metadata general.architecture: unknown value type 13")
    ):
        parse_gguf_header(data[:at] + struct.pack("<I", 13) + data[at + 4 :])
    huge = data[:8] + struct.pack("<Q", 1 << 40) + data[16:]
    with pytest.raises(GGUFHeaderError, match="tensor count 1099511627776 at byte 8"):
        parse_gguf_header(huge)


def test_per_layer_head_counts_use_the_largest(write_gguf, tmp_path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "openelm.gguf", "openelm")
    writer.add_block_count(3)
    writer.add_embedding_length(1280)
    writer.add_head_count([12, 16, 20])
    writer.add_head_count_kv([3, 4, 5])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    summary = parse_gguf_header((tmp_path / "openelm.gguf").read_bytes())
    assert summary is not None
    assert (summary.head_count, summary.head_count_kv, summary.head_dim) == (20, 5, 64)
    assert (summary.num_tensors, summary.num_parameters, summary.context_length) == (0, 0, None)


def test_the_parser_imports_neither_numpy_nor_gguf() -> None:
    code = (
        "import sys, kvfleet_operator.gguf_header, kvfleet_operator.plan;"
        "assert not {'numpy', 'gguf'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
