"""Granite 4 (`GraniteMoeHybridForCausalLM`) on Conveyor's decoder: Granite's scalars over layers
that attend (without a rotary where the config names none: Granite 4's hybrids are NoPE) or mix
tokens by Mamba2 (`ssd.py`), each followed by experts beside an MLP every token runs, or by that
MLP alone where the model has no experts (Granite 4's dense models).

A Mamba2 layer mixes its normed rows by `mamba2.Mamba2Mixer` (a request's convolution inputs and
scan state in the state cache) and projects them. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from engine.models.experts import is_sparse
from engine.models.granite import PagedGraniteForCausalLM, PagedGraniteLayer
from engine.models.llama import hybrid_layers, not_plain
from engine.models.mamba2 import Mamba2Layer as GenericMamba2Layer
from engine.models.mamba2 import why_not_mixed
from engine.parallel.sharding import Shard

GRANITE_HYBRID_ARCHITECTURES = frozenset({"GraniteMoeHybridForCausalLM"})


class _SharedMlp:
    """Granite's MLP every token runs (gate and up in one projection, gate first) under the
    Llama MLP's names, where it is the layer's only MLP."""

    def __init__(self, mlp: Any) -> None:
        self.gate_up_proj, self.down_proj = mlp.input_linear, mlp.output_linear
        self.act_fn = mlp.activation


class _Layer:
    """A Granite 4 decoder layer under the Granite layer's names (its Mamba2 mixer as
    `self_attn`)."""

    def __init__(self, layer: Any) -> None:
        self.self_attn = layer.self_attn if layer.mamba is None else layer.mamba
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.post_attention_layernorm
        self.residual_multiplier = layer.residual_multiplier
        experts = layer.block_sparse_moe
        self.mlp = experts if experts is not None else _SharedMlp(layer.shared_mlp)
        self.shared_mlp = layer.shared_mlp if experts is not None else None


class GraniteAttentionLayer(PagedGraniteLayer):
    """A Granite 4 attention layer; `index` is its place in the KV cache. It rotates q and k only
    where the model has a rotary."""

    def _attention_parts(self, attn: Any, group: Any) -> None:
        super()._attention_parts(attn, group)
        self.rotates = attn.config.position_embedding_type == "rope"


class Mamba2Layer(GenericMamba2Layer, PagedGraniteLayer):
    """A Granite 4 Mamba2 layer: the Mamba2 mixer under Granite's scalars."""


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer and its Mamba2 layers
    convolve through silu, else why not."""
    for layer in hf_model.model.layers:
        mixer = layer.self_attn if layer.mamba is None else layer.mamba
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "out_proj")
        projections = [getattr(mixer, n) for n in names if hasattr(mixer, n)]
        shared = layer.shared_mlp
        projections += [shared.input_linear, shared.output_linear]
        if layer.block_sparse_moe is not None and not is_sparse(layer.block_sparse_moe):
            return "its experts are not ones Conveyor runs"
        mixed = why_not_mixed(layer.mamba) if layer.mamba is not None else ""
        reason = not_plain(projections) or mixed
        if reason:
            return reason
    return ""


class PagedGraniteHybridForCausalLM(PagedGraniteForCausalLM):
    name = "conveyor"

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        if any(layer.mamba is not None for layer in hf_model.model.layers):
            self.op_by_op = "Granite 4's Mamba2 layers"
        super().__init__(hf_model, shard)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, GraniteAttentionLayer, Mamba2Layer, _Layer)
