"""Image-text models (LLaVA, LLaVA-NeXT, Idefics3, Gemma 3, the Qwen VL models, Qwen3.5):
transformers' own vision encoder and projector, and the language model (Conveyor's decoder where
it is of the Llama family, Gemma 3 or Qwen3.5, else transformers' own over the paged attention)
fed embeddings where the prompt holds images.

The encoder runs once per request, on the step that first reaches the request's image
placeholders (`engine/worker/image_features.py`); its rows replace those placeholders'
embeddings in whichever steps compute them, so chunked prefill may cut an image anywhere, except
in a model whose image tokens see each other both ways (Gemma 3): there each image's run of
placeholders is computed in one step (`ImageInputs.whole_runs`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.models.base import CausalLM
from engine.models.gemma import PagedGemmaForCausalLM
from engine.models.hf import TransformersCausalLM
from engine.models.llama import PagedLlamaForCausalLM, plain_projections
from engine.models.qwen3_5 import PagedQwen3_5ForCausalLM
from engine.models.qwen3_5 import why_not_run_layers as qwen3_5_reason
from engine.models.rotary_table import AxisRotary, rotary_axes

# The families whose images are served.
IMAGE_TEXT_TYPES = (
    "llava",
    "llava_next",
    "llava_onevision",
    "idefics3",
    "smolvlm",
    "gemma3",
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
)
# Those whose image tokens see their whole image's run both ways, not causally.
BOTH_WAYS_TYPES = ("gemma3",)
# Those whose rotary positions lie on three axes, an image's tokens on its grid (M-RoPE).
GRID_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
# Those whose encoder also feeds the first decoder layers' outputs at the image tokens
# (Qwen3-VL's "deepstack"), which only Conveyor's decoder takes.
LAYER_ROWS_TYPES = ("qwen3_vl", "qwen3_vl_moe")
# Qwen3.5's language models, whose linear attention layers keep recurrent states: only
# Conveyor's decoder runs them (`qwen3_5.py`).
STATEFUL_TEXT_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# Language models Conveyor's decoder runs (the Llama family's dense members, Gemma 3's, and
# the Qwen VL models', rotated on three axes, Qwen3-VL-MoE's with its experts).
TEXT_TYPES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3_text",
    "qwen2_vl_text",
    "qwen2_5_vl_text",
    "qwen3_vl_text",
    "qwen3_vl_moe_text",
    *STATEFUL_TEXT_TYPES,
)


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


class ImageEncoder:
    """transformers' own vision encoder and projector of an image-text model: a prompt's images
    in, one row per placeholder out. A model whose encoder also feeds its first decoder layers
    (Qwen3-VL) gets those layers' rows beside each row (`ImageRows`)."""

    def __init__(self, hf_model: Any) -> None:
        token = image_token_id(hf_model.config)
        assert token is not None, "checked by why_not_served"
        self.image_token_id = token
        self.hf_model = hf_model
        self._keys = _named_parameters(hf_model.model.get_image_features)
        self._embed = hf_model.get_input_embeddings()
        # The dtype the encoder computes in (the checkpoint's, whatever the language model's).
        self.dtype = _encoder_dtype(hf_model)
        kind = hf_model.config.model_type
        # Whether an image's placeholders attend both ways within their run (`ImageInputs`),
        # and then how many an image has (Gemma 3's fixed count), which one step must hold.
        self.both_ways = kind in BOTH_WAYS_TYPES
        self.image_tokens: int | None = getattr(hf_model.config, "mm_tokens_per_image", None)
        # Where images lie on their grids (`engine/core/mrope.py`): patches merged a token.
        vision = hf_model.config.vision_config
        self.grid_merge: int | None = vision.spatial_merge_size if kind in GRID_TYPES else None
        # Whether its rows also feed the first decoder layers (Qwen3-VL's deepstack).
        self.feeds_layers = kind in LAYER_ROWS_TYPES

    @torch.inference_mode()
    def __call__(self, data: dict[str, Any]) -> torch.Tensor:
        """The projected features of a prompt's images, one row per placeholder in order
        `[rows, hidden]` in the language model's dtype, as transformers' own forward places
        them (`[rows, (1 + layers) * hidden]` with the rows each of the first decoder layers
        adds to its output, where the encoder gives those)."""
        device = self._embed.weight.device
        inputs = {
            key: _to(value, device, self.dtype)
            for key, value in data.items()
            if key in self._keys or key == "pixel_values"
        }
        found = self.hf_model.model.get_image_features(**inputs)
        features = getattr(found, "pooler_output", found)
        layers = getattr(found, "deepstack_features", None) or []
        parts = [self._rows(features), *(self._rows(layer) for layer in layers)]
        return torch.cat(parts, dim=-1).to(self._embed.weight.dtype)

    def _rows(self, features: Any) -> torch.Tensor:
        """`[rows, hidden]`: the features of every image (a tensor or one per image)."""
        pieces = features if isinstance(features, (list, tuple)) else [features]
        hidden = self._embed.weight.shape[-1]
        return torch.cat([piece.reshape(-1, hidden) for piece in pieces])


class ImageTextLM(CausalLM, Protocol):
    """What the runner needs of an image-text model: its encoder beside the calling convention
    (whose `image_features` replace some tokens' embeddings)."""

    image_encoder: ImageEncoder


def takes_images(model: Any) -> bool:
    return isinstance(model, (TransformersImageTextLM, PagedImageTextLM))


class TransformersImageTextLM(TransformersCausalLM):
    """The Hugging Face image-text model whole, its language model on the paged attention."""

    name = "transformers (image-text)"

    def __init__(self, hf_model: Any) -> None:
        super().__init__(hf_model)
        self.image_encoder = ImageEncoder(hf_model)


@dataclass(frozen=True, slots=True)
class LanguageModel:
    """An image-text model's language model in the shape Conveyor's decoder reads a causal LM:
    the decoder (`model`: embeddings, layers, norm, rotary), the head, the text config."""

    model: Any
    lm_head: Any
    config: Any


class PagedImageTextLM(PagedLlamaForCausalLM):
    """An image-text model whose language model is of the Llama family: Conveyor's decoder
    over its weights (decode steps take the fused stack), transformers' encoder for images.
    `paged_image_text` builds it, or its Gemma twin."""

    name = "conveyor (image-text)"

    def __init__(self, hf_model: Any) -> None:
        language = LanguageModel(
            hf_model.get_decoder(), hf_model.get_output_embeddings(), hf_model.config.text_config
        )
        super().__init__(language)
        self.image_encoder = ImageEncoder(hf_model)
        axes = rotary_axes(language.config)
        if axes is not None:
            self.rotary = AxisRotary(self.rotary, axes)  # type: ignore[assignment]


class PagedGemmaImageTextLM(PagedImageTextLM, PagedGemmaForCausalLM):
    """Gemma 3's image-text model: Conveyor's Gemma decoder for its language model."""


class PagedQwen3_5ImageTextLM(PagedImageTextLM, PagedQwen3_5ForCausalLM):
    """Qwen3.5's image-text model: Conveyor's Qwen3.5 decoder (its linear attention's states
    in the state cache) for its language model."""


def paged_image_text(hf_model: Any) -> PagedImageTextLM:
    """Conveyor's decoder for the image-text model's language model (`decoder_supports`)."""
    kind = hf_model.config.get_text_config().model_type
    if kind.startswith("gemma"):
        return PagedGemmaImageTextLM(hf_model)
    if kind in STATEFUL_TEXT_TYPES:
        return PagedQwen3_5ImageTextLM(hf_model)
    return PagedImageTextLM(hf_model)


def needs_decoder(hf_model: Any) -> bool:
    """Whether only Conveyor's decoder runs the model's language model: transformers' takes
    no rows for its layers from outside its own forward (Qwen3-VL's deepstack), nor the states
    of Qwen3.5's linear attention."""
    kind = hf_model.config.get_text_config().model_type
    return hf_model.config.model_type in LAYER_ROWS_TYPES or kind in STATEFUL_TEXT_TYPES


def decoder_supports(hf_model: Any) -> str:
    """Empty where Conveyor's decoder runs the image-text model's language model, else why
    not."""
    kind = hf_model.config.get_text_config().model_type
    if kind not in TEXT_TYPES:
        return f"its language model is {kind}, not one of {', '.join(TEXT_TYPES)}"
    if kind in STATEFUL_TEXT_TYPES:
        return qwen3_5_reason(hf_model.get_decoder().layers)
    return plain_projections(hf_model.get_decoder().layers)


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
