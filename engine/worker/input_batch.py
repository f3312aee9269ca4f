"""Flatten one step's scheduled requests into model inputs, with no per-token Python loops."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.core.request import Request
from engine.scheduling.scheduler import ScheduledRequest


@dataclass(slots=True)
class InputBatch:
    """Host-side inputs of one forward pass over all scheduled tokens (no padding).

    Row `i` is the i-th scheduled request: it runs `query_lens[i]` tokens starting at position
    `context_lens[i]` (its tokens already cached), flattened at `query_starts[i]`. Under
    overlapped scheduling a row's last input may be the token its previous step is still
    sampling: `input_ids` holds 0 at those flattened `placeholders`, whose tokens the runner
    takes on the device from that step's output for the requests `placeholder_ids` names.
    `key_limits` maps a row whose image tokens see their whole run both ways to the last key
    position each of its query tokens sees (`ImageInputs.key_limits`); other rows are causal.
    `rope_positions` `[3, tokens]`, where a row's images lie on their grids (`engine/core/
    mrope.py`), are the rotary positions on three axes (None: `positions` on each).
    A request that verifies `drafts` (by request id) runs one decode row per token, its last
    known one and each draft, every row sampled: its rows are consecutive, and each one's K/V
    are stored before any attends, so row i sees the drafts before it as a prompt chunk would.
    In a recurrent model each of its rows after the first keeps its states in a slot of its own
    (`ScheduledRequest.draft_slots`), which starts from the row before's (`state_sources`).
    """

    requests: list[Request]
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_starts: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_table: np.ndarray
    sample_rows: np.ndarray
    placeholders: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    placeholder_ids: list[str] = field(default_factory=list)
    key_limits: dict[int, np.ndarray] = field(default_factory=dict)
    rope_positions: np.ndarray | None = None
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # Each row's request's slot of recurrent states (-1: none), for a model that keeps some.
    state_slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # The slot whose states each row's slot takes before it runs (a verifying request's rows
    # after its first); -1 (or no entries at all): its own.
    state_sources: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_lens(self) -> np.ndarray:
        return self.context_lens + self.query_lens

    @property
    def sample_token_indices(self) -> np.ndarray:
        """Flattened index of the last token of each row that samples."""
        rows = self.sample_rows
        return self.query_starts[rows] + self.query_lens[rows] - 1


def build_input_batch(items: list[ScheduledRequest], block_size: int) -> InputBatch:
    scheduled = _rows(items)
    requests = [item.request for item in scheduled]
    query_lens = np.fromiter((item.num_tokens for item in scheduled), np.int64, len(scheduled))
    context_lens = np.fromiter((_context(item) for item in scheduled), np.int64, len(scheduled))
    query_starts = np.cumsum(query_lens) - query_lens
    token_rows = np.repeat(np.arange(len(requests)), query_lens)
    offsets = np.arange(int(query_lens.sum())) - query_starts[token_rows]
    positions = context_lens[token_rows] + offsets
    block_table = _block_table(requests)
    slot_mapping = block_table[token_rows, positions // block_size] * block_size + (
        positions % block_size
    )
    sample_rows = np.flatnonzero(
        np.fromiter((item.completes_sequence for item in scheduled), bool, len(scheduled))
    )
    input_ids, placeholders = _input_ids(scheduled)
    return InputBatch(
        requests=requests,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        query_starts=query_starts,
        query_lens=query_lens,
        context_lens=context_lens,
        block_table=block_table,
        sample_rows=sample_rows,
        placeholders=np.asarray([index for index, _ in placeholders], dtype=np.int64),
        placeholder_ids=[request_id for _, request_id in placeholders],
        key_limits=_key_limits(scheduled),
        rope_positions=_rope_positions(scheduled, positions, query_starts),
        drafts={item.request.request_id: item.drafts for item in items if item.drafts},
        state_slots=_state_slots(scheduled),
        state_sources=_state_sources(scheduled),
    )


def _state_slots(scheduled: list[ScheduledRequest | _Row]) -> np.ndarray:
    """Each row's slot of recurrent states, -1 where it holds none."""
    return np.fromiter((_state_slot(item) for item in scheduled), np.int64, len(scheduled))


def _state_slot(item: ScheduledRequest | _Row) -> int:
    """A verifying row's own slot, or its request's."""
    if isinstance(item, _Row) and item.slot is not None:
        return item.slot
    slot = item.request.state_slot
    return -1 if slot is None else slot


def _state_sources(scheduled: list[ScheduledRequest | _Row]) -> np.ndarray:
    """Each row's source of states (`InputBatch.state_sources`); no entries where every row's
    is its own."""
    if not any(isinstance(item, _Row) and item.source is not None for item in scheduled):
        return np.zeros(0, dtype=np.int64)
    sources = (
        item.source if isinstance(item, _Row) and item.source is not None else -1
        for item in scheduled
    )
    return np.fromiter(sources, np.int64, len(scheduled))


@dataclass(slots=True)
class _Row:
    """One row of a verifying request (`ScheduledRequest.drafts`): one token, `token_id`, at
    position `start`, sampled; in a recurrent model a row after the first keeps its states in
    `slot`, which starts from slot `source`'s."""

    request: Request
    start: int
    token_id: int
    num_tokens: int = 1
    completes_sequence: bool = True
    slot: int | None = None
    source: int | None = None

    @property
    def end(self) -> int:
        return self.start + 1


def _context(item: ScheduledRequest | _Row) -> int:
    """The tokens cached before the row's first one."""
    return item.start if isinstance(item, _Row) else item.request.num_computed_tokens


def _rows(items: list[ScheduledRequest]) -> list[ScheduledRequest | _Row]:
    """The step's rows: a verifying request's item split into one row per token."""
    if not any(item.drafts for item in items):
        return list(items)
    rows: list[ScheduledRequest | _Row] = []
    for item in items:
        if not item.drafts:
            rows.append(item)
            continue
        last = item.request.all_token_ids[item.start]
        rows.append(_Row(item.request, item.start, last))
        # A recurrent model's: each row after the first from the states of the row before.
        sources = [item.request.state_slot, *item.draft_slots][:-1]
        for offset, token in enumerate(item.drafts, start=1):
            row = _Row(item.request, item.start + offset, token)
            if item.draft_slots:
                row.slot, row.source = item.draft_slots[offset - 1], sources[offset - 1]
            rows.append(row)
    return rows


def _key_limits(scheduled: list[ScheduledRequest | _Row]) -> dict[int, np.ndarray]:
    """The rows whose chunk holds image tokens that attend both ways, with their limits."""
    limits: dict[int, np.ndarray] = {}
    for row, item in enumerate(scheduled):
        images = item.request.images
        if images is None or not images.both_ways:
            continue
        found = images.key_limits(item.start, item.end)
        if found is not None:
            limits[row] = found
    return limits


def _rope_positions(
    scheduled: list[ScheduledRequest | _Row], positions: np.ndarray, query_starts: np.ndarray
) -> np.ndarray | None:
    """`[3, tokens]` where some row's images lie on their grids: those rows' grid positions,
    every other row's positions on all three axes (None where no row has any)."""
    grids = {
        row: images.grid
        for row, item in enumerate(scheduled)
        if (images := item.request.images) is not None and images.grid is not None
    }
    if not grids:
        return None
    found = np.repeat(positions[None], 3, axis=0)
    for row, grid in grids.items():
        item, start = scheduled[row], int(query_starts[row])
        found[:, start : start + item.num_tokens] = grid.of(item.start, item.end)
    return found


def _input_ids(
    scheduled: list[ScheduledRequest | _Row],
) -> tuple[np.ndarray, list[tuple[int, str]]]:
    """The known input tokens, 0 for each one still being sampled, and (flattened index,
    request id) of those."""
    ids: list[int] = []
    placeholders: list[tuple[int, str]] = []
    for item in scheduled:
        request = item.request
        if isinstance(item, _Row):
            ids.append(item.token_id)
            continue
        known = request.all_token_ids[item.start : item.end]
        ids.extend(known)
        for _ in range(item.num_tokens - len(known)):
            placeholders.append((len(ids), request.request_id))
            ids.append(0)
    return np.asarray(ids, dtype=np.int64), placeholders


def _block_table(requests: list[Request]) -> np.ndarray:
    width = max((len(r.block_ids) for r in requests), default=0)
    table = np.zeros((len(requests), max(width, 1)), dtype=np.int64)
    for row, request in enumerate(requests):
        table[row, : len(request.block_ids)] = request.block_ids
    return table
