"""GGUF blocks kept quantized: Q8_0 / Q4_0 / Q4_1 / Q4_K repacked into the int8 / int4 group-32
layouts dequantize to exactly gguf.quants.dequantize's values; a model served through them
(quantization="gguf", CPU, float32) gives the dequantized path's greedy tokens and logprobs;
mixed files keep what they can; the CPU dequantizes by default; other methods are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from engine_cases import write_checkpoint
from gguf_files import permute_rows, write_gguf
from gguf_pack import quantize

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.loaders.gguf_tensors import gguf_tensors, unpermute_rows
from kvfleet_engine.quant.layout import dequantize_int4, dequantize_int8, pack_int4, pack_int8
from kvfleet_engine.quant.linear import QuantLinear

T = gguf.GGMLQuantizationType
KEPT = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 90)]]
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
# Q4_K's 256-value super-blocks need 256-wide rows: hidden and MLP sizes a multiple of 256.
WIDE = dict(hidden_size=256, intermediate_size=512)


def _random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Every bit pattern of codes and 6-bit scales (random bytes), with finite fp16 d / m / dmin
    of either sign: uint8 [rows, bytes per row]."""
    rng = np.random.default_rng(seed)
    block_values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block_values, block_bytes), dtype=np.uint8)
    halves = {T.Q8_0: 1, T.Q4_0: 1, T.Q4_1: 2, T.Q4_K: 2}[qtype]  # leading fp16 fields
    floats = rng.normal(0, 0.01, (raw.shape[0], halves)).astype(np.float16)
    raw[:, : 2 * halves] = floats.view(np.uint8)
    return raw.reshape(rows, -1)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, T]], heads: int) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    for name, (raw, qtype) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _dequantized(read: dict[str, np.ndarray], module: str) -> np.ndarray:
    """A repacked module's weight [out, in], through the kernels' packed layout and back."""
    codes, scales = (torch.from_numpy(read[f"{module}.{part}"]) for part in ("codes", "scales"))
    if f"{module}.offsets" not in read:
        packed8 = pack_int8(codes, scales, 32, scale_dtype=torch.float32)
        return dequantize_int8(packed8).t().numpy()
    offsets = torch.from_numpy(read[f"{module}.offsets"])
    packed4 = pack_int4(codes, scales, offsets, 32, scale_dtype=torch.float32)
    return dequantize_int4(packed4).t().numpy()


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
@pytest.mark.parametrize("source", ["random-bytes", "quantized-weights"])
def test_repacked_blocks_dequantize_exactly_like_gguf(
    tmp_path: Path, qtype: T, source: str
) -> None:
    """float32 values equal to gguf.quants.dequantize's, element for element, for a query
    projection (llama.cpp's row permutation undone on the codes) and an MLP weight."""
    heads, rows, cols = 4, 64, 512
    tensors = {}
    for seed, name in enumerate(["blk.0.attn_q.weight", "blk.0.ffn_up.weight"]):
        if source == "random-bytes":
            raw = _random_blocks(qtype, rows, cols, seed)
        else:
            rng = np.random.default_rng(seed)
            weight = rng.normal(0, 0.05, (rows, cols)) * rng.uniform(0.01, 10, (1, cols))
            raw = quantize(weight.astype(np.float32), qtype)
        tensors[name] = (raw, qtype)
    path = _write(tmp_path / "t.gguf", tensors, heads)
    kept = frozenset({"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.up_proj"})
    read = dict(gguf_tensors(str(path), kept))
    expected = {
        name: gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
        for name, (raw, qtype) in tensors.items()
    }
    assert ("model.layers.0.mlp.up_proj.offsets" in read) == (qtype != T.Q8_0)
    np.testing.assert_array_equal(
        _dequantized(read, "model.layers.0.self_attn.q_proj"),
        unpermute_rows(expected["blk.0.attn_q.weight"], heads),
    )
    np.testing.assert_array_equal(
        _dequantized(read, "model.layers.0.mlp.up_proj"), expected["blk.0.ffn_up.weight"]
    )


def test_unpermute_undoes_the_converters_permutation() -> None:
    weight = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(weight, 4), 4), weight)


def _generate(path: Path, **settings: Any) -> tuple[list[Any], LLM]:
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=256, **settings)
    outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
    return [out.outputs[0] for out in outputs], llm


def _assert_same_answers(quantized: list[Any], dequantized: list[Any]) -> None:
    for ours, plain in zip(quantized, dequantized, strict=True):
        assert list(ours.token_ids) == list(plain.token_ids)
        for token_id, logprob in plain.logprobs[0].items():
            assert ours.logprobs[0][token_id] == pytest.approx(logprob, abs=1e-4)


def _quantized_layers(llm: LLM) -> dict[str, str]:
    model = llm.engine.model_runner.model
    return {
        name: module.packed_kind
        for name, module in model.named_modules()
        if isinstance(module, QuantLinear) and module.packed_kind is not None
    }


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """llama3 (q/k permutation, rope factors) and qwen2 (biases, tied embeddings), 256 wide."""
    root = tmp_path_factory.mktemp("gguf-quantized")
    made = {
        arch: write_checkpoint(arch, root / arch, seed=7, **WIDE) for arch in ("llama3", "qwen2")
    }
    made["qwen2-directory"] = root / "qwen2"
    return made


@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama3", "qwen2"])
def test_quantized_path_answers_like_the_dequantized_path(
    wide_models: dict[str, Any], tmp_path: Path, arch: str, qtype: T
) -> None:
    # Every block linear in `qtype`; the embedding too (it stays dequantized).
    path = write_gguf(wide_models[arch], tmp_path / "m.gguf", lambda name, w: qtype)
    quantized, llm = _generate(path, quantization="gguf")
    kind = "int8" if qtype == T.Q8_0 else "int4"
    assert set(_quantized_layers(llm).values()) == {kind}
    assert len(_quantized_layers(llm)) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert llm.engine.model_config.quantization_name == "gguf"
    dequantized, plain = _generate(path)  # the CPU's default: every tensor dequantized
    assert _quantized_layers(plain) == {}
    _assert_same_answers(quantized, dequantized)


def _q4_k_m_like(name: str, weight: np.ndarray) -> T:
    """Types mixed the way llama.cpp's Q4_K_M mixes them, plus Q4_0 / Q8_0 / F16 neighbours."""
    if name == "token_embd.weight":
        return T.Q4_K
    if name == "output.weight":
        return T.Q6_K
    layer = int(name.split(".")[1])
    return {
        "attn_q": T.Q4_K,
        "attn_k": T.Q4_K,
        "attn_v": T.Q6_K if layer == 0 else T.Q4_K,
        "attn_output": T.Q8_0,
        "ffn_gate": T.Q4_0,
        "ffn_up": T.Q4_K,
        "ffn_down": T.F16 if layer == 0 else T.Q4_1,
    }[name.split(".")[2]]


def test_mixed_file_keeps_what_it_can(wide_models: dict[str, Any], tmp_path: Path) -> None:
    """A fused layer whose parts differ in kind (Q6_K v with Q4_K q/k) stays dequantized; Q4_0
    gate with Q4_K up is one int4 layer; F16 / Q6_K tensors and the embedding dequantize."""
    path = write_gguf(wide_models["llama3"], tmp_path / "mixed.gguf", _q4_k_m_like)
    quantized, llm = _generate(path, quantization="gguf")
    assert _quantized_layers(llm) == {
        "model.layers.0.self_attn.o_proj": "int8",
        "model.layers.0.mlp.gate_up_proj": "int4",
        "model.layers.1.self_attn.qkv_proj": "int4",
        "model.layers.1.self_attn.o_proj": "int8",
        "model.layers.1.mlp.gate_up_proj": "int4",
        "model.layers.1.mlp.down_proj": "int4",
    }
    dequantized, _ = _generate(path, quantization="none")
    _assert_same_answers(quantized, dequantized)


def test_the_cpu_dequantizes_unless_gguf_is_asked_for(
    wide_models: dict[str, Any], tmp_path: Path
) -> None:
    path = write_gguf(wide_models["qwen2"], tmp_path / "q4.gguf", lambda name, w: T.Q4_0)
    for setting in ("auto", None, "none"):
        llm = LLM(str(path), device="cpu", max_model_len=64, quantization=setting)
        assert _quantized_layers(llm) == {}, setting


@pytest.mark.parametrize("setting", ["awq", "int4-gptq", "int8", "fp8", "compressed-tensors"])
def test_other_methods_on_a_gguf_file_are_refused(
    wide_models: dict[str, Any], tmp_path: Path, setting: str
) -> None:
    path = write_gguf(wide_models["qwen2"], tmp_path / "q4.gguf", lambda name, w: T.Q4_K)
    name = {"int4-gptq": "gptq"}.get(setting, setting)
    with pytest.raises(
        ValueError,
        match=rf"quantization='{name}' does not apply to the GGUF file q4.gguf \(its tensors "
        r"are Q4_K\); use auto .*, gguf .* or none",
    ):
        LLM(str(path), device="cpu", max_model_len=64, quantization=setting)


def test_gguf_on_a_safetensors_directory_is_refused(wide_models: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF file"):
        LLM(
            str(wide_models["qwen2-directory"]), device="cpu", max_model_len=64, quantization="gguf"
        )


@pytest.mark.slow
def test_smollm2_q4_1_through_the_quantized_path_answers_like_the_dequantized_path() -> None:
    """SmolLM2's real Q4_1 file (210 Q4_1 linears kept as int4; the Q8_0 embedding
    dequantized), float32 on the CPU: the France answer, and the dequantized path's greedy
    tokens on the first 4 chat prompts. (Measured 2026-12-01: all 17 single-turn prompts of
    test_smollm2 agree for 64 tokens; the CPU reference dequantizes every weight at every step,
    so only 4 x 24 tokens run here.)"""
    from test_smollm2 import QUESTIONS

    from kvfleet_engine.model_store import DEFAULT_MODEL, fetch

    path = fetch(DEFAULT_MODEL)
    params = SamplingParams(temperature=0, max_tokens=24)
    answers = []
    for setting in ("gguf", "none"):
        llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=512, quantization=setting)
        assert len(_quantized_layers(llm)) == (30 * 4 if setting == "gguf" else 0)
        tokenizer = llm.get_tokenizer()
        chats = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
            for question in QUESTIONS[:4]
        ]
        answers.append([out.outputs[0] for out in llm.generate(chats, params, use_tqdm=False)])
    quantized, dequantized = answers
    assert quantized[0].text == "The capital of France is Paris."
    assert [list(a.token_ids) for a in quantized] == [list(a.token_ids) for a in dequantized]


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", KEPT, ids=lambda t: t.name)
def test_gpu_keeps_blocks_quantized_and_the_kernels_match_their_reference(
    wide_models: dict[str, Any], tmp_path: Path, qtype: T
) -> None:
    """CUDA, quantization auto: the blocks stay quantized (fp16 scales), each layer's kernel
    matches layout.py's reference product on its packed weight at 1, 7 and 64 rows, and greedy
    tokens are the same with CUDA graphs and without."""
    from kvfleet_engine.quant.layout import int4_linear_reference, int8_linear_reference

    path = write_gguf(wide_models["llama3"], tmp_path / "m.gguf", lambda name, w: qtype)
    tokens = []
    for eager in (False, True):
        llm = LLM(
            str(path), device="cuda", dtype="bfloat16", max_model_len=256, enforce_eager=eager
        )
        layers = {
            name: module
            for name, module in llm.engine.model_runner.model.named_modules()
            if isinstance(module, QuantLinear)
        }
        assert len(layers) == 8
        for name, layer in layers.items():
            weight = layer.packed
            reference = (
                int8_linear_reference if layer.packed_kind == "int8" else int4_linear_reference
            )
            for rows in (1, 7, 64):
                x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
                torch.testing.assert_close(
                    layer(x), reference(x, weight, layer.bias), rtol=2e-2, atol=2e-2, msg=name
                )
        outputs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=PARAMS, use_tqdm=False)
        tokens.append([list(out.outputs[0].token_ids) for out in outputs])
    assert tokens[0] == tokens[1]
