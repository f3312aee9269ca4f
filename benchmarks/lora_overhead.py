"""Output tokens/s of the engine serving LoRA adapters, against the same model without them,
in one run: random prompts, fixed output lengths, EOS ignored, all requests at once.

    python benchmarks/lora_overhead.py --concurrency 1 16 64

Two random adapters of `--rank` over all seven projections of every layer are written with PEFT
first. Each concurrency runs four ways in turn, twice in mirrored order: `off` (an engine
without `--enable-lora`), `base` (the LoRA engine, no request naming an adapter), `one` (every
request under one adapter) and `two` (requests alternating between the two, `--max-loras 2`).
Each row gives a way's median tok/s and its ratio to `off`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from engine_setup import (
    add_engine_arguments,
    add_load_arguments,
    engine_config,
    output_rate,
    timed_engine_core,
)
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from engine.loading.default_model import ensure_default_model

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ORDER = ["off", "base", "one", "two", "two", "one", "base", "off"]


def write_adapter(model: str, folder: Path, rank: int, seed: int) -> str:
    """A random adapter of the model's shape (its weights are not read)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False)
    adapted = get_peft_model(base, lora)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.02)
    adapted.save_pretrained(str(folder))
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    model = args.model or str(ensure_default_model())
    with tempfile.TemporaryDirectory() as folder:
        adapters = tuple(
            (name, write_adapter(model, Path(folder) / name, args.rank, seed))
            for seed, name in enumerate("ab")
        )
        off, _, info = timed_engine_core(engine_config(args))
        on, _, _ = timed_engine_core(
            engine_config(
                args,
                enable_lora=True,
                max_loras=2,
                max_lora_rank=args.rank,
                lora_modules=adapters,
            )
        )
    assert on.loras is not None
    a, b = on.loras.get("a"), on.loras.get("b")
    ways = {"off": (off, [None]), "base": (on, [None]), "one": (on, [a]), "two": (on, [a, b])}
    print(f"# {info.model_name} {info.dtype} on {info.device}, adapters of rank {args.rank}")
    for core, loras in ways.values():
        output_rate(core, 2, argparse.Namespace(input_len=16, output_len=4), -1, loras)
    for concurrency in args.concurrency:
        rates: dict[str, list[float]] = {way: [] for way in ways}
        for turn, way in enumerate(ORDER):
            core, loras = ways[way]
            rates[way].append(output_rate(core, concurrency, args, turn, loras))
        baseline = statistics.median(rates["off"])
        for way, values in rates.items():
            rate = statistics.median(values)
            row = {"concurrency": concurrency, "way": way, "output_tok_per_s": round(rate, 1)}
            print(json.dumps({**row, "vs_off": round(rate / baseline, 3)}))


if __name__ == "__main__":
    main()
