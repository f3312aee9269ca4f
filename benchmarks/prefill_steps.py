"""Seconds the engine takes to prefill a batch of fresh random prompts (one output token each,
so nothing but the prompts runs), repeated with new prompts; the first round, which also
touches the cache's memory for the first time, is left out of the median.

    python benchmarks/prefill_steps.py --dtype float32 --int8-activations \\
        --kv-cache-dtype bfloat16 --prompts 16 --input-len 128

The token budget per step is at least the prompt length, so one long prompt runs in one step.
With `--both-prompt-products` (a bf16 model on a CPU with AVX-512 BF16) rounds alternate between
the prompt attention's bf16 products and fp32 ones, each reported apart.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_setup import add_engine_arguments, engine_config, timed_engine_core

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def prefill_seconds(core: EngineCore, prompts: int, input_len: int, seed: int) -> float:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for i in range(prompts):
        prompt = [rng.randrange(100, core.vocab_size - 100) for _ in range(input_len)]
        core.add_request(f"prefill-{seed}-{i}", prompt, params)
    start = time.perf_counter()
    while core.has_unfinished():
        core.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_engine_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--both-prompt-products", action="store_true")
    args = parser.parse_args()
    config = engine_config(args, max_num_batched_tokens=max(2048, args.input_len))
    core, _, _ = timed_engine_core(config)
    backend = core.runner.backend
    modes = [getattr(backend, "bf16_prompts", False)]
    if args.both_prompt_products:
        if not modes[0]:
            raise SystemExit(
                "the prompt attention has no bf16 products here: a bf16 model on "
                "a CPU with AVX-512 BF16 has them"
            )
        modes.append(False)
    prefill_seconds(core, args.prompts, args.input_len, 10**6)  # first touch of the cache
    times: dict[bool, list[float]] = {mode: [] for mode in modes}
    for seed in range(args.repeats):
        for mode in modes if seed % 2 == 0 else modes[::-1]:
            if args.both_prompt_products:
                backend.bf16_prompts = mode
            times[mode].append(
                prefill_seconds(core, args.prompts, args.input_len, seed * len(modes) + mode)
            )
    for mode, runs in times.items():
        print(
            json.dumps(
                {
                    "prompts": args.prompts,
                    "input_len": args.input_len,
                    "prompt_products": "bf16" if mode else "fp32",
                    "median_s": round(statistics.median(runs), 3),
                    "runs_s": [round(t, 3) for t in runs],
                }
            )
        )


if __name__ == "__main__":
    main()
