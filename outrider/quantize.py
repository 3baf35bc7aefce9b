"""Weight-only 4-bit quantization: the int4 self-draft's weights.

Each row of a weight matrix is cut into groups of ``group_size`` weights;
a group keeps a scale and a zero in bfloat16 and each weight a 4-bit level
``q`` in 0..15, so ``w ≈ (q − 8) · scale + zero`` (asymmetric, the zero in
the float domain: tinygemm's layout, which torchao and gpt-fast use too).
Products are computed by torch's own int4 kernels, on the packed weights,
without ever unpacking them: ``_weight_int4pack_mm_for_cpu`` on the CPU and
tinygemm's ``_weight_int4pack_mm`` on CUDA. Both take bfloat16 activations
(the CPU's float32 variant is an unvectorised loop, many times slower:
docs/benchmark.md#the-drafters), so :meth:`Int4Weight.linear` casts to
bfloat16 and back: the rest of the model keeps its own dtype.

torchao is not used: its int4 weight-only configurations (0.18, for torch
2.13) have no CPU path for a float32 model (``plain`` and ``preshuffled``
need the mslk package, ``plain_int32`` has no CPU kernel, ``tile_packed_to_4d``
takes bfloat16 models only), and the packing it would do is the few lines
below around the same two kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from outrider.config import DEFAULT_INT4_GROUP_SIZE, INT4_GROUP_SIZES

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LEVELS = 16
ROW_MULTIPLE = 16
"""The CPU packing takes a multiple of 16 rows (tinygemm's tiles, 8)."""
KERNEL_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Int4Weight:
    """A ``[out_features, in_features]`` weight in 4 bits, packed for its
    device's kernel (rows padded to :data:`ROW_MULTIPLE`, columns to the
    group size, with zero weights)."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor  # [in_padded / group, out_padded, 2], bfloat16
    group_size: int
    out_features: int
    in_features: int

    @classmethod
    def quantize(
        cls, weight: torch.Tensor, group_size: int = DEFAULT_INT4_GROUP_SIZE
    ) -> Int4Weight:
        """The 4-bit form of ``weight``, on its device: each group's levels
        span its min to its max."""
        if group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"group size {group_size} is not one of {', '.join(map(str, INT4_GROUP_SIZES))}"
            )
        out_features, in_features = weight.shape
        w = F.pad(
            weight.detach().float(), (0, -in_features % group_size, 0, -out_features % ROW_MULTIPLE)
        )
        groups = w.reshape(-1, group_size)
        low, high = groups.amin(1, keepdim=True), groups.amax(1, keepdim=True)
        # Scales and zeros are rounded to what the kernel reads first, and
        # the levels chosen against those.
        scales = _stored(((high - low) / (LEVELS - 1)).clamp(min=1e-6))
        zeros = _stored(low + scales * (LEVELS // 2))
        levels = (groups - (zeros - scales * (LEVELS // 2))) / scales
        levels = levels.round().clamp(0, LEVELS - 1).to(torch.int32).reshape(w.shape)
        rows, num_groups = w.shape[0], w.shape[1] // group_size
        scales_and_zeros = (
            torch.cat(
                [scales.reshape(rows, num_groups, 1), zeros.reshape(rows, num_groups, 1)], dim=2
            )
            .transpose(0, 1)
            .contiguous()
            .to(KERNEL_DTYPE)
        )
        return cls(_pack(levels), scales_and_zeros, group_size, out_features, in_features)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_and_zeros.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, W, bias)`` with this weight, in ``x``'s dtype."""
        if x.numel() == 0:
            return _no_rows(x, self.out_features, bias)
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        padded_in = self.scales_and_zeros.shape[0] * self.group_size
        if padded_in != self.in_features:
            rows = F.pad(rows, (0, padded_in - self.in_features))
        if x.device.type == "cpu":
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, self.group_size, self.scales_and_zeros
            )
        else:
            out = torch.ops.aten._weight_int4pack_mm(
                rows, self.packed, self.group_size, self.scales_and_zeros
            )
        out = out[:, : self.out_features].to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:
        """The float32 weight these levels stand for (what the kernels
        compute with, up to bfloat16 rounding)."""
        eye = torch.eye(self.in_features, device=self.packed.device)
        return self.linear(eye).float().T.contiguous()


@dataclass(frozen=True)
class Int8Weight:
    """A ``[out_features, in_features]`` weight in 8 bits, one scale per row
    (symmetric), computed by ``_weight_int8pack_mm`` (CPU and CUDA). The LM
    head takes it: its logits decide every draft token, and in 4 bits they
    agree with the target far less often (docs/benchmark.md#the-drafters)."""

    weight: torch.Tensor  # int8
    scales: torch.Tensor  # [out_features], bfloat16

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Weight:
        w = weight.detach().float()
        scales = _stored((w.abs().amax(1) / 127).clamp(min=1e-8))
        levels = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        return cls(levels, scales.to(KERNEL_DTYPE))

    @property
    def shape(self) -> tuple[int, int]:
        out_features, in_features = self.weight.shape
        return out_features, in_features

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scales.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.numel() == 0:
            return _no_rows(x, self.weight.shape[0], bias)
        rows = x.reshape(-1, self.weight.shape[1]).to(KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.weight.shape[0])
        return out if bias is None else out + bias

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


def _no_rows(x: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    """The product of no rows (a step none of whose tokens needs logits),
    without calling a kernel: on CUDA, torch's int8 kernel launches an empty
    grid for zero rows without checking the launch, and the error it leaves
    surfaces at the next operation, in whatever step comes next; tinygemm's
    refuses the launch."""
    out = x.new_empty(*x.shape[:-1], out_features)
    return out if bias is None else out + bias


def _stored(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the kernels read it (bfloat16), in float32."""
    return x.to(KERNEL_DTYPE).float()


def _pack(levels: torch.Tensor) -> torch.Tensor:
    """``levels`` (int32 in 0..15, ``[rows, columns]``) in the layout of the device's kernel."""
    if levels.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 2)
    columns = levels.shape[1]
    inner_k_tiles = next(t for t in (8, 4, 2) if columns % (16 * t) == 0)
    pairs = (levels[:, ::2] << 4 | levels[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(pairs.contiguous(), inner_k_tiles)


QuantizedWeight = Int4Weight | Int8Weight


def quantize_weight(
    weight: torch.Tensor, group_size: int, *, lm_head: bool = False
) -> QuantizedWeight:
    """The int4 drafter's form of a weight: 4 bits in groups, the LM head 8 bits a row."""
    return Int8Weight.quantize(weight) if lm_head else Int4Weight.quantize(weight, group_size)


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is quantized (for models run by transformers)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.quantized = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized.linear(x, self.bias)

    def extra_repr(self) -> str:
        out_features, in_features = self.quantized.shape
        return (
            f"in_features={in_features}, out_features={out_features}, "
            f"{type(self.quantized).__name__}"
        )


def quantize_linears(model: PreTrainedModel, group_size: int = DEFAULT_INT4_GROUP_SIZE) -> int:
    """Gives a transformers causal LM the int4 drafter's weights: every
    ``nn.Linear`` in 4 bits, the LM head (``get_output_embeddings``, untied
    from the input embedding) in 8; returns how many it replaced."""
    head = model.get_output_embeddings()
    targets = [
        (name, module) for name, module in model.named_modules() if isinstance(module, nn.Linear)
    ]
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layers to quantize")
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        weight = quantize_weight(module.weight, group_size, lm_head=module is head)
        setattr(
            model.get_submodule(parent_name) if parent_name else model,
            child,
            QuantizedLinear(weight, module.bias),
        )
    return len(targets)
