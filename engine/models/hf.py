"""Any Hugging Face causal LM, run unchanged with the paged attention registered in it."""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.hf import METADATA_KWARG
from engine.models.base import ImageRows, with_image_rows
from engine.worker.sampler import row_argmax


class TransformersCausalLM:
    name = "transformers"

    def __init__(self, hf_model: Any) -> None:
        self.hf_model = hf_model

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        if image_features is None:
            return self.logits(positions, metadata, logits_indices, input_ids=input_ids[None])
        embeds = with_image_rows(self.hf_model.get_input_embeddings()(input_ids), image_features)
        return self.logits(positions, metadata, logits_indices, inputs_embeds=embeds[None])

    def logits(
        self,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        **inputs: torch.Tensor,
    ) -> torch.Tensor:
        """The model's logits over the step's `inputs` (its `input_ids` or `inputs_embeds`)."""
        # Positions on three axes (`[3, tokens]`) take the batch dimension second.
        position_ids = positions[None] if positions.dim() == 1 else positions[:, None]
        out = self.hf_model(
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=logits_indices,
            **{METADATA_KWARG: metadata},
            **inputs,
        )
        return out.logits[0]

    def greedy_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: ImageRows | None = None,
    ) -> torch.Tensor:
        """The argmax of each row's logits, as the sampler takes it."""
        logits = self(input_ids, positions, metadata, logits_indices, image_features)
        return row_argmax(logits.float())
