"""Bamba (IBM's `BambaForCausalLM`) on Conveyor's decoder: the Llama layer's shape, each layer
mixing its normed rows either by attention (half of each head's dims rotated) or by Mamba2
(`mamba2.Mamba2Layer`, a request's states in the state cache), then a SwiGLU MLP. The KV cache
holds the attention layers only. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer, hybrid_layers, not_plain
from engine.models.mamba2 import Mamba2Layer, why_not_mixed
from engine.parallel.sharding import Shard

BAMBA_ARCHITECTURES = frozenset({"BambaForCausalLM"})


class _Layer:
    """A Bamba decoder layer under the Llama layer's names (its Mamba2 mixer as `self_attn`)."""

    def __init__(self, layer: Any) -> None:
        self.self_attn = layer.mamba if layer.block_type == "linear_attention" else layer.self_attn
        self.mlp = layer.feed_forward
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.pre_ff_layernorm


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer and its Mamba2 layers
    convolve through silu, else why not."""
    for layer in hf_model.model.layers:
        view, mlp = _Layer(layer), layer.feed_forward
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj")
        projections = [getattr(view.self_attn, n) for n in names if hasattr(view.self_attn, n)]
        reason = not_plain([*projections, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
        if not reason and layer.block_type == "linear_attention":
            reason = why_not_mixed(layer.mamba)
        if reason:
            return reason
    return ""


class PagedBambaForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Bamba's Mamba2 layers"

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, PagedLlamaLayer, Mamba2Layer, _Layer)

    @staticmethod
    def _final_norm(base: Any) -> Any:
        return base.final_layernorm
