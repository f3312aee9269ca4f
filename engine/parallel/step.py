"""One step as plain data: what every rank needs to run the same forward pass as rank 0."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.worker.input_batch import InputBatch


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The flattened batch (without its requests), the positions whose logits are wanted and
    the KV blocks to copy first."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_starts: np.ndarray
    query_lens: np.ndarray
    context_lens: np.ndarray
    block_table: np.ndarray
    sample_rows: np.ndarray
    logits_indices: np.ndarray
    block_copies: list[tuple[int, int]]

    @classmethod
    def of(
        cls, batch: InputBatch, logits_indices: np.ndarray, block_copies: list[tuple[int, int]]
    ) -> StepInputs:
        return cls(
            input_ids=batch.input_ids,
            positions=batch.positions,
            slot_mapping=batch.slot_mapping,
            query_starts=batch.query_starts,
            query_lens=batch.query_lens,
            context_lens=batch.context_lens,
            block_table=batch.block_table,
            sample_rows=batch.sample_rows,
            logits_indices=logits_indices,
            block_copies=list(block_copies),
        )

    def batch(self) -> InputBatch:
        return InputBatch(
            requests=[],
            input_ids=self.input_ids,
            positions=self.positions,
            slot_mapping=self.slot_mapping,
            query_starts=self.query_starts,
            query_lens=self.query_lens,
            context_lens=self.context_lens,
            block_table=self.block_table,
            sample_rows=self.sample_rows,
        )
