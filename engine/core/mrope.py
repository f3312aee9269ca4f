"""Rotary positions on three axes (time, height, width) for models that lay an image's tokens
out on its grid (Qwen2-VL, Qwen2.5-VL: "M-RoPE").

Text tokens take the same position on all three axes, one more than the largest position before
them. An image's tokens, one per merged patch of its `(t, h, w)` grid (`h` and `w` divided by
the merge size), all start at the position the next text token would have had: the time axis
stays there (a still image has one time step), and the height and width axes add the token's
row and column. The text after the image resumes past the image's largest position. A prompt's
positions are thus fixed once, with `delta` (the largest position plus one, less the prompt's
length): a token the model generates at index `i` sits at `i + delta` on every axis.

Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class GridPositions:
    """A prompt's positions `[3, prompt_len]` and the `delta` of every later token."""

    prompt: np.ndarray
    delta: int

    def of(self, start: int, end: int) -> np.ndarray:
        """`[3, end - start]`: the positions of token indices `[start, end)` of the sequence."""
        prompt_len = self.prompt.shape[1]
        inside = self.prompt[:, start : min(end, prompt_len)]
        later = np.arange(max(start, prompt_len), end, dtype=np.int64) + self.delta
        return np.concatenate([inside, np.broadcast_to(later, (3, later.size))], axis=1)


def grid_positions(
    prompt_len: int, runs: np.ndarray, grids: Sequence[Sequence[int]], merge: int
) -> GridPositions:
    """The positions of a prompt whose images' placeholders are `runs` (`[runs, 2]`, one run
    an image, in order) with `grids` (each image's `(t, h, w)` in patches) merged `merge` by
    `merge` into tokens. Raises ValueError where a run does not hold its grid's tokens."""
    if len(runs) != len(grids):
        raise ValueError(f"the prompt has {len(runs)} runs of image tokens for {len(grids)} images")
    prompt = np.empty((3, prompt_len), dtype=np.int64)
    done, next_position = 0, 0
    for (start, end), (t, h, w) in zip(runs.tolist(), grids, strict=True):
        rows, cols = h // merge, w // merge
        if end - start != t * rows * cols:
            raise ValueError(
                f"an image of {t * rows * cols} tokens has {end - start} placeholders in the prompt"
            )
        text = np.arange(start - done, dtype=np.int64) + next_position
        prompt[:, done:start] = text
        base = next_position + start - done
        steps, row, col = np.meshgrid(np.arange(t), np.arange(rows), np.arange(cols), indexing="ij")
        prompt[:, start:end] = base + np.stack([steps, row, col]).reshape(3, -1)
        done, next_position = end, base + max(rows, cols)
    prompt[:, done:] = np.arange(prompt_len - done, dtype=np.int64) + next_position
    delta = (int(prompt.max()) + 1 if prompt_len else 0) - prompt_len
    return GridPositions(prompt, delta)
