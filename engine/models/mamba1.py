"""Mamba's selective scan (Mamba1, as Jamba's layers mix tokens) over the state cache. Each of the
mixer's channels keeps a state `[state dims]`: a token with input `x`, step `dt` (softplus of its
projection plus a bias, one a channel) and the projections `B`, `C` `[state dims]` (shared by
the channels) decays it by `exp(dt A)` (`A = -exp(A_log)`, `[channels, state dims]`) and adds
`dt x B`; the output is `S . C + D x`, gated by silu(z).

The mixer projects each normed row to the scan's input and the gate `z`, convolves the input (a
short causal convolution with a bias, then silu), projects it to the step's rank and `B`, `C`
(each normed: Jamba's), and the step up to the channels. A request keeps its convolution's last
inputs and the scan's state `[channels, state dims]` (fp32) in the state cache. Decode rows run
together (rows verifying drafts in order, each from the state the row before it left), on the CPU
in Conveyor's kernel (`csrc/recurrent/mamba1_scan.cpp`), elsewhere over their gathered states; a
prompt's tokens run in turn, on the CPU in that kernel, elsewhere within chunks of `SCAN_CHUNK`
whose decays and writes are computed at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kv.state_cache import StateCache, StateSpec, convolved_state_specs
from engine.models import scan_decode
from engine.models.mixer_layer import MixerLayer
from engine.parallel.group import ParallelGroup
from engine.parallel.layers import reduced

# Tokens whose decays and writes a prompt's scan computes at once (`[tokens, channels, state
# dims]` each), before it takes them in turn.
SCAN_CHUNK = 64


class Mamba1Mixer(nn.Module):
    """A Hugging Face Mamba1 mixer's weights (`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`,
    `D`, `out_proj`, and Jamba's or Falcon-Mamba's norms of the step, `B` and `C`), run over the
    step's rows from each request's states at `index` (its convolution's inputs) and `index + 1`
    (its scan's). Under tensor parallelism (`group`) it holds the rank's channels, and their
    projections to the step, B and C are summed over the ranks."""

    def __init__(self, mixer: Any, group: ParallelGroup | None = None) -> None:
        super().__init__()
        self.mixer = mixer
        self.x_proj = reduced(mixer.x_proj, group)
        self.inner = int(mixer.intermediate_size)
        self.heads, self.head_dim = 1, self.inner  # its output, one row a token
        self.rank, self.state_dims = int(mixer.time_step_rank), int(mixer.ssm_state_size)
        self.in_proj, self.out_proj = mixer.in_proj, mixer.out_proj
        # The taps `[width, channels]`, oldest input first.
        self.taps = mixer.conv1d.weight.detach()[:, 0].t().contiguous()
        self.conv_bias = mixer.conv1d.bias
        self.a = -torch.exp(mixer.A_log.detach().float())  # [channels, state dims]
        self.d = mixer.D.detach().float()
        self.dt_bias = mixer.dt_proj.bias.detach().float()
        self.normed = hasattr(mixer, "dt_layernorm")

    def state_specs(self) -> list[StateSpec]:
        """A request's convolution inputs and its scan's state."""
        return convolved_state_specs(self.taps, (self.inner, self.state_dims))

    def forward(
        self, normed: torch.Tensor, states: StateCache, index: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The gated scan of the normed rows `[tokens, hidden]`: `[tokens, channels]` in `dtype`
        (the residual's), the output projection's input."""
        mixer = self.mixer
        x, z = self.in_proj(normed).chunk(2, dim=-1)
        x = states.convolve(index, x, self.taps, self.conv_bias, silu=True)
        step, b, c = self.x_proj(x).split([self.rank, self.state_dims, self.state_dims], dim=-1)
        if self.normed:  # Jamba's and Falcon-Mamba's norms of the step, `B` and `C`
            step, b, c = mixer.dt_layernorm(step), mixer.b_layernorm(b), mixer.c_layernorm(c)
        steps = F.softplus(F.linear(step, mixer.dt_proj.weight).float() + self.dt_bias)
        x32, b, c = x.float(), b.float(), c.float()
        a = self.a

        def prompt(
            x: torch.Tensor,
            steps: torch.Tensor,
            b: torch.Tensor,
            c: torch.Tensor,
            held: torch.Tensor,
        ) -> torch.Tensor:
            return side_by_side_rows(x, steps, b, c, a, held)

        out = torch.empty(x32.shape, dtype=torch.float32, device=x.device)
        decode = scan_decode.recur_decode(decode_rows, a)
        out = states.recur(index + 1, (x32, steps, b, c), decode, prompt, out, chains=True)
        return ((out + self.d * x32) * F.silu(z.float())).to(dtype)


def decode_rows(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each row (`x`, `steps` `[rows, channels]`, `b`, `c` `[rows, state dims]`,
    fp32) through the scan, row i from `state[slots[i]]` `[channels, state dims]`, written back
    (or, with `sources`, from `state[sources[i]]`, the rows in order, so that a row may read the
    state an earlier one wrote); the output without the skip. On the CPU Conveyor's kernel
    updates each state in place and reads it out in the same pass; elsewhere
    `decode_rows_torch`."""
    inputs = (x, steps, b, c)
    return scan_decode.decode_rows(
        cpu_ops.mamba1_decode, decode_rows_torch, inputs, a, state, slots, sources
    )


def decode_rows_torch(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """`decode_rows` in torch: the rows' states gathered, updated and written back."""
    held = state.index_select(0, slots)
    held = held * torch.exp(steps[..., None] * a) + (steps * x)[..., None] * b[:, None, :]
    state.index_copy_(0, slots, held)
    return (held @ c[..., None]).squeeze(-1)


def side_by_side_rows(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    held: torch.Tensor,
) -> torch.Tensor:
    """Prompt chunks of one length side by side (`x`, `steps` `[tokens, rows * channels]`, `b`,
    `c` `[tokens, rows * state dims]`, fp32) through the scan, each row from its channels' states
    in `held` `[rows * channels, state dims]` (`a` `[channels, state dims]`), updated in place;
    the output `[tokens, rows * channels]` without the skip. On the CPU Conveyor's kernel keeps
    each channel's state in registers across the tokens; elsewhere `prompt_rows`, a token at a
    time over every channel."""
    channels, state_dims = a.shape
    rows, length = held.shape[0] // channels, x.shape[0]
    if held.is_cpu and cpu_ops.has("recurrent"):
        xs, ss, bs, cs = (t.reshape(length, rows, -1).contiguous() for t in (x, steps, b, c))
        states = held.view(rows, channels, state_dims)
        found = cpu_ops.mamba1_prompt_scan(xs, ss, bs, cs, a.contiguous(), states)
        return found.view(length, rows * channels)

    def per_channel(t: torch.Tensor) -> torch.Tensor:
        """`[tokens, rows * state dims]` as each channel's `[tokens, rows * channels, state
        dims]`."""
        shape = (length, rows, channels, state_dims)
        return t.reshape(length, rows, 1, state_dims).expand(shape).flatten(1, 2)

    return prompt_rows(x, steps, per_channel(b), per_channel(c), a.repeat(rows, 1), held)


def prompt_rows(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    a: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """A prompt's tokens (`x`, `steps` `[tokens, channels]`, `b`, `c` `[tokens, channels, state
    dims]`, fp32; `a` `[channels, state dims]`) through the scan from `state` `[channels, state
    dims]`, updated in place; the output without the skip."""
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, x.shape[0], SCAN_CHUNK):
        span = slice(start, start + SCAN_CHUNK)
        decays = torch.exp(steps[span, :, None] * a)
        writes = (steps[span] * x[span])[..., None] * b[span]
        for t in range(decays.shape[0]):
            state.mul_(decays[t]).add_(writes[t])
            out[start + t] = (state * c[start + t]).sum(-1)
    return out


class Mamba1Layer(MixerLayer):
    """A layer whose mixer is Mamba1 (Jamba's), then the family's MLP block; under tensor
    parallelism it holds the rank's channels and their states."""

    states_split = True

    def mixer_of(self, mixer: Any, group: ParallelGroup | None) -> Mamba1Mixer:
        return Mamba1Mixer(mixer, group)
