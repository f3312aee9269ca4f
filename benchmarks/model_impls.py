"""Output tokens/s of Conveyor's decoder against transformers' own model with Conveyor's paged
attention plugged in (`--model-impl transformers`), on the same model in one run: random
prompts, fixed output lengths, EOS ignored, all requests at once.

    python benchmarks/model_impls.py --model MODEL_DIR --concurrency 1 16 64

Each concurrency runs the two implementations in turn, twice in mirrored order; each row gives
an implementation's median tok/s and its ratio to transformers'. For a mixture of experts of a
given shape, write random weights first (`random_weights.py --model-type qwen3_moe --set ...`).
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine_setup import (
    add_engine_arguments,
    add_load_arguments,
    engine_config,
    output_rate,
    timed_engine_core,
)

ORDER = ["transformers", "conveyor", "conveyor", "transformers"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser)
    args = parser.parse_args()
    cores = {}
    for impl in ("transformers", "conveyor"):
        cores[impl], _, info = timed_engine_core(engine_config(args, model_impl=impl))
    print(f"# {info.model_name} {info.dtype} on {info.device}")
    short = argparse.Namespace(input_len=16, output_len=4)
    for core in cores.values():
        output_rate(core, 2, short, -1)
    for concurrency in args.concurrency:
        rates: dict[str, list[float]] = {impl: [] for impl in cores}
        for turn, impl in enumerate(ORDER):
            rates[impl].append(output_rate(cores[impl], concurrency, args, turn))
        baseline = statistics.median(rates["transformers"])
        for impl, values in rates.items():
            rate = statistics.median(values)
            row = {"concurrency": concurrency, "impl": impl, "output_tok_per_s": round(rate, 1)}
            print(json.dumps({**row, "vs_transformers": round(rate / baseline, 3)}))


if __name__ == "__main__":
    main()
