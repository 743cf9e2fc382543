"""A GGUF file's metadata as the engine needs it: the file to read, a Hugging Face style config
dict built from llama.cpp's keys, and the end-of-sequence tokens. No torch, no numpy of our own
(the `gguf` package is imported only when a GGUF file is read)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from kvfleet_engine.loaders.gguf_header import check_gguf_header

# GGUF `general.architecture` -> the Hugging Face architecture our model code implements.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGML tensor types the engine reads (dequantized at load into the serving dtype).
TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)  # fmt: skip


def find_gguf_file(path: str) -> Path | None:
    """The GGUF file `path` names: a `.gguf` file, or a directory without config.json holding
    exactly one. None when `path` is not a GGUF checkpoint (a Hugging Face directory)."""
    target = Path(path)
    if target.suffix == ".gguf" or (target.is_file() and _has_gguf_magic(target)):
        if not target.is_file():
            raise ValueError(f"model: {path!r} does not exist")
        return target
    if not target.is_dir() or (target / "config.json").is_file():
        return None
    files = sorted(target.glob("*.gguf"))
    if len(files) > 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"model: {path!r} holds several GGUF files ({names}); name one of them")
    return files[0] if files else None


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> Any:
    """The file's `gguf.GGUFReader` (memory-mapped; one per file, shared by the config, tokenizer
    and weight loaders), once its header is checked against the file's size. A file that is not
    GGUF, is cut short or holds a count no file can: a ValueError naming the file and the field."""
    import gguf

    try:
        check_gguf_header(Path(path))
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as error:
        raise ValueError(f"model: {path}: is not a readable GGUF file: {error}") from None


def field(reader: Any, key: str, default: Any = None) -> Any:
    """One metadata value (str, int, float, bool or list), or `default` when absent."""
    entry = reader.fields.get(key)
    if entry is None:
        return default
    return entry.contents()


def gguf_hf_config(path: str) -> dict[str, Any]:
    """The model's config in config.json's keys, from the GGUF metadata (and which tensors exist:
    no `output.weight` means tied embeddings)."""
    reader = open_gguf(path)
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise ValueError(
            f"model: GGUF architecture {arch!r} is not supported; supported: {supported}"
        )

    def required(key: str) -> Any:
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"model: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = _count(path, f"{arch}.embedding_length", required("embedding_length"))
    num_heads, num_kv_heads = head_counts(reader, arch)
    _count(path, f"{arch}.attention.head_count", num_heads)
    _count(path, f"{arch}.attention.head_count_kv", num_kv_heads)
    head_dim = int(field(reader, f"{arch}.attention.key_length") or hidden // num_heads)
    rope_dim = int(field(reader, f"{arch}.rope.dimension_count") or head_dim)
    if rope_dim != head_dim:
        raise ValueError(
            f"model: GGUF rope.dimension_count {rope_dim} != head dim {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "num_hidden_layers": _count(path, f"{arch}.block_count", required("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(_uniform(required("feed_forward_length"), "feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(required("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(required("context_length")),
        "vocab_size": int(field(reader, f"{arch}.vocab_size") or len(tokens)),
        "rope_parameters": _rope_parameters(reader, arch),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names and arch == "llama",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": field(reader, "tokenizer.ggml.eos_token_id"),
    }
    return config


def _count(path: str, key: str, value: Any) -> int:
    """A metadata size the model is built from: an integer >= 1."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model: {path}: GGUF {key} must be >= 1, got {value!r}")
    return value


def head_counts(reader: Any, arch: str) -> tuple[int, int]:
    """(query heads, KV heads); KV heads default to the query heads."""
    num_heads = field(reader, f"{arch}.attention.head_count")
    if num_heads is None:
        raise ValueError(f"model: GGUF metadata lacks {arch}.attention.head_count")
    num_kv_heads = field(reader, f"{arch}.attention.head_count_kv", num_heads)
    return int(num_heads), _uniform(num_kv_heads, "head_count_kv")


def _uniform(value: Any, key: str) -> int:
    """llama.cpp may store a per-layer list; we need one value for every layer."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"model: GGUF {key} differs between layers ({sorted(set(value))})")
        return int(value[0])
    return int(value)


def _rope_parameters(reader: Any, arch: str) -> dict[str, Any]:
    params: dict[str, Any] = {
        "rope_theta": float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_type": "default",
    }
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        # Llama 3.1's "llama3" scaling is stored as per-frequency factors (rope_freqs.weight),
        # not as a scaling type; linear and yarn scaling are not implemented.
        raise ValueError(f"model: GGUF rope scaling {scaling!r} is not supported")
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # F32 [head_dim // 2]
            params["rope_type"] = "frequency_factors"
            params["frequency_factors"] = [float(x) for x in tensor.data]
    return params


def gguf_eos_token_ids(path: str) -> frozenset[int]:
    """The end-of-sequence token, plus end-of-turn / end-of-text tokens llama.cpp records."""
    reader = open_gguf(path)
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        value = field(reader, key)
        if value is not None:
            ids.add(int(value))
    return frozenset(ids)
