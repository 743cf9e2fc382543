"""The `quantization` setting and a checkpoint's `quantization_config`, resolved into one scheme per
linear layer. Pure (no torch): config.py reads it at the edge."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvfleet_engine.config.checks import is_int

METHODS = ("none", "fp8", "int8", "awq", "gptq", "compressed-tensors", "gguf")
# The operator's names (InferenceDeployment quantization.weights) for the int4 methods.
ALIASES = {"int4-awq": "awq", "int4-gptq": "gptq"}
INT4_GROUP_SIZES = (32, 64, 128)
# GGML types whose blocks stay quantized (as these kinds, group 32); other types dequantize.
GGUF_KINDS = {"Q8_0": "int8", "Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4"}
GGUF_GROUP_SIZE = 32
_SUPPORTED_BITS = "4 (group 32, 64 or 128) or 8"


@dataclass(frozen=True)
class WeightScheme:
    """How one linear's weights are stored in the checkpoint and what they run as."""

    # What the weights run as: "fp8" (W8A8, activations quantized per token) | "int8" (W8A16)
    # | "int4" (W4A16).
    kind: str
    # Where the tensors come from: "float" (a float weight quantized at load) | "awq" (AutoAWQ
    # GEMM) | "gptq" (auto-gptq / GPTQModel) | "ct-float" (e4m3 + scales: compressed-tensors
    # float-quantized, or quant_method fp8) | "ct-int" (compressed-tensors int-quantized)
    # | "ct-pack" (compressed-tensors pack-quantized) | "gguf" (GGUF blocks, repacked by the
    # loader into the canonical codes / scales / offsets).
    layout: str
    # Input columns per scale; None: one scale per output channel (or per tensor).
    group_size: int | None = None
    # Zero point fixed at the middle of the code range (no zero-point tensor).
    symmetric: bool = True
    # GPTQ v1 checkpoints store zero - 1 in qzeros (GPTQModel's gptq_v2 stores the zero).
    zeros_minus_one: bool = False


@dataclass(frozen=True)
class QuantConfig:
    """The resolved setting: a method name and the scheme of each checkpoint linear."""

    # One of METHODS except "none".
    method: str
    # (targets, scheme): a checkpoint module name takes the scheme of the first group whose
    # target matches it ("Linear": every linear; "re:<regex>": re.match; else the exact name).
    groups: tuple[tuple[tuple[str, ...], WeightScheme], ...]
    # Checkpoint module names left unquantized (same matching as targets; AWQ's
    # modules_to_not_convert match as substrings).
    ignore: tuple[str, ...] = ()
    # The checkpoint quantizes lm_head too (otherwise it stays in the serving dtype).
    quantize_lm_head: bool = False
    # Applies on CUDA only; other devices load plain weights (GGUF with quantization auto).
    cuda_only: bool = False
    # A fused layer whose checkpoint layers differ stays unquantized instead of being an error
    # (GGUF files choose a type per tensor: Q4_K_M has Q6_K v_proj in some layers).
    unquantized_when_mixed: bool = False

    def scheme_for(self, name: str) -> WeightScheme | None:
        """The scheme of the checkpoint linear `name` (e.g. model.layers.0.self_attn.q_proj),
        None when it stays unquantized."""
        if name == "lm_head" and not self.quantize_lm_head:
            return None
        if any(_matches(name, pattern) for pattern in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(target == "Linear" or _matches(name, target) for target in targets):
                return scheme
        return None

    @property
    def kinds(self) -> frozenset[str]:
        return frozenset(scheme.kind for _, scheme in self.groups)


def resolve_quantization(
    requested: str | None, hf_config: dict[str, Any] | None
) -> QuantConfig | None:
    """The quantization to run: `requested` (None or "auto": whatever the checkpoint says)
    checked against the checkpoint's `quantization_config` (hf_config None: a GGUF file).
    None means plain weights."""
    requested = ALIASES.get(requested or "", requested)
    if requested is not None and requested != "auto" and requested not in METHODS:
        raise ValueError(
            f"quantization must be one of auto, {', '.join(METHODS)}, got {requested!r}"
        )
    stored = (hf_config or {}).get("quantization_config")
    if stored is not None and not isinstance(stored, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {stored!r:.80}")
    if requested == "gguf":
        raise ValueError(
            "quantization='gguf' needs a GGUF file; the model is a safetensors directory"
        )
    if stored is None:
        if requested in ("awq", "gptq", "compressed-tensors"):
            raise ValueError(
                f"quantization={requested!r} needs a checkpoint quantized with it, but the "
                "checkpoint has no quantization_config (fp8 and int8 quantize a float "
                "checkpoint at load)"
            )
        if requested == "fp8":
            return QuantConfig("fp8", ((("Linear",), WeightScheme("fp8", "float")),))
        if requested == "int8":
            return QuantConfig("int8", ((("Linear",), WeightScheme("int8", "float")),))
        return None
    config = checkpoint_quantization(stored)
    if requested in (None, "auto") or requested in _accepted_names(config):
        return config
    raise ValueError(
        f"quantization={requested!r} contradicts the checkpoint's quantization_config "
        f"(quant_method {stored.get('quant_method')!r}, which runs as {config.method!r}); "
        "leave quantization unset to use the checkpoint's"
    )


def resolve_gguf_quantization(
    requested: str | None, linear_types: dict[str, str], file_name: str
) -> QuantConfig | None:
    """The quantization of a GGUF file's linears (linear_types: module name -> GGML type name):
    None or "auto" keeps the GGUF_KINDS blocks quantized on CUDA (the CPU dequantizes: faster
    there, and exact); "gguf" keeps them on every device; "none" dequantizes everything. Other
    methods are ValueErrors: the file's tensors carry their own formats."""
    requested = ALIASES.get(requested or "", requested)
    if requested == "none":
        return None
    if requested not in (None, "auto", "gguf"):
        if requested not in METHODS:
            raise ValueError(
                f"quantization must be one of auto, {', '.join(METHODS)}, got {requested!r}"
            )
        types = ", ".join(sorted(set(linear_types.values())))
        raise ValueError(
            f"quantization={requested!r} does not apply to the GGUF file {file_name} (its tensors "
            f"are {types}); use auto (blocks stay quantized on CUDA), gguf (on every device) or "
            "none (dequantized at load)"
        )
    groups = []
    for kind in ("int4", "int8"):
        names = tuple(name for name, t in linear_types.items() if GGUF_KINDS.get(t) == kind)
        if names:
            scheme = WeightScheme(
                kind, "gguf", group_size=GGUF_GROUP_SIZE, symmetric=kind == "int8"
            )
            groups.append((names, scheme))
    if not groups:
        return None
    return QuantConfig(
        "gguf", tuple(groups), cuda_only=requested != "gguf", unquantized_when_mixed=True
    )


def checkpoint_quantization(stored: dict[str, Any]) -> QuantConfig:
    """A config.json `quantization_config` as a QuantConfig; unsupported formats, bit widths and
    group sizes are ValueErrors naming them."""
    method = stored.get("quant_method")
    if method == "awq":
        return _awq(stored)
    if method == "gptq":
        return _gptq(stored)
    if method == "compressed-tensors":
        return _compressed_tensors(stored)
    if method == "fp8":
        return _fp8(stored)
    raise ValueError(
        f"checkpoint quant_method {method!r} is not supported; supported: awq, gptq, "
        "compressed-tensors, fp8"
    )


def _accepted_names(config: QuantConfig) -> set[str]:
    """The `quantization` values that agree with a checkpoint's config."""
    names = {config.method}
    if config.method == "compressed-tensors" and len(config.kinds) == 1:
        names |= config.kinds & {"fp8", "int8"}
    return names


def _awq(stored: dict[str, Any]) -> QuantConfig:
    bits, group_size = stored.get("bits", stored.get("w_bit")), stored.get("group_size")
    version = str(stored.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; supported: gemm")
    if not stored.get("zero_point", True):
        raise ValueError("AWQ with zero_point false is not supported; supported: zero_point true")
    _check_int(bits, group_size, "AWQ", allow_8=False)
    scheme = WeightScheme("int4", "awq", group_size=group_size, symmetric=False)
    names = _names(stored.get("modules_to_not_convert"), "AWQ modules_to_not_convert")
    ignore = tuple(f"re:.*{re.escape(name)}" for name in names)
    return QuantConfig("awq", ((("Linear",), scheme),), ignore=ignore)


def _gptq(stored: dict[str, Any]) -> QuantConfig:
    bits, group_size = stored.get("bits"), stored.get("group_size")
    checkpoint_format = str(stored.get("checkpoint_format", stored.get("format", "gptq")))
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"GPTQ checkpoint_format {checkpoint_format!r} is not supported; supported: gptq, "
            "gptq_v2"
        )
    symmetric = bool(stored.get("sym", True))
    _check_int(
        bits, None if group_size == -1 else group_size, "GPTQ", allow_8=True
    )  # -1: per channel
    if bits == 8 and not symmetric:
        raise ValueError("GPTQ 8-bit with sym false is not supported; supported: 8-bit sym")
    if bits == 8 and stored.get("desc_act"):
        raise ValueError("GPTQ 8-bit with desc_act is not supported; supported: 4-bit desc_act")
    scheme = WeightScheme(
        "int4" if bits == 4 else "int8",
        "gptq",
        group_size=None if group_size == -1 else group_size,
        symmetric=symmetric,
        zeros_minus_one=checkpoint_format == "gptq",
    )
    return QuantConfig(
        "gptq", ((("Linear",), scheme),), quantize_lm_head=bool(stored.get("lm_head", False))
    )


def _fp8(stored: dict[str, Any]) -> QuantConfig:
    if stored.get("weight_block_size"):
        raise ValueError(
            f"fp8 weight_block_size {stored['weight_block_size']} (block-wise scales) is not "
            "supported; supported: per-tensor or per-channel weight_scale"
        )
    key = "ignored_layers" if stored.get("ignored_layers") else "modules_to_not_convert"
    ignore = _names(stored.get(key), f"fp8 {key}")
    return QuantConfig("fp8", ((("Linear",), WeightScheme("fp8", "ct-float")),), ignore=ignore)


def _compressed_tensors(stored: dict[str, Any]) -> QuantConfig:
    default_format = stored.get("format")
    groups = []
    config_groups = _object(stored.get("config_groups") or {}, "compressed-tensors config_groups")
    for name, group in config_groups.items():
        where = f"compressed-tensors group {name!r}"
        weights = _object(group, where).get("weights")
        if weights is None:
            raise ValueError(f"{where} has no weights scheme")
        groups.append(
            (
                _names(group.get("targets"), f"{where} targets"),
                _ct_scheme(group.get("format") or default_format, _object(weights, where)),
            )
        )
    if not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    if stored.get("kv_cache_scheme"):
        raise ValueError(
            "compressed-tensors kv_cache_scheme is not supported; use kv_cache_dtype instead"
        )
    return QuantConfig(
        "compressed-tensors",
        tuple(groups),
        ignore=_names(stored.get("ignore"), "compressed-tensors ignore"),
        quantize_lm_head=True,  # lm_head is quantized when a target matches and ignore doesn't
    )


def _ct_scheme(format_name: str | None, weights: dict[str, Any]) -> WeightScheme:
    num_bits, kind = weights.get("num_bits"), weights.get("type", "int")
    strategy, group_size = weights.get("strategy"), weights.get("group_size")
    symmetric = bool(weights.get("symmetric", True))
    if kind == "float":
        if format_name != "float-quantized" or num_bits != 8:
            raise ValueError(
                f"compressed-tensors float weights in format {format_name!r} with {num_bits} "
                "bits are not supported; supported: float-quantized 8-bit (fp8 e4m3)"
            )
        if strategy not in ("tensor", "channel"):
            raise ValueError(
                f"compressed-tensors fp8 strategy {strategy!r} is not supported; supported: "
                "tensor, channel"
            )
        return WeightScheme("fp8", "ct-float")
    if strategy not in ("tensor", "channel", "group"):
        raise ValueError(
            f"compressed-tensors weight strategy {strategy!r} is not supported; supported: "
            "tensor, channel, group"
        )
    group = group_size if strategy == "group" else None
    if format_name in ("int-quantized", "naive-quantized") and num_bits == 8:
        if not symmetric:
            raise ValueError(
                "compressed-tensors int8 with symmetric false is not supported; supported: "
                "symmetric int8"
            )
        _check_int(num_bits, group, "compressed-tensors", allow_8=True)
        return WeightScheme("int8", "ct-int", group_size=group)
    if format_name == "pack-quantized" and num_bits == 8:  # llmcompressor's W8A16
        if not symmetric:
            raise ValueError(
                "compressed-tensors int8 with symmetric false is not supported; supported: "
                "symmetric int8"
            )
        _check_int(num_bits, group, "compressed-tensors", allow_8=True)
        return WeightScheme("int8", "ct-pack", group_size=group)
    if format_name == "pack-quantized":
        _check_int(num_bits, group, "compressed-tensors", allow_8=False)
        if weights.get("actorder") not in (None, False, "weight", "group"):
            raise ValueError(f"compressed-tensors actorder {weights['actorder']!r} is unknown")
        return WeightScheme("int4", "ct-pack", group_size=group, symmetric=symmetric)
    raise ValueError(
        f"compressed-tensors format {format_name!r} with {num_bits}-bit {kind} weights is not "
        "supported; supported: float-quantized (fp8), int-quantized (int8), pack-quantized (int4)"
    )


def _check_int(bits: Any, group_size: Any, source: str, allow_8: bool) -> None:
    if not is_int(bits):
        raise ValueError(f"{source} bits must be an integer, got {bits!r:.80}")
    if group_size is not None and not is_int(group_size):
        raise ValueError(f"{source} group_size must be an integer, got {group_size!r:.80}")
    if bits == 8 and allow_8:
        if group_size is not None and (group_size <= 0 or group_size % 8):
            raise ValueError(
                f"{source} 8-bit group size {group_size} is not supported; supported: a "
                "multiple of 8, or per channel"
            )
        return
    if bits != 4:
        supported = _SUPPORTED_BITS if allow_8 else "4 (group 32, 64 or 128)"
        raise ValueError(f"{source} {bits}-bit weights are not supported; supported: {supported}")
    if group_size not in INT4_GROUP_SIZES:
        what = "per-channel scales are" if group_size is None else f"group size {group_size} is"
        raise ValueError(
            f"{source} 4-bit {what} not supported; supported: group size "
            f"{', '.join(map(str, INT4_GROUP_SIZES))}"
        )


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a JSON object, got {value!r:.80}")
    return value


def _names(value: Any, where: str) -> tuple[str, ...]:
    """A list of module names or patterns (null: none); a "re:" pattern must compile."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise ValueError(f"{where} must be a list of module names, got {value!r:.80}")
    for name in value:
        if name.startswith("re:"):
            try:
                re.compile(name[3:])
            except re.error as exc:
                raise ValueError(f"{where}: {name!r} is not a regular expression: {exc}") from None
    return tuple(value)


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name
