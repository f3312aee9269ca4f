"""A prompt's images as the engine carries them: where their features go in the prompt, what
the vision encoder reads, and (once it has run) the features themselves.

The model's processor expands each image into a run of placeholder tokens; the encoder's output
rows replace those tokens' embeddings, in order. The prompt's token ids stay plain ids, so the
scheduler, the block manager and the detokenizer treat an image prompt as any other; only the
prefix cache needs more, since equal placeholders do not mean equal images (`starts`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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


def image_starts(positions: np.ndarray, digests: Sequence[bytes]) -> tuple[tuple[int, bytes], ...]:
    """Where each image begins: the first token of each run of placeholders, where there is one
    run per image (most processors); otherwise (an image cut into tiles with text between them)
    every image counts from the first placeholder, which keeps the prefix cache right at the
    cost of sharing less."""
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = [int(positions[0]), *(int(positions[b]) for b in breaks)]
    if len(runs) == len(digests):
        return tuple(zip(runs, digests, strict=True))
    whole = hashlib.sha256(b"".join(digests)).digest()
    return ((runs[0], whole),)
