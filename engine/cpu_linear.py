"""Linear layers for CPUs: fp32 weights packed for oneDNN, and 16-bit weights computed in fp32.

torch's `F.linear` runs a plain fp32 GEMM over the weight as stored. oneDNN's GEMM over a weight
reordered for it ahead of time is 10-40% faster from 4 to 64 rows on an AVX2 CPU, and about as
fast above; `PackedLinear` holds its weight that way.

On CPUs without native bf16, torch's bf16 matrix products are several times slower than fp32,
yet decoding a few sequences is bound by how fast the weights stream from memory, so fp32
weights cost twice the bandwidth they need. `HalfWeightLinear` holds each weight twice: in fp16
for a few rows, which stream it at half the bytes (through Conveyor's own kernel, split over
all threads, where it builds; else fbgemm's fp16-weight GEMM, which runs on one thread), and in
fp32 (packed for oneDNN where torch can, else plain for `F.linear`) for more rows, where the
product is bound by arithmetic. Both copies hold the same values: every bf16 number between
2**-17 and 65504 is exact in fp16.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels

logger = logging.getLogger(__name__)

# Up to this many rows the fp16-weight product beats the fp32 product in a whole model, where
# the weights stream from memory (a lone layer whose weights stay in cache favours fp32 from far
# fewer rows). Measured with fbgemm's kernel: against oneDNN over packed weights the two tie at
# 16 rows and oneDNN wins clearly at 32 (decode steps of 139 against 178 ms); against plain
# `F.linear` the crossing is near 48. Conveyor's own kernel, where it builds, is as fast or
# faster up to 16 rows, so the same bounds hold.
SMALL_BATCH_ROWS = 16
SMALL_BATCH_ROWS_PLAIN = 48
# The batch size oneDNN lays packed weights out for; any other works too.
ONEDNN_BATCH_HINT = 64
FP16_MAX = torch.finfo(torch.float16).max

warnings.filterwarnings("ignore", message=r"fbgemm_\w+ is deprecated")


def fbgemm_fp16_available() -> bool:
    """True when this torch build has fbgemm's fp16-weight GEMM (x86 CPU builds)."""
    if not hasattr(torch, "fbgemm_pack_gemm_matrix_fp16"):
        return False
    try:
        packed = torch.fbgemm_pack_gemm_matrix_fp16(torch.ones(8, 8))
        out = torch.fbgemm_linear_fp16_weight_fp32_activation(torch.ones(1, 8), packed, None)
    except RuntimeError:
        return False
    return bool(torch.allclose(out, torch.full((1, 8), 8.0)))


@cache
def onednn_linear_available() -> bool:
    """True when this torch build can pack a linear weight for oneDNN ahead of time."""
    try:
        out = onednn_linear(torch.ones(2, 8), pack_for_onednn(torch.ones(8, 8)), None)
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.full((2, 8), 8.0)))


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """An fp32 `[out, in]` weight reordered for oneDNN's GEMM (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(),
                                                   ONEDNN_BATCH_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`y = x W^T + b` in fp32 through oneDNN's GEMM, W packed for it ahead of time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack_for_onednn(weight)
        self.register_buffer("bias", None if bias is None else bias.detach().float())

    @property
    def weight(self) -> torch.Tensor:
        """The weight in fp32, `[out_features, in_features]`."""
        return self.packed.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight=fp32 (oneDNN-packed)")


class HalfWeightLinear(nn.Module):
    """`y = x W^T + b` with W rounded to fp16; x, b and y in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rounded = weight.detach().to(torch.float16).float().contiguous()
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # The fp16 copy for a few rows: plain for Conveyor's kernel, or packed for fbgemm's.
        own_kernel = cpu_kernels.half_linear_available()
        self.register_buffer("weight_fp16", rounded.half() if own_kernel else None)
        self.packed = None if own_kernel else torch.fbgemm_pack_gemm_matrix_fp16(rounded)
        # The fp32 copy for larger steps: packed for oneDNN, or plain for F.linear.
        self.large = pack_for_onednn(rounded) if onednn_linear_available() else None
        self.register_buffer("dense", rounded if self.large is None else None)
        self.small_rows = SMALL_BATCH_ROWS if self.large is not None else SMALL_BATCH_ROWS_PLAIN

    @property
    def weight(self) -> torch.Tensor:
        """The fp16-rounded weight in fp32, `[out_features, in_features]`."""
        return self.dense if self.large is None else self.large.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.small_rows:
            if self.large is not None:
                return onednn_linear(x, self.large, self.bias)
            return F.linear(x, self.dense, self.bias)
        flat = x.reshape(rows, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        if self.weight_fp16 is not None:
            out = cpu_kernels.half_linear(flat.contiguous(), self.weight_fp16, self.bias)
        else:
            out = torch.fbgemm_linear_fp16_weight_fp32_activation(flat.contiguous(), self.packed,
                                                                   self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        small = "plain" if self.weight_fp16 is not None else "fbgemm-packed"
        large = "oneDNN-packed" if self.large is not None else "plain"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight=fp16 ({small}) + fp32 ({large})")


def fits_fp16(weight: torch.Tensor) -> bool:
    """fp16 holds the weight without overflow (its largest finite value is 65504)."""
    return bool(weight.abs().max() <= FP16_MAX)


def convert_linears(model: nn.Module) -> int:
    """Swap every fp32 `nn.Linear` whose weight fits fp16 for a `HalfWeightLinear`; return how
    many were swapped. Weights shared with other modules (tied embeddings) stay in place there."""
    swapped = _swap(model, HalfWeightLinear, fits_fp16)
    logger.info("%d linear layers hold fp16 weights and compute in fp32", swapped)
    return swapped


def pack_linears(model: nn.Module) -> int:
    """Swap every fp32 `nn.Linear` for a `PackedLinear`; return how many were swapped."""
    swapped = _swap(model, PackedLinear, lambda weight: True)
    logger.info("%d linear layers hold weights packed for oneDNN", swapped)
    return swapped


def _swap(model: nn.Module, layer: type[nn.Module],
          accepts: Callable[[torch.Tensor], bool]) -> int:
    swapped = 0
    for parent, name, linear in list(_linears(model)):
        if linear.weight.dtype != torch.float32 or not accepts(linear.weight):
            continue
        setattr(parent, name, layer(linear.weight, linear.bias))
        swapped += 1
    return swapped


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, child
