"""A selective scan's decode step (Mamba1's, Mamba2's): one token of each row through its state in
the state cache, on the CPU in Conveyor's kernel, elsewhere in the layer's torch form; rows
verifying drafts chained, each from the state the row before it left."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.kernels.cpu import ops as cpu_ops


def decode_rows(
    kernel: Callable[..., torch.Tensor],
    torch_form: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    rates: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor | None,
) -> torch.Tensor:
    """`kernel(*inputs, rates, state, slots, sources)` where the state is on the CPU and the
    kernels are built (each state updated in place and read out in one pass), else
    `torch_form(*inputs, rates, state, slots)`; with `sources`, row i reads its state from
    `state[sources[i]]` and the rows run in order, so that a row may read the state an earlier
    one wrote."""
    if state.is_cpu and cpu_ops.has("recurrent"):
        dense = [t.contiguous() for t in inputs]
        read = None if sources is None else sources.cpu()
        return kernel(*dense, rates.contiguous(), state, slots.cpu(), read)
    if sources is None:
        return torch_form(*inputs, rates, state, slots)
    outs = []
    for row in range(len(slots)):
        state[slots[row]] = state[sources[row]]
        one = slice(row, row + 1)
        outs.append(torch_form(*(t[one] for t in inputs), rates, state, slots[one]))
    return torch.cat(outs)


def recur_decode(
    decode: Callable[..., torch.Tensor], rates: torch.Tensor
) -> Callable[..., torch.Tensor]:
    """The `decode` that `StateCache.recur` calls with the decode rows' inputs and their slots
    (and sources) on the host: `decode(*inputs, rates, state, slots, sources)` with the slots
    on the state's device (a layer's `decode_rows`)."""

    def run(
        *inputs: torch.Tensor,
        state: torch.Tensor,
        slots: np.ndarray,
        sources: np.ndarray | None = None,
    ) -> torch.Tensor:
        on_device = torch.from_numpy(slots).to(state.device)
        read = None if sources is None else torch.from_numpy(sources).to(state.device)
        return decode(*inputs, rates, state, on_device, read)

    return run
