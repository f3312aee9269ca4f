"""Seconds the engine takes to prefill a batch of fresh random prompts (one output token each,
so nothing but the prompts runs), repeated with new prompts; the first round, which also
touches the cache's memory for the first time, is left out of the median.

    python benchmarks/prefill_steps.py --dtype float32 --int8-activations \\
        --kv-cache-dtype bfloat16 --prompts 16 --input-len 128

The token budget per step is at least the prompt length, so one long prompt runs in one step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_setup import add_engine_arguments, engine_config

from engine.core import EngineCore
from engine.factory import create_engine_core
from engine.sampling_params import SamplingParams


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
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    config = engine_config(args, max_num_batched_tokens=max(2048, args.input_len))
    core, _, _ = create_engine_core(config)
    times = [prefill_seconds(core, args.prompts, args.input_len, seed)
             for seed in range(args.repeats + 1)][1:]
    print(json.dumps({"prompts": args.prompts, "input_len": args.input_len,
                      "median_s": round(statistics.median(times), 3),
                      "runs_s": [round(t, 3) for t in times]}))


if __name__ == "__main__":
    main()
