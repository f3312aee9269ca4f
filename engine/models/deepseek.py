"""DeepSeek V3 (and the models on its architecture: DeepSeek R1, Kimi K2; GLM-4.7-Flash's copy of
it) and DeepSeek V2 on Conveyor's decoder: multi-head latent attention (MLA) over a latent KV
cache, and experts chosen by their scores plus a bias (V3's, `routing`) or within the best groups
(V2's) beside shared experts, after dense first layers. V2's rotary turns neighbouring dims as
pairs in place, from turns transformers gives as complex numbers.

MLA projects each token to one latent of `kv_lora_rank` dims (normed) and one rotated key part of
`qk_rope_head_dim` dims shared by every head; each head's key and value are the latent times its
rows of `kv_b_proj`. The cache holds the latent and the rotated part only, one KV head of
`kv_lora_rank + qk_rope_head_dim` dims (576 in DeepSeek V3, against 128 heads x 192 + 128 dims
expanded). Each head's query is taken into the latent's space instead (its non-rotated part times
the head's key rows of `kv_b_proj`, the "absorbed" form), so the attention is multi-query over the
cache as it is; each head's output, in the latent's space, is then taken to the head's value dims
by its value rows of `kv_b_proj`. The scores equal transformers' `q . k` over the expanded keys
(the same sums, grouped otherwise). The cache's one plane a layer is read as both keys and values
(`KVCacheSpec.values_are_keys`); of the attention's output only the latent's dims are read.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.lora.adapter import Shapes
from engine.lora.slots import LoRASlots
from engine.models.layers import fuse, rotate, rotate_pairs
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.models.rotary_table import RotaryTable
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

# DeepSeek V3's, and GLM-4.7-Flash's (`Glm4MoeLiteForCausalLM`), the same layers.
DEEPSEEK_ARCHITECTURES = frozenset({"DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM"})
# DeepSeek V2's: its rotary in complex numbers, its own router.
DEEPSEEK_V2_ARCHITECTURES = frozenset({"DeepseekV2ForCausalLM"})


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rotary over `[tokens, heads, dim]`: dims `2i` and `2i + 1` turn as a pair by
    frequency `i` (the first half of `cos` and `sin`), written out as the turned even dims then
    the turned odd ones, the same operations in the same order as transformers'."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


class PagedDeepseekLayer(PagedLlamaLayer):
    """The Llama layer with multi-head latent attention: the cache's one KV head holds each
    token's latent and rotated key part."""

    def _attention_parts(self, attn: Any, group: Any) -> None:
        config = attn.config
        self.num_kv_heads = 1
        self.rank = int(attn.kv_lora_rank)
        self.nope_dim = int(attn.qk_nope_head_dim)
        self.rope_dim = int(attn.qk_rope_head_dim)
        self.v_dim = int(attn.v_head_dim)
        # The heads held (a rank's share of them: its rows of `kv_b_proj`).
        self.num_heads = int(attn.kv_b_proj.out_features) // (self.nope_dim + self.v_dim)
        self.head_dim = self.rank + self.rope_dim  # the latent cache's width
        self.scaling = float(attn.scaling)
        self.rotary_dim = self.rope_dim
        self.attention = None
        self.rotates = True
        self.layer_type = None
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        # q (or its low-rank down projection) and the latent with the rotated key part, from the
        # same normed rows: one projection.
        first_q = attn.q_proj if attn.q_a_proj is None else attn.q_a_proj
        self.q_width = int(first_q.out_features)
        self.qkv_proj = fuse([first_q, attn.kv_a_proj_with_mqa])
        self.q_a_norm = attn.q_a_layernorm
        self.q_b_proj = attn.q_b_proj
        self.kv_a_norm = attn.kv_a_layernorm
        # Each head's key rows `[heads, nope, rank]` and value rows `[heads, v, rank]`.
        kv_b = attn.kv_b_proj.weight.detach().view(
            self.num_heads, self.nope_dim + self.v_dim, self.rank
        )
        self.key_rows = kv_b[:, : self.nope_dim]
        self.value_rows = kv_b[:, self.nope_dim :]
        self.o_proj = reduced(attn.o_proj, group)
        self.qk_norm_weight = None
        self.qk_norm_eps = 0.0

    def _target_shapes(self) -> Shapes:
        """An adapter may target the output projection and the dense MLP's, not the latent
        projections."""
        shapes = super()._target_shapes()
        hidden = shapes["o_proj"][1]
        kept = {k: v for k, v in shapes.items() if k not in ("q_proj", "k_proj", "v_proj")}
        return kept | {"o_proj": (self.num_heads * self.v_dim, hidden)}

    def project_qkv(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        lora: LoRASlots | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each head's query in the latent's space with its rotated part `[tokens, heads,
        width]`, and the token's latent row `[tokens, 1, width]` as key and value."""
        normed = self._norm(self.input_norm, hidden, self.qkv_proj)
        tokens = normed.shape[0]
        projected = self.qkv_proj(normed)
        q, latent = projected[:, : self.q_width], projected[:, self.q_width :]
        if self.q_b_proj is not None:
            q = self.q_b_proj(self.q_a_norm(q))
        q = q.view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        compressed = self.kv_a_norm(latent[:, : self.rank]).view(tokens, 1, self.rank)
        q_rot = self._turn(q[..., self.nope_dim :], cos, sin)
        k_rot = self._turn(latent[:, self.rank :].reshape(tokens, 1, self.rope_dim), cos, sin)
        rows = self.key_rows.to(q.dtype)
        absorbed = torch.bmm(q[..., : self.nope_dim].transpose(0, 1), rows).transpose(0, 1)
        query = torch.cat([absorbed, q_rot], dim=-1)
        key = torch.cat([compressed.to(k_rot.dtype), k_rot], dim=-1)
        return query, key, key

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_interleaved(x, cos, sin) if self.interleaved else rotate(x, cos, sin)

    def _attended(self, out: torch.Tensor) -> torch.Tensor:
        """Each head's output taken from the latent's space to its value dims, side by side."""
        latent = out[..., : self.rank].transpose(0, 1)  # [heads, tokens, rank]
        values = torch.bmm(latent, self.value_rows.to(out.dtype).transpose(1, 2))
        return values.transpose(0, 1).reshape(out.shape[0], self.num_heads * self.v_dim)


class PagedDeepseekForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "multi-head latent attention"
    layer_class = PagedDeepseekLayer


class PolarRotary:
    """DeepSeek V2's rotary, which gives each position's turns as complex numbers (scaled), as
    the cos and sin `RotaryTable` reads (each frequency's twice, side by side)."""

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary
        self.rope_type = getattr(rotary, "rope_type", None)
        self.inv_freq = getattr(rotary, "inv_freq", None)

    def __call__(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        turns = self.rotary(x, position_ids)
        cos, sin = turns.real, turns.imag
        return torch.cat([cos, cos], dim=-1).to(x.dtype), torch.cat([sin, sin], dim=-1).to(x.dtype)


class PagedDeepseekV2Layer(PagedDeepseekLayer):
    """DeepSeek V2's layer: its rotary turns neighbouring dims as pairs in place (the complex
    product transformers' computes, in fp32)."""

    def _turn(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(x.float(), cos.float(), sin.float()).to(x.dtype)


class PagedDeepseekV2ForCausalLM(PagedDeepseekForCausalLM):
    layer_class = PagedDeepseekV2Layer

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(hf_model, shard)
        positions = getattr(hf_model.config, "max_position_embeddings", 0)
        self.rotary = RotaryTable(PolarRotary(hf_model.model.rotary_emb), positions)
