"""`kv_cache_calibration`: an fp8 cache's K rounded toward the queries (`layers.kv_shaping`) by a
file of query moments (`bench.calibrate_kv`, `runner.kv_calibration`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_cases import random_prompts
from engine_checkpoints import Checkpoints
from parallel_cases import SETTINGS, assert_same_greedy, generate_twice

from kvfleet_engine import SamplingParams
from kvfleet_engine.bench import calibrate_kv
from kvfleet_engine.layers import attention_torch, kv_shaping
from kvfleet_engine.runner import kv_calibration

E4M3 = torch.float8_e4m3fn


def _codes() -> torch.Tensor:  # every finite e4m3 value, ascending
    values = torch.arange(256, dtype=torch.uint8).view(E4M3).float()
    return values[values.isfinite()].unique()


def test_other_code_is_the_code_on_the_far_side_of_the_value() -> None:
    scaled = torch.cat([torch.linspace(-448, 448, 100_001), torch.tensor([0.0, 1e-4, -1e-4])])
    nearest = scaled.to(E4M3).float()
    other = kv_shaping.other_code(scaled, nearest)
    low, high = torch.minimum(nearest, other), torch.maximum(nearest, other)
    assert bool(((low <= scaled) & (scaled <= high)).all())
    on_a_code = nearest == scaled
    assert bool((other[on_a_code] == nearest[on_a_code]).all())
    codes = _codes()  # otherwise the two are neighbours on e4m3's grid
    index = torch.searchsorted(codes, low[~on_a_code])
    assert bool((codes[index + 1] == high[~on_a_code]).all())


def _keys_and_queries(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, kv_shaping.KMoment]:
    """Keys [64, 2, 32]; queries [4096, 2 kv heads, 2, 32] that share a direction per kv head
    (as real models' do); the moment of their first half, over its trace, factored."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(64, 2, 32, generator=generator)
    shared = torch.randn(2, 1, 32, generator=generator) * 3
    queries = torch.randn(4096, 2, 2, 32, generator=generator) + shared[None]
    moment = kv_shaping.query_moment(queries[:2048].reshape(2048, 4, 32), 2)
    moment = moment / torch.diagonal(moment, dim1=1, dim2=2).sum(-1)[:, None, None]
    return keys, queries, kv_shaping.factor(moment)


def _score_error(keys: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, queries) -> float:
    """The mean square of q . (stored key - key) over queries and keys."""
    error = attention_torch.dequantize_kv(codes, scales) - keys  # [keys, kv heads, dim]
    return float(torch.einsum("qhgd,khd->qhgk", queries, error).pow(2).mean())


def test_shaped_keys_score_closer_for_the_queries_they_were_shaped_for() -> None:
    keys, queries, moment = _keys_and_queries()
    nearest, scales = attention_torch.quantize_kv(keys)
    shaped = kv_shaping.shaped_e4m3(keys, nearest, scales, moment)
    fresh = queries[2048:]  # queries the moment did not see
    assert _score_error(keys, shaped, scales, fresh) < 0.7 * _score_error(
        keys, nearest, scales, fresh
    )
    # Each element stays on one of the two codes around it, and the scales are the nearest's.
    codes = _codes()
    moved = shaped.float() != nearest.float()
    assert 0 < int(moved.sum()) <= kv_shaping.SHAPE_STEPS * keys.shape[0] * keys.shape[1]
    scaled = keys * (1.0 / scales.float())[..., None]
    other = kv_shaping.other_code(scaled, nearest.float())
    assert bool((shaped.float()[moved] == other[moved]).all())
    assert bool(torch.isin(shaped.float(), codes).all())


def test_no_moment_no_moves() -> None:
    keys, _, moment = _keys_and_queries()
    nearest, scales = attention_torch.quantize_kv(keys)
    zero = kv_shaping.KMoment(torch.zeros_like(moment.factors), torch.zeros_like(moment.isotropic))
    keys[:, :, ::4] = -0.0  # a -0 code stays -0
    nearest, scales = attention_torch.quantize_kv(keys)
    shaped = kv_shaping.shaped_e4m3(keys, nearest, scales, zero)
    assert torch.equal(shaped.view(torch.uint8), nearest.view(torch.uint8))


def test_the_factored_moment_keeps_the_top_eigenpairs_and_the_trace() -> None:
    """M ~ W W^T + s I: exact for a moment of rank <= SHAPE_RANK plus a multiple of I; for any
    moment the same top eigenvalues and the same trace."""
    generator = torch.Generator().manual_seed(5)
    dim, rank = 32, kv_shaping.SHAPE_RANK
    low = torch.randn(2, dim, rank, generator=generator)
    exact = low @ low.mT + 0.25 * torch.eye(dim)
    assert torch.allclose(kv_shaping.factor(exact).dense(), exact, atol=1e-4)
    spread = torch.randn(2, dim, dim, generator=generator)
    moment = spread @ spread.mT
    dense = kv_shaping.factor(moment).dense()
    top = torch.linalg.eigvalsh(moment)[..., -rank:]
    assert torch.allclose(torch.linalg.eigvalsh(dense)[..., -rank:], top, rtol=1e-4, atol=1e-3)
    traces = [torch.diagonal(m, dim1=1, dim2=2).sum(-1) for m in (dense, moment)]
    assert torch.allclose(traces[0], traces[1], rtol=1e-4)
    # A head smaller than the rank keeps all of M (a power-of-two rank the kernels can tile).
    small = spread[:, :6, :6] @ spread[:, :6, :6].mT
    factored = kv_shaping.factor(small)
    assert factored.factors.shape == (2, 6, 4) and bool(factored.isotropic.isfinite().all())
    assert kv_shaping.factor(moment, rank=6).factors.shape == (2, dim, 4)  # a power of two
    assert torch.allclose(kv_shaping.factor(small[:, :4, :4]).dense(), small[:, :4, :4], atol=1e-4)


@pytest.fixture(scope="module")
def calibration(checkpoints: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("calibration") / "llama3.kv-calibration.safetensors"
    model = str(checkpoints.path("llama3"))
    assert calibrate_kv.main([model, "--output", str(output), "--tokens", "256"]) == 0
    return output


def test_calibrate_kv_writes_one_moment_per_layer(calibration: Path, make_llm) -> None:
    moments, metadata = kv_calibration.load(str(calibration))
    layers = make_llm("llama3").engine.model_runner.attention_layers
    assert metadata["tokens"] == "256" and int(metadata["num_layers"]) == len(layers) == len(
        moments
    )
    for moment, layer in zip(moments, layers, strict=True):
        assert moment.shape == (layer.num_kv_heads, layer.head_dim, layer.head_dim)
        traces = torch.diagonal(moment, dim1=1, dim2=2).sum(-1)
        assert torch.allclose(traces, torch.ones_like(traces))
        assert torch.allclose(moment, moment.transpose(1, 2))


def _k_codes(llm: Any, prompt: list[int]) -> torch.Tensor:
    """The first layer's K codes of the prompt's tokens, as the cache holds them after it ran."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False)
    layer = llm.engine.model_runner.attention_layers[0]
    blocks = -(-len(prompt) // layer.k_cache.shape[1])
    # A fresh engine places its one request in its first blocks (the block pool's order).
    return layer.k_cache[:blocks].flatten(0, 1)[: len(prompt)].float().cpu()


DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="gpu",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_the_engine_stores_k_shaped_by_the_calibration(
    calibration: Path, make_llm: Callable[..., Any], device: str
) -> None:
    prompt = random_prompts([48], seed=3)[0]
    settings = {"device": device, "kv_cache_dtype": "fp8", "enable_prefix_caching": False}
    plain = make_llm("llama3", **settings)
    shaped = make_llm("llama3", kv_cache_calibration=str(calibration), **settings)
    layer = shaped.engine.model_runner.attention_layers[0]
    assert layer.k_moment is not None and layer.rotary_decode_attention is None
    nearest, codes = _k_codes(plain, prompt), _k_codes(shaped, prompt)
    moved = nearest != codes
    assert int(moved.sum()) > 0
    # Moves go to the neighbouring code: never more than one e4m3 step away.
    grid = _codes()
    steps = (
        torch.searchsorted(grid, codes[moved]) - torch.searchsorted(grid, nearest[moved])
    ).abs()
    assert bool((steps == 1).all())


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"kv_cache_dtype": "auto"}, "used with kv_cache_dtype fp8"),
        ({"kv_cache_dtype": "int8"}, "used with kv_cache_dtype fp8"),
    ],
)
def test_calibration_needs_an_fp8_cache(
    calibration: Path, make_llm: Callable[..., Any], settings: dict[str, Any], says: str
) -> None:
    with pytest.raises(ValueError, match="kv_cache_calibration") as raised:
        make_llm("llama3", kv_cache_calibration=str(calibration), **settings)
    assert says in str(raised.value)


def test_a_calibration_file_must_be_one_and_fit_the_model(
    calibration: Path, make_llm: Callable[..., Any], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="must be an existing file"):
        make_llm("llama3", kv_cache_dtype="fp8", kv_cache_calibration=str(tmp_path / "missing"))
    from safetensors.torch import save_file

    other = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(other))
    with pytest.raises(ValueError, match="not a KV calibration file"):
        make_llm("llama3", kv_cache_dtype="fp8", kv_cache_calibration=str(other))
    moments, _ = kv_calibration.load(str(calibration))
    fewer = tmp_path / "fewer.safetensors"
    kv_calibration.save(fewer, moments[:-1], "fewer", 256)
    with pytest.raises(ValueError, match=rf"{len(moments) - 1} layers, the model has"):
        make_llm("llama3", kv_cache_dtype="fp8", kv_cache_calibration=str(fewer))


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_ranks_round_by_their_part_of_the_file(
    calibration: Path, world: Callable[..., Any], make_llm: Callable[..., Any], tp: int, pp: int
) -> None:
    """Each rank binds its kv heads' (TP) or its layers' (PP) moments: the greedy tokens are one
    rank's, and rank 0's first layer holds the file's first kv head."""
    settings = dict(SETTINGS, kv_cache_dtype="fp8", kv_cache_calibration=str(calibration))
    reference = generate_twice(make_llm("llama3", **settings))
    llm = world("llama3", tp, pp, kv_cache_dtype="fp8", kv_cache_calibration=str(calibration))
    assert_same_greedy(generate_twice(llm), reference, f"calibrated tp{tp} pp{pp}")
    moments, _ = kv_calibration.load(str(calibration))
    first = llm.engine.model_runner.attention_layers[0]
    assert first.k_moment is not None
    want = kv_shaping.factor(moments[0][: first.num_kv_heads])
    assert torch.equal(first.k_moment.factors.cpu(), want.factors)
    assert torch.equal(first.k_moment.isotropic.cpu(), want.isotropic)
