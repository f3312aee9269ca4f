"""Conveyor's own decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3).

It takes its weights from the loaded Hugging Face model and computes the same thing with fewer
kernel launches: q, k and v come from one fused projection and gate and up from another, rotary
embeddings rotate q and k in one pass, and the layers call the paged attention directly. On the
CPU, with weights in Conveyor's panels, a step of decode rows runs each layer as one C++ op
(`csrc/fused_decode/decode_layer.cpp`) over the same kernels. The Hugging Face model stays the
oracle: greedy tokens from both must agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionMetadata, DecodeStep
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import (
    CPU_LINEAR_TYPES,
    GatedPanelLinear,
    PanelLinear,
    takes_bf16_rows,
)
from engine.models.rotary_table import RotaryTable
from engine.worker.sampler import row_argmax

ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                           "Qwen3ForCausalLM"})
LINEAR_TYPES = (nn.Linear, *CPU_LINEAR_TYPES)
# Projections the one-op decode layer takes: panels, or gate/up panel pairs.
PANEL_TYPES = (PanelLinear, GatedPanelLinear)


def supports(hf_model: Any) -> str:
    """Empty when this module can run the model, else why not."""
    name = type(hf_model).__name__
    if name not in ARCHITECTURES:
        return f"{name} is not one of {', '.join(sorted(ARCHITECTURES))}"
    layer = hf_model.model.layers[0]
    projections = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj)
    if not all(type(p) in LINEAR_TYPES for p in projections):
        return "its projections are not plain linear layers (quantized weights?)"
    return ""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             bf16_rows: bool = False) -> torch.Tensor:
    """Hugging Face's RMSNorm: normalise in fp32, scale in the input dtype. `weight` is `[dim]`
    or broadcasts against `x` (one row per head). With `bf16_rows`, for a product over bf16
    panels, Conveyor's one-pass kernel hands its fp32 rows over rounded to bf16, as that product
    would round them (elsewhere they stay fp32)."""
    if x.dtype == torch.float32 and weight.dim() == 1:
        if _one_pass_norm(x, weight):
            return cpu_ops.rms_norm(x, weight, eps, bf16_rows)
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _one_pass_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernel applies: fp32 rows on the CPU, kernels built."""
    return (x.is_cpu and x.dim() == 2 and x.is_contiguous() and weight.dtype == torch.float32
            and cpu_ops.has("elementwise"))


def fuse(linears: list[nn.Module]) -> nn.Module:
    """One projection whose output is the given projections' outputs side by side; panels are
    joined as held where they line up (GGUF blocks stay blocks)."""
    if all(isinstance(m, PanelLinear) for m in linears):
        joined = PanelLinear.joined(cast(list[PanelLinear], linears))
        if joined is not None:
            return joined
    weight = torch.cat([cast(torch.Tensor, m.weight) for m in linears])
    biases = [cast(torch.Tensor | None, m.bias) for m in linears]
    bias = None if biases[0] is None else torch.cat(cast(list[torch.Tensor], biases))
    if isinstance(linears[0], CPU_LINEAR_TYPES):
        return linears[0].remade(weight, bias)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if bias is not None:
            fused.bias.copy_(bias)
    return fused


@dataclass(frozen=True, slots=True)
class FusedWeights:
    """A layer's tensors in the order `cpu_ops.decode_layer` takes them."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    heads: list[int]
    eps: float


@dataclass(frozen=True, slots=True)
class FusedStack:
    """Every layer's `FusedWeights` back to back, as `cpu_ops.decode_layers` takes them: a
    step of decode rows through the whole stack in one op."""

    weights: list[torch.Tensor]
    biases: list[torch.Tensor | None]
    heads: list[int]
    eps: float
    scale: float
    indices: list[int]

    @classmethod
    def of(cls, layers: list[PagedLlamaLayer]) -> FusedStack | None:
        """None unless every layer runs as one op, with the same heads, epsilon and scale."""
        fused = [layer.fused for layer in layers if layer.fused is not None]
        if not layers or len(fused) != len(layers):
            return None
        first = fused[0]
        if (any(f.heads != first.heads or f.eps != first.eps for f in fused)
                or len({layer.scaling for layer in layers}) != 1):
            return None
        return cls(weights=[w for f in fused for w in f.weights],
                   biases=[b for f in fused for b in f.biases], heads=first.heads,
                   eps=first.eps, scale=layers[0].scaling,
                   indices=[layer.index for layer in layers])

    def decode(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               step: DecodeStep) -> torch.Tensor:
        cache = step.kv_cache
        return cpu_ops.decode_layers(
            hidden, self.weights, self.biases, self.heads, cos, sin,
            [cache.key(i) for i in self.indices], [cache.value(i) for i in self.indices],
            step.slot_mapping, step.block_table, step.seq_lens, self.eps, self.scale)


class PagedLlamaLayer(nn.Module):
    def __init__(self, hf_layer: Any, index: int) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.index = index
        self.head_dim = attn.head_dim
        self.num_heads = attn.q_proj.out_features // self.head_dim
        self.num_kv_heads = attn.k_proj.out_features // self.head_dim
        self.scaling = attn.scaling
        self.qkv_proj = fuse([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = attn.o_proj
        self.silu = getattr(getattr(mlp, "config", None), "hidden_act", None) == "silu"
        gated = GatedPanelLinear.of(mlp.gate_proj, mlp.up_proj) if self.silu else None
        # With `gated`, one op computes silu(gate) * up; else gate and up side by side.
        self.gate_up_proj = gated or fuse([mlp.gate_proj, mlp.up_proj])
        self.down_proj = mlp.down_proj
        self.act_fn = mlp.act_fn
        self.intermediate = mlp.gate_proj.out_features
        self.input_norm = hf_layer.input_layernorm
        self.post_attention_norm = hf_layer.post_attention_layernorm
        self.qk_norm_weight = self._qk_norm_weight(attn)
        self.qk_norm_eps = attn.q_norm.variance_epsilon if self.qk_norm_weight is not None else 0.0
        self.fused = self._fused_weights()

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        """Qwen3 normalises each q and k head; one `[q heads + kv heads, dim]` weight does both
        in one pass."""
        if getattr(attn, "q_norm", None) is None:
            return None
        return torch.cat([attn.q_norm.weight.expand(self.num_heads, -1),
                          attn.k_norm.weight.expand(self.num_kv_heads, -1)])

    def _fused_weights(self) -> FusedWeights | None:
        """The layer as one op takes it, where that op computes it: projections in Conveyor's
        panels (fp32, fp16, bf16 or GGUF blocks; gate/up maybe as gated pairs), fp32 norms with
        one epsilon, silu gating, no per-head q/k norm."""
        projections = (self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj)
        norms = (self.input_norm, self.post_attention_norm)
        if not (self.silu and self.qk_norm_weight is None
                and all(isinstance(p, PANEL_TYPES) for p in projections)
                and all(n.weight.dtype == torch.float32 and n.weight.dim() == 1 for n in norms)
                and norms[0].variance_epsilon == norms[1].variance_epsilon
                and cpu_ops.has("fused_decode")):
            return None
        panels = cast(tuple[PanelLinear | GatedPanelLinear, ...], projections)
        return FusedWeights(
            weights=[norms[0].weight, panels[0].panels, panels[1].panels,
                     norms[1].weight, panels[2].panels, panels[3].panels],
            biases=[p.padded_bias for p in panels],
            heads=[self.num_heads, self.num_kv_heads, self.head_dim],
            eps=float(norms[0].variance_epsilon))

    def decode(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               step: DecodeStep) -> torch.Tensor:
        """`forward` for a step of decode rows, in one op; needs `self.fused`."""
        fused = self.fused
        assert fused is not None
        cache = step.kv_cache
        return cpu_ops.decode_layer(
            hidden, fused.weights, fused.biases, fused.heads, cos, sin, cache.key(self.index),
            cache.value(self.index), step.slot_mapping, step.block_table, step.seq_lens,
            fused.eps, self.scaling)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        hidden = self._attention(normed, cos, sin, metadata, hidden)
        return self._mlp(self._norm(self.post_attention_norm, hidden, self.gate_up_proj), hidden)

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: nn.Module) -> torch.Tensor:
        """The normalized rows for `projection`: in bf16 where it takes bf16 rows."""
        return rms_norm(hidden, norm.weight, norm.variance_epsilon, takes_bf16_rows(projection))

    def _attention(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   metadata: AttentionMetadata, residual: torch.Tensor) -> torch.Tensor:
        """`residual` plus the attention block's output."""
        tokens = hidden.shape[0]
        qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, :qk_heads * self.head_dim].view(tokens, qk_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            qk = rms_norm(qk, self.qk_norm_weight, self.qk_norm_eps)
        qk = rotate(qk, cos, sin)
        value = qkv[:, qk_heads * self.head_dim:].view(tokens, self.num_kv_heads, self.head_dim)
        out = metadata.backend.forward(self.index, qk[:, :self.num_heads],
                                       qk[:, self.num_heads:], value, self.scaling, metadata)
        return add_projected(self.o_proj, out.reshape(tokens, self.num_heads * self.head_dim),
                             residual)

    def _mlp(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`residual` plus the MLP's output."""
        return add_projected(self.down_proj, self._activation(hidden), residual)

    def _activation(self, hidden: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, GatedPanelLinear):
            # bf16 down panels take the rows rounded as they leave the gated product.
            return self.gate_up_proj(hidden, bf16_out=takes_bf16_rows(self.down_proj))
        gate_up = self.gate_up_proj(hidden)
        if self.silu and _one_pass_gate(gate_up):
            return cpu_ops.silu_mul(gate_up)
        gate, up = gate_up[:, :self.intermediate], gate_up[:, self.intermediate:]
        return self.act_fn(gate) * up


def add_projected(projection: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """`residual + projection(x)`: in the product's own pass where the projection is Conveyor's
    panels and the residual fp32 (the same bits: addition commutes)."""
    if isinstance(projection, PanelLinear) and residual.dtype == torch.float32:
        return projection(x, residual)
    return residual + projection(x)


def _one_pass_gate(gate_up: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU activation applies: fp32 rows on the CPU, kernels built."""
    return (gate_up.is_cpu and gate_up.dtype == torch.float32 and gate_up.dim() == 2
            and gate_up.is_contiguous() and cpu_ops.has("elementwise"))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in Hugging Face's half-split layout, the same operations in the same
    order: `x * cos + rotate_half(x) * sin` over `[tokens, heads, dim]`."""
    if _one_pass_rotary(x, cos):
        return cpu_ops.rotary(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _one_pass_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """Conveyor's one-pass CPU kernel applies: fp32 on the CPU, heads and dims contiguous."""
    return (x.is_cpu and x.dtype == torch.float32 and cos.dtype == torch.float32
            and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cpu_ops.has("elementwise"))


class PagedLlamaForCausalLM(nn.Module):
    name = "conveyor"

    def __init__(self, hf_model: Any) -> None:
        super().__init__()
        base = hf_model.model
        self.embed_tokens = base.embed_tokens
        self.rotary_emb = base.rotary_emb
        self.rotary = RotaryTable(base.rotary_emb,
                                  getattr(hf_model.config, "max_position_embeddings", 0))
        self.layers = nn.ModuleList(PagedLlamaLayer(layer, i) for i, layer in
                                    enumerate(base.layers))
        self.norm = base.norm
        self.lm_head = hf_model.lm_head
        self.stack = FusedStack.of(cast(list[PagedLlamaLayer], list(self.layers)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._final_hidden(input_ids, positions, metadata, logits_indices))

    def greedy_tokens(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """`forward`'s logits' argmax per row, int64 `[len(logits_indices)]`: chosen as the LM
        head's sums leave the registers where it is bf16 panels (a decode step of 64 rows writes
        12.6 MB of the default model's logits otherwise, and reads them back to choose)."""
        hidden = self._final_hidden(input_ids, positions, metadata, logits_indices)
        if isinstance(self.lm_head, PanelLinear) and self.lm_head.chooses_greedily:
            return self.lm_head.greedy(hidden)
        return row_argmax(self.lm_head(hidden).float())

    def _final_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      metadata: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """The normalized hidden rows of the kept positions, the LM head's input."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary(hidden, positions)
        step = metadata.backend.decode_step(metadata) if _fp32_rows(hidden) else None
        if step is not None and self.stack is not None:
            hidden = self.stack.decode(hidden, cos, sin, step)
        else:
            hidden = self._layers(hidden, cos, sin, metadata, step)
        return rms_norm(hidden[logits_indices], self.norm.weight, self.norm.variance_epsilon)

    def _layers(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                metadata: AttentionMetadata, step: DecodeStep | None) -> torch.Tensor:
        """Layer by layer: each as one op where it can be, else op by op."""
        for layer in cast(list[PagedLlamaLayer], self.layers):
            if step is not None and layer.fused is not None:
                hidden = layer.decode(hidden, cos, sin, step)
            else:
                hidden = layer(hidden, cos, sin, metadata)
        return hidden


def _fp32_rows(hidden: torch.Tensor) -> bool:
    return (hidden.is_cpu and hidden.dtype == torch.float32 and hidden.dim() == 2
            and hidden.is_contiguous())
