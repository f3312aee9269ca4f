"""The fused CPU decode: a step of decode rows through a decoder layer, or the whole stack, in
one C++ op (`csrc/fused_decode/`).

It computes what the layers compute op by op, to the bit: the same kernels in the same order
(norm (none in OLMo 2's layer), q/k/v, each q and k head's norm where the layer has them (Qwen3,
Gemma 3; q's and k's heads each normed as one row in OLMo 2; after the rotary in Hunyuan),
rotary of all, some (Phi-4-mini) or none (SmolLM3's NoPE layers) of each head's dims, their
halves or neighbouring pairs (GLM, ERNIE 4.5, Helium), K/V stored at their slots, paged
attention (with gpt-oss's sinks), output projection (normed before the residual in Gemma's and
OLMo 2's layers) and residual, norm, gate/up, activation (silu, or Gemma's GELU), down (normed
again in Gemma's and OLMo 2's) and residual), without the dispatch of two dozen small ops a
layer. A layer of experts runs its attention so (up to the attention's residual add), then its
norm, router and experts as the layer's own `mlp_block` (the experts themselves one op,
`ExpertLinears.group`). Its attention is Conveyor's CPU paged attention, so it runs where that
backend hands out a `DecodeStep` (every row decodes, the cache holds a dtype it reads).

`choose` decides once, when the model is built, how decode steps run: the whole stack as one op,
one op per layer, or op by op, with the reason when the fused routes do not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import torch
from torch import nn

from engine.attention.backend import DecodeStep, softcap_of, window_of
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear

# The step's cos and sin: under None, or under each layer type with a table of its own.
RotaryTables = Mapping[str | None, tuple[torch.Tensor, torch.Tensor]]

# Projections the fused layer takes: panels, or gate/up panel pairs.
PANEL_TYPES = (PanelLinear, GatedPanelLinear)


# Why a stack with layers of experts runs a layer at a time.
EXPERTS_BETWEEN = "mixture-of-experts layers: their experts run between the layers' ops"


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
    gelu_tanh: bool
    qk_norm_weight: torch.Tensor | None
    qk_norm_eps: float
    # A sliding window, or None (`LayerAttention`).
    attention: Any
    # The norm of the attention's input (None: nothing is normed there, OLMo 2's layer).
    input_norm: Any
    # The norms of the attention's and the MLP's outputs before they join the residual
    # (Gemma's, OLMo 2's), or None.
    output_norms: tuple[Any, Any] | None
    # The layer's type, whose rotary table it takes where the frequencies differ by type.
    layer_type: str | None
    qkv_proj: nn.Module
    o_proj: nn.Module
    # The gated MLP's projections (a layer of experts has none).
    gate_up_proj: nn.Module
    down_proj: nn.Module
    # A mixture of experts in place of the gated MLP, or None.
    moe: Any

    @property
    def mlp_norm(self) -> Any:
        """The norm of the MLP's input (None where the attention's input has none either)."""

    @property
    def experts_as_llama(self) -> bool:
        """A layer of experts whose block after the attention is the Llama layer's."""

    def mlp_block(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows after the attention's residual add through the layer's MLP (or experts')
        block."""


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
    # Each q and k head's norm weight, `[heads + kv heads, head dim]`; or q's and k's side by
    # side, `[(heads + kv heads) * head dim]`, each normed over all its heads at once (OLMo 2's);
    # None: not normed.
    qk_norm: torch.Tensor | None = None
    # False for a layer that rotates neither q nor k (SmolLM3's NoPE layers).
    rotates: bool = True
    # The attention's and the MLP's output norms' weights (Gemma's), or None.
    out_norms: tuple[torch.Tensor, torch.Tensor] | None = None
    # gelu(gate) * up (tanh's approximation) instead of silu(gate) * up.
    gelu: bool = False
    # The step's rotary table the layer takes (None: the model's one table).
    rotary: str | None = None
    # What the attention's and the MLP's outputs are multiplied by before they join the
    # residual (Granite's residual multiplier).
    residual_scale: float = 1.0
    # The attention's score cap (Gemma 2's), or 0.
    softcap: float = 0.0
    # The rotary turns neighbouring dims as pairs (GLM's), not halves.
    pairs: bool = False
    # The q/k norm comes after the rotary (Hunyuan's), not before it.
    norms_rotated: bool = False
    # A logit per query head joining each head's softmax with no value (gpt-oss's sinks), fp32
    # `[heads]`, or None.
    sinks: torch.Tensor | None = None
    # A layer of experts: the op stops after the attention's residual add and this runs the
    # rest (the layer's `mlp_block`); None: the op runs the layer's gated MLP.
    experts: Callable[[torch.Tensor], torch.Tensor] | None = None


def why_not_fused(layer: FusibleLayer) -> str:
    """Why the fused layer does not compute this layer ("" where it does): it needs projections
    in Conveyor's panels, fp32 norms with one epsilon (before the attention and the MLP, after
    them, or both), silu or GELU (tanh) gating, q, k and v made as the Llama layer makes them
    (q/k norms, where it has them, head by head or over all heads at once, before or after a
    rotary of all, some or none of each head's dims, their halves or neighbouring pairs), and
    the kernels built. A layer of experts needs the same of its attention, and the Llama
    layer's block after it (`experts_as_llama`)."""
    experts = getattr(layer, "moe", None) is not None
    if experts and not layer.experts_as_llama:
        return "a mixture-of-experts block of its own after the attention"
    sinks = _sinks(layer)
    if sinks is not None and (sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        return "attention sinks not fp32"
    projections = [layer.qkv_proj, layer.o_proj]
    if not experts:
        projections += [layer.gate_up_proj, layer.down_proj]
    pre_norms = (layer.input_norm, layer.mlp_norm)
    norms = [n for n in (*pre_norms, *(layer.output_norms or ())) if n is not None]
    if (pre_norms[0] is None) != (pre_norms[1] is None):
        return "a norm before the attention or the MLP, not both"
    if not norms:
        return "no norms"
    if getattr(layer, "rotary_dim", 0) % 2:
        return "an odd number of dims rotating"
    if not cpu_ops.has("fused_decode"):
        return "the fused_decode kernels are not built"
    if not (experts or getattr(layer, "gated", True)):
        return "an MLP without a gate"
    if not (experts or layer.silu or layer.gelu_tanh):
        return "the activation is neither silu nor GELU's tanh approximation"
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
    if any(n.variance_epsilon != norms[0].variance_epsilon for n in norms):
        return "two norm epsilons in a layer"
    if layer.qk_norm_weight is not None and layer.qk_norm_eps != norms[0].variance_epsilon:
        return "a q/k norm epsilon of its own"
    return ""


def _sinks(layer: FusibleLayer) -> torch.Tensor | None:
    """The layer's attention sinks (`LayerAttention`), or None."""
    features = getattr(layer, "attention", None)
    return None if features is None else features.sinks


def _why_qk_norm_not_fused(layer: FusibleLayer) -> str:
    """Why the fused layer does not compute this layer's q/k norms ("" where it has none or they
    fuse): each head normed by one fp32 weight row (or q's and k's heads each as one row, OLMo
    2's), before the rotary or after it (Hunyuan's), as the Llama layer norms them."""
    weight = layer.qk_norm_weight
    if weight is None:
        return ""
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return "q/k norm weights not fp32"
    return ""


def layer_weights(layer: FusibleLayer, rotary_kinds: Collection[str] = ()) -> LayerWeights:
    """The layer's tensors as the ops take them; `rotary_kinds`: the layer types with a rotary
    table of their own."""
    experts = layer.moe is not None
    panels: list[Any] = [layer.qkv_proj, layer.o_proj]
    if not experts:
        panels += [layer.gate_up_proj, layer.down_proj]
    mlp = [p.panels for p in panels[2:]] or [torch.empty(0), torch.empty(0)]
    out_norms = layer.output_norms
    norms = [n for n in (layer.input_norm, *(out_norms or ())) if n is not None]
    return LayerWeights(
        index=layer.index,
        weights=[
            _norm_weight(layer.input_norm),
            panels[0].panels,
            panels[1].panels,
            _norm_weight(layer.mlp_norm),
            *mlp,
        ],
        biases=[p.padded_bias for p in panels] + [None] * (4 - len(panels)),
        heads=[layer.num_heads, layer.num_kv_heads, layer.head_dim],
        eps=float(norms[0].variance_epsilon),
        scale=layer.scaling,
        window=window_of(layer.attention),
        qk_norm=layer.qk_norm_weight,
        rotates=bool(getattr(layer, "rotates", True)),
        out_norms=None if out_norms is None else (out_norms[0].weight, out_norms[1].weight),
        gelu=layer.gelu_tanh,
        rotary=layer.layer_type if layer.layer_type in rotary_kinds else None,
        residual_scale=residual_scale(layer),
        softcap=softcap_of(layer.attention),
        pairs=bool(getattr(layer, "paired_rotary", False)),
        norms_rotated=bool(getattr(layer, "norms_rotated", False)),
        sinks=_sinks(layer),
        experts=layer.mlp_block if experts else None,
    )


def _norm_weight(norm: Any) -> torch.Tensor:
    """A norm's weight as the ops take it: empty where the layer norms nothing there (OLMo 2's
    layer before its attention and its MLP)."""
    return torch.empty(0) if norm is None else norm.weight


def residual_scale(layer: FusibleLayer) -> float:
    """Granite's residual multiplier, 1 for a layer without one."""
    multiplier = getattr(layer, "residual_multiplier", None)
    return 1.0 if multiplier is None else float(multiplier)


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
    windows: tuple[int, ...] = ()
    out_norms: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] = ()
    gelu: tuple[bool, ...] = ()
    residual_scales: tuple[float, ...] = ()
    softcaps: tuple[float, ...] = ()
    pairs: tuple[bool, ...] = ()
    norms_rotated: tuple[bool, ...] = ()
    sinks: tuple[torch.Tensor | None, ...] = ()

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
            tuple(layer.window for layer in layers),
            tuple(layer.out_norms for layer in layers),
            tuple(layer.gelu for layer in layers),
            tuple(layer.residual_scale for layer in layers),
            tuple(layer.softcap for layer in layers),
            tuple(layer.pairs for layer in layers),
            tuple(layer.norms_rotated for layer in layers),
            tuple(layer.sinks for layer in layers),
        )

    def __call__(
        self, hidden: torch.Tensor, tables: RotaryTables, step: DecodeStep
    ) -> torch.Tensor:
        """The decode rows through every layer; `tables`: the step's cos and sin, under None, or
        under each layer type with a table of its own."""
        cache = step.kv_cache
        if self.route is DecodeRoute.STACK:
            first = self.layers[0]
            rows = [tables[layer.rotary] for layer in self.layers]
            return cpu_ops.decode_layers(
                hidden,
                list(self.weights),
                list(self.biases),
                first.heads,
                [cos for cos, _ in rows],
                [sin for _, sin in rows],
                [cache.key(layer.index) for layer in self.layers],
                [cache.value(layer.index) for layer in self.layers],
                step.slot_mapping,
                step.block_table,
                step.seq_lens,
                first.eps,
                first.scale,
                list(self.windows),
                list(self.qk_norms),
                list(self.rotates),
                list(self.out_norms),
                list(self.gelu),
                list(self.residual_scales),
                list(self.softcaps),
                list(self.pairs),
                list(self.norms_rotated),
                list(self.sinks),
            )
        for layer in self.layers:
            cos, sin = tables[layer.rotary]
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
                layer.out_norms,
                layer.gelu,
                layer.residual_scale,
                layer.softcap,
                layer.pairs,
                layer.norms_rotated,
                layer.sinks,
            )
            if layer.experts is not None:
                hidden = layer.experts(hidden)
        return hidden

    def describe(self) -> str:
        return f"{self.route} ({self.reason})" if self.reason else str(self.route)


def choose(layers: Sequence[FusibleLayer], rotary_kinds: Collection[str] = ()) -> FusedDecode:
    """The decode route for these layers (`rotary_kinds`: the layer types with a rotary table of
    their own): the whole stack as one op where every layer fuses with the same heads, epsilon
    and scale (each its own window and rotary); one op per layer where every layer fuses; else
    op by op, with the first layer's reason."""
    reasons = [why_not_fused(layer) for layer in layers]
    if not layers or any(reasons):
        reason = next((r for r in reasons if r), "no layers")
        return FusedDecode(DecodeRoute.OPS, reason=reason)
    fused = tuple(layer_weights(layer, rotary_kinds) for layer in layers)
    if any(layer.experts is not None for layer in fused):
        return FusedDecode.of(DecodeRoute.LAYERS, fused, reason=EXPERTS_BETWEEN)
    first = fused[0]
    shape = (first.heads, first.eps, first.scale)
    if all((f.heads, f.eps, f.scale) == shape for f in fused):
        return FusedDecode.of(DecodeRoute.STACK, fused)
    return FusedDecode.of(DecodeRoute.LAYERS, fused, reason="the layers differ in shape")
