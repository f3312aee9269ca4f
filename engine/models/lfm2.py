"""LFM2 (Liquid AI's) on Conveyor's decoder: most layers mix tokens by a short causal convolution
instead of attention, the others attend as the Llama layer does (each q and k head normed). A
convolution layer projects each normed row to three (`B`, `C`, `x`), convolves `B * x` over the
row's last `conv_L_cache` inputs per channel, and projects `C` times that; each request keeps
its last `conv_L_cache - 1` inputs as its state between steps (`kv/state_cache.py`). Every
layer's MLP is SwiGLU (`w1`, `w3`, `w2`); the last norm is the model's `embedding_norm`. The KV
cache holds the attention layers only. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kv.state_cache import StateSpec
from engine.lora.adapter import Shapes
from engine.lora.slots import LoRASlots
from engine.models.layers import add_projected
from engine.models.llama import (
    PagedLlamaForCausalLM,
    PagedLlamaLayer,
    hybrid_layers,
    not_plain,
)
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

LFM2_ARCHITECTURES = frozenset({"Lfm2ForCausalLM"})


class _Attention:
    """LFM2's attention under the Llama layer's names."""

    def __init__(self, attn: Any) -> None:
        self.config, self.head_dim, self.scaling = attn.config, attn.head_dim, attn.scaling
        self.q_proj, self.k_proj, self.v_proj = attn.q_proj, attn.k_proj, attn.v_proj
        self.o_proj = attn.out_proj
        self.q_norm, self.k_norm = attn.q_layernorm, attn.k_layernorm
        self.sliding_window = None


class _Mlp:
    """LFM2's SwiGLU under the Llama MLP's names."""

    def __init__(self, feed_forward: Any) -> None:
        self.gate_proj, self.up_proj = feed_forward.w1, feed_forward.w3
        self.down_proj = feed_forward.w2
        self.act_fn = nn.SiLU()


class _Layer:
    """An LFM2 decoder layer under the Llama layer's names (its convolution as `self_attn`)."""

    def __init__(self, layer: Any) -> None:
        self.self_attn = _Attention(layer.self_attn) if layer.is_attention_layer else layer.conv
        self.mlp = _Mlp(layer.feed_forward)
        self.input_layernorm = layer.operator_norm
        self.post_attention_layernorm = layer.ffn_norm


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer, else why not."""
    for layer in hf_model.model.layers:
        mixer = layer.self_attn if layer.is_attention_layer else layer.conv
        names = ("q_proj", "k_proj", "v_proj", "out_proj", "in_proj")
        projections = [getattr(mixer, n) for n in names if hasattr(mixer, n)]
        ff = layer.feed_forward
        reason = not_plain([*projections, ff.w1, ff.w2, ff.w3])
        if reason:
            return reason
    return ""


class ShortConvLayer(PagedLlamaLayer):
    """An LFM2 convolution layer; `index` is its place among the model's state-keeping layers
    (its state in `StateCache.layers`). Under tensor parallelism it holds the rank's channels."""

    states_split = True
    # LoRA adapters of its MLP apply; the convolution's projections take none.
    adapted = True

    def _attention_parts(self, conv: Any, group: Any) -> None:
        self.in_proj, self.out_proj = conv.in_proj, reduced(conv.out_proj, group)
        # The taps `[width, channels]`, oldest input first.
        self.taps = conv.conv.weight.detach()[:, 0].t().contiguous()
        self.conv_bias = conv.conv.bias
        self.width = int(self.taps.shape[0])
        self.channels = int(self.taps.shape[1])
        self.attention = None
        self.layer_type = "conv"
        self.qkv_proj = self.in_proj  # the first projection (its rows' dtype)

    def _target_shapes(self) -> Shapes:
        """Its MLP's projections."""
        return self._mlp_shapes(cast(int, self.in_proj.in_features))

    def state_specs(self) -> list[StateSpec]:
        """A request's state: its last `width - 1` inputs of the convolution."""
        return [((self.width - 1, self.channels), None)]

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        normed = self._norm(self.input_norm, hidden, self.in_proj)
        b, c, x = self.in_proj(normed).chunk(3, dim=-1)
        states = metadata.kv_cache.states
        assert states is not None, "a recurrent model runs with its states"
        convolved = states.convolve(self.index, b * x, self.taps, self.conv_bias)
        mixed = add_projected(self.out_proj, c * convolved, hidden)
        lora = self.active_lora()
        return self.after_mixing(mixed, lora)

    def after_mixing(self, hidden: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        normed = self._norm(self.post_attention_norm, hidden, self.gate_up_proj)
        return self._mlp(normed, hidden, lora)


class PagedLfm2ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "LFM2's convolution layers"

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, PagedLlamaLayer, ShortConvLayer, _Layer)

    @staticmethod
    def _final_norm(base: Any) -> Any:
        return base.embedding_norm
