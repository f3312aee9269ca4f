"""Which of a step's tokens take image features instead of their embeddings, and those rows.

A request's encoder runs on the first step that computes any of its image placeholders (a
prefix cache hit over all of them skips it); its rows stay on the request for later chunks."""

from __future__ import annotations

import numpy as np
import torch

from engine.core.images import ImageInputs
from engine.models.base import ImageRows
from engine.models.vision import ImageEncoder
from engine.worker.input_batch import InputBatch


def step_image_features(
    batch: InputBatch, encoder: ImageEncoder | None, device: torch.device
) -> ImageRows | None:
    """The step's image features (and prompt embeddings), or None where it computes no
    placeholder. `encoder`: the model's, None for a text model (its rows are all given)."""
    indices: list[np.ndarray] = []
    rows: list[torch.Tensor] = []
    for row, request in enumerate(batch.requests):
        images = request.images
        if images is None:
            continue
        start = int(batch.context_lens[row])
        first, last = images.span(start, start + int(batch.query_lens[row]))
        if first == last:
            continue
        features = encoded(images, encoder)
        indices.append(images.positions[first:last] - start + int(batch.query_starts[row]))
        rows.append(features[first:last])
    if not rows:
        return None
    flat = torch.from_numpy(np.concatenate(indices)).to(device)
    return flat, torch.cat([part.to(device) for part in rows])


def encoded(images: ImageInputs, encoder: ImageEncoder | None) -> torch.Tensor:
    """The request's image features, computed on first use (given rows are there already); a
    count that does not match the placeholders is the request's fault, raised (the step's
    isolation fails it alone)."""
    if images.features is None:
        assert encoder is not None  # a text model's rows are all given
        features = encoder(images.data)
        if features.shape[0] != len(images.positions):
            raise ValueError(
                f"the images gave {features.shape[0]} feature rows for "
                f"{len(images.positions)} image placeholders in the prompt"
            )
        images.features, images.data = features, {}  # the pixels are no longer needed
    return images.features
