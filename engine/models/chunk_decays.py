"""What decays a chunk's earlier positions leave on its later ones, shared by the chunked prompt
forms of the scans that decay a state (Mamba2's SSD, the gated delta rule): from each position's
log decay since the chunk began, `exp(d_i - d_j)` for each position `i` and each `j <= i`, zero
for `j > i`."""

from __future__ import annotations

import torch

# The least log decay between two positions that is taken as it is: below, exp is under 2e-35
# (nothing beside the other terms of a sum). torch's exp takes a slow path near fp32's smallest
# numbers, which a model's steep decays reach over a chunk, for -inf, and where it overflows. So
# every difference is held within [LEAST_LOG_DECAY, 0] before the exp (a decay since an earlier
# position is at most 1: only the differences towards later positions, which can be huge, lie
# above 0) and the later positions are zeroed after it.
LEAST_LOG_DECAY = -80.0


def pairwise(decays: torch.Tensor) -> torch.Tensor:
    """`decays` `[..., length]` (each position's log decay since the chunk began) as
    `[..., length, length]`: `exp(decays[i] - decays[j])` where `j <= i`, 0 elsewhere."""
    length = decays.shape[-1]
    later = torch.ones(length, length, dtype=torch.bool, device=decays.device).triu_(1)
    between = decays[..., :, None] - decays[..., None, :]
    return between.clamp_(LEAST_LOG_DECAY, 0.0).exp_().masked_fill_(later, 0.0)
