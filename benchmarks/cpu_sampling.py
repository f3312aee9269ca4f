"""A step's sampling on the CPU, the two ways of drawing a random row taking turns: the running
sum of its probabilities (the CPU's default) and the exponential race (noise for every token,
as a GPU draws). Rows of a few kinds of request; prints the median milliseconds of
`Sampler.sample` plus its tokens brought back, each way, and their ratio.

    python benchmarks/cpu_sampling.py --rows 1 16 64 --vocab 49152 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import malloc_tuning
from engine.worker.sampler import Sampler

# Each kind's sampling parameters, and the spread of its rows' logits: peaked rows (a nucleus
# of a few dozen tokens) or flat ones (a nucleus of thousands, as random prompts give).
KINDS = {
    "temperature 0.7": ({"temperature": 0.7}, 4.0),
    "top_p 0.95": ({"temperature": 0.7, "top_p": 0.95}, 4.0),
    "top_p 0.95, flat": ({"temperature": 0.7, "top_p": 0.95}, 1.0),
    "top_k 50": ({"temperature": 0.7, "top_k": 50}, 4.0),
    "seeded": ({"temperature": 0.7, "seed": 1}, 4.0),
}


def requests_of(rows: int, params: dict) -> list[Request]:
    return [
        Request(f"r{row}", [1, 2, 3], SamplingParams(**params), 0.0, 10_000) for row in range(rows)
    ]


def timed(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> float:
    start = time.perf_counter()
    sampler.sample(logits.clone(), requests).to_host(requests)
    return 1000 * (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc_tuning.keep_freed_memory()  # as the engine runs: scratch reused, not faulted in anew
    device = torch.device("cpu")
    ways = {"running_sum": Sampler(args.vocab, device), "race": Sampler(args.vocab, device)}
    ways["race"].race = True
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        normal = torch.randn(rows, args.vocab, generator=generator)
        for kind, (params, spread) in KINDS.items():
            logits = normal * spread
            requests = requests_of(rows, params)
            times: dict[str, list[float]] = {way: [] for way in ways}
            for turn in range(args.repeats + 1):  # the first turn warms up
                for way, sampler in ways.items():
                    elapsed = timed(sampler, logits, requests)
                    if turn:
                        times[way].append(elapsed)
            medians = {way: round(statistics.median(t), 3) for way, t in times.items()}
            ratio = round(medians["race"] / medians["running_sum"], 2)
            print(json.dumps({"rows": rows, "kind": kind, **medians, "race_over_sum": ratio}))


if __name__ == "__main__":
    main()
