"""On the GPU (bf16, the quant_matmul kernels): each quantized layer's product matches layout.py's
reference on the same packed weights, and each checkpoint layout's greedy tokens match
transformers running its dequantized weights, ties judged at bf16 tolerance. Marked `gpu`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import assert_greedy_equal, random_prompts, reference_greedy, write_checkpoint
from quant_pack import add_fp8_activation_hooks, write_quantized_checkpoint

from kvfleet_engine import LLM, SamplingParams
from kvfleet_engine.quant.config import WeightScheme
from kvfleet_engine.quant.layout import (
    fp8_linear_reference,
    fp8_weight_only_reference,
    int4_linear_reference,
    int8_linear_reference,
)
from kvfleet_engine.quant.linear import QuantLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16_TIE = 0.1  # as tests/engine/test_gpu.py: a logit gap below this is a tie in bf16
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "awq": ("llama3", dict(method="awq", group_size=32, symmetric=False)),
    "gptq-act-order": ("qwen2", dict(method="gptq", group_size=32, act_order=True)),
    "ct-int4-asym": ("qwen3", dict(method="ct-int4", group_size=64, symmetric=False)),
    "ct-int8": ("llama3", dict(method="ct-int8", group_size=0)),
    "ct-fp8": ("mistral", dict(method="ct-fp8")),
}


def _filled_layer(scheme: WeightScheme, in_features: int, out_features: int) -> QuantLinear:
    """A QuantLinear for a float weight, loaded and packed on the GPU."""
    layer = QuantLinear(in_features, {}, out_features, True, scheme, torch.bfloat16).cuda()
    torch.manual_seed(0)
    layer.weight.data.normal_(0, 0.05)
    layer.bias.data.normal_(0, 0.1)
    layer.finish_loading()
    return layer


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_layer_matches_its_reference(kind: str, rows: int) -> None:
    layer = _filled_layer(WeightScheme(kind, "float"), 512, 384)
    x = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    if kind == "int8":
        expected = int8_linear_reference(x, layer.packed, layer.bias)
        torch.testing.assert_close(layer(x), expected, rtol=2e-2, atol=2e-2)
        return
    # The kernel module is imported here, not at collection: imported natively before
    # tests/kernels switch Triton to its interpreter, its kernels would not run there.
    from kvfleet_engine.kernels.fp8_gemv import GEMV_MAX_ROWS

    # fp8: decode-sized batches multiply x as it is, larger ones quantize it per token (W8A8);
    # W8A8's rounding of x costs ~3% relative error, so the wrong path fails the 1% bound.
    reference = fp8_weight_only_reference if rows <= GEMV_MAX_ROWS else fp8_linear_reference
    expected = reference(x, layer.packed, layer.bias).float()
    error = (layer(x).float() - expected).norm() / expected.norm()
    assert error < 1e-2, f"{rows} rows: relative error {error:.4f} against {reference.__name__}"


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_act_order_layer_matches_its_reference(tmp_path: Path, rows: int) -> None:
    """Through a whole GPTQ act-order checkpoint: the perm gather happens before the kernel."""
    model = write_checkpoint("llama3", tmp_path / "float", seed=1)
    write_quantized_checkpoint(model, tmp_path / "q", method="gptq", group_size=32, act_order=True)
    llm = LLM(str(tmp_path / "q"), device="cuda", dtype="bfloat16", max_model_len=64)
    layer = llm.engine.model_runner.model.model.layers[0].mlp.down_proj
    assert layer.packed.perm is not None
    x = torch.randn(rows, layer.in_features, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        layer(x), int4_linear_reference(x, layer.packed), rtol=2e-2, atol=2e-2
    )


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_quantized_greedy_matches_dequantized_transformers(tmp_path: Path, name: str) -> None:
    arch, keywords = CHECKPOINTS[name]
    model = write_checkpoint(arch, tmp_path / "float", seed=2, max_position_embeddings=2048)
    model = write_quantized_checkpoint(model, tmp_path / name, **keywords)
    if keywords["method"] == "ct-fp8":
        add_fp8_activation_hooks(model)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    prompts = random_prompts([1, 17, 120, 300], seed=4)
    llm = LLM(str(tmp_path / name), dtype="bfloat16", device="cuda", max_model_len=1024)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref = reference_greedy(model, prompt, GREEDY.max_tokens)
        assert_greedy_equal(output.outputs[0].token_ids, ref, f"{name} {len(prompt)}", BF16_TIE)


def test_fp8_rows_from_the_norms_change_no_token(tmp_path: Path, monkeypatch) -> None:
    """Norms handing the fp8 linears their rows quantized give the tokens of quantizing in the
    product (the same e4m3 rows); 40 and 300 prompt tokens take W8A8. Prefix caching off: the
    second run computes its prompts again instead of reading the first run's cache."""
    from kvfleet_engine.kernels import quant_matmul

    write_checkpoint("llama3", tmp_path / "float", seed=3)
    prompts = random_prompts([40, 300], seed=6)
    llm = LLM(
        str(tmp_path / "float"),
        dtype="bfloat16",
        device="cuda",
        max_model_len=512,
        quantization="fp8",
        enforce_eager=True,
        enable_prefix_caching=False,
    )
    model = llm.engine.model_runner.model
    norms = [m for m in model.modules() if getattr(m, "fp8_rows_out", False)]
    assert len(norms) == 2 * len(model.model.layers)
    calls = []
    rows_matmul = quant_matmul.fp8_rows_matmul
    monkeypatch.setattr(
        quant_matmul, "fp8_rows_matmul", lambda rows, *a: calls.append(1) or rows_matmul(rows, *a)
    )
    tokens, rows_products = [], []
    for fp8_rows_out in (True, False):
        for norm in norms:
            norm.fp8_rows_out = fp8_rows_out
        calls.clear()
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
        assert all(o.num_cached_tokens == 0 for o in outputs)
        rows_products.append(len(calls))
    assert rows_products[0] >= len(norms) and rows_products[1] == 0
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantized_at_load_on_the_gpu_runs_under_cuda_graphs(tmp_path: Path, method: str) -> None:
    """Graphs on and off agree (the kernels capture)."""
    write_checkpoint("llama3", tmp_path / "float", seed=3)
    prompts = random_prompts([5, 40], seed=5)
    tokens = []
    for eager in (False, True):
        llm = LLM(
            str(tmp_path / "float"),
            dtype="bfloat16",
            device="cuda",
            max_model_len=256,
            quantization=method,
            enforce_eager=eager,
        )
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outputs])
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_shared_prefix_steps_of_quantized_models_are_the_same_with_and_without_pdl(
    tmp_path: Path, monkeypatch, method: str
) -> None:
    """Quantized linears launch every kernel with PDL, the shared-prefix pair among them (the
    split kernel starts while the prefix kernel runs and waits only before merging its
    partials, `kernels.pdl`). 24 prompts behind one cached 600-token prefix, 96 tokens a step:
    mixed steps, then decodes in the shared-prefix graphs. PDL changes when kernels start,
    never what they compute: the tokens are identical with it off and on."""
    from kvfleet_engine.kernels import pdl

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("PDL needs compute capability 9.0")
    write_checkpoint("llama3", tmp_path / "float", seed=3, max_position_embeddings=2048)
    prefix, *tails = random_prompts([600, *range(5, 29)], seed=36)
    prompts = [prefix + tail for tail in tails]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv(pdl.PDL_ENV, setting)
        pdl.enabled.cache_clear()
        llm = LLM(
            str(tmp_path / "float"),
            dtype="bfloat16",
            device="cuda",
            max_model_len=1024,
            max_num_seqs=32,
            max_num_batched_tokens=96,
            quantization=method,
        )
        executor = llm.engine.model_runner.executor
        assert pdl.pair_options(executor.device)["PDL"] == (setting == "1")
        assert pdl.enabled(executor.device) == (setting == "1")
        llm.generate(prompt_token_ids=[prefix], sampling_params=params, use_tqdm=False)
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[setting] = [list(o.outputs[0].token_ids) for o in outputs]
        # The last shared-prefix replay read the prefix's 37 full blocks once.
        assert int(executor.decode_graphs.shared[0]) == 37 * 16
        del llm, executor, outputs
        torch.cuda.empty_cache()
    pdl.enabled.cache_clear()
    assert tokens["1"] == tokens["0"]
