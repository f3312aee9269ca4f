"""Mamba2's selective state space scan (state space duality, SSD) over a step's tokens, each request
from its state in the state cache (`kv/state_cache.py`). Each head `h` keeps a state `S [head dims,
state dims]`; a token with input `x [head dims]`, step `dt` (softplus of its projection plus a
bias) and the projections `B`, `C [state dims]` of its head's group decays it by `exp(dt A)` (`A =
-exp(A_log)`, one per head) and adds `dt x B^T`; the output is `S C + D x`.

Decode rows (one token each) run together (on the CPU one C++ op that updates each state in place
and reads it out in the same pass; elsewhere over their gathered states); a prompt's tokens run by
chunks of `SSD_CHUNK`: within a chunk the scan is a masked product of `C B^T` weighted by the decays
between positions (the SSD's attention-like form), plus each position's read of the state the
chunk began with; the state then takes the chunk's writes. Prompts of one length in a step run
together, each row's heads beside the others'. The state stays fp32 (as transformers keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops as cpu_ops
from engine.kv.state_cache import StateCache
from engine.models import chunk_decays, scan_decode

# Tokens a chunk of a prompt's scan: within one, the scan is a few products; chunks run in turn.
SSD_CHUNK = 64


@dataclass(frozen=True, slots=True)
class ScanParams:
    """A layer's per-head constants: `A` (negative), the skip `D`, the step's bias, and the
    bounds a prompt's steps are clamped to (Mamba2's `time_step_limit`)."""

    a: torch.Tensor  # [heads] fp32
    d: torch.Tensor  # [heads] fp32
    dt_bias: torch.Tensor  # [heads] fp32
    dt_limit: tuple[float, float]

    @classmethod
    def of(cls, mixer: Any) -> ScanParams:
        """From a Mamba2 mixer's parameters (`A_log`, `D`, `dt_bias`, `time_step_limit`)."""
        a = -torch.exp(mixer.A_log.detach().float())
        d = mixer.D.detach().float()
        dt_bias = mixer.dt_bias.detach().float()
        limit = getattr(mixer, "time_step_limit", None) or (0.0, float("inf"))
        return cls(a, d, dt_bias, (float(limit[0]), float(limit[1])))


def scan(
    states: StateCache,
    index: int,
    x: torch.Tensor,
    dt: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    params: ScanParams,
) -> torch.Tensor:
    """The scan over the step's tokens (`x` `[tokens, heads, head dims]`, `dt` `[tokens, heads]`
    before its bias and softplus, `b`, `c` `[tokens, groups, state dims]`), each request from its
    state `index`, which it leaves updated; the output `[tokens, heads, head dims]` in fp32,
    with the `D` skip."""
    x, b, c = x.float(), b.float(), c.float()
    steps = F.softplus(dt.float() + params.dt_bias)

    def prompt(
        x: torch.Tensor, steps: torch.Tensor, b: torch.Tensor, c: torch.Tensor, held: torch.Tensor
    ) -> torch.Tensor:
        # A prompt's steps are clamped to the limit (the decode form takes them as they are).
        rates = params.a.repeat(x.shape[1] // len(params.a))  # each row's heads side by side
        return prompt_rows(x, steps.clamp(*params.dt_limit), rates, b, c, held)

    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    decode = scan_decode.recur_decode(decode_rows, params.a)
    out = states.recur(index, (x, steps, b, c), decode, prompt, out, chains=True)
    return out + params.d[:, None] * x


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
    """One token of each row (`x` `[rows, heads, head dims]`, `steps` `[rows, heads]`, `b`, `c`
    `[rows, groups, state dims]`, fp32) through the scan, row i from `state[slots[i]]` `[heads,
    head dims, state dims]`, written back (or, with `sources`, from `state[sources[i]]`, the rows
    in order, so that a row may read the state an earlier one wrote); the output without the
    skip. On the CPU Conveyor's kernel updates each state in place and reads it out in the same
    pass; elsewhere `decode_rows_torch`."""
    inputs = (x, steps, b, c)
    return scan_decode.decode_rows(
        cpu_ops.ssd_decode, decode_rows_torch, inputs, a, state, slots, sources
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
    """`decode_rows` in torch's ops, over the rows' gathered states."""
    heads = x.shape[1]
    b, c = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (b, c))
    held = state.index_select(0, slots)
    decay = torch.exp(steps * a)[..., None, None]
    held = held * decay + (steps[..., None] * x)[..., None] * b[:, :, None, :]
    state.index_copy_(0, slots, held)
    return (held @ c[..., None]).squeeze(-1)


def prompt_rows(
    x: torch.Tensor,
    steps: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """A prompt's tokens (`x` `[tokens, heads, head dims]`, `steps` `[tokens, heads]`, `b`, `c`
    `[tokens, groups, state dims]`, fp32; `a` `[heads]`; consecutive heads share a group)
    through the scan from `state` `[heads, head dims, state dims]`, updated in place; the output
    without the skip. By chunks of `SSD_CHUNK` tokens, each reading the state the chunks before
    it left."""
    tokens = x.shape[0]
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, tokens, SSD_CHUNK):
        span = slice(start, min(start + SSD_CHUNK, tokens))
        out[span] = _chunk(x[span], steps[span], a, b[span], c[span], state)
    return out


def _chunk(
    x: torch.Tensor,
    steps: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One chunk of `prompt_rows`: a group's heads take its `C B^T` and its reads of their
    states in one product each."""
    length, heads, dims = x.shape
    groups, size = b.shape[1], b.shape[2]
    shared = heads // groups
    # [heads, length]: log decay since the chunk began (contiguous, so that what is computed
    # from it is laid out heads first, as the products take their batches).
    decays = (steps * a).cumsum(0).t().contiguous()
    # [heads, length, head dims], each head's rows together (the products' batches).
    written = (x * steps[..., None]).transpose(0, 1).contiguous()
    b, c = b.transpose(0, 1), c.transpose(0, 1)  # [groups, length, state dims]
    weights = chunk_decays.pairwise(decays).view(groups, shared, length, length)
    weights.mul_((c @ b.transpose(-1, -2))[:, None])  # each pair's C B^T, decayed between them
    out = (weights.view(heads, length, length) @ written).view(groups, shared, length, dims)
    by_group = state.view(groups, shared * dims, size)
    read = (c @ by_group.transpose(-1, -2)).view(groups, length, shared, dims).transpose(1, 2)
    out += read * decays.exp().view(groups, shared, length, 1)
    last = decays[:, -1:]
    kept = written * (last - decays).exp()[..., None]  # [heads, length, head dims]
    writes = kept.view(groups, shared, length, dims).transpose(2, 3).reshape(groups, -1, length)
    state.mul_(last.exp()[..., None])
    by_group.add_(writes @ b)
    return out.view(heads, length, dims).transpose(0, 1)
