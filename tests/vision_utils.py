"""Tiny random-weight image-text models with their processors: LLaVA (a CLIP vision tower, one
run of placeholders an image), LLaVA-NeXT (tiles on a grid, rows ended by a newline feature),
Idefics3 (SmolVLM's family: a SigLIP tower, each image cut into tiles with row and column
tokens between them), Gemma 3 (a SigLIP tower, each image's placeholders attending to each
other both ways, a Gemma decoder with local and global layers) and Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (an image's tokens on its grid of merged patches, rotated on three axes; Qwen3-VL's
tower also feeding its first decoder layers); random images; and the
reference, transformers' own `generate` over the same inputs."""

from __future__ import annotations

import base64
import copy
import hashlib
import io
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import (
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessorPil,
    LlavaOnevisionProcessor,
    LlavaProcessor,
    PreTrainedTokenizerFast,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
    Qwen2VLProcessor,
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeConfig,
    Qwen3VLMoeForConditionalGeneration,
    Qwen3VLProcessor,
    SiglipVisionConfig,
    SmolVLMConfig,
    SmolVLMForConditionalGeneration,
    SmolVLMImageProcessorPil,
    SmolVLMProcessor,
    SmolVLMVisionConfig,
)

from engine.core.images import ImageInputs
from engine.loading.processors import images_only
from tests.helpers import TINY_SHAPE, tiny_tokenizer

IMAGE_TOKEN = "<image>"
# 28x28 pixels in 14x14 patches: four placeholders an image (the CLS feature is dropped).
IMAGE_SIZE, PATCH = 28, 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2
VISION = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH,
}
# Content as parts, as image-text models' templates take it.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<image>"
    "{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


CROP = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
# How both LLaVA processors expand `<image>`: a placeholder a patch, the CLS feature dropped.
LLAVA_PROCESSING: dict[str, Any] = {
    "patch_size": PATCH,
    "vision_feature_select_strategy": "default",
    "image_token": IMAGE_TOKEN,
    "num_additional_image_tokens": 1,
    "chat_template": CHAT_TEMPLATE,
}


@lru_cache(maxsize=1)
def llava_processor() -> LlavaProcessor:
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    images = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE}, crop_size=CROP)
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, **LLAVA_PROCESSING)


# LLaVA-NeXT's grids: an image is cut into the tiles of the nearest, plus the whole, and its
# features unpadded with a newline feature after each row.
GRIDS = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE], [2 * IMAGE_SIZE] * 2]


@lru_cache(maxsize=1)
def llava_next_processor() -> LlavaNextProcessor:
    tokenizer = llava_processor().tokenizer
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size=CROP, image_grid_pinpoints=GRIDS
    )
    return LlavaNextProcessor(image_processor=images, tokenizer=tokenizer, **LLAVA_PROCESSING)


@lru_cache(maxsize=1)
def llava_onevision_processor() -> Any:
    """LLaVA-OneVision's tiles on the same grids, each tile's patches all kept (a SigLIP tower
    has no CLS feature), without its video half (`images_only`)."""
    tokenizer = copy.deepcopy(llava_processor().tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<video>"]})
    images = LlavaOnevisionImageProcessorPil(size=CROP, image_grid_pinpoints=GRIDS)
    return images_only(LlavaOnevisionProcessor)(
        image_processor=images,
        tokenizer=tokenizer,
        num_image_tokens=TOKENS_PER_IMAGE,
        vision_feature_select_strategy="full",
        image_token=IMAGE_TOKEN,
        video_token="<video>",
        chat_template=CHAT_TEMPLATE,
    )


@lru_cache(maxsize=1)
def idefics3_processor() -> Idefics3Processor:
    """Images resized to at most 56 pixels a side and cut into 28-pixel tiles, plus the whole
    image as a global tile: one placeholder a tile (`image_seq_len`)."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials + grid})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=True,
    )
    return Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=1, chat_template=CHAT_TEMPLATE
    )


# Gemma 3's processor expands its begin-of-image token into the image's placeholders between
# that token and an end-of-image one.
GEMMA_IMAGE_TOKENS = {
    "image_token": "<image_soft_token>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}


@lru_cache(maxsize=1)
def gemma3_processor() -> Gemma3Processor:
    """Images resized to 28 pixels a side: four placeholders an image (`image_seq_length`)."""
    base = tiny_tokenizer()
    template = CHAT_TEMPLATE.replace(IMAGE_TOKEN, GEMMA_IMAGE_TOKENS["boi_token"])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(base.backend_tokenizer),
        eos_token=base.eos_token,
        bos_token=base.bos_token,
        extra_special_tokens=GEMMA_IMAGE_TOKENS,
        chat_template=template,
    )
    images = Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=TOKENS_PER_IMAGE,
        chat_template=template,
    )


# Qwen2-VL's processor expands its image token into one per merged patch of the image's grid.
QWEN_VL_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
# Images resized to whole 28-pixel cells (14-pixel patches merged 2x2), 4 to 12 cells an image.
QWEN_VL_IMAGES = {"min_pixels": 4 * 28 * 28, "max_pixels": 12 * 28 * 28, "patch_size": PATCH}


QWEN_VL_FAMILIES = {
    "qwen2_vl": Qwen2VLProcessor,
    "qwen2_5_vl": Qwen2_5_VLProcessor,
    "qwen3_vl": Qwen3VLProcessor,
    "qwen3_vl_moe": Qwen3VLProcessor,
    "qwen3_5": Qwen3VLProcessor,
    "qwen3_5_moe": Qwen3VLProcessor,
}


@lru_cache(maxsize=4)
def qwen_vl_processor(family: str) -> Any:
    """Qwen2-VL's, Qwen2.5-VL's or Qwen3-VL's processor without its video half
    (`images_only`)."""
    base = tiny_tokenizer()
    template = CHAT_TEMPLATE.replace(IMAGE_TOKEN, "<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(base.backend_tokenizer),
        eos_token=base.eos_token,
        bos_token=base.bos_token,
        extra_special_tokens=QWEN_VL_TOKENS,
        chat_template=template,
    )
    images = Qwen2VLImageProcessorPil(**QWEN_VL_IMAGES)
    processor = images_only(QWEN_VL_FAMILIES[family])
    return processor(image_processor=images, tokenizer=tokenizer, chat_template=template)


@lru_cache(maxsize=1)
def smolvlm_processor() -> Any:
    """SmolVLM2's: Idefics3's tiles and tokens, its processor without its video half; its
    template on the tokenizer, as served (its processor's own needs the video half)."""
    tokenizer = copy.deepcopy(idefics3_processor().tokenizer)
    tokenizer.chat_template = CHAT_TEMPLATE
    images = SmolVLMImageProcessorPil(
        size={"longest_edge": 2 * IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
        do_image_splitting=True,
    )
    return images_only(SmolVLMProcessor)(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=None,
        image_seq_len=1,
        chat_template=CHAT_TEMPLATE,
    )


def processor_of(family: str) -> Any:
    makers = {
        "llava": llava_processor,
        "llava_next": llava_next_processor,
        "llava_onevision": llava_onevision_processor,
        "idefics3": idefics3_processor,
        "smolvlm": smolvlm_processor,
        "gemma3": gemma3_processor,
    }
    if family in QWEN_VL_FAMILIES:
        return qwen_vl_processor(family)
    return makers[family]()


# The token each family's processor expands into an image's placeholders.
PLACEHOLDERS = {
    "gemma3": GEMMA_IMAGE_TOKENS["image_token"],
    "qwen2_vl": QWEN_VL_TOKENS["image_token"],
    "qwen2_5_vl": QWEN_VL_TOKENS["image_token"],
    "qwen3_vl": QWEN_VL_TOKENS["image_token"],
    "qwen3_vl_moe": QWEN_VL_TOKENS["image_token"],
    "qwen3_5": QWEN_VL_TOKENS["image_token"],
    "qwen3_5_moe": QWEN_VL_TOKENS["image_token"],
}


def _text_config(tokenizer: Any) -> LlamaConfig:
    return LlamaConfig(
        **TINY_SHAPE | dict(vocab_size=len(tokenizer)),
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=0,
    )


def tiny_image_text(family: str = "llava", seed: int = 0) -> Any:
    """A tiny random model of `family` (one of `FAMILIES`), in fp32."""
    return MAKERS[family](seed)


def _qwen_vl_text(tokenizer: Any) -> dict[str, Any]:
    """A Qwen2 of head dim 16, its 8 frequencies rotated by time, height and width 2, 3, 3."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": rope,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
        "bos_token_id": 1,
        "pad_token_id": 0,
    }


def tiny_qwen3_vl(seed: int = 0, family: str = "qwen3_vl") -> Any:
    """A Qwen3 language model of three layers (its frequencies interleaved over the three axes);
    its tower's two layers each feed one of the first two decoder layers (deepstack). As
    `qwen3_vl_moe`, each layer's MLP is four experts, two a token."""
    tokenizer = qwen_vl_processor(family).tokenizer
    text = {**_qwen_vl_text(tokenizer), "num_hidden_layers": 3, "head_dim": 16}
    if family == "qwen3_vl_moe":
        text |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    vision = _qwen3_tower() | {"deepstack_visual_indexes": [0, 1]}
    moe = family == "qwen3_vl_moe"
    config = (Qwen3VLMoeConfig if moe else Qwen3VLConfig)(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        **_qwen_vl_tokens(tokenizer),
    )
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration if moe else Qwen3VLForConditionalGeneration
    return model(config).eval()


def _qwen3_tower() -> dict[str, Any]:
    """The vision tower of Qwen3-VL's and Qwen3.5's tiny models: two layers."""
    return {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "num_position_embeddings": 64,
        "initializer_range": 0.2,
    }


def tiny_qwen3_vl_moe(seed: int = 0) -> Qwen3VLMoeForConditionalGeneration:
    return tiny_qwen3_vl(seed, "qwen3_vl_moe")


def tiny_qwen3_5(seed: int = 0, family: str = "qwen3_5") -> Any:
    """A Qwen3.5 language model of four layers, the last attention (a quarter of its head dims
    rotated, interleaved over the three axes), the others Gated DeltaNet; its tower without
    layers fed by it. As `qwen3_5_moe`, each layer's MLP is four experts, two a token, beside a
    shared expert."""
    tokenizer = qwen_vl_processor(family).tokenizer
    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.5,
    }
    text = _qwen_vl_text(tokenizer) | {
        "num_hidden_layers": 4,
        "head_dim": 16,
        "rope_parameters": rope,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 12,
    }
    moe = family == "qwen3_5_moe"
    if moe:
        text |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
        }
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(
        text_config=text,
        vision_config=_qwen3_tower(),
        tie_word_embeddings=False,
        **_qwen_vl_tokens(tokenizer),
    )
    torch.manual_seed(seed)
    model = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    return model(config).eval()


def tiny_qwen3_5_moe(seed: int = 0) -> Qwen3_5MoeForConditionalGeneration:
    return tiny_qwen3_5(seed, "qwen3_5_moe")


def _qwen_vl_tokens(tokenizer: Any) -> dict[str, int]:
    return {
        "image_token_id": tokenizer.image_token_id,
        "video_token_id": tokenizer.video_token_id,
        "vision_start_token_id": tokenizer.vision_start_token_id,
        "vision_end_token_id": tokenizer.vision_end_token_id,
    }


def tiny_qwen2_vl(seed: int = 0) -> Qwen2VLForConditionalGeneration:
    tokenizer = qwen_vl_processor("qwen2_vl").tokenizer
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2}
    config = Qwen2VLConfig(
        text_config=_qwen_vl_text(tokenizer),
        vision_config={**vision, "patch_size": PATCH},
        tie_word_embeddings=False,
        **_qwen_vl_tokens(tokenizer),
    )
    torch.manual_seed(seed)
    return Qwen2VLForConditionalGeneration(config).eval()


def tiny_qwen2_5_vl(seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    """Its tower attends within windows of 2x2 tokens in the first layer, whole in the second."""
    tokenizer = qwen_vl_processor("qwen2_5_vl").tokenizer
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "out_hidden_size": 64,
        "patch_size": PATCH,
        "window_size": 56,
        "fullatt_block_indexes": [1],
    }
    config = Qwen2_5_VLConfig(
        text_config=_qwen_vl_text(tokenizer),
        vision_config=vision,
        tie_word_embeddings=False,
        **_qwen_vl_tokens(tokenizer),
    )
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def tiny_gemma3(seed: int = 0) -> Gemma3ForConditionalGeneration:
    """Local layers of an 8-token window, then a global one. Its greedy tokens change where the
    image tokens attend causally instead of both ways."""
    tokenizer = gemma3_processor().tokenizer
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        initializer_range=0.2,
        tie_word_embeddings=False,  # tied, a random model repeats its last token
        eos_token_id=0,
        bos_token_id=1,
        pad_token_id=0,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=SiglipVisionConfig(**VISION).to_dict(),
        mm_tokens_per_image=TOKENS_PER_IMAGE,
        image_token_index=tokenizer.image_token_id,
        boi_token_index=tokenizer.boi_token_id,
        eoi_token_index=tokenizer.eoi_token_id,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_llava_next(seed: int = 0) -> LlavaNextForConditionalGeneration:
    tokenizer = llava_next_processor().tokenizer
    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(**VISION).to_dict(),
        text_config=_text_config(tokenizer).to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_grid_pinpoints=GRIDS,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    return LlavaNextForConditionalGeneration(config).eval()


def tiny_llava_onevision(seed: int = 0) -> LlavaOnevisionForConditionalGeneration:
    """A SigLIP tower and a Qwen2 language model, as LLaVA-OneVision's."""
    tokenizer = llava_onevision_processor().tokenizer
    text = Qwen2Config(**_text_config(tokenizer).to_dict(), use_sliding_window=False)
    config = LlavaOnevisionConfig(
        vision_config=SiglipVisionConfig(**VISION).to_dict(),
        text_config=text.to_dict(),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_index=tokenizer.convert_tokens_to_ids("<video>"),
        image_grid_pinpoints=GRIDS,
        vision_feature_select_strategy="full",
        vision_feature_layer=-1,
    )
    torch.manual_seed(seed)
    return LlavaOnevisionForConditionalGeneration(config).eval()


def tiny_smolvlm(seed: int = 0) -> SmolVLMForConditionalGeneration:
    parts = (SmolVLMConfig, SmolVLMVisionConfig, SmolVLMForConditionalGeneration)
    return _tiled(*parts, smolvlm_processor().tokenizer, seed)


def tiny_idefics3(seed: int = 0) -> Idefics3ForConditionalGeneration:
    parts = (Idefics3Config, Idefics3VisionConfig, Idefics3ForConditionalGeneration)
    return _tiled(*parts, idefics3_processor().tokenizer, seed)


def _tiled(config: Any, vision: Any, model: Any, tokenizer: Any, seed: int) -> Any:
    """Idefics3's shape (SmolVLM2's too): a SigLIP tower whose features are merged 2x2."""
    made = config(
        vision_config=vision(**VISION).to_dict(),
        text_config=_text_config(tokenizer).to_dict(),
        image_token_id=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        scale_factor=2,
    )
    torch.manual_seed(seed)
    return model(made).eval()


def tiny_llava(seed: int = 0) -> LlavaForConditionalGeneration:
    tokenizer = llava_processor().tokenizer
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(**VISION),
        text_config=_text_config(tokenizer),
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
    )
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config).eval()


def save_tiny(folder: Path, family: str = "llava", seed: int = 0) -> Path:
    """The model and its processor in a folder, as `conveyor serve --model` reads them."""
    tiny_image_text(family, seed).save_pretrained(folder)
    processor_of(family).save_pretrained(folder)
    return folder


def random_image(seed: int, width: int = 40, height: int = 32) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def image_prompt(
    parts: list[Any], family: str = "llava", **processor_kwargs: Any
) -> tuple[dict[str, Any], list[int], ImageInputs]:
    """A user turn of text strings and images through the template and `family`'s processor
    (called with `processor_kwargs`): the processor's output, the prompt's ids, and its images
    as the engine carries them."""
    processor = processor_of(family)
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    templating = processor.tokenizer if family == "smolvlm" else processor
    text = templating.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    images = [p for p in parts if not isinstance(p, str)]
    per_prompt = family in ("idefics3", "smolvlm", "gemma3")  # a list of images per prompt
    batch = [images] if per_prompt else images
    processed = dict(processor(text=[text], images=batch, return_tensors="pt", **processor_kwargs))
    ids = processed["input_ids"][0].tolist()
    digests = [hashlib.sha256(png_bytes(image)).digest() for image in images]
    token = processor.tokenizer.convert_tokens_to_ids(PLACEHOLDERS.get(family, IMAGE_TOKEN))
    inputs = ImageInputs.of(ids, token, digests, processed)
    inputs.both_ways = family == "gemma3"
    return processed, ids, inputs


def reference_tokens(
    model: LlavaForConditionalGeneration, processed: dict[str, Any], max_new_tokens: int
) -> list[int]:
    """transformers' greedy tokens for the processed prompt, EOS ignored (`model` must be an
    instance the engine does not run: the engine's runs Conveyor's attention)."""
    prompt_len = processed["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(
            **processed,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
        )
    return out[0, prompt_len:].tolist()


# The tiny model of every family these helpers build, each an image-text type Conveyor serves.
MAKERS: dict[str, Callable[[int], Any]] = {
    "llava": tiny_llava,
    "llava_next": tiny_llava_next,
    "llava_onevision": tiny_llava_onevision,
    "idefics3": tiny_idefics3,
    "smolvlm": tiny_smolvlm,
    "gemma3": tiny_gemma3,
    "qwen2_vl": tiny_qwen2_vl,
    "qwen2_5_vl": tiny_qwen2_5_vl,
    "qwen3_vl": tiny_qwen3_vl,
    "qwen3_vl_moe": tiny_qwen3_vl_moe,
    "qwen3_5": tiny_qwen3_5,
    "qwen3_5_moe": tiny_qwen3_5_moe,
}
FAMILIES = tuple(MAKERS)
