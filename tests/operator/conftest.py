"""Helpers for the operator's cluster-free tests."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvfleet_operator.models import InferenceDeploymentSpec

BASE_SPEC: dict[str, Any] = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B-Instruct", "maxModelLen": 8192},
    "resources": {"accelerator": "h100-80gb"},
    "replicas": 2,
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


GOLDEN = Path(__file__).parent / "golden"


@pytest.fixture
def check_golden():
    """check_golden(name, objects): the objects as YAML equal golden/NAME.yaml (rewritten with
    UPDATE_GOLDEN=1 after a deliberate change)."""

    def check(name: str, objects: list[dict[str, Any]]) -> None:
        text = yaml.safe_dump_all(objects, sort_keys=False, width=100)
        path = GOLDEN / f"{name}.yaml"
        if os.environ.get("UPDATE_GOLDEN") == "1":
            path.write_text(text)
        assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1"
        assert text == path.read_text(), f"{path} differs: review, then UPDATE_GOLDEN=1"

    return check


@pytest.fixture
def make_spec():
    """make_spec(parallelism={"tensor": 2}) -> InferenceDeploymentSpec; None removes a key."""

    def build(**override: Any) -> InferenceDeploymentSpec:
        return InferenceDeploymentSpec.model_validate(merge(BASE_SPEC, override))

    return build


@pytest.fixture
def write_gguf(tmp_path):
    """write_gguf(layers=2, hidden=256, ...) -> path of a llama-shaped GGUF file written by the
    real gguf package, with mixed tensor types; `with_data=False` writes the header only (any
    size of model, a few KiB of file)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    Q = gguf.GGMLQuantizationType

    def build(
        *,
        name: str = "tiny.gguf",
        layers: int = 2,
        hidden: int = 256,
        heads: int = 4,
        kv_heads: int = 2,
        ffn: int = 512,
        vocab: int = 1024,
        context: int = 4096,
        key_length: int | None = None,
        vocab_tokens: int = 0,
        with_data: bool = True,
        big_endian: bool = False,
        metadata: dict[str, int] | None = None,
    ):
        path = tmp_path / name
        endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
        writer = gguf.GGUFWriter(path, "llama", endianess=endian)
        writer.add_block_count(layers)
        writer.add_embedding_length(hidden)
        writer.add_feed_forward_length(ffn)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_context_length(context)
        writer.add_rope_freq_base(500000.0)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
        if key_length is not None:
            writer.add_key_length(key_length)
        for key, value in (metadata or {}).items():
            writer.add_uint32(key, value)
        if vocab_tokens:
            writer.add_tokenizer_model("llama")
            writer.add_token_list([f"token-{i}" for i in range(vocab_tokens)])
            writer.add_token_scores([0.0] * vocab_tokens)
        head_dim = key_length or hidden // heads
        tensors = [("token_embd.weight", (vocab, hidden), Q.Q4_1)]
        for layer in range(layers):
            blk = f"blk.{layer}"
            tensors += [
                (f"{blk}.attn_norm.weight", (hidden,), Q.F32),
                (f"{blk}.attn_q.weight", (heads * head_dim, hidden), Q.Q4_K),
                (f"{blk}.attn_k.weight", (kv_heads * head_dim, hidden), Q.Q4_K),
                (f"{blk}.attn_v.weight", (kv_heads * head_dim, hidden), Q.Q6_K),
                (f"{blk}.attn_output.weight", (hidden, heads * head_dim), Q.Q4_K),
                (f"{blk}.ffn_norm.weight", (hidden,), Q.F32),
                (f"{blk}.ffn_gate.weight", (ffn, hidden), Q.Q4_1),
                (f"{blk}.ffn_up.weight", (ffn, hidden), Q.Q4_1),
                (f"{blk}.ffn_down.weight", (hidden, ffn), Q.Q8_0),
            ]
        tensors += [
            ("output_norm.weight", (hidden,), Q.F32),
            ("output.weight", (vocab, hidden), Q.F16),
        ]
        for tensor_name, shape, ggml_type in tensors:
            block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
            row_bytes = shape[-1] // block_size * block_bytes
            byte_shape = (*shape[:-1], row_bytes)
            nbytes = int(np.prod(byte_shape))
            if with_data:
                writer.add_tensor(tensor_name, np.zeros(byte_shape, np.uint8), raw_dtype=ggml_type)
            else:
                writer.add_tensor_info(
                    tensor_name, byte_shape, np.dtype(np.uint8), nbytes, ggml_type
                )
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        if with_data:
            writer.write_tensors_to_file()
        else:
            writer.write_ti_data_to_file()
        writer.close()
        return path

    return build
