"""Linear layers with 16-bit weights and fp32 arithmetic, for CPUs without native bf16.

On such CPUs torch's bf16 matrix products are several times slower than fp32, yet decoding a
few sequences is bound by how fast the weights stream from memory, so fp32 weights cost twice
the bandwidth they need. `HalfWeightLinear` holds each weight twice: packed in fp16 for fbgemm's
fp16-weight GEMM, which a few rows stream at half the bytes, and in fp32 for more rows, where
the product is bound by arithmetic. The fp32 copy is packed ahead of time for oneDNN's GEMM
where torch has it (10-40% faster than `F.linear` from 16 to 64 rows on an AVX2 CPU), else
kept plain for `F.linear`. Both copies hold the same values: every bf16 number between 2**-17
and 65504 is exact in fp16.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

# Above this many rows the fp32 product is faster than fbgemm's fp16 kernel: oneDNN's with its
# weights packed ahead, or else `F.linear`.
SMALL_BATCH_ROWS = 8
PLAIN_SMALL_BATCH_ROWS = 48
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


def onednn_linear_available() -> bool:
    """True when this torch build can pack a linear weight for oneDNN ahead of time."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8), 64)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8), packed, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(out, torch.full((2, 8), 8.0)))


class HalfWeightLinear(nn.Module):
    """`y = x W^T + b` with W rounded to fp16; x, b and y in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rounded = weight.detach().to(torch.float16).float().contiguous()
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.packed = torch.fbgemm_pack_gemm_matrix_fp16(rounded)
        self.onednn = onednn_linear_available()
        if self.onednn:
            self.packed_fp32 = torch.ops.mkldnn._reorder_linear_weight(rounded, 64)
            self.small_rows = SMALL_BATCH_ROWS
        else:
            self.register_buffer("plain_fp32", rounded)
            self.small_rows = PLAIN_SMALL_BATCH_ROWS

    @property
    def weight(self) -> torch.Tensor:
        """The rounded weight in fp32, `[out_features, in_features]`."""
        return self.packed_fp32.to_dense() if self.onednn else self.plain_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.small_rows:
            if self.onednn:
                return torch.ops.mkldnn._linear_pointwise(x.float(), self.packed_fp32,
                                                          self.bias, "none", [], "")
            return F.linear(x, self.plain_fp32, self.bias)
        flat = x.reshape(rows, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = torch.fbgemm_linear_fp16_weight_fp32_activation(flat.contiguous(), self.packed,
                                                               self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        fp32 = "oneDNN-packed" if self.onednn else "plain"
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"weight=fp16 (packed) + fp32 ({fp32})")


def fits_fp16(weight: torch.Tensor) -> bool:
    """fp16 holds the weight without overflow (its largest finite value is 65504)."""
    return bool(weight.abs().max() <= FP16_MAX)


def convert_linears(model: nn.Module) -> int:
    """Swap every fp32 `nn.Linear` whose weight fits fp16 for a `HalfWeightLinear`; return how
    many were swapped. Weights shared with other modules (tied embeddings) stay in place there."""
    swapped = 0
    for parent, name, linear in list(_linears(model)):
        if linear.weight.dtype != torch.float32 or not fits_fp16(linear.weight):
            continue
        setattr(parent, name, HalfWeightLinear(linear.weight, linear.bias))
        swapped += 1
    logger.info("%d linear layers hold fp16 weights and compute in fp32", swapped)
    return swapped


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, child
