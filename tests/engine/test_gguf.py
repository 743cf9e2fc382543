"""GGUF checkpoints: tiny random models of each architecture written the way llama.cpp's
converter writes them, read back by the engine; every tensor type read back within its
rounding; broken files refused with a message naming the problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from engine_cases import ARCHITECTURES, assert_greedy_equal, reference_greedy, write_checkpoint
from gguf_files import gguf_name, permute_rows, write_gguf
from gguf_pack import SUPPORTED, tolerance

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.loaders.gguf_tensors import gguf_tensors

T = gguf.GGMLQuantizationType
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 90)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """Each architecture as (transformers model, its GGUF file)."""
    root = tmp_path_factory.mktemp("gguf")
    made = {}
    for name in ARCHITECTURES:
        model = write_checkpoint(name, root / name)
        made[name] = (model, write_gguf(model, root / f"{name}.gguf"))
    return made


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_greedy_tokens_match_transformers(models: dict[str, Any], name: str) -> None:
    """Config from the metadata, names mapped, q/k permutation undone, tied embeddings, llama3
    rope factors, qwen2 biases and qwen3 q/k norms: the same greedy tokens as the original."""
    model, path = models[name]
    llm = LLM(str(path), device="cpu", max_model_len=256)
    assert llm.engine.model_config.format == "gguf"
    assert llm.engine.model_config.architecture == type(model).__name__.replace("Mistral", "Llama")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_greedy_equal(list(out.outputs[0].token_ids), reference_greedy(model, prompt, 16))


def test_quantized_file_matches_transformers_reading_it(models: dict[str, Any]) -> None:
    """Q8_0 and Q4_1 weights: the engine and transformers' own GGUF loader (same file, each
    dequantizing it) give the same greedy tokens. (Not llama3: transformers' GGUF loader
    ignores the rope frequency factors.)"""
    from transformers import AutoModelForCausalLM

    model, good = models["llama2-tied"]
    path = write_gguf(
        model,
        good.with_name("llama2-q.gguf"),
        lambda name, w: T.Q8_0 if "attn" in name or "token_embd" in name else T.Q4_1,
    )
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    llm = LLM(str(path), device="cpu", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert_greedy_equal(list(out.outputs[0].token_ids), reference_greedy(reference, prompt, 16))


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda t: t.name)
def test_every_tensor_type_reads_back_within_its_rounding(tmp_path: Path, qtype: T) -> None:
    rng = np.random.default_rng(int(qtype))
    heads, head_dim, cols = 4, 16, 256
    weights = {
        "blk.0.attn_q.weight": rng.normal(0, 0.05, (heads * head_dim, cols)),
        "blk.0.ffn_up.weight": rng.normal(0, 1.0, (96, cols)) * rng.uniform(0.01, 10, (96, 1)),
    }
    writer = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    from gguf_pack import quantize

    for name, weight in weights.items():
        stored = weight.astype(np.float32)
        if ".attn_q." in name:
            stored = permute_rows(stored, heads)
        writer.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = dict(gguf_tensors(str(tmp_path / "t.gguf")))
    for name, weight in weights.items():
        hf = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}.get(
            name, "model.layers.0.mlp.up_proj.weight"
        )
        error = np.abs(read[hf] - weight.astype(np.float32)).max()
        assert read[hf].shape == weight.shape
        assert error <= tolerance(weight.astype(np.float32), qtype), (name, error)


def test_directory_with_one_gguf_file(models: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "model.gguf").symlink_to(models["qwen3"][1])
    assert LLM(str(tmp_path), device="cpu", max_model_len=64).engine.model_config.format == "gguf"
    (tmp_path / "other.gguf").symlink_to(models["qwen2"][1])
    with pytest.raises(ValueError, match=r"several GGUF files \(model.gguf, other.gguf\)"):
        LLM(str(tmp_path), device="cpu")


def _broken(models: dict[str, Any], tmp_path: Path, case: str) -> Path:
    model, good = models["llama3"]
    path = tmp_path / f"{case}.gguf"
    if case == "not-gguf":
        path.write_text("this is a text file, not a model\n")
    elif case == "truncated":
        path.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    elif case == "architecture":
        path.write_bytes(good.read_bytes().replace(b"llama", b"gemma", 1))
    elif case == "missing-tensor":
        write_gguf(model, path, skip=frozenset({gguf_name("model.layers.1.mlp.up_proj.weight")}))
    elif case == "wrong-hidden-size":
        write_gguf(model, path, metadata=lambda w: _override(w, "llama.embedding_length", 32))
    elif case == "tensor-type":
        write_gguf(model, path, lambda name, w: T.IQ4_NL if "ffn_up" in name else T.F32)
    return path


def _override(writer: gguf.GGUFWriter, key: str, value: int) -> None:
    for kv in writer.kv_data:
        kv.pop(key, None)
    writer.add_uint32(key, value)


BROKEN = {
    "not-gguf": "is not a readable GGUF file",
    "truncated": "is not a readable GGUF file",
    "architecture": "GGUF architecture 'gemma' is not supported; supported: llama, qwen2, qwen3",
    "missing-tensor": r"^model: .*\.gguf: the checkpoint lacks weights for: "
    r"\['model.layers.1.mlp.gate_up_proj.weight \(up\)'\]",
    "wrong-hidden-size": r"'vocab_size' and 'hidden_size' are \[260, 32\], but the checkpoint's "
    r"model.embed_tokens.weight has shape \[260, 64\]",
    "tensor-type": "has type IQ4_NL, which kvfleet does not read; supported: F32, F16",
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_broken_files_are_refused_by_name(
    models: dict[str, Any], tmp_path: Path, case: str
) -> None:
    with pytest.raises(ValueError, match=BROKEN[case]):
        LLM(str(_broken(models, tmp_path, case)), device="cpu", max_model_len=64)


def test_serve_reports_a_broken_file_without_a_traceback(
    models: dict[str, Any], tmp_path: Path
) -> None:
    path = _broken(models, tmp_path, "missing-tensor")
    done = subprocess.run(
        [sys.executable, "-m", "kvfleet_cli", "serve", "--model", str(path), "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "lacks weights for" in done.stderr and "Traceback" not in done.stderr


def test_max_model_len_beyond_the_files_context(models: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"max_model_len must be in \[2, 1024\]"):
        LLM(str(models["qwen2"][1]), device="cpu", max_model_len=4096)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path: Path) -> None:
    """A `llama` (SentencePiece BPE) vocabulary with scores and byte fallback, as Llama 2 and
    Mistral files carry: the same pieces as transformers' GGUF tokenizer, BOS first as llama.cpp
    adds it (`tokenizer.ggml.add_bos_token`), and text decoded back exactly."""
    from transformers import AutoTokenizer

    from kvfleet_engine.loaders.gguf_tokenizer import gguf_tokenizer

    words = ["▁the", "▁cat", "▁sat", "▁on", "▁mat", "▁hello", "▁world", "he", "llo", "▁h", "at"]
    letters = list("abcdefghijklmnopqrstuvwxyz")
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", *letters, *words]
    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([2, 3, 3, *[6] * 256, *[1] * (1 + len(letters) + len(words))])
    writer.add_token_scores(
        [0.0] * 259 + [-100.0] + [-50.0 - i for i in range(26)] + [-float(i) for i in range(11)]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = gguf_tokenizer(str(tmp_path / "spm.gguf"))
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in ["the cat sat on the mat", "hello world", "Hello wörld!\n  x", "thecat"]:
        ids = ours.encode(text)
        assert ids[0] == 1 and ids[1:] == ours.encode(text, add_special_tokens=False)
        assert ids[1:] == [i for i in theirs.encode(text) if i != 1]
        assert ours.decode(ids, skip_special_tokens=True) == text
