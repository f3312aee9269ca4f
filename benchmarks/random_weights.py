"""A model folder with another model's config and tokenizer but random weights, for timing on
a machine that cannot fetch the real weights (speed does not depend on the values; run with
EOS ignored).

    python benchmarks/random_weights.py OUT_DIR [--like MODEL_DIR] [--dtype bfloat16]
        [--set hidden_size=896 num_attention_heads=14 ...]

`--set` changes fields of the config (another shape with the same tokenizer), and
`--model-type` makes it another family's (`qwen3_moe`, `mixtral`: a mixture of experts with the
same attention and tokenizer; set its expert fields with `--set`). With
`--config-only` no weights are written: serve the folder with `--load-format dummy`, which
makes random weights of its shape where the model runs (a large shape takes no disk).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("output", type=Path)
    parser.add_argument(
        "--like",
        type=Path,
        default=None,
        help="folder with config.json and tokenizer files (default: the "
        "embedded default model, fetched if needed)",
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=NUMBER|true|false|WORD|N,N,..."
    )
    parser.add_argument("--config-only", action="store_true")
    parser.add_argument("--model-type", default=None, help="another family's config")
    args = parser.parse_args()
    if args.like is None:
        from engine.loading.default_model import ensure_default_model

        args.like = Path(ensure_default_model())
    config = AutoConfig.from_pretrained(args.like)
    changes = {name: _value(value) for name, _, value in (f.partition("=") for f in args.set)}
    if args.model_type is not None:
        fields = config.to_dict()
        for key in ("model_type", "architectures", "transformers_version", "layer_types"):
            fields.pop(key, None)
        # Set before the config is built, so fields derived from them (gpt-oss's layer types
        # per layer) follow.
        config = AutoConfig.for_model(args.model_type, **(fields | changes))
    for name, value in changes.items():
        setattr(config, name, value)
    if args.config_only:
        config.dtype = args.dtype
        config.save_pretrained(args.output)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
        model.save_pretrained(args.output)
    for name in TOKENIZER_FILES:
        if (args.like / name).exists():
            shutil.copy(args.like / name, args.output / name)
    print(args.output)


def _value(text: str) -> int | float | bool | str | list[int | str]:
    """A `--set` value: an integer, a number with a point (a partial rotary's share),
    `true`/`false` for a boolean field, a word (Granite 4's `position_embedding_type=rope`), or
    integers or words between commas for a list (LFM2's `full_attn_idxs`, Granite 4's
    `layer_types=mamba,attention,...`)."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "," in text:
        return [_number_or_word(part) for part in text.split(",") if part]
    if text.replace(".", "", 1).lstrip("-").isdigit():
        return float(text) if "." in text else int(text)
    return text


def _number_or_word(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


if __name__ == "__main__":
    main()
