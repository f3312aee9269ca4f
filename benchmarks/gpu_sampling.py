"""A step's sampling on a GPU, the sampler's two routes taking turns: its Triton kernels and
torch. Top-p rows (top_p 0.9, no top-k) over peaked logits (a nucleus of a few tokens) and
flat ones (most of the vocabulary: rounds of pivoting in the kernel, a search widened to all
of it in torch, which asks the host how far to go); and seeded rows (noise from one launch
against a generator call per row). Prints the median milliseconds of `Sampler.sample` plus
the wait for its tokens, each way.

    python benchmarks/gpu_sampling.py --rows 1 16 64 256 --vocab 151936

`--device cpu` runs the same code in Triton's interpreter (`TRITON_INTERPRET=1`, tiny sizes
only) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.worker.sampler import Sampler


def timed(sampler: Sampler, logits: torch.Tensor, requests: list[Request], repeats: int) -> float:
    """Median milliseconds of one sampling, its tokens brought to the host."""
    times = []
    for _ in range(repeats + 1):
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        sampler.sample(logits, requests).to_host(requests)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device(args.device)
    ways = {
        "triton": Sampler(args.vocab, device, triton_kernels=True),
        "torch": Sampler(args.vocab, device),
    }
    cases = {
        "top-p, peaked": (8.0, dict(top_p=args.top_p)),
        "top-p, flat": (0.05, dict(top_p=args.top_p)),
        "seeded": (1.0, {}),
    }
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        for case, (spread, params) in cases.items():
            requests = [
                Request(
                    str(i),
                    [1],
                    SamplingParams(seed=i if case == "seeded" else None, **params),
                    0.0,
                    100,
                )
                for i in range(rows)
            ]
            logits = (torch.randn(rows, args.vocab, generator=generator) * spread).to(device)
            medians: dict[str, list[float]] = {way: [] for way in ways}
            for order in (list(ways), list(reversed(ways))):
                for way in order:
                    medians[way].append(timed(ways[way], logits, requests, args.repeats))
            result = {way: round(min(times), 3) for way, times in medians.items()}
            ratio = round(result["torch"] / result["triton"], 2)
            print(json.dumps({"rows": rows, "case": case, **result, "torch/triton": ratio}))


if __name__ == "__main__":
    main()
