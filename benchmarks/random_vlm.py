"""An Idefics3 model folder shaped like SmolVLM-256M (a SigLIP tower of 12 layers of 768 over
512-pixel tiles in 16-pixel patches, 64 image tokens a tile, SmolLM2-135M's language model) with
random weights and a processor built on the default model's tokenizer, for timing image
requests on a machine that cannot fetch the real weights (run with EOS ignored).

    python benchmarks/random_vlm.py OUT_DIR [--dtype bfloat16] [--config-only]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoTokenizer,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
)

from engine.loading.default_model import ensure_default_model

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


def processor() -> Idefics3Processor:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", type=Path)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--config-only", action="store_true")
    args = parser.parse_args()
    made = processor()
    text = AutoConfig.from_pretrained(ensure_default_model())
    text.vocab_size = len(made.tokenizer)
    config = Idefics3Config(
        vision_config=VISION,
        text_config=text.to_dict(),
        image_token_id=made.tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE_FACTOR,
        tie_word_embeddings=text.tie_word_embeddings,
    )
    config.dtype = args.dtype
    if args.config_only:
        config.save_pretrained(args.output)
    else:
        torch.manual_seed(0)
        model = Idefics3ForConditionalGeneration(config).to(getattr(torch, args.dtype))
        model.save_pretrained(args.output)
    made.save_pretrained(args.output)
    print(args.output)


if __name__ == "__main__":
    main()
