"""Granite 4 (`GraniteMoeHybridForCausalLM`) on Conveyor's decoder: Granite's scalars over layers
that attend (without a rotary where the config names none: Granite 4's hybrids are NoPE) or mix
tokens by Mamba2 (`ssd.py`), each followed by experts beside an MLP every token runs, or by that
MLP alone where the model has no experts (Granite 4's dense models).

A Mamba2 layer projects each normed row to a gate `z`, the convolved inputs (`x`, `B`, `C`,
through a short causal convolution with a bias, then silu) and each head's step `dt`; the scan's
output is normed in groups after a silu(z) gate and projected. A request keeps its
convolution's last inputs and its scan's state `[heads, head dims, state dims]` in the state
cache. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kv.state_cache import StateSpec, convolved_state_specs
from engine.lora.adapter import Shapes
from engine.models.experts import is_sparse
from engine.models.granite import PagedGraniteForCausalLM, PagedGraniteLayer
from engine.models.llama import hybrid_layers, not_plain
from engine.models.ssd import ScanParams, scan
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


class Mamba2Layer(PagedGraniteLayer):
    """A Granite 4 Mamba2 layer; `index` is the place of its first state (its convolution's last
    inputs; the scan's state follows)."""

    def _attention_parts(self, mixer: Any, group: Any) -> None:
        self.mixer = mixer
        self.heads, self.head_dim = int(mixer.num_heads), int(mixer.head_dim)
        self.state_dims, self.groups = int(mixer.ssm_state_size), int(mixer.n_groups)
        self.inner = int(mixer.intermediate_size)
        self.num_heads = self.heads  # the output projection's rows: each head's dims side by side
        self.qkv_proj = mixer.in_proj  # the first projection (its rows' dtype)
        self.o_proj = mixer.out_proj
        # The taps `[width, channels]`, oldest input first.
        self.taps = mixer.conv1d.weight.detach()[:, 0].t().contiguous()
        self.conv_bias = mixer.conv1d.bias
        self.params = ScanParams.of(mixer)
        self.attention = None
        self.layer_type = "linear_attention"

    def _target_shapes(self) -> Shapes:
        return {}

    def state_specs(self) -> list[StateSpec]:
        """A request's convolution inputs and its scan's state."""
        return convolved_state_specs(self.taps, (self.heads, self.head_dim, self.state_dims))

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        states = metadata.kv_cache.states
        assert states is not None, "a recurrent model runs with its states"
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        channels = self.taps.shape[1]
        z, inputs, dt = self.qkv_proj(normed).split([self.inner, channels, self.heads], dim=-1)
        inputs = states.convolve(self.index, inputs, self.taps, self.conv_bias, silu=True)
        tokens, grouped = inputs.shape[0], self.groups * self.state_dims
        x, b, c = inputs.split([self.inner, grouped, grouped], dim=-1)
        scanned = scan(
            states,
            self.index + 1,
            x.reshape(tokens, self.heads, self.head_dim),
            dt,
            b.reshape(tokens, self.groups, self.state_dims),
            c.reshape(tokens, self.groups, self.state_dims),
            self.params,
        )
        gated = self.mixer.norm(scanned.reshape(tokens, self.inner), z).to(hidden.dtype)
        return self.after_attention(gated.view(tokens, self.heads, self.head_dim), hidden)


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
        reason = not_plain(projections)
        if reason:
            return reason
        if layer.mamba is not None and layer.mamba.activation != "silu":
            return f"its Mamba2 layers convolve through {layer.mamba.activation}, not silu"
    return ""


class PagedGraniteHybridForCausalLM(PagedGraniteForCausalLM):
    name = "conveyor"

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        if any(layer.mamba is not None for layer in hf_model.model.layers):
            self.op_by_op = "Granite 4's Mamba2 layers"
        super().__init__(hf_model, shard)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return hybrid_layers(base, shard, GraniteAttentionLayer, Mamba2Layer, _Layer)
