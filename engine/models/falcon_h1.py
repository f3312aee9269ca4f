"""Falcon-H1 (TII's `FalconH1ForCausalLM`) on Conveyor's decoder: every layer runs attention and
Mamba2 side by side over its normed rows and adds both to the residual, then a gated MLP. Its
µP multipliers stay where transformers applies them: on the embeddings and the logits, on the
attention's input, keys and output, on the Mamba2 mixer's input, its first projection's output
(a multiplier per part: `mup_vector`) and its output, and on the MLP's gate (inside the
activation) and down projection. The mixer's output is normed in groups with its gate (before or
after the norm) or only gated, as the config says. Each layer's K/V are in the paged cache and
its Mamba2 states in the state cache. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kv.state_cache import StateSpec
from engine.lora.slots import LoRASlots
from engine.models.granite import ScaledEmbedding
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer, not_plain
from engine.models.mamba2 import Mamba2Mixer, why_not_mixed
from engine.models.mixer_layer import layer_states
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

FALCON_H1_ARCHITECTURES = frozenset({"FalconH1ForCausalLM"})


class _Layer:
    """A Falcon-H1 layer under the Llama layer's names."""

    def __init__(self, layer: Any) -> None:
        self.self_attn, self.mlp = layer.self_attn, layer.feed_forward
        self.input_layernorm = layer.input_layernorm
        self.post_attention_layernorm = layer.pre_ff_layernorm


class FalconH1Layer(PagedLlamaLayer):
    """Attention (its K/V at `index` in the cache) beside Mamba2 (its states at `2 * index`),
    then the MLP; under tensor parallelism each holds the rank's heads. LoRA adapters of the
    attention and the MLP add their deltas inside the multipliers, where PEFT's merged weights
    would."""

    states_split = True
    adapted = True

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(_Layer(hf_layer), index, shard)
        config = hf_layer.self_attn.config
        mixer = hf_layer.mamba
        group = shard.group if shard is not None else None
        scale = _projection_scale(mixer, config.ssm_multipliers)
        self.mamba = Mamba2Mixer(mixer, float(config.ssm_in_multiplier), scale, group)
        self.mamba_out_proj = reduced(mixer.out_proj, group)
        self.state_index = 2 * index
        self.attention_in = float(config.attention_in_multiplier)
        self.attention_out = float(config.attention_out_multiplier)
        self.mamba_out = float(config.ssm_out_multiplier)
        self.gate_multiplier, self.down_multiplier = (float(m) for m in config.mlp_multipliers)
        # Each q head's scale, then each k head's (`key_multiplier`), over the fused q and k.
        key = float(config.key_multiplier)
        self.qk_scale = torch.tensor([1.0] * self.num_heads + [key] * self.num_kv_heads)

    def state_specs(self) -> list[StateSpec]:
        return self.mamba.state_specs()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        lora = self.active_lora()
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        mixed = self.mamba(normed, layer_states(metadata), self.state_index, hidden.dtype)
        mamba = self.mamba_out_proj(mixed) * self.mamba_out
        query, key, value = self._project(normed * self.attention_in, cos, sin, lora)
        out = metadata.backend.forward(
            self.index, query, key, value, self.scaling, metadata, self.attention
        )
        attended = self._attention_output(out, lora) * self.attention_out
        hidden = hidden + (mamba + attended)
        normed = self._norm(self.post_attention_norm, hidden, self.gate_up_proj)
        return self._mlp(normed, hidden, lora)

    def _project(
        self,
        rows: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Query, key (scaled by `key_multiplier`) and value of each row, q and k rotated."""
        tokens, heads = rows.shape[0], self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(rows)
        if lora is not None and lora.adapts(self.lora_index, "qkv"):
            qkv = qkv + lora.delta(self.lora_index, "qkv", rows).to(qkv.dtype)
        qk = qkv[:, : heads * self.head_dim].view(tokens, heads, self.head_dim)
        qk = self._rotate(qk * self.qk_scale.to(qk.device, qk.dtype)[:, None], cos, sin)
        value = qkv[:, heads * self.head_dim :].view(tokens, self.num_kv_heads, self.head_dim)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], value

    def _activation(self, hidden: torch.Tensor, lora: LoRASlots | None = None) -> torch.Tensor:
        """`act(gate * gate_multiplier) * up`."""
        gate_up = self._gate_up(hidden)
        if lora is not None and lora.adapts(self.lora_index, "gate_up"):
            gate_up = gate_up + lora.delta(self.lora_index, "gate_up", hidden).to(gate_up.dtype)
        gate, up = gate_up[:, : self.intermediate], gate_up[:, self.intermediate :]
        return self.act_fn(gate * self.gate_multiplier) * up

    def _mlp(
        self, hidden: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        return residual + self._mlp_output(hidden, lora) * self.down_multiplier


def _projection_scale(mixer: Any, multipliers: list[float]) -> torch.Tensor:
    """The multiplier of each row of the mixer's first projection (its `mup_vector`, for the
    rows it holds): one per part, z, x, B, C and dt in turn."""
    inner, heads = int(mixer.intermediate_size), int(mixer.num_heads)
    grouped = int(mixer.n_groups) * int(mixer.ssm_state_size)
    widths = [inner, inner, grouped, grouped, heads]
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(widths, multipliers, strict=True)])


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer, its Mamba2 mixers
    convolve through silu and its logits' multiplier keeps their order; else why not."""
    if float(hf_model.config.lm_head_multiplier) <= 0:
        return "its lm_head_multiplier is not positive"
    for layer in hf_model.model.layers:
        attn, mlp, mixer = layer.self_attn, layer.feed_forward, layer.mamba
        projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mixer.in_proj]
        projections += [mixer.out_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        reason = not_plain(projections) or why_not_mixed(mixer)
        if reason:
            return reason
    return ""


class PagedFalconH1ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Falcon-H1's Mamba2 mixers"

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        config = hf_model.config
        self.embed_tokens = ScaledEmbedding(self.embed_tokens, float(config.embedding_multiplier))
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        return [FalconH1Layer(layer, i, shard) for i, layer in enumerate(base.layers)]

    @staticmethod
    def _final_norm(base: Any) -> Any:
        return base.final_layernorm

    def logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        """The LM head's output times `lm_head_multiplier` (positive: each row's argmax
        stays)."""
        return super().logits(hidden, logits_indices) * self.lm_head_multiplier
