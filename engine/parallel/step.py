"""One step as plain data: what every rank needs to run the same forward pass as rank 0."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from engine.worker.input_batch import InputBatch


@dataclass(frozen=True, slots=True)
class StateCopies:
    """A step's copies of a recurrent model's states: `(snapshot, slot)` pairs restored into the
    slots before the forward, `(slot, snapshot)` pairs saved after it; before both, on the
    workers, the `(slot, slot)` copies the step before left once its drafts were verified (its
    requests' last kept rows' states, `verify.kept_state_copies`), which rank 0 made then."""

    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The flattened batch (without its requests: arrays only), the positions whose logits are
    wanted, the KV blocks to copy first and the states to restore and save. Under async
    scheduling the batch's placeholders take the tokens rank 0 broadcasts once the step is
    received: its previous step's `previous_count` sampled tokens, of which each placeholder
    reads row `previous_rows[i]`."""

    batch: InputBatch
    logits_indices: np.ndarray
    block_copies: list[tuple[int, int]]
    previous_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    previous_count: int = 0
    state_copies: StateCopies = field(default_factory=StateCopies)

    @classmethod
    def of(
        cls,
        batch: InputBatch,
        logits_indices: np.ndarray,
        block_copies: list[tuple[int, int]],
        previous_rows: list[int] | None = None,
        previous_count: int = 0,
        state_copies: StateCopies | None = None,
    ) -> StepInputs:
        rows = np.asarray(previous_rows or [], dtype=np.int64)
        return cls(
            replace(batch, requests=[]),
            logits_indices,
            list(block_copies),
            rows,
            previous_count,
            state_copies or StateCopies(),
        )
