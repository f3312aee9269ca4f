"""Linear layers for CPUs: Conveyor's own GEMM over packed weights, with torch's as fallback.

`PanelLinear` holds its weight packed in panels of 16 output columns, in fp32 for fp32 models
or in fp16 for 16-bit models on CPUs without native 16-bit arithmetic, and multiplies through
Conveyor's kernel (`csrc/linear/panel_linear.cpp`, AVX2 and FMA). Decoding a few sequences is bound
by how fast the weights stream from memory, which fp16 halves; more rows are bound by
arithmetic, which the kernel runs at most of the CPU's peak. Every bf16 number between 2**-17
and 65504 is exact in fp16, so a bf16 model's fp16 panels hold its weights exactly, and each
output is summed in the same order whatever the batch, so a sequence's tokens do not depend on
what it is batched with. A model converted from GGUF can hold its Q4_1 / Q8_0 blocks instead
(`PanelLinear.of_blocks`, `use_gguf_blocks`): the kernel widens them to exactly the fp32 weights.

Where the kernel cannot build or run, torch's products stand in: `PackedLinear` for fp32
weights (oneDNN's GEMM over a weight reordered for it ahead of time, 10-40% faster than
`F.linear` from 4 to 64 rows on an AVX2 CPU), and `HalfWeightLinear` for 16-bit ones, which
holds each weight twice: in fp16 for fbgemm's fp16-weight GEMM up to a few rows, and in fp32
(packed for oneDNN where torch can, else plain for `F.linear`) for more.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator, Sequence
from functools import cache
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu import ops as cpu_ops
from engine.loading import gguf_blocks

logger = logging.getLogger(__name__)

# Up to this many rows the fp16-weight product beats the fp32 product in a whole model, where
# the weights stream from memory (a lone layer whose weights stay in cache favours fp32 from far
# fewer rows). Measured with fbgemm's kernel: against oneDNN over packed weights the two tie at
# 16 rows and oneDNN wins clearly at 32 (decode steps of 139 against 178 ms); against plain
# `F.linear` the crossing is near 48.
SMALL_BATCH_ROWS = 16
SMALL_BATCH_ROWS_PLAIN = 48
# The batch size oneDNN lays packed weights out for; any other works too.
ONEDNN_BATCH_HINT = 64
FP16_MAX = torch.finfo(torch.float16).max
# Output columns per panel of `PanelLinear`'s packed weight.
PANEL = 16


def silence_fbgemm_deprecation() -> None:
    """torch warns on every call of its fbgemm fp16 ops, which `HalfWeightLinear` relies on: a
    process-wide filter, installed where the engine starts, not when this module is imported."""
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
    return torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().float().contiguous(), ONEDNN_BATCH_HINT
    )


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`y = x W^T + b` in fp32 through oneDNN's GEMM, W packed for it ahead of time."""

    bias: torch.Tensor | None

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

    def remade(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear:
        """A layer of the same kind over another weight (fused projections)."""
        return PackedLinear(weight, bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight=fp32 (oneDNN-packed)"
        )


class PanelLinear(nn.Module):
    """`y = x W^T + b` in fp32 through Conveyor's kernel, W packed in panels of 16 output
    columns and held in fp32 or fp16 (`storage`), or in GGUF blocks (`of_blocks`)."""

    panels: torch.Tensor
    padded_bias: torch.Tensor | None

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, storage: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self._hold(pack_panels(weight.detach(), storage), bias, *weight.shape)

    @classmethod
    def of_blocks(
        cls,
        fmt: gguf_blocks.BlockFormat,
        rows: torch.Tensor,
        bias: torch.Tensor | None,
        int8_activations: bool = False,
    ) -> PanelLinear:
        """A layer over GGUF rows `[out, in / block * block_bytes]`, widened as it multiplies;
        or, with `int8_activations` (Q4_1, Q8_0, Q4_K and 4-bit groups), multiplied in 8-bit
        integers against inputs rounded to 8-bit blocks (approximate;
        `csrc/linear/int8_panels.cpp`)."""
        in_features = gguf_blocks.in_features(fmt, rows)
        panels = None
        if int8_activations and fmt in gguf_blocks.INT8_FORMATS:
            panels = gguf_blocks.pack_int8_panels(fmt, rows)
        if panels is None:
            panels = gguf_blocks.pack_panels(fmt, rows)
        return cls._of_panels(panels, bias, rows.shape[0], in_features)

    @classmethod
    def joined(cls, layers: list[PanelLinear]) -> PanelLinear | None:
        """One layer whose outputs are `layers`' side by side, sharing their panels as held;
        None where a panel would mix two layers' columns or their storage differs. Block panels
        of different formats (a Q4_K_M layer's q and k in Q4_K, v in Q6_K) join as Q8_K panels
        of the same weights. Each of `layers` then holds a view of its panels in the joined
        ones: no second copy."""
        first = layers[0]
        mixed = _mixed_blocks(layers)
        alike = slice(1, 2) if mixed else slice(1, 3)  # mixed formats: groups differ in size
        if (
            any(layer.out_features % PANEL for layer in layers[:-1])
            or any(
                layer.panels.shape[alike] != first.panels.shape[alike]
                or layer.panels.dtype != first.panels.dtype
                for layer in layers
            )
            or len({layer.padded_bias is None for layer in layers}) > 1
        ):
            return None
        if mixed:
            for layer in layers:
                layer.panels = gguf_blocks.as_q8_k(layer.panels)
        # Every layer has a bias where the first does (checked above).
        biases = cast(list[torch.Tensor], [m.bias for m in layers])
        bias = None if first.padded_bias is None else torch.cat(biases)
        joined = cls._of_panels(
            torch.cat([layer.panels for layer in layers]),
            bias,
            sum(layer.out_features for layer in layers),
            first.in_features,
        )
        start = 0
        for layer in layers:
            count = layer.panels.shape[0]
            layer.panels = joined.panels[start : start + count]
            start += count
        if all(layer.bf16_blocks for layer in layers):
            joined.multiply_in_bf16()  # as its parts did
        return joined

    def split(self, at: int) -> tuple[PanelLinear, PanelLinear] | None:
        """Two layers, over the first `at` outputs and over the rest, holding views of these
        panels (the inverse of `joined`); None where `at` falls inside a panel."""
        if at % PANEL or not 0 < at < self.out_features:
            return None
        cut, bias = at // PANEL, self.bias
        parts = (
            PanelLinear._of_panels(
                self.panels[:cut], None if bias is None else bias[:at], at, self.in_features
            ),
            PanelLinear._of_panels(
                self.panels[cut:],
                None if bias is None else bias[at:],
                self.out_features - at,
                self.in_features,
            ),
        )
        for part in parts:
            part.bf16_blocks = self.bf16_blocks
        return parts

    @classmethod
    def _of_panels(
        cls, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int
    ) -> PanelLinear:
        """A layer over panels already packed."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._hold(panels, bias, out_features, in_features)
        return layer

    def _hold(
        self, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int, in_features: int
    ) -> None:
        cpu_ops.load()  # the product's op is registered when the kernels load
        self.out_features, self.in_features = out_features, in_features
        self.register_buffer("panels", panels)
        padded = None if bias is None else pad_to_panels(bias.detach().float())
        self.register_buffer("padded_bias", padded)
        self.bf16_blocks = False

    def multiply_in_bf16(self) -> bool:
        """Multiply the blocks against inputs rounded to bf16 in AVX-512 BF16 dot products, as
        a bf16 model's panels multiply, where they run here; returns whether the layer now
        does. MXFP4's weights, where bf16 holds each exactly, widen to bf16 and sum as bf16
        panels of them would, to the bit (`cpu_ops.mxfp4_bf16_linear`); Q4_1, Q8_0, Q4_K,
        Q6_K and Q8_K sum the inputs times their blocks' integers, each block's sums then
        scaled in fp32 (`cpu_ops.block_bf16_linear`: the weights exact, not rounded)."""
        fmt = self.block_format
        runs = self.panels.dtype == torch.uint8 and cpu_ops.bf16_panels_available()
        if fmt is gguf_blocks.MXFP4:
            runs = runs and gguf_blocks.mxfp4_fits_bf16(self.panels, self.out_features)
        self.bf16_blocks = runs and fmt in gguf_blocks.PANEL_FORMATS
        return self.bf16_blocks

    @property
    def block_format(self) -> gguf_blocks.BlockFormat | None:
        """The GGUF block format the weight is held in; None for fp32 or fp16 panels."""
        if self.panels.dtype not in (torch.uint8, torch.int8):
            return None
        return gguf_blocks.GROUP_FORMATS[self.panels.shape[2]]

    @property
    def int8_activations(self) -> bool:
        """The blocks multiply against inputs rounded to 8-bit blocks (int8 panels)."""
        return self.panels.dtype == torch.int8

    @property
    def weight(self) -> torch.Tensor:
        """The weight as held (rounded to fp16 or bf16 for 16-bit panels), in fp32,
        `[out, in]`."""
        if self.block_format is not None:
            return gguf_blocks.dequantize_panels(self.panels, self.out_features)
        return unpack_panels(self.panels, self.out_features)

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.padded_bias is None else self.padded_bias[: self.out_features]

    @property
    def bf16_activations(self) -> bool:
        """The bf16 weights multiply inputs rounded to bf16 (AVX-512 BF16 dot products)."""
        return self.panels.dtype == torch.bfloat16

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """`x W^T + b`, plus `residual` (fp32, the output's shape) where given: added as the
        product is stored, equal to the bit to adding it after. bf16 panels also take bf16 `x`,
        the rows they would round fp32 ones to; the output is fp32."""
        skip = None if residual is None else residual.reshape(-1, self.out_features).contiguous()
        if self.bf16_blocks:
            product = (
                cpu_ops.mxfp4_bf16_linear
                if self.block_format is gguf_blocks.MXFP4
                else cpu_ops.block_bf16_linear
            )
            rows = fp32_rows(x, self.in_features)
            out = product(rows, self._panels(), self.padded_bias, self.out_features)
            if skip is not None:
                out.add_(skip)
        else:
            rows = kernel_rows(x, self.in_features, self.bf16_activations)
            out = cpu_ops.panel_linear(
                rows, self._panels(), self.padded_bias, self.out_features, skip
            )
        return out.view(*x.shape[:-1], self.out_features)

    @property
    def chooses_greedily(self) -> bool:
        """`greedy` runs: bf16 panels, whose product can keep each row's best output instead of
        writing the outputs."""
        return self.bf16_activations

    def greedy(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).argmax(dim=-1)` for rows `x [rows, in]`, the same choice (the first of equal
        maxima, the first NaN where a row has one), without the outputs written: int64
        `[rows]`. Needs `chooses_greedily`."""
        rows = kernel_rows(x, self.in_features, bf16_panels=True)
        return cpu_ops.panel_argmax(rows, self._panels(), self.padded_bias, self.out_features)

    def _panels(self) -> torch.Tensor:
        """The panels as the kernels take them: a layer whose panels are gate or up panels of a
        `GatedPanelLinear` (every other panel of its pairs) multiplies through a copy."""
        return self.panels if self.panels.is_contiguous() else self.panels.contiguous()

    def remade(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PanelLinear:
        """A layer of the same kind over another weight (fused projections); block weights are
        exact in fp32, so they remake as fp32 panels."""
        storage = torch.float32 if self.block_format is not None else self.panels.dtype
        return PanelLinear(weight, bias, storage)

    @property
    def held_as(self) -> str:
        """How the weight is held and multiplied: `q4_1 blocks`, `float16`, `q8_0 blocks x int8
        activations`, `q4_k blocks x bf16 activations`, ..."""
        fmt = self.block_format
        held = (
            f"{fmt.name} blocks"
            if fmt is not None
            else str(self.panels.dtype).removeprefix("torch.")
        )
        if self.int8_activations:
            return held + " x int8 activations"
        return held + " x bf16 activations" if self.bf16_blocks else held

    def extra_repr(self) -> str:
        storage = self.held_as
        if self.bf16_activations:
            storage += " x bf16 activations"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight={storage} (16-column panels)"
        )


class GatedPanelLinear(nn.Module):
    """A gated MLP's gate and up projections and its activation, `silu(x Wg^T + bg) * (x Wu^T
    + bu)` (with `gelu`, GELU's tanh approximation for silu: Gemma's; with `clamped` `(alpha,
    limit)`, gpt-oss's clamped SwiGLU), in one op over bf16 panels: each gate panel followed
    by the up panel of the same 16 columns (`[ceil(inter / 16), 2, in / 2, 32]`), so one pass
    of the kernel holds both sums and writes only the activation (`cpu_ops.gated_linear`).
    Equal to the bit to the joined gate/up `PanelLinear` followed by `cpu_ops.silu_mul`
    (`cpu_ops.gelu_tanh_mul`, `cpu_ops.clamped_swiglu_mul`)."""

    panels: torch.Tensor
    padded_bias: torch.Tensor | None

    def __init__(
        self,
        gate: PanelLinear,
        up: PanelLinear,
        gelu: bool = False,
        clamped: tuple[float, float] | None = None,
    ) -> None:
        """Over copies of `gate`'s and `up`'s panels, which then hold views of them."""
        super().__init__()
        self.gelu = gelu
        self.clamped = clamped
        self.in_features, self.out_features = gate.in_features, gate.out_features
        self.register_buffer("panels", torch.stack([gate.panels, up.panels], dim=1))
        gate.panels, up.panels = self.panels[:, 0], self.panels[:, 1]
        bias = None
        if gate.padded_bias is not None and up.padded_bias is not None:
            bias = torch.stack(
                [gate.padded_bias.view(-1, PANEL), up.padded_bias.view(-1, PANEL)], dim=1
            ).flatten()
        self.register_buffer("padded_bias", bias)

    @classmethod
    def of(
        cls,
        gate: nn.Module,
        up: nn.Module,
        gelu: bool = False,
        clamped: tuple[float, float] | None = None,
    ) -> GatedPanelLinear | None:
        """The gated layer over these projections, where both are bf16 `PanelLinear`s of one
        shape, both with or both without bias, and the kernels run here; else None."""
        if not (
            isinstance(gate, PanelLinear)
            and isinstance(up, PanelLinear)
            and gate.bf16_activations
            and up.bf16_activations
            and gate.panels.shape == up.panels.shape
            and gate.out_features == up.out_features
            and (gate.padded_bias is None) == (up.padded_bias is None)
            and cpu_ops.bf16_panels_available()
        ):
            return None
        return cls(gate, up, gelu, clamped)

    def forward(self, x: torch.Tensor, bf16_out: bool = False) -> torch.Tensor:
        """fp32, or with `bf16_out` rounded to bf16: the rows a bf16 product would round the
        fp32 ones to, for the down projection, without the fp32 rows' pass over memory. `x`
        may be bf16 rows too (taken as they are)."""
        rows = kernel_rows(x, self.in_features, bf16_panels=True)
        out = cpu_ops.gated_linear(
            rows,
            self.panels,
            self.padded_bias,
            self.out_features,
            bf16_out,
            self.gelu,
            self.clamped,
        )
        return out.view(*x.shape[:-1], self.out_features)

    def gate_and_up(self, x: torch.Tensor) -> torch.Tensor:
        """Gate and up side by side before the activation, fp32 `[rows, 2 * out]`: the panel
        pairs taken as one layer's panels in one pass, its columns then put in order (for
        whoever changes them before the activation: LoRA adapters)."""
        pairs = self.panels.shape[0]
        rows = kernel_rows(x, self.in_features, bf16_panels=True)
        panels = self.panels.view(2 * pairs, *self.panels.shape[2:])
        out = cpu_ops.panel_linear(rows, panels, self.padded_bias, 2 * pairs * PANEL, None)
        halves = out.view(-1, pairs, 2, PANEL).transpose(1, 2).reshape(-1, 2, pairs * PANEL)
        return halves[:, :, : self.out_features].reshape(-1, 2 * self.out_features).contiguous()

    @property
    def activation(self) -> str:
        if self.clamped is not None:
            return "clamped swiglu(gate, up)"
        return f"{'gelu_tanh' if self.gelu else 'silu'}(gate) * up"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight=bf16 x bf16 activations (gate/up panel pairs, {self.activation})"
        )


def takes_bf16_rows(layer: nn.Module) -> bool:
    """The layer multiplies bf16 panels by its inputs rounded to bf16, and so takes bf16 rows
    as they are: a producer can hand them over already rounded."""
    return isinstance(layer, GatedPanelLinear) or (
        isinstance(layer, PanelLinear) and layer.bf16_activations
    )


def kernel_rows(x: torch.Tensor, in_features: int, bf16_panels: bool) -> torch.Tensor:
    """`x [..., in]` as the contiguous rows `[rows, in]` a panel product takes: bf16 rows as
    they are over bf16 panels (the rows they would round fp32 ones to), else fp32 rows."""
    if x.dtype == torch.bfloat16 and bf16_panels:
        return x.reshape(-1, in_features).contiguous()
    return fp32_rows(x, in_features)


def fp32_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """`x [..., in]` as the contiguous fp32 rows `[rows, in]` that Conveyor's kernels and
    fbgemm's fp16-weight product take."""
    flat = x.reshape(-1, in_features)
    if flat.dtype != torch.float32:
        flat = flat.float()
    return flat.contiguous()


def pack_panels(weight: torch.Tensor, storage: torch.dtype) -> torch.Tensor:
    """`[out, in]` to `[ceil(out / 16), in, 16]` in `storage`, spare columns zero; for bf16,
    `[ceil(out / 16), in / 2, 32]`: each pair of input features with each column's two weights
    side by side, as AVX-512 BF16 dot products take them (`in` even)."""
    padded = pad_to_panels(weight.to(storage))
    if storage == torch.bfloat16:
        pairs = padded.view(-1, PANEL, weight.shape[1] // 2, 2)
        return pairs.transpose(1, 2).reshape(pairs.shape[0], -1, 2 * PANEL).contiguous()
    return padded.view(-1, PANEL, weight.shape[1]).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The inverse of `pack_panels`, in fp32."""
    count = panels.shape[0]
    if panels.dtype == torch.bfloat16:
        pairs = panels.view(count, -1, PANEL, 2).transpose(1, 2)
        rows = pairs.reshape(count * PANEL, -1)
    else:
        rows = panels.transpose(1, 2).reshape(count * PANEL, panels.shape[1])
    return rows[:out_features].float()


def pad_to_panels(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (a bias `[out]`, or a weight `[out, in]`) zero-padded to whole panels of 16 along
    the first dim, as the kernel reads them."""
    padded = rows.new_zeros((-(-rows.shape[0] // PANEL) * PANEL, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    return padded


class HalfWeightLinear(nn.Module):
    """`y = x W^T + b` with W rounded to fp16; x, b and y in fp32."""

    bias: torch.Tensor | None
    dense: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        rounded = weight.detach().to(torch.float16).float().contiguous()
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        # The fp16 copy for a few rows, packed for fbgemm.
        self.packed = torch.fbgemm_pack_gemm_matrix_fp16(rounded)
        # The fp32 copy for larger steps: packed for oneDNN, or plain for F.linear.
        self.large = pack_for_onednn(rounded) if onednn_linear_available() else None
        self.register_buffer("dense", rounded if self.large is None else None)
        self.small_rows = SMALL_BATCH_ROWS if self.large is not None else SMALL_BATCH_ROWS_PLAIN

    @property
    def weight(self) -> torch.Tensor:
        """The fp16-rounded weight in fp32, `[out_features, in_features]`."""
        if self.large is not None:
            return self.large.to_dense()
        assert self.dense is not None  # one of the two copies is held
        return self.dense

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows > self.small_rows:
            if self.large is not None:
                return onednn_linear(x, self.large, self.bias)
            return F.linear(x, self.weight, self.bias)
        out = torch.fbgemm_linear_fp16_weight_fp32_activation(
            fp32_rows(x, self.in_features), self.packed, self.bias
        )
        return out.view(*x.shape[:-1], self.out_features)

    def remade(self, weight: torch.Tensor, bias: torch.Tensor | None) -> HalfWeightLinear:
        """A layer of the same kind over another weight (fused projections)."""
        return HalfWeightLinear(weight, bias)

    def extra_repr(self) -> str:
        large = "oneDNN-packed" if self.large is not None else "plain"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight=fp16 (fbgemm-packed) + fp32 ({large})"
        )


def fits_fp16(weight: torch.Tensor) -> bool:
    """fp16 holds the weight without overflow (its largest finite value is 65504)."""
    return bool(weight.abs().max() <= FP16_MAX)


def half_weights_supported() -> bool:
    """This CPU can hold 16-bit weights in fp16 and compute in fp32: Conveyor's kernel runs, or
    torch has fbgemm's fp16-weight GEMM."""
    return cpu_ops.panel_linear_available() or fbgemm_fp16_available()


def fp32_packing_supported() -> bool:
    """fp32 weights can be packed ahead of time: for Conveyor's kernel, or for oneDNN's."""
    return cpu_ops.panel_linear_available() or onednn_linear_available()


def convert_linears(
    model: nn.Module, dtype: torch.dtype = torch.float16, within: Sequence[nn.Module] = ()
) -> int:
    """Swap every fp32 `nn.Linear` whose weight fits fp16 for a layer that holds it in fp16 and
    computes in fp32; return how many were swapped. With `within`, every `nn.Linear` of those
    modules is swapped instead, whatever its dtype (a 16-bit model's, each widened alone).
    Weights shared with other modules (tied embeddings) stay in place there. With `dtype` bf16
    on a CPU with AVX-512 BF16, the layers hold bf16 panels and multiply inputs rounded to bf16
    instead (`bf16_linears`)."""
    if dtype == torch.bfloat16 and cpu_ops.bf16_panels_available():
        return bf16_linears(model, within)
    if cpu_ops.panel_linear_available():
        swapped = _swap(model, lambda w, b: PanelLinear(w, b, torch.float16), fits_fp16, within)
        logger.info("%d linear layers hold fp16 weights in panels and compute in fp32", swapped)
    else:
        swapped = _swap(model, HalfWeightLinear, fits_fp16, within)
        logger.info("%d linear layers hold fp16 weights for fbgemm and compute in fp32", swapped)
    return swapped


def bf16_linears(model: nn.Module, within: Sequence[nn.Module] = ()) -> int:
    """Swap every fp32 `nn.Linear` (with `within`, every one of those modules) with an even
    number of inputs for a `PanelLinear` over its weight in bf16 panels, multiplied in bf16
    dot products against inputs rounded to bf16 and summed in fp32; return how many were
    swapped."""
    swapped = _swap(
        model,
        lambda w, b: PanelLinear(w, b, torch.bfloat16),
        lambda weight: weight.shape[1] % 2 == 0,
        within,
    )
    logger.info("%d linear layers hold bf16 weights in panels and multiply in bf16", swapped)
    return swapped


def blocks_in_bf16(model: nn.Module) -> int:
    """Have every block layer of a bf16-panel model multiply in bf16 dot products, as its other
    layers do, where it can (`PanelLinear.multiply_in_bf16`); return how many do."""
    layers = [m for m in model.modules() if isinstance(m, PanelLinear) and m.block_format]
    count = sum(layer.multiply_in_bf16() for layer in layers)
    if count:
        logger.info("%d linear layers multiply their blocks in bf16", count)
    return count


def pack_linears(model: nn.Module) -> int:
    """Swap every fp32 `nn.Linear` for one whose weight is packed ahead of time; return how many
    were swapped."""
    if cpu_ops.panel_linear_available():
        swapped = _swap(model, PanelLinear, lambda weight: True)
        logger.info("%d linear layers hold fp32 weights in panels", swapped)
    else:
        swapped = _swap(model, PackedLinear, lambda weight: True)
        logger.info("%d linear layers hold weights packed for oneDNN", swapped)
    return swapped


def _mixed_blocks(layers: list[PanelLinear]) -> bool:
    """Whether `layers` hold block panels (multiplied widened, not against 8-bit activations)
    of more than one format over the same inputs."""
    formats = {layer.panels.shape[2] for layer in layers}
    return (
        len(formats) > 1
        and all(layer.panels.dtype == torch.uint8 for layer in layers)
        and len({layer.in_features for layer in layers}) == 1
    )


def use_gguf_blocks(
    model: nn.Module,
    blocks: gguf_blocks.Blocks,
    int8_activations: bool = False,
) -> int:
    """Swap each fp32 `nn.Linear` named in `blocks` for a `PanelLinear` over its GGUF blocks,
    where they widen to exactly its weight; return how many were swapped. With
    `int8_activations`, the blocks multiply against inputs rounded to 8-bit blocks instead
    (faster, approximate). Run before `pack_linears`, which packs the rest."""
    swapped, rounded, mismatched = 0, 0, []
    for name, (fmt, rows) in blocks.items():
        parent_name, _, child = name.rpartition(".")
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            continue
        if type(linear) is not nn.Linear or linear.weight.dtype != torch.float32:
            continue
        if not gguf_blocks.holds(fmt, rows, linear.weight):
            mismatched.append(name)
            continue
        rounding = int8_activations and gguf_blocks.rounds_inputs(name, blocks)
        candidate = PanelLinear.of_blocks(fmt, rows, linear.bias, rounding)
        setattr(model.get_submodule(parent_name), child, candidate)
        swapped += 1
        rounded += candidate.int8_activations
    if mismatched:
        logger.warning(
            "quantized blocks that do not hold their layer's weights: %d (%s, ...); "
            "those layers keep fp32 panels",
            len(mismatched),
            mismatched[0],
        )
    logger.info("%d linear layers hold quantized blocks (exactly their fp32 weights)", swapped)
    if int8_activations:
        logger.info("%d of them multiply against activations rounded to 8-bit blocks", rounded)
    return swapped


def _swap(
    model: nn.Module,
    layer: Callable[[torch.Tensor, torch.Tensor | None], nn.Module],
    accepts: Callable[[torch.Tensor], bool],
    within: Sequence[nn.Module] = (),
) -> int:
    """Swap `model`'s fp32 `nn.Linear` layers (with `within`, all of those modules' ones) whose
    weight `accepts` for `layer(weight, bias)`; return how many were swapped."""
    inside = {id(m) for part in within for m in part.modules()}
    swapped = 0
    replaced = malloc_tuning.FreedMemory()  # the weights swapped out go back as the swaps go
    # By name, not holding the layers: each one swapped out is freed before the next is made.
    for parent, name in [(parent, name) for parent, name, _ in _linears(model)]:
        linear = getattr(parent, name)
        weight, bias = linear.weight, linear.bias
        taken = id(linear) in inside if within else weight.dtype == torch.float32
        del linear
        if not taken or not accepts(weight):
            continue
        setattr(parent, name, layer(weight, bias))
        swapped += 1
        nbytes = weight.nbytes
        del weight, bias
        replaced.freed(nbytes)
    return swapped


def _linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear]]:
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear:
                yield parent, name, child


CPU_LINEAR_TYPES = (PanelLinear, PackedLinear, HalfWeightLinear)


def widen_all_but_kernels(model: nn.Module) -> None:
    """Every floating-point parameter and buffer of `model` in fp32, as `model.float()` makes
    them, except those of the kernels' layers (`CPU_LINEAR_TYPES`), whose panels stay as they
    are held. Each tensor widens alone: the model is never held twice."""
    for module in model.modules():
        if not isinstance(module, CPU_LINEAR_TYPES):
            module._apply(_to_fp32, recurse=False)


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.is_floating_point() else tensor
