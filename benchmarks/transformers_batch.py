"""Output tok/s of Conveyor's engine against transformers' own continuous batching
(`generate_batch`, paged attention) on the same model, device and prompts, in one run: random
prompts, fixed output lengths, EOS ignored, greedy, every request submitted at once, the two
taking turns (Conveyor, transformers, transformers, Conveyor) at each concurrency.

    python benchmarks/transformers_batch.py --dtype bfloat16 --concurrency 16 64

With `--load-format dummy` both take random weights of the model's shape (the folder needs only
its config and tokenizer), each its own: speed does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from engine_setup import add_engine_arguments, add_load_arguments, engine_config, timed_engine_core
from engine_throughput import run as run_engine
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from engine.loading.default_model import ensure_default_model


def run_transformers(
    model: torch.nn.Module, prompts: list[list[int]], output_len: int
) -> dict[str, float]:
    config = GenerationConfig(
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    start = time.perf_counter()
    # No warm-up pass inside the timed call: the run before this one warmed the model up.
    outputs = model.generate_batch(  # type: ignore[operator]
        prompts, generation_config=config, warmup=False
    )
    elapsed = time.perf_counter() - start
    produced = sum(len(output.generated_tokens) for output in outputs.values())
    return {
        "output_tokens": produced,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(produced / elapsed, 1),
    }


def prompts_for(concurrency: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """The prompts `engine_throughput.run` makes for this seed, for transformers to get too."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(input_len)] for _ in range(concurrency)]


def transformers_model(
    folder: str, dtype: torch.dtype, device: str, load_format: str
) -> torch.nn.Module:
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(folder)
        with torch.device(device):  # random weights made where they run
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device)
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser, concurrency=[16, 64])
    args = parser.parse_args()
    core, _, info = timed_engine_core(engine_config(args))
    folder = args.model or str(ensure_default_model())
    hf = transformers_model(folder, getattr(torch, info.dtype), info.device, args.load_format)
    print(f"# {info.model_name} {info.dtype} on {info.device}")
    run_engine(core, 2, 16, 4, seed=-1)  # warm-up
    run_transformers(hf, prompts_for(2, 16, core.vocab_size, -1), 4)
    for seed, concurrency in enumerate(args.concurrency):
        prompts = prompts_for(concurrency, args.input_len, core.vocab_size, seed)
        for side in ("conveyor", "transformers", "transformers", "conveyor"):
            if side == "conveyor":
                result = run_engine(core, concurrency, args.input_len, args.output_len, seed)
            else:
                result = run_transformers(hf, prompts, args.output_len)
            print(json.dumps({"engine": side, "concurrency": concurrency, **result}))


if __name__ == "__main__":
    main()
