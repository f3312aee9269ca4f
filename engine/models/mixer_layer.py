"""A decoder layer whose token mixer is a recurrence over the state cache instead of attention
(Mamba's and Mamba2's, as Jamba's, Granite 4's and Bamba's layers run them), then the family's
MLP block: the layer norms its rows, the mixer mixes them from each request's states, and the
family's `after_attention` projects the mix onto the residual and runs the MLP.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

import torch
from torch import nn

from engine.attention.backend import AttentionMetadata
from engine.kv.state_cache import StateCache, StateSpec
from engine.lora.adapter import Shapes
from engine.models.llama import PagedLlamaLayer
from engine.parallel.group import ParallelGroup
from engine.parallel.layers import reduced


class RecurrentMixer(Protocol):
    """A mixer over the state cache: its first and output projections, how its output splits
    into heads (`heads` of `head_dim`), its states, and its forward."""

    in_proj: nn.Module
    out_proj: nn.Module
    heads: int
    head_dim: int

    def state_specs(self) -> list[StateSpec]: ...

    def __call__(
        self, normed: torch.Tensor, states: StateCache, index: int, dtype: torch.dtype
    ) -> torch.Tensor: ...


def layer_states(metadata: AttentionMetadata) -> StateCache:
    """The step's state cache, which a recurrent layer reads."""
    states = metadata.kv_cache.states
    assert states is not None, "a recurrent model runs with its states"
    return states


class MixerLayer(PagedLlamaLayer):
    """A layer whose `self_attn` (of the layer's view) is the mixer `mixer_of` wraps; `index` is
    the place of its first state (its convolution's last inputs; the recurrence's follows)."""

    # Whether the mixer splits by heads under tensor parallelism (Mamba2's).
    states_split = False
    # LoRA adapters of the layer's MLP apply; the mixer's own projections take none.
    adapted = True

    def mixer_of(self, mixer: Any, group: ParallelGroup | None) -> RecurrentMixer:
        raise NotImplementedError

    def _attention_parts(self, mixer: Any, group: Any) -> None:
        self.mamba = self.mixer_of(mixer, group)
        self.num_heads, self.head_dim = self.mamba.heads, self.mamba.head_dim
        self.qkv_proj = self.mamba.in_proj  # the first projection (its rows' dtype)
        # Takes each head's dims side by side (summed over the ranks' heads).
        self.o_proj = reduced(self.mamba.out_proj, group)
        self.attention = None
        self.layer_type = "linear_attention"

    def _target_shapes(self) -> Shapes:
        """Its dense MLP's projections (none where its MLP is experts)."""
        return self._mlp_shapes(cast(int, self.mamba.in_proj.in_features))

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
        mixed = self.mamba(normed, layer_states(metadata), self.index, hidden.dtype)
        return self.after_attention(mixed.view(-1, self.num_heads, self.head_dim), hidden, lora)
