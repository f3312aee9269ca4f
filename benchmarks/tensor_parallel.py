"""What tensor parallelism costs or gains on this machine: the engine's output tokens/s and
median decode step at each tensor-parallel size, the sizes taking turns in one run (each size's
engine built, run and closed in turn, twice), and each size's speed against size 1.

    python benchmarks/tensor_parallel.py --sizes 1 2 --concurrency 1 16 64

On a CPU the ranks share the cores (each takes its share of the threads) and meet over gloo:
this measures the cost of the collectives, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import statistics

from engine_setup import add_engine_arguments, add_load_arguments, engine_config, timed_engine_core
from engine_throughput import run

ROUNDS = 2


def measure(args: argparse.Namespace, size: int, round_: int) -> list[dict[str, float]]:
    args.tensor_parallel_size = size
    core, _, _ = timed_engine_core(engine_config(args))
    try:
        run(core, 2, 16, 4, seed=-1)  # warm-up
        rows = []
        for seed, concurrency in enumerate(args.concurrency):
            result = run(core, concurrency, args.input_len, args.output_len, seed)
            rows.append({"tensor_parallel_size": size, "round": round_, **result})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        core.close()


def summary(rows: list[dict[str, float]], sizes: list[int], levels: list[int]) -> None:
    def median(size: int, concurrency: int, key: str) -> float:
        return statistics.median(
            r[key]
            for r in rows
            if r["tensor_parallel_size"] == size and r["concurrency"] == concurrency
        )

    for concurrency in levels:
        base = median(sizes[0], concurrency, "output_tok_per_s")
        for size in sizes:
            tok_s = median(size, concurrency, "output_tok_per_s")
            step = median(size, concurrency, "step_ms_median")
            print(
                f"# size {size}, concurrency {concurrency}: {tok_s:.1f} tok/s "
                f"({tok_s / base:.2f}x size {sizes[0]}), median step {step:.1f} ms"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    add_load_arguments(parser, output_len=64)
    args = parser.parse_args()
    rows = []
    for round_ in range(ROUNDS):
        order = args.sizes if round_ % 2 == 0 else list(reversed(args.sizes))
        for size in order:
            rows += measure(args, size, round_)
    summary(rows, args.sizes, args.concurrency)


if __name__ == "__main__":
    main()
