"""A random-weight image-text model folder with a processor built on the default model's
tokenizer, for timing image requests on a machine that cannot fetch the real weights (run with
EOS ignored). `--family idefics3` (the default) is shaped like SmolVLM-256M: a SigLIP tower of
12 layers of 768 over 512-pixel tiles in 16-pixel patches, 64 image tokens a tile, SmolLM2-135M's
language model. `--family gemma3` is a Gemma 3 with Gemma 3 270M's language model (18 layers of
640, five local layers of a 512-token window to one global) and a SigLIP tower of the same size
over 448-pixel images in 14-pixel patches, pooled to 256 image tokens an image as Gemma 3's are.
`--family qwen2_5_vl` is a Qwen2.5-VL with Qwen2.5-0.5B's language model (24 layers of 896,
rotated on three axes) and a Qwen2.5-VL tower of 12 layers of 768 (windows of 112 pixels but
in four layers), a 448-pixel image in 14-pixel patches merged 2x2 into 256 tokens.
`--family qwen3_vl` is a Qwen3-VL with Qwen3-0.6B's language model (28 layers of 1024) and a
Qwen3-VL tower of 12 layers of 768 whose layers 3, 7 and 11 feed the first three decoder layers,
a 448-pixel image in 16-pixel patches merged 2x2 into 196 tokens.

    python benchmarks/random_vlm.py OUT_DIR [--family gemma3|qwen2_5_vl|qwen3_vl] [--dtype bfloat16]
        [--config-only]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3ImageProcessorPil,
    Gemma3Processor,
    Gemma3TextConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2_5_VLProcessor,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)

from engine.loading.default_model import ensure_default_model
from engine.loading.processors import images_only

VISION = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": 512,
    "patch_size": 16,
}
SCALE_FACTOR = 4  # (512 / 16)^2 / 4^2 = 64 tokens a tile
CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}<image>{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def idefics3_processor() -> Idefics3Processor:
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    grid = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    specials = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]
    tokenizer.add_special_tokens({"additional_special_tokens": specials + grid})
    images = Idefics3ImageProcessorPil(
        size={"longest_edge": 4 * VISION["image_size"]},
        max_image_size={"longest_edge": VISION["image_size"]},
        do_image_splitting=True,
    )
    tokens = (VISION["image_size"] // VISION["patch_size"]) ** 2 // SCALE_FACTOR**2
    return Idefics3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_len=tokens,
        chat_template=CHAT_TEMPLATE,
    )


GEMMA_VISION = {**VISION, "image_size": 448, "patch_size": 14}  # 32x32 patches, pooled 2x2
GEMMA_TOKENS = {
    "image_token": "<image_soft_token>",
    "boi_token": "<start_of_image>",
    "eoi_token": "<end_of_image>",
}
GEMMA_TEMPLATE = CHAT_TEMPLATE.replace("<image>", GEMMA_TOKENS["boi_token"])


def gemma3_processor() -> Gemma3Processor:
    tokenizer = AutoTokenizer.from_pretrained(
        ensure_default_model(), extra_special_tokens=GEMMA_TOKENS
    )
    size = GEMMA_VISION["image_size"]
    images = Gemma3ImageProcessorPil(size={"height": size, "width": size})
    return Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        image_seq_length=256,
        chat_template=GEMMA_TEMPLATE,
    )


def idefics3_model(made: Idefics3Processor) -> tuple[Idefics3Config, type]:
    text = AutoConfig.from_pretrained(ensure_default_model())
    text.vocab_size = len(made.tokenizer)
    config = Idefics3Config(
        vision_config=VISION,
        text_config=text.to_dict(),
        image_token_id=made.tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=text.tie_word_embeddings,
    )
    return config, Idefics3ForConditionalGeneration


def gemma3_model(made: Gemma3Processor) -> tuple[Gemma3Config, type]:
    tokenizer = made.tokenizer
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=[("full" if (i + 1) % 6 == 0 else "sliding") + "_attention" for i in range(18)],
        max_position_embeddings=32768,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id or 0,
    )
    config = Gemma3Config(
        text_config=text.to_dict(),
        vision_config=GEMMA_VISION,
        mm_tokens_per_image=256,
        image_token_index=tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["image_token"]),
        boi_token_index=tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["boi_token"]),
        eoi_token_index=tokenizer.convert_tokens_to_ids(GEMMA_TOKENS["eoi_token"]),
    )
    return config, Gemma3ForConditionalGeneration


QWEN_TOKENS = {
    "image_token": "<|image_pad|>",
    "video_token": "<|video_pad|>",
    "vision_start_token": "<|vision_start|>",
    "vision_end_token": "<|vision_end|>",
}
QWEN_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")
QWEN_PIXELS = 448 * 448  # every 448-pixel square image: 32x32 patches


def qwen_processor(processor_class: type, patch: int) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(
        ensure_default_model(), extra_special_tokens=QWEN_TOKENS
    )
    images = Qwen2VLImageProcessorPil(
        min_pixels=QWEN_PIXELS, max_pixels=QWEN_PIXELS, patch_size=patch
    )
    return images_only(processor_class)(
        image_processor=images, tokenizer=tokenizer, chat_template=QWEN_TEMPLATE
    )


def qwen2_5_vl_processor() -> Qwen2_5_VLProcessor:
    made: Qwen2_5_VLProcessor = qwen_processor(Qwen2_5_VLProcessor, 14)
    return made


def qwen3_vl_processor() -> Qwen3VLProcessor:
    made: Qwen3VLProcessor = qwen_processor(Qwen3VLProcessor, 16)
    return made


def qwen2_5_vl_model(made: Qwen2_5_VLProcessor) -> tuple[Qwen2_5_VLConfig, type]:
    tokenizer = made.tokenizer
    text = qwen_text(
        tokenizer,
        (1000000.0, [8, 12, 12]),  # sections of head dim 64
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
    )
    vision = {
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "out_hidden_size": 896,
        "fullatt_block_indexes": [2, 5, 8, 11],
    }
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **qwen_tokens(tokenizer))
    return config, Qwen2_5_VLForConditionalGeneration


def qwen3_vl_model(made: Qwen3VLProcessor) -> tuple[Qwen3VLConfig, type]:
    tokenizer = made.tokenizer
    text = qwen_text(
        tokenizer,
        (5000000.0, [24, 20, 20]),
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    vision = {
        "depth": 12,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_heads": 12,
        "out_hidden_size": 1024,
        "deepstack_visual_indexes": [3, 7, 11],
    }
    config = Qwen3VLConfig(text_config=text, vision_config=vision, **qwen_tokens(tokenizer))
    return config, Qwen3VLForConditionalGeneration


def qwen_text(tokenizer: Any, rope: tuple[float, list[int]], **shape: Any) -> dict[str, Any]:
    """A Qwen VL language model's config of `shape`, its `(theta, mrope sections)` and the
    tokenizer's vocabulary and special ids."""
    theta, sections = rope
    return {
        **shape,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta, "mrope_section": sections},
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id or 0,
    }


def qwen_tokens(tokenizer: Any) -> dict[str, int]:
    return {
        "image_token_id": tokenizer.image_token_id,
        "video_token_id": tokenizer.video_token_id,
        "vision_start_token_id": tokenizer.vision_start_token_id,
        "vision_end_token_id": tokenizer.vision_end_token_id,
    }


FAMILIES = {
    "idefics3": (idefics3_processor, idefics3_model),
    "gemma3": (gemma3_processor, gemma3_model),
    "qwen2_5_vl": (qwen2_5_vl_processor, qwen2_5_vl_model),
    "qwen3_vl": (qwen3_vl_processor, qwen3_vl_model),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", type=Path)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="idefics3")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--config-only", action="store_true")
    args = parser.parse_args()
    make_processor, make_model = FAMILIES[args.family]
    made = make_processor()
    config, model_class = make_model(made)
    config.dtype = args.dtype
    if args.config_only:
        config.save_pretrained(args.output)
    else:
        torch.manual_seed(0)
        model = model_class(config).to(getattr(torch, args.dtype))
        model.save_pretrained(args.output)
    made.save_pretrained(args.output)
    print(args.output)


if __name__ == "__main__":
    main()
