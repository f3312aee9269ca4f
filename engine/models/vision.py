"""Image-text models (LLaVA and its kin): transformers' own vision encoder and projector, and its
language model over Conveyor's paged attention, fed embeddings where the prompt holds images.

The encoder runs once per request, on the step that first reaches the request's image
placeholders (`engine/worker/image_features.py`); its rows replace those placeholders'
embeddings in whichever steps compute them, so chunked prefill may cut an image anywhere.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from engine.attention.backend import AttentionMetadata
from engine.models.hf import TransformersCausalLM
from engine.worker.sampler import row_argmax

# The families whose images are served: one position per token (no multi-axis rotary), and
# image tokens that attend causally as text does (Gemma 3 lets an image's tokens see each
# other both ways, which paged causal attention does not compute).
IMAGE_TEXT_TYPES = ("llava", "idefics3")


def is_image_text(config: Any) -> bool:
    """Whether a checkpoint's config is an image-text model's (it has a vision part)."""
    return getattr(config, "vision_config", None) is not None


def why_not_served(config: Any) -> str:
    """Empty where this module serves the image-text model, else why not."""
    kind = getattr(config, "model_type", "?")
    if kind not in IMAGE_TEXT_TYPES:
        return f"the images of {kind} models are not served (served: {', '.join(IMAGE_TEXT_TYPES)})"
    if image_token_id(config) is None:
        return "its config names no image token"
    return ""


def image_token_id(config: Any) -> int | None:
    found = getattr(config, "image_token_id", None)
    if found is None:
        found = getattr(config, "image_token_index", None)
    return found if isinstance(found, int) else None


class TransformersImageTextLM(TransformersCausalLM):
    """The Hugging Face image-text model; a step may carry image features (`image_features`:
    the flattened indices of the step's tokens they replace, and the rows)."""

    name = "transformers (image-text)"

    def __init__(self, hf_model: Any) -> None:
        super().__init__(hf_model)
        token = image_token_id(hf_model.config)
        assert token is not None, "checked by why_not_served"
        self.image_token_id = token
        self._encoder_keys = _named_parameters(hf_model.model.get_image_features)
        self._embed = hf_model.get_input_embeddings()
        self._encoder_dtype = _encoder_dtype(hf_model)

    @torch.inference_mode()
    def encode_images(self, data: dict[str, Any]) -> torch.Tensor:
        """The projected features of a prompt's images, one row per placeholder in order
        `[rows, hidden]`, as transformers' own forward places them."""
        device, dtype = self._embed.weight.device, self._embed.weight.dtype
        inputs = {
            key: _to(value, device, self._encoder_dtype)
            for key, value in data.items()
            if key in self._encoder_keys or key == "pixel_values"
        }
        found = self.hf_model.model.get_image_features(**inputs)
        features = getattr(found, "pooler_output", found)
        pieces = features if isinstance(features, (list, tuple)) else [features]
        hidden = self._embed.weight.shape[-1]
        return torch.cat([piece.reshape(-1, hidden) for piece in pieces]).to(dtype)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if image_features is None:
            return super().__call__(input_ids, positions, metadata, logits_indices)
        embeds = self._embed(input_ids)
        rows, features = image_features
        embeds = embeds.index_copy(0, rows, features.to(embeds.dtype))
        return self.logits(positions, metadata, logits_indices, inputs_embeds=embeds[None])

    def greedy_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        logits_indices: torch.Tensor,
        image_features: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        logits = self(input_ids, positions, metadata, logits_indices, image_features)
        return row_argmax(logits.float())


def _encoder_dtype(hf_model: Any) -> torch.dtype:
    """The dtype the vision encoder computes in (it may differ from the language model's:
    `model_loader.widened_parts`)."""
    decoder = {id(p) for p in hf_model.get_decoder().parameters()}
    found = (p.dtype for p in hf_model.model.parameters() if id(p) not in decoder)
    return next((d for d in found if d.is_floating_point), torch.float32)


def _named_parameters(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters) - {"self", "kwargs"}


def _to(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """A processor's tensor where the encoder runs: floating ones in the model's dtype."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(device, dtype) if value.is_floating_point() else value.to(device)
