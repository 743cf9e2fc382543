"""Quantized checkpoints and quantization at load: for every method and layout, kvfleet's greedy
tokens and first logits match transformers running the same checkpoint's dequantized weights
(CPU, float32); fused layers, ignore lists and the module swap; bad settings refused by name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import Reference, assert_greedy_equal, reference_greedy, write_checkpoint
from quant_pack import add_fp8_activation_hooks, write_quantized_checkpoint
from safetensors.torch import load_file, save_file

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.quant.layout import dequantize_int8, quantize_fp8, quantize_int8
from kvfleet_engine.quant.linear import QuantLinear

PROMPTS = [[256, 72, 101, 108, 108, 111], [256, *range(40, 80)]]
MAX_TOKENS = 12

# name -> (architecture, write_quantized_checkpoint keywords)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "awq-g32": ("llama3", dict(method="awq", group_size=32, symmetric=False)),
    "awq-g64-qwen2": ("qwen2", dict(method="awq", group_size=64, symmetric=False)),
    "gptq-sym-g32": ("llama3", dict(method="gptq", group_size=32)),
    "gptq-asym-v2-g64": (
        "mistral",
        dict(method="gptq", group_size=64, symmetric=False, gptq_v2=True),
    ),
    "gptq-asym-v1-g32": ("qwen3", dict(method="gptq", group_size=32, symmetric=False)),
    "gptq-act-order": ("llama3", dict(method="gptq", group_size=32, act_order=True)),
    "ct-int4-sym": ("llama3", dict(method="ct-int4", group_size=32)),
    "ct-int4-asym-g64": ("qwen2", dict(method="ct-int4", group_size=64, symmetric=False)),
    "ct-int4-act-order": ("llama2-tied", dict(method="ct-int4", group_size=32, act_order=True)),
    "ct-int8-channel": ("llama3", dict(method="ct-int8", group_size=0)),
    "ct-int8-g32": ("qwen3", dict(method="ct-int8", group_size=32)),
    "ct-fp8-channel": ("llama3", dict(method="ct-fp8")),
    "ct-fp8-tensor": ("qwen2", dict(method="ct-fp8", per_tensor=True)),
    "ct-int4-ignore-mlp": ("llama3", dict(method="ct-int4", group_size=32, ignore=("down_proj",))),
}


class Quantized:
    """Quantized checkpoints and the references of their dequantized weights, made once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[str, tuple[Path, Any]] = {}
        self.references: dict[tuple[str, int], Reference] = {}

    def path(self, name: str) -> Path:
        if name not in self.made:
            arch, keywords = CHECKPOINTS[name]
            model = write_checkpoint(arch, self.root / f"{name}-float", seed=3)
            model = write_quantized_checkpoint(model, self.root / name, **keywords)
            if keywords["method"] == "ct-fp8":
                add_fp8_activation_hooks(model)
            self.made[name] = (self.root / name, model)
        return self.made[name][0]

    def reference(self, name: str, prompt_index: int) -> Reference:
        key = (name, prompt_index)
        if key not in self.references:
            self.path(name)
            model = self.made[name][1]
            self.references[key] = reference_greedy(model, PROMPTS[prompt_index], MAX_TOKENS)
        return self.references[key]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> Quantized:
    return Quantized(tmp_path_factory.mktemp("quantized"))


def _generate(llm: LLM) -> list[Any]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return llm.generate(prompt_token_ids=PROMPTS, sampling_params=params, use_tqdm=False)


def _assert_matches(
    outputs: list[Any], references: list[Reference], label: str, atol: float = 2e-4
) -> None:
    for out, ref in zip(outputs, references, strict=True):
        completion = out.outputs[0]
        assert_greedy_equal(list(completion.token_ids), ref, label)
        expected = torch.log_softmax(ref.first_logits, dim=-1)
        for token_id, logprob in completion.logprobs[0].items():
            assert logprob == pytest.approx(float(expected[token_id]), abs=atol), (label, token_id)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_quantized_checkpoint_matches_its_dequantized_weights(
    quantized: Quantized, name: str
) -> None:
    llm = LLM(str(quantized.path(name)), device="cpu", max_model_len=256)
    outputs = _generate(llm)
    _assert_matches(outputs, [quantized.reference(name, i) for i in range(len(PROMPTS))], name)
    expected = CHECKPOINTS[name][1]["method"]
    method = llm.engine.model_config.quantization.method
    assert method == (expected if expected in ("awq", "gptq") else "compressed-tensors")


def test_quantized_layers_are_swapped_and_ignored_ones_stay(quantized: Quantized) -> None:
    llm = LLM(str(quantized.path("ct-int4-ignore-mlp")), device="cpu", max_model_len=64)
    model = llm.engine.model_runner.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert layer.self_attn.qkv_proj.packed_kind == "int4"
    assert isinstance(layer.mlp.gate_up_proj, QuantLinear)
    assert not isinstance(layer.mlp.down_proj, QuantLinear)  # in the checkpoint's ignore list
    assert not isinstance(model.lm_head, QuantLinear)
    assert not any(p.dtype == torch.int32 for p in model.parameters())  # checkpoint layout dropped


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_at_load_matches_the_rounded_float_model(tmp_path: Path, method: str) -> None:
    """--quantization int8 / fp8 on a float checkpoint: the weights are rounded per output
    channel at load (fp8 also rounds activations per token)."""
    model = write_checkpoint("qwen2", tmp_path / "float", seed=5)
    llm = LLM(str(tmp_path / "float"), device="cpu", max_model_len=256, quantization=method)
    assert llm.engine.model_config.quantization.method == method
    # fp8: the norms before qkv and gate_up hand them e4m3 rows (on CUDA); the final norm not
    runner_model = llm.engine.model_runner.model
    layer = runner_model.model.layers[0]
    assert layer.input_layernorm.fp8_rows_out is (method == "fp8")
    assert layer.post_attention_layernorm.fp8_rows_out is (method == "fp8")
    assert runner_model.model.norm.fp8_rows_out is False
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1].endswith("_proj"):
                weight = module.weight
                if method == "int8":
                    rounded = dequantize_int8(quantize_int8(weight)).t()
                else:
                    packed = quantize_fp8(weight)
                    rounded = packed.weight.float() * packed.scale[:, None]
                weight.copy_(rounded)
    if method == "fp8":
        add_fp8_activation_hooks(model)
    references = [reference_greedy(model, prompt, MAX_TOKENS) for prompt in PROMPTS]
    _assert_matches(_generate(llm), references, method)


def test_fused_shards_must_share_one_act_order(quantized: Quantized, tmp_path: Path) -> None:
    source = quantized.path("gptq-act-order")
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in source.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=r"layers\.1\.self_attn\.[qk]_proj\.g_idx'.*g_idx of shard '[qk]' differs from "
        r"shard '[qk]''s: the fused shards \['q', 'k', 'v'\] must share one act-order",
    ):
        LLM(str(broken), device="cpu", max_model_len=64)


def test_quantization_contradicting_the_checkpoint_is_refused(quantized: Quantized) -> None:
    with pytest.raises(ValueError, match=r"quantization='gptq' contradicts .*quant_method 'awq'"):
        LLM(str(quantized.path("awq-g32")), device="cpu", quantization="gptq")
    with pytest.raises(ValueError, match=r"quantization='none' contradicts"):
        LLM(str(quantized.path("awq-g32")), device="cpu", quantization="none")
    # A compressed-tensors fp8 checkpoint runs as fp8 too.
    llm = LLM(
        str(quantized.path("ct-fp8-channel")), device="cpu", quantization="fp8", max_model_len=32
    )
    assert llm.engine.model_config.quantization_name == "compressed-tensors"


def test_serve_awq_on_a_float_checkpoint_exits_2(checkpoints: Any) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfleet_cli",
            "serve",
            "--model",
            str(checkpoints.path("llama3")),
            "--device",
            "cpu",
            "--quantization",
            "awq",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2
    assert "quantization='awq' needs a checkpoint quantized with it" in done.stderr
    assert "Traceback" not in done.stderr


def test_fp8_refused_on_a_gpu_before_ada(monkeypatch: pytest.MonkeyPatch, checkpoints: Any) -> None:
    from kvfleet_engine.config import EngineConfig
    from kvfleet_engine.models.loader import load_model

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    config = EngineConfig.create(str(checkpoints.path("llama3")), quantization="fp8")
    with pytest.raises(
        ValueError,
        match=r"fp8 needs compute capability >= 8\.9, device NVIDIA A100-SXM4-80GB has 8\.0",
    ):
        load_model(config.model, torch.device("cuda:0"), torch.bfloat16)


def test_unknown_quantization_setting(checkpoints: Any) -> None:
    with pytest.raises(ValueError, match=r"quantization must be auto .* \| awq \| gptq"):
        LLM(str(checkpoints.path("llama3")), device="cpu", quantization="int3")


# ---- checkpoints written by the real tools (tests/engine/quant_checkpoints.py) ----------------

TOOL_CHECKPOINTS = [
    ("llama3", "gptq-w4a16"),
    ("qwen2", "gptq-w4a16-asym"),
    ("llama3", "gptq-w4a16-actorder"),
    ("qwen3", "awq-w4a16"),
    ("llama3", "fp8-dynamic"),
    ("qwen2", "w8a16"),
    ("llama2-tied", "w8a16-channel"),
]


@pytest.mark.parametrize(("arch", "scheme"), TOOL_CHECKPOINTS, ids=lambda v: str(v))
def test_llmcompressor_checkpoint_matches_transformers_reading_it(
    quantized_checkpoints: Any, arch: str, scheme: str
) -> None:
    """llmcompressor's compressed-tensors files: the same tokens and logits as transformers
    decompressing them (compressed-tensors' own unpacking; fp8 activations rounded per token)."""
    path = quantized_checkpoints.path(arch, scheme)
    reference = quantized_checkpoints.reference(arch, scheme)
    llm = LLM(str(path), device="cpu", max_model_len=256)
    assert llm.engine.model_config.quantization_name == "compressed-tensors"
    references = [reference_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    _assert_matches(_generate(llm), references, f"{arch} {scheme}")


@pytest.mark.slow
def test_autoawq_checkpoint_matches_autoawqs_dequantization(quantized_checkpoints: Any) -> None:
    """AutoAWQ's own GEMM files (about a minute to write; saved as float16, run in float32 like
    the reference). AutoAWQ dequantizes in float16, (q - z) * s rounded to 11 bits, where the
    engine's float32 product is exact: logits agree to 2e-3."""
    path = quantized_checkpoints.path("llama3", "autoawq-gemm")
    reference = quantized_checkpoints.reference("llama3", "autoawq-gemm")
    llm = LLM(str(path), device="cpu", max_model_len=256, dtype="float32")
    assert llm.engine.model_config.quantization_name == "awq"
    references = [reference_greedy(reference, prompt, MAX_TOKENS) for prompt in PROMPTS]
    _assert_matches(_generate(llm), references, "autoawq", atol=2e-3)
