"""The building blocks of Conveyor's decoders, each computing what Hugging Face's module
computes: on the CPU through Conveyor's one-pass kernels where they apply (fp32 rows, kernels
built), else through torch's own ops. A model file calls these and never picks a kernel itself."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import CPU_LINEAR_TYPES, PanelLinear, takes_bf16_rows


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, bf16_rows: bool = False
) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, scale in the input dtype. `weight` is `[dim]`
    or broadcasts against `x` (one row per head). With `bf16_rows`, for a product over bf16
    panels, Conveyor's one-pass kernel hands its fp32 rows over rounded to bf16, as that product
    would round them (elsewhere they stay fp32)."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        if _one_pass_norm(x, weight):
            return cpu_ops.rms_norm(x, weight, eps, bf16_rows)
        return F.rms_norm(x, weight.shape, weight, eps)
    if _one_pass_head_norm(x, weight):
        return cpu_ops.head_rms_norm(x, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _one_pass_head_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernel norms each head: q/k heads it takes (`_kernel_heads`) by
    an fp32 `[heads, dim]` weight."""
    return one_pass_heads(x, weight) and weight.shape == x.shape[1:]


def _kernel_heads(x: torch.Tensor) -> bool:
    """Heads Conveyor's one-pass CPU kernels (head norm, rotary) take: fp32 `[tokens, heads,
    dim]` on the CPU, heads and dims contiguous (tokens at any stride), the kernels built."""
    return (
        x.is_cpu
        and x.dtype == torch.float32
        and x.dim() == 3
        and x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cpu_ops.has("elementwise")
    )


def fp32_scaled_norm(
    hidden: torch.Tensor, norm: Any, projection: nn.Module | None = None
) -> torch.Tensor:
    """An RMSNorm that scales in fp32 before it rounds (Gemma's, whose `norm` holds one more
    than the checkpoint's weight; gpt-oss's; Helium's): Conveyor's one-pass kernel for fp32
    rows (rounded to bf16 for bf16 panels, where `projection` takes them); 16-bit rows
    normalised and scaled in fp32, cast to their dtype after."""
    if hidden.dtype == torch.float32:
        bf16_rows = projection is not None and takes_bf16_rows(projection)
        return rms_norm(hidden, norm.weight, norm.variance_epsilon, bf16_rows)
    return scaled_in_fp32(hidden, norm.weight, norm.variance_epsilon)


def module_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """`x` through a family's RMSNorm module: Conveyor's one-pass kernel for fp32 rows on the
    CPU (the module's operations in fp32, as the fused CPU decode norms its rows), else the
    module itself."""
    if x.dtype == torch.float32 and _one_pass_norm(x, norm.weight):
        return cpu_ops.rms_norm(x, norm.weight, float(norm.variance_epsilon))
    return cast(torch.Tensor, norm(x))


def one_pass_heads(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernels take these heads (fp32 `[tokens, heads, dim]`, heads and
    dims contiguous) and this fp32 weight."""
    return _kernel_heads(x) and weight.dtype == torch.float32 and weight.is_contiguous()


def scaled_in_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """An RMSNorm of 16-bit rows (or heads): normalised and scaled by `weight` in fp32, cast to
    the rows' dtype after."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight).to(x.dtype)


def _one_pass_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernel applies: fp32 rows on the CPU, kernels built."""
    return (
        x.is_cpu
        and x.dim() == 2
        and x.is_contiguous()
        and weight.dtype == torch.float32
        and cpu_ops.has("elementwise")
    )


def fuse(linears: list[nn.Module]) -> nn.Module:
    """One projection whose output is the given projections' outputs side by side; panels are
    joined as held where they line up (GGUF blocks stay blocks). Plain linear layers keep no
    second copy: each source's weight (and bias) becomes a view of its rows of the fused one, so
    the model they came from still computes what it did, over the same memory."""
    if all(isinstance(m, PanelLinear) for m in linears):
        joined = PanelLinear.joined(cast(list[PanelLinear], linears))
        if joined is not None:
            return joined
    with torch.no_grad():
        weight = torch.cat([cast(torch.Tensor, m.weight) for m in linears])
        biases = [cast(torch.Tensor | None, m.bias) for m in linears]
        bias = None if biases[0] is None else torch.cat(cast(list[torch.Tensor], biases))
    if isinstance(linears[0], CPU_LINEAR_TYPES):
        return linears[0].remade(weight, bias)
    with torch.device("meta"):
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    if all(isinstance(m, nn.Linear) for m in linears):
        _share_rows(cast(list[nn.Linear], linears), fused)
    return fused


def _share_rows(linears: list[nn.Linear], fused: nn.Linear) -> None:
    """Point each of `linears` at its rows of `fused`, freeing its own copy."""
    start = 0
    for linear in linears:
        rows = slice(start, start + linear.out_features)
        linear.weight = nn.Parameter(fused.weight[rows], requires_grad=False)
        if fused.bias is not None:
            linear.bias = nn.Parameter(fused.bias[rows], requires_grad=False)
        start = rows.stop


def add_projected(projection: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + projection(x)`: in the product's own pass where the projection is Conveyor's
    panels and the residual fp32 (the same bits: addition commutes)."""
    if isinstance(projection, PanelLinear) and residual.dtype == torch.float32:
        return projection(x, residual)
    return residual + projection(x)


# The activation modules that compute silu (torch's, and transformers' own).
SILU_MODULES = frozenset({"SiLU", "SiLUActivation"})


def is_silu(act_fn: nn.Module) -> bool:
    """Whether the activation module computes silu."""
    return type(act_fn).__name__ in SILU_MODULES


def is_gelu_tanh(act_fn: nn.Module) -> bool:
    """Whether the activation module is torch's GELU under its tanh approximation (Gemma's
    `gelu_pytorch_tanh`): torch's module, or transformers' module over torch's function."""
    if isinstance(act_fn, nn.GELU):
        return act_fn.approximate == "tanh"
    act = getattr(act_fn, "act", None)
    return (
        type(act_fn).__name__ == "GELUTanh"
        and isinstance(act, functools.partial)
        and act.func is F.gelu
        and act.args == ()
        and act.keywords == {"approximate": "tanh"}
    )


def gated_activation(
    gate_up: torch.Tensor,
    act_fn: nn.Module,
    intermediate: int,
    silu: bool,
    gelu_tanh: bool = False,
) -> torch.Tensor:
    """`act_fn(gate) * up` over a fused gate/up projection's output `[rows, 2 * intermediate]`;
    in one pass on the CPU where `act_fn` is silu, or GELU under its tanh approximation."""
    if (silu or gelu_tanh) and _one_pass_gate(gate_up):
        return cpu_ops.silu_mul(gate_up) if silu else cpu_ops.gelu_tanh_mul(gate_up)
    return act_fn(gate_up[:, :intermediate]) * gate_up[:, intermediate:]


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation over gate and up side by side (`[rows, 2 * intermediate]`, gate
    first), the same operations in the same order as transformers': gate capped at `limit`, up
    clamped to `[-limit, limit]`, then `(up + 1) * gate * sigmoid(alpha * gate)`; in one pass on
    the CPU (the sigmoid in silu's operations)."""
    if _one_pass_gate(gate_up):
        return cpu_ops.clamped_swiglu_mul(gate_up, alpha, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def soft_capped(x: torch.Tensor, cap: float) -> torch.Tensor:
    """`tanh(x / cap) * cap`: logits capped as Gemma 2 and nanochat cap theirs."""
    return torch.tanh(x / cap) * cap


def _one_pass_gate(gate_up: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU activation applies: fp32 rows on the CPU, kernels built."""
    return (
        gate_up.is_cpu
        and gate_up.dtype == torch.float32
        and gate_up.dim() == 2
        and gate_up.is_contiguous()
        and cpu_ops.has("elementwise")
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in Hugging Face's half-split layout, the same operations in the same
    order: `x * cos + rotate_half(x) * sin` over `[tokens, heads, dim]`. Where `cos` is
    narrower than the heads (a partial rotary), only each head's first dims rotate."""
    width = cos.shape[-1]
    if _one_pass_rotary(x, cos):
        return cpu_ops.rotary(x, cos, sin)  # the rest of a partial rotary's heads copied
    if width < x.shape[-1]:
        return torch.cat([rotate(x[..., :width], cos, sin), x[..., width:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM's rotary over `[tokens, heads, dim]`: the first `cos.shape[-1]` dims turn as
    neighbouring pairs, each by its frequency (the first half of `cos` and `sin`, each value
    twice), the rest pass; the same operations in the same order as transformers' GLM (on the
    CPU, one pass of Conveyor's rotary kernel)."""
    if _one_pass_rotary(x, cos):
        return cpu_ops.rotary(x, cos, sin, pairs=True)
    width = cos.shape[-1]
    part, rest = x[..., :width], x[..., width:]
    cos = cos[..., : width // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : width // 2].repeat_interleave(2, dim=-1)
    turned = torch.stack((-part[..., 1::2], part[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([part * cos + turned * sin, rest], dim=-1)


def _one_pass_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernel applies: heads it takes (`_kernel_heads`), fp32 tables,
    an even number of dims rotating."""
    return _kernel_heads(x) and cos.dtype == torch.float32 and cos.shape[-1] % 2 == 0
