"""Nemotron-H (NVIDIA's `NemotronHForCausalLM`: Nemotron-H, Nemotron Nano 2, Nemotron 3) on
Conveyor's decoder. Each of its blocks adds one mixer of its normed rows to the residual: Mamba2
(`mamba2.Mamba2Mixer`, a request's convolution inputs and scan state in the state cache),
attention without a rotary (its K/V in the paged cache), an MLP without a gate (squared ReLU), or
experts without a gate beside a shared one, chosen by sigmoid scores plus a bias (DeepSeek V3's
router, `routing.py`), in a narrower latent width where the config names one. The norms scale in
fp32 before they round. Decode steps run op by op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.lora.adapter import Shapes
from engine.lora.slots import LoRASlots
from engine.models.experts import SparseMoE, is_sparse
from engine.models.layers import add_projected, fp32_scaled_norm
from engine.models.llama import PagedLlamaForCausalLM, nope_view, not_plain
from engine.models.mamba import MambaBlock, ResidualBlock
from engine.models.mamba2 import why_not_mixed
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

NEMOTRON_H_ARCHITECTURES = frozenset({"NemotronHForCausalLM"})
# The block kinds (`config.layers_block_type`) by what they mix.
MAMBA, ATTENTION, EXPERTS = "linear_attention", "full_attention", "moe"


class _Block(ResidualBlock):
    """A Nemotron-H block: its residual plus one mixer of its normed rows, normed in fp32."""

    @staticmethod
    def _norm(norm: Any, hidden: torch.Tensor, projection: nn.Module) -> torch.Tensor:
        return fp32_scaled_norm(hidden, norm, projection)


class NemotronAttentionBlock(_Block):
    """Attention over the paged cache, q and k not rotated, its output projected onto the
    residual."""

    def _mixer_parts(self, block: Any) -> None:
        self._attention_parts(block.mixer, self.group)
        self.rotates = False
        self.layer_type = ATTENTION

    def _target_shapes(self) -> Shapes:
        hidden = int(self.qkv_proj.in_features)  # type: ignore[arg-type]  # a linear layer's
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv)} | {
            "o_proj": (q, hidden)
        }

    def after_attention(
        self, out: torch.Tensor, residual: torch.Tensor, lora: LoRASlots | None = None
    ) -> torch.Tensor:
        if lora is not None:
            return residual + self._attention_output(out, lora)
        return add_projected(self.o_proj, self._attended(out), residual)


class NemotronMambaBlock(_Block, MambaBlock):
    """Mamba2 over each request's states, its output projected onto the residual; under tensor
    parallelism the rank's heads and their states. Its mixer's own projections take no LoRA
    adapters (the attention and MLP blocks take theirs)."""

    adapted = True


class NemotronMlpBlock(_Block):
    """An MLP without a gate (`down(relu(up(x))^2)`), or experts, onto the residual."""

    def _mixer_parts(self, block: Any) -> None:
        mlp = block.mixer
        if is_sparse(mlp):
            self.moe = reduced(SparseMoE(mlp), self.group)
            self.silu = False
        else:
            self._dense_mlp(mlp, self.group)

    def _target_shapes(self) -> Shapes:
        if self.moe is not None:
            return {}
        hidden = int(self.gate_up_proj.in_features)  # type: ignore[arg-type]  # a linear layer's
        return self._mlp_shapes(hidden)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        lora = self.active_lora()
        mlp_input = self.gate_up_proj if self.moe is None else self.moe
        return self._mlp(self._norm(self.input_norm, hidden, mlp_input), hidden, lora)


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer, its experts are ones
    Conveyor runs and its Mamba2 layers convolve through silu; else why not."""
    for block in hf_model.model.layers:
        mixer, kind = block.mixer, block.block_type
        if kind == MAMBA:
            reason = not_plain([mixer.in_proj, mixer.out_proj]) or why_not_mixed(mixer)
        elif kind == ATTENTION:
            reason = not_plain([mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj])
        elif kind == EXPERTS:
            if not is_sparse(mixer):
                return "its experts are not ones Conveyor runs"
            shared = mixer.shared_experts
            latent = [
                p
                for p in (mixer.fc1_latent_proj, mixer.fc2_latent_proj)
                if not isinstance(p, nn.Identity)
            ]
            reason = not_plain([shared.up_proj, shared.down_proj, *latent])
        else:
            reason = not_plain([mixer.up_proj, mixer.down_proj])
        if reason:
            return reason
    return ""


class PagedNemotronHForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Nemotron-H's blocks"
    splits_at_attention = False

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(nope_view(hf_model, "embeddings", "norm_f"), shard)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        """Each block as its kind's layer: attention blocks indexed by their place in the KV
        cache, Mamba2 blocks by the place of their first state."""
        layers: list[nn.Module] = []
        cached, held = 0, 0
        for i, block in enumerate(base.layers):
            built: ResidualBlock
            if block.block_type == ATTENTION:
                built = NemotronAttentionBlock(block, cached, shard)
                cached += 1
            elif block.block_type == MAMBA:
                built = NemotronMambaBlock(block, held, shard)
                held += len(built.state_specs())
            else:
                built = NemotronMlpBlock(block, 0, shard)
            built.lora_index = i  # adapters' weights by the block's place in the decoder
            layers.append(built)
        return layers

    def _normed(self, hidden: torch.Tensor, logits_indices: torch.Tensor) -> torch.Tensor:
        return fp32_scaled_norm(hidden[logits_indices], self.norm)
