"""One step as plain data: what every rank needs to run the same forward pass as rank 0."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from engine.worker.input_batch import InputBatch


@dataclass(frozen=True, slots=True)
class StepInputs:
    """The flattened batch (without its requests: arrays only), the positions whose logits are
    wanted and the KV blocks to copy first."""

    batch: InputBatch
    logits_indices: np.ndarray
    block_copies: list[tuple[int, int]]

    @classmethod
    def of(
        cls, batch: InputBatch, logits_indices: np.ndarray, block_copies: list[tuple[int, int]]
    ) -> StepInputs:
        return cls(replace(batch, requests=[]), logits_indices, list(block_copies))
