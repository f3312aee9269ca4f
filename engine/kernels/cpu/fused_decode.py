"""The fused CPU decode: a step of decode rows through a decoder layer, or the whole stack, in
one C++ op (`csrc/fused_decode/`).

It computes what the layers compute op by op, to the bit: the same kernels in the same order
(norm, q/k/v, each q and k head's norm where the layer has them (Qwen3), rotary of all, some
(Phi-4-mini) or none (SmolLM3's NoPE layers) of each head's dims, K/V stored at their slots,
paged attention, output projection and residual, norm, gate/up, activation, down and
residual), without the dispatch of two dozen small ops a layer. Its attention is Conveyor's
CPU paged attention, so it runs where that backend hands out a `DecodeStep` (every row decodes,
the cache holds a dtype it reads).

`choose` decides once, when the model is built, how decode steps run: the whole stack as one op,
one op per layer, or op by op, with the reason when the fused routes do not apply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch
from torch import nn

from engine.attention.backend import DecodeStep
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear

# Projections the fused layer takes: panels, or gate/up panel pairs.
PANEL_TYPES = (PanelLinear, GatedPanelLinear)


class DecodeRoute(StrEnum):
    STACK = "whole stack as one op"
    LAYERS = "one op per layer"
    OPS = "op by op"


class FusibleLayer(Protocol):
    """What the fused decode reads from a decoder layer."""

    index: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    silu: bool
    qk_norm_weight: torch.Tensor | None
    qk_norm_eps: float
    # A sliding window, or None (`LayerAttention`).
    attention: Any
    input_norm: Any
    post_attention_norm: Any
    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module


@dataclass(frozen=True, slots=True)
class LayerWeights:
    """A layer's tensors in the order `cpu_ops.decode_layer` takes them."""

    index: int
    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    heads: list[int]
    eps: float
    scale: float
    window: int = 0
    # Each q and k head's norm weight, `[heads + kv heads, head dim]` (None: not normed).
    qk_norm: torch.Tensor | None = None
    # False for a layer that rotates neither q nor k (SmolLM3's NoPE layers).
    rotates: bool = True


def why_not_fused(layer: FusibleLayer) -> str:
    """Why the fused layer does not compute this layer ("" where it does): it needs projections
    in Conveyor's panels, fp32 norms with one epsilon, silu gating, q, k and v made as the Llama
    layer makes them (q/k norms, where it has them, before a rotary of all, some or none of each
    head's dims), and the kernels built."""
    if getattr(layer, "moe", None) is not None:
        return "a mixture-of-experts MLP"
    features = getattr(layer, "attention", None)
    if features is not None and (features.softcap is not None or features.sinks is not None):
        return "soft-capped scores or sinks"
    projections = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    norms = (layer.input_norm, layer.post_attention_norm)
    if layer.input_norm is None:
        return "no norm before the attention (OLMo 2)"
    if getattr(layer, "residual_multiplier", None) is not None:
        return "scaled residual adds (Granite)"
    if getattr(layer, "rotary_dim", 0) % 2:
        return "an odd number of dims rotating"
    if not cpu_ops.has("fused_decode"):
        return "the fused_decode kernels are not built"
    if not getattr(layer, "gated", True):
        return "an MLP without a gate"
    if not layer.silu:
        return "the activation is not silu"
    qk_norm = _why_qk_norm_not_fused(layer)
    if qk_norm:
        return qk_norm
    if not getattr(layer, "qkv_as_llama", False):
        return "q, k and v made otherwise than the Llama layer makes them"
    if not all(isinstance(p, PANEL_TYPES) for p in projections):
        return "projections not in Conveyor's panels"
    if any(getattr(p, "bf16_blocks", False) for p in projections):
        return "blocks multiplied in bf16 dot products"
    if any(isinstance(n, nn.LayerNorm) for n in norms):
        return "LayerNorms"
    if not all(n.weight.dtype == torch.float32 and n.weight.dim() == 1 for n in norms):
        return "norm weights not fp32"
    if norms[0].variance_epsilon != norms[1].variance_epsilon:
        return "two norm epsilons in a layer"
    if layer.qk_norm_weight is not None and layer.qk_norm_eps != norms[0].variance_epsilon:
        return "a q/k norm epsilon of its own"
    return ""


def _why_qk_norm_not_fused(layer: FusibleLayer) -> str:
    """Why the fused layer does not compute this layer's per-head q/k norms ("" where it has
    none or they fuse): each head normed by one fp32 weight row before the rotary, as the Llama
    layer norms them (not after it, as Hunyuan's)."""
    weight = layer.qk_norm_weight
    if weight is None:
        return ""
    if getattr(layer, "norms_rotated", False):
        return "per-head q/k norms after the rotary"
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return "q/k norm weights not fp32"
    return ""


def layer_weights(layer: FusibleLayer) -> LayerWeights:
    panels: list[Any] = [layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj]
    return LayerWeights(
        index=layer.index,
        weights=[
            layer.input_norm.weight,
            panels[0].panels,
            panels[1].panels,
            layer.post_attention_norm.weight,
            panels[2].panels,
            panels[3].panels,
        ],
        biases=[p.padded_bias for p in panels],
        heads=[layer.num_heads, layer.num_kv_heads, layer.head_dim],
        eps=float(layer.input_norm.variance_epsilon),
        scale=layer.scaling,
        window=(layer.attention.window or 0) if layer.attention is not None else 0,
        qk_norm=layer.qk_norm_weight,
        rotates=bool(getattr(layer, "rotates", True)),
    )


@dataclass(frozen=True, slots=True)
class FusedDecode:
    """How decode steps run, chosen once: `layers` is empty on the op-by-op route; the whole
    stack's weights and biases are flattened once, as `decode_layers` takes them."""

    route: DecodeRoute
    layers: tuple[LayerWeights, ...] = ()
    reason: str = ""
    weights: tuple[torch.Tensor, ...] = ()
    biases: tuple[torch.Tensor | None, ...] = ()
    qk_norms: tuple[torch.Tensor | None, ...] = ()
    rotates: tuple[bool, ...] = ()

    @classmethod
    def of(cls, route: DecodeRoute, layers: tuple[LayerWeights, ...], reason: str = ""):
        return cls(
            route,
            layers,
            reason,
            tuple(w for layer in layers for w in layer.weights),
            tuple(b for layer in layers for b in layer.biases),
            tuple(layer.qk_norm for layer in layers),
            tuple(layer.rotates for layer in layers),
        )

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: DecodeStep
    ) -> torch.Tensor:
        cache = step.kv_cache
        if self.route is DecodeRoute.STACK:
            first = self.layers[0]
            return cpu_ops.decode_layers(
                hidden,
                list(self.weights),
                list(self.biases),
                first.heads,
                cos,
                sin,
                [cache.key(layer.index) for layer in self.layers],
                [cache.value(layer.index) for layer in self.layers],
                step.slot_mapping,
                step.block_table,
                step.seq_lens,
                first.eps,
                first.scale,
                first.window,
                list(self.qk_norms),
                list(self.rotates),
            )
        for layer in self.layers:
            hidden = cpu_ops.decode_layer(
                hidden,
                layer.weights,
                layer.biases,
                layer.heads,
                cos,
                sin,
                cache.key(layer.index),
                cache.value(layer.index),
                step.slot_mapping,
                step.block_table,
                step.seq_lens,
                layer.eps,
                layer.scale,
                layer.window,
                layer.qk_norm,
                layer.rotates,
            )
        return hidden

    def describe(self) -> str:
        return f"{self.route} ({self.reason})" if self.reason else str(self.route)


def choose(layers: Sequence[FusibleLayer]) -> FusedDecode:
    """The decode route for these layers: the whole stack as one op where every layer fuses
    with the same heads, epsilon, scale and window; one op per layer where every layer fuses;
    else op by op, with the first layer's reason."""
    reasons = [why_not_fused(layer) for layer in layers]
    if not layers or any(reasons):
        reason = next((r for r in reasons if r), "no layers")
        return FusedDecode(DecodeRoute.OPS, reason=reason)
    fused = tuple(layer_weights(layer) for layer in layers)
    first = fused[0]
    shape = (first.heads, first.eps, first.scale, first.window)
    if all((f.heads, f.eps, f.scale, f.window) == shape for f in fused):
        return FusedDecode.of(DecodeRoute.STACK, fused)
    return FusedDecode.of(DecodeRoute.LAYERS, fused, reason="the layers differ in shape")
