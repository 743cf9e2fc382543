"""The quantization setting against a checkpoint's quantization_config: what each resolves to,
and every unsupported format, bit width and group size refused by name (pure, no torch)."""

from __future__ import annotations

from typing import Any

import pytest

from kvfleet_engine.quant.config import WeightScheme, resolve_quantization

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}


def _ct(weights: dict[str, Any], fmt: str, **extra: Any) -> dict[str, Any]:
    group = {"targets": ["Linear"], "weights": weights, "format": fmt}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": group}, **extra}


W4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}
W8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}


def _resolve(requested: str | None, stored: dict[str, Any] | None) -> Any:
    return resolve_quantization(
        requested, None if stored is None else {"quantization_config": stored}
    )


def test_auto_detects_each_method() -> None:
    awq = _resolve(None, AWQ)
    assert awq.method == "awq"
    assert awq.scheme_for("model.layers.0.mlp.down_proj") == WeightScheme(
        "int4", "awq", group_size=128, symmetric=False
    )
    assert _resolve("int4-awq", AWQ).method == "awq"  # the operator's name
    gptq = _resolve("auto", GPTQ)
    assert gptq.scheme_for("model.layers.0.self_attn.q_proj") == WeightScheme(
        "int4", "gptq", group_size=128, zeros_minus_one=True
    )
    assert gptq.scheme_for("lm_head") is None  # lm_head stays unless the checkpoint says so
    v2 = _resolve(None, {**GPTQ, "checkpoint_format": "gptq_v2", "sym": False})
    assert v2.scheme_for("x.o_proj") == WeightScheme("int4", "gptq", 128, False, False)
    ct = _resolve(None, _ct(W4, "pack-quantized", ignore=["lm_head", "re:.*mlp.down_proj$"]))
    assert ct.scheme_for("model.layers.3.mlp.down_proj") is None
    assert ct.scheme_for("model.layers.3.mlp.up_proj") == WeightScheme("int4", "ct-pack", 128)
    assert ct.scheme_for("lm_head") is None
    assert _resolve(None, _ct(FP8, "float-quantized")).kinds == {"fp8"}
    w8a16 = _resolve("int8", _ct(W8, "pack-quantized"))  # llmcompressor's W8A16 packs int8 too
    assert w8a16.scheme_for("m.q_proj") == WeightScheme("int8", "ct-pack")
    assert _resolve(None, None) is None
    assert _resolve("none", None) is None


def test_fp8_and_int8_quantize_a_float_checkpoint_or_accept_a_matching_one() -> None:
    assert _resolve("fp8", None).scheme_for("m.q_proj") == WeightScheme("fp8", "float")
    assert _resolve("int8", None).scheme_for("m.q_proj") == WeightScheme("int8", "float")
    assert _resolve("fp8", _ct(FP8, "float-quantized")).method == "compressed-tensors"
    assert _resolve("int8", _ct(W8, "int-quantized")).method == "compressed-tensors"
    assert _resolve("fp8", {"quant_method": "fp8"}).method == "fp8"


@pytest.mark.parametrize(
    ("requested", "stored", "message"),
    [
        ("gptq", AWQ, r"quantization='gptq' contradicts .*quant_method 'awq'"),
        ("none", GPTQ, r"quantization='none' contradicts .*quant_method 'gptq'"),
        (
            "fp8",
            _ct(W4, "pack-quantized"),
            r"quantization='fp8' contradicts .*'compressed-tensors'",
        ),
        ("awq", None, r"quantization='awq' needs a checkpoint quantized with it"),
        ("int3", None, r"quantization must be one of auto, none, fp8, int8, awq, gptq"),
    ],
)
def test_contradictions_are_refused(requested: str, stored: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _resolve(requested, stored)


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ({**AWQ, "bits": 3}, r"AWQ 3-bit weights are not supported; supported: 4 \(group 32"),
        (
            {**AWQ, "group_size": 256},
            r"AWQ 4-bit group size 256 is not supported; supported: group size 32, 64, 128",
        ),
        ({**AWQ, "version": "gemv"}, r"AWQ version 'gemv' is not supported; supported: gemm"),
        (
            {**GPTQ, "bits": 2},
            r"GPTQ 2-bit weights are not supported; supported: 4 \(group 32, 64 or 128\) or 8",
        ),
        (
            {**GPTQ, "group_size": -1},
            r"GPTQ 4-bit per-channel scales are not supported; supported: group size 32, 64, 128",
        ),
        ({**GPTQ, "checkpoint_format": "marlin"}, r"checkpoint_format 'marlin' is not supported"),
        ({**GPTQ, "bits": 8, "sym": False}, r"GPTQ 8-bit with sym false is not supported"),
        (
            {"quant_method": "bitsandbytes"},
            r"quant_method 'bitsandbytes' is not supported; supported: awq",
        ),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            r"weight_block_size \[128, 128\]",
        ),
        (_ct(W4, "marlin-24"), r"format 'marlin-24' with 4-bit int weights is not supported"),
        (
            _ct({**W4, "group_size": 16}, "pack-quantized"),
            r"compressed-tensors 4-bit group size 16",
        ),
        (
            _ct({**W4, "strategy": "channel"}, "pack-quantized"),
            r"compressed-tensors 4-bit per-channel scales are not supported",
        ),
        (
            _ct({**W4, "num_bits": 2}, "pack-quantized"),
            r"compressed-tensors 2-bit weights are not supported",
        ),
        (
            _ct({**FP8, "num_bits": 4}, "nvfp4-pack-quantized"),
            r"float weights in format 'nvfp4-pack-quantized'",
        ),
        (
            _ct({**FP8, "strategy": "block"}, "float-quantized"),
            r"fp8 strategy 'block' is not supported",
        ),
        (
            _ct({**W8, "symmetric": False}, "int-quantized"),
            r"int8 with symmetric false is not supported",
        ),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(stored: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _resolve(None, stored)


def test_gptq_8_bit_runs_as_int8() -> None:
    config = _resolve(None, {**GPTQ, "bits": 8, "desc_act": False})
    assert config.scheme_for("m.up_proj") == WeightScheme("int8", "gptq", 128, True, True)


@pytest.mark.parametrize(
    ("stored", "message"),
    [
        ("awq", r"quantization_config must be a JSON object, got 'awq'"),
        (
            {"quant_method": "compressed-tensors", "config_groups": [{"weights": W4}]},
            r"compressed-tensors config_groups must be a JSON object",
        ),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"g": "W4A16"}},
            r"compressed-tensors group 'g' must be a JSON object, got 'W4A16'",
        ),
        (_ct("int4", "pack-quantized"), r"group 'group_0' must be a JSON object, got 'int4'"),
        ({**GPTQ, "bits": 8, "group_size": "a"}, r"GPTQ group_size must be an integer, got 'a'"),
        ({**AWQ, "bits": "4"}, r"AWQ bits must be an integer, got '4'"),
        (
            _ct(W4, "pack-quantized", ignore=["re:["]),
            r"compressed-tensors ignore: 're:\[' is not a regular expression",
        ),
        (
            {
                **_ct(W4, "pack-quantized"),
                "config_groups": {"g": {"targets": "Linear", "weights": W4}},
            },
            r"group 'g' targets must be a list of module names, got 'Linear'",
        ),
        (
            {**AWQ, "modules_to_not_convert": "lm_head"},
            r"AWQ modules_to_not_convert must be a list",
        ),
        ({"quant_method": "fp8", "ignored_layers": [1]}, r"fp8 ignored_layers must be a list"),
    ],
)
def test_malformed_quantization_configs_are_refused_by_name(stored: Any, message: str) -> None:
    """A quantization_config of the wrong JSON shape is a ValueError naming the key, not an
    AttributeError, a TypeError or a re.error from deep in the parsing."""
    with pytest.raises(ValueError, match=message):
        resolve_quantization(None, {"quantization_config": stored})
