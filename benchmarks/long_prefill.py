"""Time to first token of short prompts that arrive with a long one, under each
`--long-prefill-token-threshold` given (0: off): the long prompt first, then the short ones, all
at once, each with a few greedy output tokens (EOS ignored). Thresholds take turns within each
round, so a slow spell of the machine touches all alike.

    python benchmarks/long_prefill.py --thresholds 0 256 512 --long-len 4096 --shorts 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from engine_setup import add_engine_arguments, engine_config, timed_engine_core

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def first_tokens(core: EngineCore, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Seconds to each request's first token ("long", "short-0", ...), and the whole run's."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    lengths = {"long": args.long_len} | {f"short-{i}": args.short_len for i in range(args.shorts)}
    for name, length in lengths.items():
        prompt = [rng.randrange(100, core.vocab_size - 100) for _ in range(length)]
        core.add_request(f"{seed}-{name}", prompt, params)
    start, first = time.perf_counter(), {}
    while core.has_unfinished():
        for output in core.step():
            first.setdefault(output.request_id.split("-", 1)[1], time.perf_counter() - start)
    return first | {"total": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--thresholds", type=int, nargs="+", default=[0, 256, 512])
    parser.add_argument("--long-len", type=int, default=4096)
    parser.add_argument("--short-len", type=int, default=64)
    parser.add_argument("--shorts", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    core, _, info = timed_engine_core(
        engine_config(args, max_num_batched_tokens=args.max_num_batched_tokens)
    )
    print(f"# {info.model_name} {info.dtype} on {info.device}")
    first_tokens(core, args, seed=-1)  # warm-up
    runs: dict[int, list[dict[str, float]]] = {t: [] for t in args.thresholds}
    base = core.scheduler.config
    for round_ in range(args.rounds):
        for index, threshold in enumerate(args.thresholds):
            core.scheduler.config = dataclasses.replace(
                base, long_prefill_token_threshold=threshold
            )
            # Prompts of their own each run: none finds another's in the prefix cache.
            seed = round_ * len(args.thresholds) + index
            runs[threshold].append(first_tokens(core, args, seed))
    for threshold, found in runs.items():
        shorts = [v for run in found for k, v in run.items() if k.startswith("short")]
        print(
            json.dumps(
                {
                    "threshold": threshold,
                    "short_ttft_median_ms": round(1000 * statistics.median(shorts), 1),
                    "long_ttft_median_ms": round(
                        1000 * statistics.median(run["long"] for run in found), 1
                    ),
                    "total_median_s": round(statistics.median(run["total"] for run in found), 3),
                }
            )
        )


if __name__ == "__main__":
    main()
