"""OLMo 2, OLMo 3 and OLMoE on Conveyor's decoder. OLMo 2's is the Llama layer with its norms
moved: no norm comes before the attention or the MLP; each one's output is normed before it
joins the residual; q and k are normed over all their heads at once (one weight of `heads x
head_dim`), before the rotary. The norms are the model's own modules (fp32 inside, scaled before
the cast back, as OLMo 2 computes them). OLMo 3 windows some layers and rotates each layer type
by its own frequencies. OLMoE's layer is norm-first (the Llama layer's norms) with the same q/k
norms and a mixture of experts in every layer. Decode steps run op by op: the fused C++ stack
computes the Llama layer only.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.lora.slots import LoRASlots
from engine.models.layers import rotate
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.parallel.layers import SplitHeadsNorms
from engine.parallel.sharding import Shard

# OLMo 3's layers are OLMo 2's, some of them windowed, with rotaries per layer type.
OLMO2_ARCHITECTURES = frozenset({"Olmo2ForCausalLM", "Olmo3ForCausalLM"})
# OLMoE's are norm-first, with OLMo 2's q/k norms and experts in place of the MLP.
OLMOE_ARCHITECTURES = frozenset({"OlmoeForCausalLM"})


class PostNormedLayer(PagedLlamaLayer):
    """The Llama layer with no norm before the attention or the MLP, each one's output normed
    before it joins the residual instead (OLMo 2's, EXAONE 4's)."""

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        self.post_mlp_norm = hf_layer.post_feedforward_layernorm

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        """The output projection normed onto `residual`, then the MLP's output normed onto
        that."""
        projected = self._attention_output(out, lora)
        hidden = residual + self.post_attention_norm(projected)
        mlp_out = self._mlp_output(hidden, lora)
        return hidden + self.post_mlp_norm(mlp_out)


class AllHeadsNormedLayer(PagedLlamaLayer):
    """The Llama layer with q and k each normed over all their heads at once (one weight of
    `heads x head_dim`), before the rotary (OLMo 2's, OLMoE's and MiniMax M2's); OLMoE's may
    clamp q, k and v (`clip_qkv`), q and k after their norms. Under tensor parallelism the
    norms add the ranks' sums of squares."""

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        attn = hf_layer.self_attn
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.split_norms = (
            SplitHeadsNorms(attn.q_norm, attn.k_norm, shard.group)
            if shard is not None and shard.group.is_parallel
            else None
        )
        clip = getattr(getattr(attn, "config", None), "clip_qkv", None)
        self.clip = float(clip) if clip is not None else None

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        return None  # normed over all heads at once, in `project_qkv`

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        normed = hidden
        if self.input_norm is not None:  # None: normed after the attention instead (OLMo 2)
            normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        tokens = normed.shape[0]
        qkv = self.qkv_proj(normed)
        if lora is not None and lora.adapts(self.lora_index, "qkv"):
            qkv = qkv + lora.delta(self.lora_index, "qkv", normed).to(qkv.dtype)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key = self._normed_qk(qkv[:, :q_size], qkv[:, q_size : q_size + kv_size])
        value = qkv[:, q_size + kv_size :]
        if self.clip is not None:
            query, key, value = (t.clamp(-self.clip, self.clip) for t in (query, key, value))
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        return rotate(query, cos, sin), rotate(key, cos, sin), value

    def _normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split_norms is not None:
            return self.split_norms(q, k)
        return self.q_norm(q), self.k_norm(k)


class PagedOlmo2Layer(AllHeadsNormedLayer, PostNormedLayer):
    pass


class PagedOlmo2ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "OLMo 2's layers"
    layer_class = PagedOlmo2Layer


class PagedOlmoeForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "OLMoE's q/k norms over all heads"
    layer_class = AllHeadsNormedLayer
