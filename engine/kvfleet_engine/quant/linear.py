"""The quantized linear layer that takes the place of a Linear / MergedLinear before weights load.

It holds the checkpoint's tensors in the checkpoint's own layout (`checkpoint_layout` lists
them per layout), one parameter each, every one
carrying its `weight_loader` (a fused q/k/v or gate/up shard fills its slice of each tensor);
`finish_loading()` then converts them to the kernel layout of layout.py and drops them. The
forward runs the quant_matmul kernels on CUDA and layout.py's references on the CPU."""

from __future__ import annotations

from dataclasses import fields
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvfleet_engine.layers.linear import CheckpointSlicer, silu_and_mul
from kvfleet_engine.quant import formats
from kvfleet_engine.quant.checkpoint_layout import CheckpointTensor, checkpoint_tensors
from kvfleet_engine.quant.config import WeightScheme
from kvfleet_engine.quant.layout import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    fp8_linear_reference,
    int4_linear_reference,
    int8_linear_reference,
    pack_int4,
    pack_int8,
    quantize_fp8,
    quantize_int8,
)

if TYPE_CHECKING:
    from kvfleet_engine.kernels.fp8_rows import Fp8Rows

PackedWeight = Int4Weight | Int8Weight | Fp8Weight


class QuantLinear(nn.Module):
    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],  # checkpoint shard -> rows ({}: one unfused checkpoint linear)
        out_features: int,
        bias: bool,
        scheme: WeightScheme,
        dtype: torch.dtype,  # the serving dtype (activations, bias, float weights)
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.scheme = in_features, out_features, scheme
        self.dtype = dtype
        self._offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, rows in shards.items():
            self._offsets[name] = (offset, rows)
            offset += rows
        self._tensors = {
            t.name: t for t in checkpoint_tensors(scheme, in_features, out_features, bias, dtype)
        }
        for t in self._tensors.values():
            if t.kind == "slice" and any(rows % t.pack for _, rows in self._offsets.values()):
                raise ValueError(
                    f"{t.name}: fused shards of {dict(shards)} rows cannot split a tensor packed "
                    f"{t.pack} per int32 along the output features"
                )
            data = torch.empty(t.shape, dtype=t.dtype)
            self.register_parameter(t.name, nn.Parameter(data, requires_grad=False))
        self._equal_first: dict[str, str | None] = {}  # "equal" tensor -> the shard that set it
        self.packed_kind: str | None = None  # "int4" | "int8" | "fp8" once finish_loading ran
        # Cuts a checkpoint tensor down to this layer's part first (tensor parallelism).
        self.checkpoint_slicer: CheckpointSlicer | None = None
        self.attach_weight_loaders()

    def shard_offsets(self) -> dict[str, tuple[int, int]]:
        """Checkpoint shard name -> (row offset, rows) inside the fused output features."""
        return self._offsets

    @property
    def checkpoint_layout(self) -> dict[str, CheckpointTensor]:
        """The checkpoint tensors this layer reads, by name (what a tensor-parallel split cuts)."""
        return dict(self._tensors)

    def attach_weight_loaders(self) -> None:
        """Give each parameter its loader (again after to_empty, which makes new parameters)."""
        for name, param in self.named_parameters(recurse=False):
            spec = self._tensors[name]
            param.weight_loader = partial(self._load, spec)  # type: ignore[attr-defined]
            param.optional = spec.optional  # type: ignore[attr-defined]

    # ---- loading -------------------------------------------------------------------------

    def _load(
        self, spec: CheckpointTensor, param: torch.Tensor, loaded: torch.Tensor, shard: str | None
    ) -> None:
        if spec.kind == "ignored":
            return
        if self.checkpoint_slicer is not None:
            loaded = self.checkpoint_slicer(spec.name, loaded, shard)
        if spec.kind == "shape":
            rows = self.out_features if shard is None else self._offsets[shard][1]
            if loaded.tolist() != [rows, self.in_features]:
                raise ValueError(f"weight_shape {loaded.tolist()} != [{rows}, {self.in_features}]")
            return
        if spec.kind == "equal":
            self._load_equal(spec, param, loaded, shard)
            return
        target = param.data
        if shard is not None:
            offset, rows = self._offsets[shard]
            target = target.narrow(spec.shard_dim, offset // spec.pack, rows // spec.pack)
        if spec.broadcast and loaded.numel() == 1:
            target.fill_(loaded.reshape(()).item())
            return
        if tuple(loaded.shape) != tuple(target.shape):
            where = "" if shard is None else f"shard {shard!r} "
            raise ValueError(
                f"{where}has shape {tuple(loaded.shape)}, expected {tuple(target.shape)}"
            )
        target.copy_(loaded)

    def _load_equal(
        self, spec: CheckpointTensor, param: torch.Tensor, loaded: torch.Tensor, shard: str | None
    ) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        if spec.name not in self._equal_first:
            self._equal_first[spec.name] = shard
            param.data.copy_(loaded)
        elif not torch.equal(param.data, loaded.to(param.device, param.dtype)):
            raise ValueError(
                f"{spec.name} of shard {shard!r} differs from shard "
                f"{self._equal_first[spec.name]!r}'s: the fused shards {list(self._offsets)} "
                "must share one act-order"
            )

    def finish_loading(self) -> None:
        """Checkpoint layout -> kernel layout; the checkpoint tensors are dropped."""
        tensors = {name: param.data for name, param in self.named_parameters(recurse=False)}
        packed = to_kernel_layout(self.scheme, tensors, self.in_features, self._equal_first)
        bias = tensors.get("bias")
        for name in self._tensors:
            delattr(self, name)
        self.register_buffer("bias", bias)
        self.packed_kind = _packed_kind(packed)
        for field in fields(packed):
            value = getattr(packed, field.name)
            if isinstance(value, torch.Tensor) or value is None:
                self.register_buffer(f"{self.packed_kind}_{field.name}", value)
        self.group_size = getattr(packed, "group_size", 0)

    @property
    def packed(self) -> PackedWeight:
        kind, tensor = self.packed_kind, self._kernel_tensor
        if kind == "int4":
            return Int4Weight(
                tensor("int4_qweight"),
                tensor("int4_scales"),
                tensor("int4_offsets"),
                self._buffers["int4_perm"],
                self.group_size,
            )
        if kind == "int8":
            return Int8Weight(tensor("int8_qweight"), tensor("int8_scales"), self.group_size)
        if kind == "fp8":
            return Fp8Weight(tensor("fp8_weight"), tensor("fp8_scale"))
        raise RuntimeError("QuantLinear used before finish_loading()")

    def _kernel_tensor(self, name: str) -> torch.Tensor:
        tensor = self._buffers[name]
        assert tensor is not None
        return tensor

    # ---- the product ---------------------------------------------------------------------

    def forward(self, x: torch.Tensor | Fp8Rows, silu_gated: bool = False) -> torch.Tensor:
        """x [rows, in_features] times the weight (+ bias); with silu_gated, x is a gated MLP's
        [gate | up] and the product takes silu(gate) * up (fp8 on CUDA: quantized as it is
        made). An fp8 layer also takes rows its producer quantized (Fp8Rows, on CUDA)."""
        weight, bias = self.packed, self._buffers["bias"]
        on_cuda = x[0].is_cuda if isinstance(x, tuple) else x.is_cuda
        if silu_gated and not (on_cuda and isinstance(weight, Fp8Weight)):
            assert isinstance(x, torch.Tensor), "silu_gated takes [gate | up] rows"
            x, silu_gated = silu_and_mul(x), False
        out = self._cuda_product(x, weight, silu_gated) if on_cuda else self._reference(x, weight)
        return out if bias is None else out + bias  # out: [rows, out_features]

    def _reference(self, x: torch.Tensor | Fp8Rows, weight: PackedWeight) -> torch.Tensor:
        assert not isinstance(x, tuple), "e4m3 rows are a CUDA input"
        if isinstance(weight, Int4Weight):
            return int4_linear_reference(x, weight)
        if isinstance(weight, Int8Weight):
            return int8_linear_reference(x, weight)
        return fp8_linear_reference(x, weight)

    def _cuda_product(
        self, x: torch.Tensor | Fp8Rows, weight: PackedWeight, silu_gated: bool
    ) -> torch.Tensor:
        from kvfleet_engine.kernels import quant_matmul  # type: ignore[attr-defined,unused-ignore]

        if isinstance(x, tuple):  # Fp8Rows from a norm (RMSNorm.fp8_rows_out)
            assert isinstance(weight, Fp8Weight), "only an fp8 layer takes e4m3 rows"
            return quant_matmul.fp8_rows_matmul(x, weight.weight, weight.scale, self.dtype)
        if isinstance(weight, Int4Weight):
            if weight.perm is not None:
                x = x[:, weight.perm]
            return quant_matmul.int4_matmul(
                x, weight.qweight, weight.scales, weight.offsets, weight.group_size
            )
        if isinstance(weight, Int8Weight):
            return quant_matmul.int8_matmul(x, weight.qweight, weight.scales, weight.group_size)
        fp8_matmul = quant_matmul.fp8_silu_and_mul_matmul if silu_gated else quant_matmul.fp8_matmul
        return fp8_matmul(x, weight.weight, weight.scale, x.dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"{self.scheme.kind} from {self.scheme.layout}, group_size={self.scheme.group_size}"
        )


def to_kernel_layout(
    scheme: WeightScheme,
    tensors: dict[str, torch.Tensor],  # name -> the loaded checkpoint-layout tensor
    in_features: int,
    equal_loaded: dict[str, str | None],  # "equal" tensors the checkpoint had
) -> PackedWeight:
    # Float scales on the CPU (the reference's float32 product stays exact); float16 for the
    # kernels, as layout.py packs by default (exact for GGUF's fp16 d and m; Q4_K's d * sc, 17
    # significant bits, rounds to 11).
    device = next(iter(tensors.values())).device
    scale_dtype = torch.float32 if device.type == "cpu" else torch.float16
    group_size = scheme.group_size or in_features
    layout = scheme.layout
    if layout == "float":
        weight = tensors["weight"]
        return quantize_fp8(weight) if scheme.kind == "fp8" else quantize_int8(weight)
    if layout == "ct-float":
        return Fp8Weight(weight=tensors["weight"], scale=tensors["weight_scale"][:, 0].float())
    if layout == "ct-int":
        return pack_int8(tensors["weight"], tensors["weight_scale"], group_size)
    if layout == "gguf" and scheme.kind == "int8":  # fp16 GGUF scales: exact in float16
        return pack_int8(tensors["codes"], tensors["scales"], group_size, scale_dtype=scale_dtype)
    if layout == "gptq" and scheme.kind == "int8":
        return _gptq_int8(scheme, tensors, group_size)
    if layout == "ct-pack" and scheme.kind == "int8":  # signed codes stored as code + 128
        codes = formats.unpack_along_last(tensors["weight_packed"], 8) - 128
        return pack_int8(codes.to(torch.int8), tensors["weight_scale"], group_size)
    g_idx = None
    if layout == "gguf":
        codes, scales, offsets = tensors["codes"], tensors["scales"], tensors["offsets"]
    elif layout == "ct-pack":
        codes, scales, offsets = formats.compressed_tensors_canonical(
            tensors["weight_packed"], tensors["weight_scale"], tensors.get("weight_zero_point")
        )
        g_idx = tensors["weight_g_idx"] if "weight_g_idx" in equal_loaded else None
    elif layout == "awq":
        codes, scales, offsets = formats.awq_canonical(
            tensors["qweight"], tensors["qzeros"], tensors["scales"]
        )
    elif layout == "gptq":
        codes, scales, offsets = formats.gptq_canonical(
            tensors["qweight"], tensors["qzeros"], tensors["scales"], 4, scheme.zeros_minus_one
        )
        g_idx = tensors["g_idx"] if "g_idx" in equal_loaded else None
    else:
        raise ValueError(f"unknown checkpoint layout {layout!r}")
    return pack_int4(codes, scales, offsets, group_size, g_idx, scale_dtype=scale_dtype)


def _gptq_int8(
    scheme: WeightScheme, tensors: dict[str, torch.Tensor], group_size: int
) -> Int8Weight:
    codes = formats.unpack_along_first(tensors["qweight"], 8).t()  # [N, K] unsigned
    zeros = formats.unpack_along_last(tensors["qzeros"], 8) + int(scheme.zeros_minus_one)
    if bool((zeros != 128).any()):
        raise ValueError("GPTQ 8-bit zero points must all be 128 (symmetric)")
    return pack_int8((codes - 128).to(torch.int8), tensors["scales"].t(), group_size)


def _packed_kind(packed: PackedWeight) -> str:
    if isinstance(packed, Int4Weight):
        return "int4"
    return "int8" if isinstance(packed, Int8Weight) else "fp8"
