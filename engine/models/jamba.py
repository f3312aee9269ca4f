"""Jamba (AI21's `JambaForCausalLM`) on Conveyor's decoder: the Llama layer's shape, each layer
mixing its normed rows either by attention without a rotary or by Mamba1 (`mamba1.py`, a
request's states in the state cache), then an MLP or experts chosen by the top-k of a softmax
(their weights not renormalized). The KV cache holds the attention layers only. Decode steps run
op by op.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.experts import is_sparse
from engine.models.llama import (
    PagedLlamaForCausalLM,
    PagedLlamaLayer,
    hybrid_layers,
    nope_view,
    not_plain,
)
from engine.models.mamba1 import Mamba1Layer
from engine.parallel.sharding import Shard

JAMBA_ARCHITECTURES = frozenset({"JambaForCausalLM"})


class _Layer:
    """A Jamba decoder layer under the Llama layer's names (its Mamba1 mixer as `self_attn`)."""

    def __init__(self, layer: Any) -> None:
        self.self_attn = getattr(layer, "self_attn", None) or layer.mamba
        self.mlp = layer.feed_forward
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.pre_ff_layernorm


class JambaAttentionLayer(PagedLlamaLayer):
    """A Jamba attention layer: q and k not rotated."""

    def _attention_parts(self, attn: Any, group: Any) -> None:
        super()._attention_parts(attn, group)
        self.rotates = False
        self.layer_type = "full_attention"


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer, its experts are ones
    Conveyor runs and its Mamba layers convolve through silu; else why not."""
    for layer in hf_model.model.layers:
        mixer, mlp = _Layer(layer).self_attn, layer.feed_forward
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "x_proj", "dt_proj", "out_proj")
        projections = [getattr(mixer, n) for n in names if hasattr(mixer, n)]
        if getattr(mlp, "experts", None) is not None:
            if not is_sparse(mlp):
                return "its experts are not ones Conveyor runs"
        else:
            projections += [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        reason = not_plain(projections)
        if reason:
            return reason
        if hasattr(mixer, "in_proj") and mixer.activation != "silu":
            return f"its Mamba layers convolve through {mixer.activation}, not silu"
    return ""


class PagedJambaForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Jamba's Mamba layers"

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(nope_view(hf_model, "embed_tokens", "final_layernorm"), shard)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, JambaAttentionLayer, Mamba1Layer, _Layer)
