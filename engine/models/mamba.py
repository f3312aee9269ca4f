"""Mamba's own models, without attention (`MambaForCausalLM`, `Mamba2ForCausalLM`,
`FalconMambaForCausalLM`: Mamba, Mamba2 and Mamba-Codestral, Falcon-Mamba) on Conveyor's decoder:
each block adds its Mamba or Mamba2 mixer of its normed rows (`mamba1.py`, `mamba2.py`) to the
residual (`ResidualBlock`, which Nemotron-H's blocks share). No layer keeps K/V: the KV cache
has no layers, and its blocks only count tokens for the scheduler (and key the prefix cache's
snapshots of the states). Decode steps run op by op. Under tensor parallelism each rank keeps its
share of every mixer's heads (Mamba2) or channels (Mamba) and their states."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kv.state_cache import StateSpec
from engine.lora.adapter import Shapes
from engine.lora.slots import LoRASlots
from engine.models.layers import add_projected
from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer, nope_view, not_plain
from engine.models.mamba1 import Mamba1Mixer
from engine.models.mamba2 import Mamba2Mixer, why_not_mixed
from engine.models.mixer_layer import RecurrentMixer, layer_states
from engine.parallel.group import ParallelGroup
from engine.parallel.layers import reduced
from engine.parallel.sharding import Shard

MAMBA_ARCHITECTURES = frozenset({"MambaForCausalLM", "Mamba2ForCausalLM", "FalconMambaForCausalLM"})


def mixer_of(mixer: Any, group: ParallelGroup | None = None) -> RecurrentMixer:
    """Conveyor's mixer for a Hugging Face Mamba (it projects a step: `x_proj`) or Mamba2 one
    (the rank's share of its channels or heads under tensor parallelism, `group`)."""
    if hasattr(mixer, "x_proj"):
        return Mamba1Mixer(mixer, group)
    return Mamba2Mixer(mixer, group=group)


class ResidualBlock(PagedLlamaLayer):
    """A block that adds one mixer of its normed rows (`block.norm`, `block.mixer`) to its
    residual (Mamba's own models', Nemotron-H's); `_mixer_parts` reads the mixer. `index` is its
    place in the KV cache (a block that attends) or of its first state (a recurrent one). Under
    tensor parallelism (`shard`) the mixer is the rank's share, its output summed over the
    ranks."""

    def __init__(self, block: Any, index: int, shard: Shard | None = None) -> None:
        nn.Module.__init__(self)
        self.index = index
        self.lora_index = index  # its place in the decoder, where the model numbers it so
        self.group = shard.group if shard is not None else None
        self.input_norm, self.post_attention_norm = block.norm, None
        self.moe: nn.Module | None = None
        self.attention = None
        self.layer_type: str | None = getattr(block, "block_type", None)
        self.lora: LoRASlots | None = None
        self._mixer_parts(block)
        self._lora_shapes = self._target_shapes()

    def _mixer_parts(self, block: Any) -> None:
        raise NotImplementedError


class MambaBlock(ResidualBlock):
    """A block whose mixer is Mamba or Mamba2; with `residual_in_fp32` its residual is added in
    fp32. Under tensor parallelism it holds the rank's share of the mixer and its states."""

    states_split = True

    def _mixer_parts(self, block: Any) -> None:
        self.mamba = mixer_of(block.mixer, self.group)
        self.out_proj = reduced(self.mamba.out_proj, self.group)
        self.layer_type = "linear_attention"
        self.fp32_residual = bool(getattr(block, "residual_in_fp32", False))

    def _target_shapes(self) -> Shapes:
        return {}

    def state_specs(self) -> list[StateSpec]:
        return self.mamba.state_specs()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        normed = self._norm(self.input_norm, hidden, self.mamba.in_proj)
        mixed = self.mamba(normed, layer_states(metadata), self.index, hidden.dtype)
        residual = hidden.float() if self.fp32_residual else hidden
        return add_projected(self.out_proj, mixed, residual).to(hidden.dtype)


def why_not_run(hf_model: Any) -> str:
    """Empty where every projection of the model is a plain linear layer and its mixers
    convolve through silu, else why not."""
    for block in hf_model.backbone.layers:
        mixer = block.mixer
        names = ("in_proj", "x_proj", "dt_proj", "out_proj")
        reason = not_plain([getattr(mixer, n) for n in names if hasattr(mixer, n)])
        reason = reason or why_not_mixed(mixer)
        if reason:
            return reason
    return ""


class PagedMambaForCausalLM(PagedLlamaForCausalLM):
    name = "conveyor"
    op_by_op = "Mamba's layers"
    splits_at_attention = False

    def __init__(self, hf_model: Any, shard: Shard | None = None) -> None:
        super().__init__(nope_view(hf_model, "embeddings", "norm_f", decoder="backbone"), shard)

    def _decoder_layers(self, base: Any, shard: Shard | None) -> list[nn.Module]:
        layers: list[nn.Module] = []
        held = 0
        for block in base.layers:
            built = MambaBlock(block, held, shard)
            layers.append(built)
            held += len(built.state_specs())
        return layers
