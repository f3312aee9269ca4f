"""A model folder with another model's config and tokenizer but random weights, for timing on
a machine that cannot fetch the real weights (speed does not depend on the values; run with
EOS ignored).

    python benchmarks/random_weights.py OUT_DIR [--like MODEL_DIR] [--dtype bfloat16]
        [--set hidden_size=896 num_attention_heads=14 ...]

`--set` changes fields of the config (another shape with the same tokenizer), and
`--model-type` makes it another family's (`qwen3_moe`, `mixtral`: a mixture of experts with the
same attention and tokenizer; set its expert fields with `--set`). With
`--config-only` no weights are written: serve the folder with `--load-format dummy`, which
makes random weights of its shape where the model runs (a large shape takes no disk). With
`--mxfp4-experts` a gpt-oss's experts are written as OpenAI publishes gpt-oss: random MXFP4
blocks (E2M1 codes under E8M0 scales), the rest in `--dtype`.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
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
    parser.add_argument("--mxfp4-experts", action="store_true", help="gpt-oss's experts in MXFP4")
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
        if args.mxfp4_experts:
            mxfp4_experts(args.output)
    for name in TOKENIZER_FILES:
        if (args.like / name).exists():
            shutil.copy(args.like / name, args.output / name)
    print(args.output)


# gpt-oss's expert tensors, `[experts, in, out]`, which an MXFP4 checkpoint stores as blocks.
EXPERT_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def mxfp4_experts(folder: Path) -> None:
    """Rewrite the gpt-oss saved in `folder` with its experts as an MXFP4 checkpoint holds them:
    `NAME_blocks` `[experts, out, in / 32, 16]` of random E2M1 codes (two a byte) and
    `NAME_scales` `[experts, out, in / 32]` of E8M0 scales between 2**-5 and 2**-2."""
    renamed = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors = load_file(file)
        for name in [n for n in tensors if n.endswith(EXPERT_TENSORS)]:
            experts, inputs, outputs = tensors.pop(name).shape
            shape = (experts, outputs, inputs // 32)
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8)
            tensors[f"{name}_scales"] = torch.randint(122, 126, shape, dtype=torch.uint8)
            renamed[name] = file.name
        save_file(tensors, file, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    if index.exists():
        layout = json.loads(index.read_text())
        for name, file in renamed.items():
            del layout["weight_map"][name]
            layout["weight_map"] |= {f"{name}_blocks": file, f"{name}_scales": file}
        index.write_text(json.dumps(layout, indent=2))
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router"],
    }
    config_file.write_text(json.dumps(config, indent=2))


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
