"""A prompt's images as the engine carries them: where their features go in the prompt, what
the vision encoder reads, and (once it has run) the features themselves.

The model's processor expands each image into a run of placeholder tokens; the encoder's output
rows replace those tokens' embeddings, in order. The prompt's token ids stay plain ids, so the
scheduler, the block manager and the detokenizer treat an image prompt as any other; only the
prefix cache needs more, since equal placeholders do not mean equal images (`starts`).

Most models' image tokens attend causally, as text does. Some (Gemma 3) let each run of an
image's placeholders see the whole run both ways: such a run must be computed in one step
(`whole_runs`), and its tokens attend up to the run's end (`key_limits`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.core.mrope import GridPositions

# What of a processor's output is the prompt itself, not what the vision encoder reads.
TEXT_KEYS = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


@dataclass(slots=True, eq=False)
class ImageInputs:
    """`positions`: the prompt indices whose embeddings the encoder's rows replace, ascending.
    `starts`: (position, digest) of each image, where its placeholders begin. `data`: what the
    processor made for the encoder (pixel values and the like), on the host. `features`: the
    encoder's rows once computed (on the model's device); they live as long as the request."""

    positions: np.ndarray
    starts: tuple[tuple[int, bytes], ...]
    data: dict[str, Any]
    features: Any = None
    # Set by the scheduler once a step that encodes them is scheduled (its encoder budget).
    encoder_scheduled: bool = False
    # Whether each run of placeholders attends both ways within itself (set by the engine
    # from its model: `ImageEncoder.both_ways`).
    both_ways: bool = False
    # The sequence's rotary positions on three axes, for a model that lays images out on
    # their grids (set by the engine: `engine/core/mrope.py`).
    grid: GridPositions | None = None
    # Rows the request gave itself (prompt embeddings, `given`), not an encoder's.
    given: bool = False
    _runs: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def embeddings(cls, rows: Any, count: int, digest: bytes) -> ImageInputs:
        """A prompt given as `count` embedding rows (`rows`, on the host) rather than tokens:
        every position takes its row, and `digest` keys the prefix cache on them."""
        positions = np.arange(count, dtype=np.int64)
        return cls(positions, ((0, digest),), {}, rows, encoder_scheduled=True, given=True)

    @classmethod
    def of(
        cls,
        prompt_token_ids: Sequence[int],
        image_token_id: int,
        digests: Sequence[bytes],
        data: dict[str, Any],
    ) -> ImageInputs:
        """The images of a processed prompt: its placeholders are the tokens equal to
        `image_token_id`; `digests` name the images in the order they appear."""
        positions = np.flatnonzero(np.asarray(prompt_token_ids, dtype=np.int64) == image_token_id)
        if len(positions) == 0:
            raise ValueError("the prompt holds no image placeholder")
        encoder_data = {key: value for key, value in data.items() if key not in TEXT_KEYS}
        return cls(positions, image_starts(positions, digests), encoder_data)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The rows of `positions` (and of the features) that fall in prompt tokens
        `[start, end)`, as a half-open range."""
        first, last = np.searchsorted(self.positions, [start, end])
        return int(first), int(last)

    def runs(self) -> np.ndarray:
        """`[runs, 2]`: each run of consecutive placeholders as prompt tokens `[start, end)`,
        found once (the scheduler asks every step)."""
        if self._runs is None:
            self._runs = placeholder_runs(self.positions)
        return self._runs

    def longest_run(self) -> int:
        runs = self.runs()
        return int((runs[:, 1] - runs[:, 0]).max())

    def whole_runs(self, start: int, num_tokens: int) -> int:
        """How many of the `num_tokens` from prompt token `start` a step may compute without
        ending inside a run that attends both ways: all, or those before that run (which may
        be none: the run waits for a step with room for it whole)."""
        if not self.both_ways or start > self.positions[-1]:
            return num_tokens
        end = start + num_tokens
        runs = self.runs()
        inside = runs[(runs[:, 0] < end) & (end < runs[:, 1])]
        if not len(inside):
            return num_tokens
        return max(int(inside[0, 0]) - start, 0)

    def key_limits(self, start: int, end: int) -> np.ndarray | None:
        """For query tokens `[start, end)`, the last key position each sees: its own, or the
        end of its run where runs attend both ways (None where no query of them is in a run).
        Every such run must end by `end` (`whole_runs`)."""
        if not self.both_ways:
            return None
        runs = self.runs()
        runs = runs[(runs[:, 0] < end) & (runs[:, 1] > start)]
        if not len(runs):
            return None
        if int(runs[:, 1].max()) > end:
            raise ValueError("a run of image tokens that attend both ways was cut by the step")
        limits = np.arange(start, end, dtype=np.int64)
        for run_start, run_end in runs:
            limits[max(run_start, start) - start : run_end - start] = run_end - 1
        return limits


def placeholder_runs(positions: np.ndarray) -> np.ndarray:
    """`[runs, 2]`: the runs of consecutive `positions` as `[start, end)`."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate([[0], breaks])]
    ends = positions[np.concatenate([breaks - 1, [len(positions) - 1]])] + 1
    return np.stack([starts, ends], axis=1).astype(np.int64)


def image_starts(positions: np.ndarray, digests: Sequence[bytes]) -> tuple[tuple[int, bytes], ...]:
    """Where each image begins: the first token of each run of placeholders, where there is one
    run per image (most processors); otherwise (an image cut into tiles with text between them)
    every image counts from the first placeholder, which keeps the prefix cache right at the
    cost of sharing less."""
    runs = [int(start) for start in placeholder_runs(positions)[:, 0]]
    if len(runs) == len(digests):
        return tuple(zip(runs, digests, strict=True))
    whole = hashlib.sha256(b"".join(digests)).digest()
    return ((runs[0], whole),)
