"""The sampler's GPU kernels: top-p (nucleus) sampling without a sort and without the host,
and seeded rows' noise in one launch.

A row sampled with top-p and no top-k has a nucleus that may reach far down a flat
distribution, so no fixed candidate width holds it, and a search that widens until it does
must ask the host how far to go. `nucleus_sample` instead pivots, as FlashInfer's rejection
samplers do: the row's exponential race (the token with the largest p / noise) is run over the
tokens above a pivot; the winner is accepted when the mass strictly above it is below top_p,
else the pivot rises to it and the race is run again over the tokens above. The nucleus is
the set of tokens above some probability, so each rejected winner lies below all of it and
every round keeps the whole nucleus in the race: the accepted token is the race's winner over
the nucleus, the very token masking the row to its nucleus and then racing would give with
the same noise. One program per row loops on the device until it accepts; each round is one
pass over the row, which also sums the mass above the current winner.

`min_p` keeps only the tokens whose probability is at least min_p times the largest (the
logits within log(min_p) of the largest); it is applied to the race's candidates.

`seeded_noise` fills the rows of requests with a seed with their race's Exp(1) noise in one
launch: Philox keyed by the seed, counting (token, draw), so a request's noise depends on its
seed and how many tokens it has drawn, never on what shares its batch.

Runs unchanged in Triton's interpreter (`TRITON_INTERPRET=1`) on CPU tensors.
"""

from __future__ import annotations

import math
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.random import philox, uint_to_uniform_float

from engine.kernels.triton import self_test

# Tokens one step of a pass over the row reads, and the warps of a row's program: one program
# per row, so a step of one or a few rows still reads its rows with many threads each.
BLOCK = 4096
WARPS = 8


@triton.jit
def _row_max(row_ptr, vocab, BLOCK: tl.constexpr):
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(row_ptr + offsets, mask=offsets < vocab, other=float("-inf"))
        best = tl.maximum(best, x)
    return tl.max(best, axis=0)


@triton.jit
def _race(row_ptr, noise_ptr, vocab, top, pivot, floor, BLOCK: tl.constexpr):
    """Over the tokens whose logit is above `pivot`: their mass relative to the largest logit
    `top` (unnormalised), and the race's winner among those at least `floor` (its index, -1
    when there is none, and its logit). Ties go to the first index, as torch's argmax."""
    mass = tl.zeros([BLOCK], tl.float32)
    best_score = tl.full([], -1.0, tl.float32)
    best_index = tl.full([], -1, tl.int32)
    best_logit = tl.full([], 0.0, tl.float32) + pivot
    for start in range(0, vocab, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < vocab
        x = tl.load(row_ptr + offsets, mask=inside, other=float("-inf"))
        noise = tl.load(noise_ptr + offsets, mask=inside, other=1.0)
        above = inside & (x > pivot)
        weight = tl.where(above, tl.exp(x - top), 0.0)
        mass += weight
        score = tl.where(above & (x >= floor), weight / noise, -1.0)
        block_best = tl.max(score, axis=0)
        where = start + tl.argmax(score, axis=0)
        better = block_best > best_score
        best_index = tl.where(better, where, best_index)
        best_logit = tl.where(better, tl.sum(tl.where(offsets == where, x, 0.0)), best_logit)
        best_score = tl.maximum(best_score, block_best)
    return tl.sum(mass, axis=0), best_index, best_logit


@triton.jit
def _nucleus_sample_kernel(
    logits_ptr,
    noise_ptr,
    rows_ptr,
    top_p_ptr,
    min_p_ptr,
    out_ptr,
    vocab,
    logits_stride,
    noise_stride,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    row = tl.load(rows_ptr + program)
    row_ptr = logits_ptr + row * logits_stride
    row_noise_ptr = noise_ptr + row * noise_stride
    top_p = tl.load(top_p_ptr + program)
    min_p = tl.load(min_p_ptr + program)
    top = _row_max(row_ptr, vocab, BLOCK)
    floor = tl.where(min_p > 0, top + tl.log(tl.maximum(min_p, 1e-30)), float("-inf"))
    lowest = tl.full([], float("-inf"), tl.float32)
    total, winner, winner_logit = _race(row_ptr, row_noise_ptr, vocab, top, lowest, floor, BLOCK)
    accepted = tl.full([], 0, tl.int1)
    while accepted == 0:
        # The mass above the winner, and the next race, over the tokens above it.
        above, next_winner, next_logit = _race(
            row_ptr, row_noise_ptr, vocab, top, winner_logit, floor, BLOCK
        )
        accepted = (above < top_p * total) | (next_winner < 0)
        winner = tl.where(accepted, winner, next_winner)
        winner_logit = tl.where(accepted, winner_logit, next_logit)
    # A row with nothing to draw from (every logit -inf, or NaN) gets token 0, as torch's
    # argmax over its NaN probabilities gives: never an id outside the vocabulary.
    tl.store(out_ptr + program, tl.maximum(winner, 0))


def nucleus_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    rows: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """The token each of `rows` draws from its top-p nucleus (and min-p set) of `logits`
    (fp32, temperature applied), with `noise` the batch's Exp(1) noise: the argmax of
    probability / noise over the row's nucleus. `top_p` and `min_p` hold one value per entry of
    `rows`. Returns int64 token ids on the device; nothing waits for the device."""
    assert logits.dtype == torch.float32 and noise.dtype == torch.float32
    assert logits.stride(1) == 1 and noise.stride(1) == 1
    out = torch.empty(rows.shape[0], dtype=torch.int64, device=logits.device)
    if rows.shape[0]:
        _nucleus_sample_kernel[(rows.shape[0],)](
            logits,
            noise,
            rows,
            top_p,
            min_p,
            out,
            logits.shape[1],
            logits.stride(0),
            noise.stride(0),
            BLOCK=BLOCK,
            num_warps=WARPS,
        )
    return out


@triton.jit
def _seeded_noise_kernel(
    noise_ptr, rows_ptr, keys_ptr, draws_ptr, vocab, noise_stride, BLOCK: tl.constexpr
):
    program = tl.program_id(0)
    row = tl.load(rows_ptr + program)
    key = tl.load(keys_ptr + program)
    draw = tl.load(draws_ptr + program)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    zero = tl.zeros_like(offsets)
    bits, _, _, _ = philox(key, offsets, zero + draw, zero, zero)
    noise = -tl.log(1.0 - uint_to_uniform_float(bits))
    # -log(1 - u) is 0 where u is 0, and p / 0 would win the race whatever p: the noise stays
    # at least 2^-24 (torch's exponential keeps away from 0 the same way).
    noise = tl.maximum(noise, 5.960464477539063e-08)
    tl.store(noise_ptr + row * noise_stride + offsets, noise, mask=offsets < vocab)


def seeded_noise(
    noise: torch.Tensor, rows: torch.Tensor, seeds: list[int], draws: list[int]
) -> None:
    """Write Exp(1) noise into `noise[rows[i]]` for the request seeded `seeds[i]` drawing its
    `draws[i]`-th token (counting from 0)."""
    assert noise.dtype == torch.float32 and noise.stride(1) == 1
    if not seeds:
        return
    # Each seed as a 64-bit key (as a generator's `manual_seed(seed % 2**64)`), stored signed.
    keys = [key - 2**64 if key >= 2**63 else key for key in (seed % 2**64 for seed in seeds)]
    device = noise.device
    vocab = noise.shape[1]
    _seeded_noise_kernel[(len(seeds), triton.cdiv(vocab, BLOCK))](
        noise,
        rows,
        torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True),
        torch.tensor(draws, dtype=torch.int32).to(device, non_blocking=True),
        vocab,
        noise.stride(0),
        BLOCK=BLOCK,
    )


@cache
def usable(device: str) -> bool:
    """The kernels compile and answer right on `device`."""
    return self_test.passes(
        lambda: _check(device), "Triton sampling kernels", device, "sampling in torch"
    )


def _check(device: str) -> None:
    """Two rows of p = (0.25, 0.75) with noise (1, 10), whose race picks token 0 (0.25 / 1 >
    0.75 / 10): with top-p 0.5 the nucleus is token 1 alone, with 0.9 both. Then seeded noise,
    positive and finite."""
    logits = torch.tensor([[0.0, math.log(3.0)]] * 2, device=device)
    noise = torch.tensor([[1.0, 10.0]] * 2, device=device)
    rows = torch.arange(2, device=device)
    top_p = torch.tensor([0.5, 0.9], device=device)
    drawn = nucleus_sample(logits, noise, rows, top_p, torch.zeros(2, device=device))
    if drawn.tolist() != [1, 0]:
        raise RuntimeError(f"drew {drawn.tolist()} instead of [1, 0]")
    seeded_noise(noise, rows[:1], [1], [0])
    if not bool(((noise[0] > 0) & noise[0].isfinite()).all()):
        raise RuntimeError("seeded noise outside (0, inf)")
