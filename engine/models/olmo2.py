"""OLMo 2, OLMo 3 and OLMoE on Conveyor's decoder. OLMo 2's is the Llama layer with its norms
moved: no norm comes before the attention or the MLP; each one's output is normed before it
joins the residual; q and k are normed over all their heads at once (one weight of `heads x
head_dim`), before the rotary. The norms are the model's own modules (fp32 inside, scaled before
the cast back, as OLMo 2 computes them), or for fp32 rows on the CPU Conveyor's one-pass kernel
of the same operations. OLMo 3 windows some layers and rotates each layer type
by its own frequencies. OLMoE's layer is norm-first (the Llama layer's norms) with the same q/k
norms and a mixture of experts in every layer. On the CPU, OLMo 2's and OLMo 3's decode steps
run the whole stack as one C++ call (`kernels/cpu/fused_decode.py`); OLMoE's each layer's
attention as one (its experts between them), unless it clamps q, k and v (op by op).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.lora.slots import LoRASlots
from engine.models.layers import module_norm, one_pass_heads, rotate
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
        self.output_norms = (self.post_attention_norm, self.post_mlp_norm)

    @property
    def mlp_norm(self) -> Any:
        return None  # nothing is normed before the MLP

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        """The output projection normed onto `residual`, then the MLP's output normed onto
        that."""
        projected = self._attention_output(out, lora)
        hidden = residual + module_norm(projected, self.post_attention_norm)
        mlp_out = self._mlp_output(hidden, lora)
        return hidden + module_norm(mlp_out, self.post_mlp_norm)


class AllHeadsNormedLayer(PagedLlamaLayer):
    """The Llama layer with q and k each normed over all their heads at once (one weight of
    `heads x head_dim`), before the rotary (OLMo 2's, OLMoE's and MiniMax M2's). Under tensor
    parallelism the norms add the ranks' sums of squares."""

    qk_norm_all_heads = True

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        attn = hf_layer.self_attn
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm
        self.split_norms = (
            SplitHeadsNorms(attn.q_norm, attn.k_norm, shard.group)
            if shard is not None and shard.group.is_parallel
            else None
        )

    def _qk_norm_weight(self, attn: Any) -> torch.Tensor | None:
        """q's norm weight and k's side by side, `[(heads + kv heads) * head_dim]`."""
        return torch.cat([attn.q_norm.weight.detach(), attn.k_norm.weight.detach()])

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """q's heads normed as one row and k's as another (`[tokens, q heads + kv heads,
        head_dim]`): Conveyor's one-pass kernel for fp32 heads on the CPU (as the fused decode
        norms them), else the model's own norms."""
        weight = self.qk_norm_weight
        assert weight is not None
        if self.split_norms is None and one_pass_heads(qk, weight):
            return cpu_ops.all_heads_rms_norm(qk, weight, self.num_heads, self.qk_norm_eps)
        tokens = qk.shape[0]
        query, key = self._normed_qk(
            qk[:, : self.num_heads].reshape(tokens, -1), qk[:, self.num_heads :].reshape(tokens, -1)
        )
        return torch.cat([query, key], dim=1).view(tokens, -1, self.head_dim)

    def _normed_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.split_norms is not None:
            return self.split_norms(q, k)
        return self.q_norm(q), self.k_norm(k)


class PagedOlmoeLayer(AllHeadsNormedLayer):
    """OLMoE's layer, which may clamp q, k and v (`clip_qkv`), q and k after their norms."""

    def __init__(self, hf_layer: Any, index: int, shard: Shard | None = None) -> None:
        super().__init__(hf_layer, index, shard)
        clip = getattr(getattr(hf_layer.self_attn, "config", None), "clip_qkv", None)
        self.clip = float(clip) if clip is not None else None

    @property
    def qkv_as_llama(self) -> bool:
        """Without a clamp, q, k and v are OLMo 2's (`project_qkv` hands them to the Llama
        layer's), as the fused CPU decode makes them."""
        return self.clip is None and type(self)._rotate is PagedLlamaLayer._rotate

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.clip is None:
            return super().project_qkv(hidden, cos, sin, lora)
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        tokens = normed.shape[0]
        qkv = self.qkv_proj(normed)
        if lora is not None and lora.adapts(self.lora_index, "qkv"):
            qkv = qkv + lora.delta(self.lora_index, "qkv", normed).to(qkv.dtype)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        query, key = self._normed_qk(qkv[:, :q_size], qkv[:, q_size : q_size + kv_size])
        value = qkv[:, q_size + kv_size :]
        query, key, value = (t.clamp(-self.clip, self.clip) for t in (query, key, value))
        query = query.view(tokens, self.num_heads, self.head_dim)
        key = key.view(tokens, self.num_kv_heads, self.head_dim)
        value = value.view(tokens, self.num_kv_heads, self.head_dim)
        return rotate(query, cos, sin), rotate(key, cos, sin), value


class PagedOlmo2Layer(AllHeadsNormedLayer, PostNormedLayer):
    pass


class PagedOlmo2ForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedOlmo2Layer


class PagedOlmoeForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    layer_class = PagedOlmoeLayer
