"""Mamba2's mixer over the state cache, as Granite 4's, Nemotron-H's and Falcon-H1's layers
compute it: each normed row is projected to a gate `z`, the convolved inputs (`x`, `B`, `C`,
through a short causal convolution with a bias, then silu) and each head's step `dt`; the scan
(`ssd.py`) runs over them, and its output is normed in groups after a silu(z) gate (the model's
own gated norm: Falcon-H1's may gate after it, or only gate). A request keeps its convolution's
last inputs and its scan's state `[heads, head dims, state dims]` in the state cache; the
family's layer projects the mixer's output and adds it to its residual.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv.state_cache import StateCache, StateSpec, convolved_state_specs
from engine.models.mixer_layer import MixerLayer
from engine.models.ssd import ScanParams, scan
from engine.parallel.group import ParallelGroup
from engine.parallel.layers import SplitGatedNorm


class Mamba2Mixer(nn.Module):
    """A Hugging Face Mamba2 mixer's weights and constants (`in_proj`, `conv1d`, `A_log`, `D`,
    `dt_bias`, the gated `norm`, `out_proj`), run over the step's rows from each request's states
    at `index` (its convolution's inputs) and `index + 1` (its scan's state)."""

    def __init__(
        self,
        mixer: Any,
        in_scale: float = 1.0,
        projection_scale: torch.Tensor | None = None,
        group: ParallelGroup | None = None,
    ) -> None:
        """`in_scale` multiplies the rows before the first projection, `projection_scale`
        (`[projected width]`) its output (Falcon-H1's multipliers). Under tensor parallelism
        (`group`) the mixer is the rank's share of the heads (`parallel.sharding`); where its
        norm's one group lies across the ranks, the norm adds their sums of squares."""
        super().__init__()
        self.mixer = mixer
        self.in_scale = in_scale
        self.projection_scale = projection_scale
        # Whether the scan's output is normed in groups after (or before) its gate, or only
        # gated (Falcon-H1 without `mamba_rms_norm`).
        self.normed = not isinstance(mixer.norm, nn.Identity)
        self.heads, self.head_dim = int(mixer.num_heads), int(mixer.head_dim)
        self.state_dims, self.groups = int(mixer.ssm_state_size), int(mixer.n_groups)
        self.inner = int(mixer.intermediate_size)
        self.in_proj, self.out_proj = mixer.in_proj, mixer.out_proj
        # The taps `[width, channels]`, oldest input first.
        self.taps = mixer.conv1d.weight.detach()[:, 0].t().contiguous()
        self.conv_bias = mixer.conv1d.bias
        self.params = ScanParams.of(mixer)
        split = group is not None and int(getattr(mixer, "norm_ranks", 1)) > 1
        self.norm = SplitGatedNorm(mixer.norm, group) if split and group else mixer.norm

    def state_specs(self) -> list[StateSpec]:
        """A request's convolution inputs and its scan's state."""
        return convolved_state_specs(self.taps, (self.heads, self.head_dim, self.state_dims))

    def forward(
        self, normed: torch.Tensor, states: StateCache, index: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The gated, normed scan of the normed rows `[tokens, hidden]`: `[tokens, inner]` in
        `dtype` (the residual's), the output projection's input."""
        channels = self.taps.shape[1]
        if self.in_scale != 1.0:
            normed = normed * self.in_scale
        projected = self.in_proj(normed)
        if self.projection_scale is not None:
            projected = projected * self.projection_scale
        z, inputs, dt = projected.split([self.inner, channels, self.heads], dim=-1)
        inputs = states.convolve(index, inputs, self.taps, self.conv_bias, silu=True)
        tokens, grouped = inputs.shape[0], self.groups * self.state_dims
        x, b, c = inputs.split([self.inner, grouped, grouped], dim=-1)
        scanned = scan(
            states,
            index + 1,
            x.reshape(tokens, self.heads, self.head_dim),
            dt,
            b.reshape(tokens, self.groups, self.state_dims),
            c.reshape(tokens, self.groups, self.state_dims),
            self.params,
        )
        scanned = scanned.reshape(tokens, self.inner)
        if not self.normed:
            return (scanned * F.silu(z)).to(dtype)
        return self.norm(scanned, z).to(dtype)


def why_not_mixed(mixer: Any) -> str:
    """Empty where Conveyor's mixer computes this Mamba2 mixer (its convolution through silu),
    else why not."""
    if mixer.activation != "silu":
        return f"its Mamba2 layers convolve through {mixer.activation}, not silu"
    return ""


class Mamba2Layer(MixerLayer):
    """A layer whose mixer is Mamba2 (Granite 4's, Bamba's), then the family's MLP block; under
    tensor parallelism it holds the rank's heads and their states."""

    states_split = True

    def mixer_of(self, mixer: Any, group: ParallelGroup | None) -> Mamba2Mixer:
        return Mamba2Mixer(mixer, group=group)
