"""The per-request states of a recurrent model's layers (a short convolution's last inputs, a
linear attention's state), on the device: each state a layer keeps is a tensor `[slots,
*shape]`, a request's at its slot (`state_slots.py`). Each step, `begin` zeroes the slots of
requests at their first token and works out, once for every layer, where each token's inputs
come from.

A request that verifies drafts runs one decode row per token (`InputBatch.drafts`), each row
after the first in a slot of its own that starts from the row before's state
(`InputBatch.state_sources`): the rows run in waves, the first rows of every request with the
step's other rows, then each request's second rows, and so on, so that every row's state
follows the one before it (or, where a kernel takes each row's source and runs the rows in
order, as the CPU's do, all at once); once the drafts it keeps are known, the state of its last
kept row is copied into the request's slot (`copy_slots`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops as cpu_ops
from engine.worker.input_batch import InputBatch


@dataclass(slots=True)
class StateStep:
    """One step's rows, or one wave of them, as the recurrent layers read them: each row's
    slot and tokens; where a wave, the flattened indices of its `tokens` among the step's and
    the slots whose states its rows' slots take first (`sources`)."""

    slots: torch.Tensor  # [rows] int64, on the device
    host_slots: np.ndarray  # [rows], the same on the host
    query_lens: np.ndarray  # [rows]
    device: torch.device
    tokens: torch.Tensor | None = None  # None: the step's every token
    sources: torch.Tensor | None = None  # None: each row runs from its own slot
    # The step's every row's source, its own slot where none (None: every row's is its own).
    host_sources: np.ndarray | None = None
    _windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def take_sources(self, state: torch.Tensor) -> None:
        """Each row's slot of `state` set to its source's, where the rows have sources."""
        if self.sources is not None:
            state.index_copy_(0, self.slots, state.index_select(0, self.sources))

    def conv_windows(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For a causal convolution of `width` taps over the step's tokens, with each row's
        last `width - 1` inputs kept as its state: indices into the rows' states (`[rows *
        (width - 1), channels]`) followed by the step's inputs (`[tokens, channels]`) of each
        token's `width` inputs, oldest first (`[tokens, width]`), and of each row's new state
        (`[rows, width - 1]`)."""
        found = self._windows.get(width)
        if found is None:
            windows, states = conv_windows(self.query_lens, width)
            found = (
                torch.from_numpy(windows).to(self.device, non_blocking=True),
                torch.from_numpy(states).to(self.device, non_blocking=True),
            )
            self._windows[width] = found
        return found


def conv_windows(query_lens: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """`StateStep.conv_windows` on the host. Row r's inputs, its state then its tokens, are its
    extended sequence; token p of the row reads extended positions p .. p + width - 1, and the
    new state is positions len .. len + width - 2."""
    kept = width - 1
    rows = len(query_lens)
    starts = np.cumsum(query_lens) - query_lens
    token_rows = np.repeat(np.arange(rows), query_lens)
    offsets = np.arange(int(query_lens.sum())) - starts[token_rows]

    def source(row: np.ndarray, extended: np.ndarray) -> np.ndarray:
        in_state = row * kept + extended
        in_step = rows * kept + starts[row] + extended - kept
        return np.where(extended < kept, in_state, in_step)

    taps = np.arange(width)
    windows = source(token_rows[:, None], offsets[:, None] + taps[None, :])
    states = source(np.arange(rows)[:, None], query_lens[:, None] + taps[None, :kept])
    return windows.astype(np.int64), states.astype(np.int64)


# One state a slot: its shape, and its dtype (None: the rows' dtype, as a convolution's inputs).
StateSpec = tuple[tuple[int, ...], torch.dtype | None]


def convolved_state_specs(taps: torch.Tensor, recurrent: tuple[int, ...]) -> list[StateSpec]:
    """A layer that convolves its inputs (`taps` `[width, channels]`) before a recurrence: its
    last `width - 1` inputs in the rows' dtype, then the recurrent state `recurrent` in fp32 (as
    transformers keeps it)."""
    width, channels = taps.shape
    return [((int(width) - 1, int(channels)), None), (recurrent, torch.float32)]


def state_slot_bytes(specs: list[StateSpec], dtype: torch.dtype) -> int:
    """The bytes one slot's states take, `dtype` that of the rows."""
    return sum(math.prod(shape) * (own or dtype).itemsize for shape, own in specs)


class StateCache:
    """`specs[i]`: the model's i-th state a slot (`[kept, channels]` for a short convolution's
    inputs, `[heads, key dims, value dims]` in fp32 for a linear attention's); `dtype` the
    rows'. Beside the slots, `num_snapshots` copies of a slot's states as they stood after some
    request's first tokens (`snapshots[i]` `[num_snapshots, *specs[i]'s shape]`), which prefix
    caching resumes from (`state_snapshots.py`)."""

    def __init__(
        self,
        specs: list[StateSpec],
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device,
        num_snapshots: int = 0,
    ) -> None:
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.device = device
        self.layers = [
            torch.zeros((num_slots, *shape), dtype=own or dtype, device=device)
            for shape, own in specs
        ]
        self.snapshots = [
            torch.zeros((num_snapshots, *shape), dtype=own or dtype, device=device)
            for shape, own in specs
        ]
        self.step: StateStep | None = None
        # The step's rows in waves where requests verify drafts (else none).
        self.waves: list[StateStep] = []

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.layers, *self.snapshots))

    def save(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each `(slot, snapshot)` pair's slot states into the snapshot, in order."""
        _copy_rows(self.layers, self.snapshots, pairs)

    def restore(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each `(snapshot, slot)` pair's snapshot into the slot's states."""
        _copy_rows(self.snapshots, self.layers, pairs)

    def copy_slots(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each `(source, target)` pair's slot states into the target slot, in order."""
        _copy_rows(self.layers, self.layers, pairs)

    def begin(self, batch: InputBatch) -> StateStep:
        """The step's rows (and their waves, where requests verify drafts); the slots of rows at
        their request's first token zeroed."""
        slots = batch.state_slots
        if len(slots) != len(batch.query_lens) or (slots < 0).any():
            raise RuntimeError("a request of a recurrent model runs without a state slot")
        fresh = np.flatnonzero(batch.context_lens == 0)
        if len(fresh):
            index = torch.from_numpy(slots[fresh]).to(self.device, non_blocking=True)
            for state in self.layers:
                state.index_fill_(0, index, 0)
        on_device = torch.from_numpy(slots).to(self.device, non_blocking=True)
        self.step = StateStep(on_device, slots, batch.query_lens, self.device)
        depths = _wave_depths(batch.state_sources, len(slots))
        self.waves = []
        if depths is not None:
            sources = batch.state_sources
            self.step.host_sources = np.where(sources < 0, slots, sources)
            self.waves = [self._wave(batch, depths == d) for d in range(int(depths.max()) + 1)]
        return self.step

    def _wave(self, batch: InputBatch, rows: np.ndarray) -> StateStep:
        """The step's rows where `rows` (a mask) as one wave: their slots, tokens, sources."""
        device = self.device
        slots, lens = batch.state_slots[rows], batch.query_lens[rows]
        tokens = np.flatnonzero(np.repeat(rows, batch.query_lens))
        sources = batch.state_sources[rows]
        return StateStep(
            torch.from_numpy(slots).to(device, non_blocking=True),
            slots,
            lens,
            device,
            torch.from_numpy(tokens).to(device, non_blocking=True),
            None if (sources < 0).all() else torch.from_numpy(sources).to(device),
        )

    def convolve(
        self,
        index: int,
        inputs: torch.Tensor,
        taps: torch.Tensor,
        bias: torch.Tensor | None,
        silu: bool = False,
    ) -> torch.Tensor:
        """Each of the step's tokens' causal convolution (`taps` `[width, channels]`, oldest
        input first) over its request's last inputs, from state `index` where they came before
        the step; each request's state becomes its last `width - 1` inputs. Summed in fp32 (as a
        convolution accumulates), through silu where `silu`, returned in the inputs' dtype. On
        the CPU over fp32 rows, Conveyor's kernel reads each input in place."""
        step = self.step
        assert step is not None, "a recurrent model's step begins its states"
        state = self.layers[index]
        if not self.waves:
            return _convolve(step, state, inputs, taps, bias, silu)
        if _own_convolution(inputs, state):  # the kernel runs chained rows in order
            return _convolve(step, state, inputs, taps, bias, silu, step.host_sources)
        out = torch.empty_like(inputs)
        for wave in self.waves:
            wave.take_sources(state)
            rows = wave.tokens
            out[rows] = _convolve(wave, state, inputs[rows], taps, bias, silu)
        return out

    def recur(
        self,
        index: int,
        inputs: Sequence[torch.Tensor],
        decode: Callable[..., torch.Tensor],
        prompt: Callable[..., torch.Tensor],
        out: torch.Tensor,
        chains: bool = False,
    ) -> torch.Tensor:
        """A recurrence over the step's tokens (`inputs`, each `[tokens, heads, ...]`), each
        request from its slot of state `index`, written into `out` (`[tokens, heads, ...]`):
        the decode rows (one token each) together, `decode(*their inputs, state=, slots=)` with
        the rows' slots on the host, which updates those slots; the prompt chunks of one length
        together, `prompt(*inputs, held)` with each token's rows side by side (`[length, rows *
        heads, ...]`) and their states gathered (`[rows * heads, ...]`), which it updates in
        place before they go back, its output laid out as its inputs (a length only one row
        has: that row's inputs as views, maybe strided, and its slot's state itself). Where
        requests verify drafts, wave by wave; or, where `decode` `chains` rows (it takes
        `sources=`, each row's slot to read its state from, and runs the rows in order), all the
        decode rows at once."""
        step = self.step
        assert step is not None, "a recurrent model's step begins its states"
        state = self.layers[index]
        if not self.waves or chains:
            return _recur(step, state, inputs, decode, prompt, out)
        for wave in self.waves:
            wave.take_sources(state)
            rows = wave.tokens
            taken = [t[rows] for t in inputs]
            out[rows] = _recur(wave, state, taken, decode, prompt, out[rows])
        return out


def _wave_depths(sources: np.ndarray, rows: int) -> np.ndarray | None:
    """Each row's wave: 0 where it runs from its own slot, else one past the row before it
    (whose state its slot takes first); None where every row runs from its own slot."""
    if not len(sources) or (sources < 0).all():
        return None
    if len(sources) != rows:
        raise RuntimeError("a step's state sources do not match its rows")
    depths = np.zeros(rows, dtype=np.int64)
    for row in np.flatnonzero(sources >= 0):
        depths[row] = depths[row - 1] + 1 if row else 0
    return depths


def _convolve(
    step: StateStep,
    state: torch.Tensor,
    inputs: torch.Tensor,
    taps: torch.Tensor,
    bias: torch.Tensor | None,
    silu: bool,
    sources: np.ndarray | None = None,
) -> torch.Tensor:
    """`StateCache.convolve` over one wave's rows (`inputs` their tokens); or over the step's
    every row with each row's `sources` (its own slot where none), in order, by the kernel."""
    if _own_convolution(inputs, state):
        weights = taps.float().contiguous()
        lens = torch.from_numpy(np.asarray(step.query_lens, dtype=np.int64))
        bias = None if bias is None else bias.float().contiguous()
        read = None if sources is None else torch.from_numpy(sources)
        return cpu_ops.short_conv(inputs, state, weights, bias, step.slots, lens, silu, read)
    width, channels = taps.shape
    windows, kept = step.conv_windows(int(width))
    held = state.index_select(0, step.slots).to(inputs.dtype)
    pool = torch.cat([held.reshape(-1, channels), inputs])
    weights = taps.float()
    out = torch.zeros(inputs.shape, dtype=torch.float32, device=inputs.device)
    for tap in range(int(width)):  # each tap over every token at once
        out.addcmul_(pool[windows[:, tap]].float(), weights[tap])
    if bias is not None:
        out = out + bias.float()
    new = pool[kept].view(-1, width - 1, channels).to(state.dtype)
    state.index_copy_(0, step.slots, new)
    return (F.silu(out) if silu else out).to(inputs.dtype)


def _recur(
    step: StateStep,
    state: torch.Tensor,
    inputs: Sequence[torch.Tensor],
    decode: Callable[..., torch.Tensor],
    prompt: Callable[..., torch.Tensor],
    out: torch.Tensor,
) -> torch.Tensor:
    """`StateCache.recur` over one wave's rows (`inputs` and `out` their tokens)."""
    lens = step.query_lens
    starts = np.cumsum(lens) - lens
    single = np.flatnonzero(lens == 1)
    if len(single):
        rows = torch.from_numpy(starts[single]).to(out.device)
        chained = {} if step.host_sources is None else {"sources": step.host_sources[single]}
        found = decode(
            *(t[rows] for t in inputs), state=state, slots=step.host_slots[single], **chained
        )
        out[rows] = found.to(out.dtype)
    for length in np.unique(lens[lens > 1]):
        group = np.flatnonzero(lens == length)
        spans = [slice(int(starts[row]), int(starts[row] + length)) for row in group]
        if len(group) == 1:  # its inputs as they lie, its state in place
            found = prompt(*(t[spans[0]] for t in inputs), state[int(step.host_slots[group[0]])])
            out[spans[0]] = found.to(out.dtype)
            continue
        slots = torch.from_numpy(step.host_slots[group]).to(out.device)
        held = state.index_select(0, slots)
        side_by_side = (torch.stack([t[s] for s in spans], dim=1).flatten(1, 2) for t in inputs)
        found = prompt(*side_by_side, held.flatten(0, 1))
        found = found.view(int(length), len(group), -1, *found.shape[2:])
        state.index_copy_(0, slots, held)
        for i, span in enumerate(spans):
            out[span] = found[:, i].to(out.dtype)
    return out


def _copy_rows(
    sources: list[torch.Tensor], targets: list[torch.Tensor], pairs: list[tuple[int, int]]
) -> None:
    """For each `(source row, target row)` pair in order, every state's source row copied into
    its target row."""
    for source, target in pairs:
        for found, kept in zip(sources, targets, strict=True):
            kept[target].copy_(found[source])


def _own_convolution(inputs: torch.Tensor, state: torch.Tensor) -> bool:
    """Conveyor's CPU kernel applies: fp32 rows (channels contiguous) and states on the CPU,
    kernels built."""
    return (
        inputs.is_cpu
        and inputs.dtype == torch.float32 == state.dtype
        and inputs.dim() == 2
        and inputs.stride(1) == 1
        and cpu_ops.has("recurrent")
    )
