"""A step's sampling of top-p rows (top_p 0.9, no top-k) on a GPU, two ways taking turns: the
Triton kernel that pivots on the device, and the widening `topk` search that asks the host
whether its candidates hold each nucleus. Peaked logits (a nucleus of a few tokens) and flat
ones (most of the vocabulary, several rounds of pivoting; the search widens to all of it).
Prints the median milliseconds of `Sampler.sample` plus the wait for its tokens, each way.

    python benchmarks/gpu_top_p.py --rows 1 16 64 256 --vocab 151936

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
        "kernel": Sampler(args.vocab, device, nucleus_kernel=True),
        "widening topk": Sampler(args.vocab, device),
    }
    generator = torch.Generator().manual_seed(0)
    for rows in args.rows:
        requests = [
            Request(str(i), [1], SamplingParams(top_p=args.top_p), 0.0, 100) for i in range(rows)
        ]
        for shape, spread in (("peaked", 8.0), ("flat", 0.05)):
            logits = (torch.randn(rows, args.vocab, generator=generator) * spread).to(device)
            medians: dict[str, list[float]] = {way: [] for way in ways}
            for order in (list(ways), list(reversed(ways))):
                for way in order:
                    medians[way].append(timed(ways[way], logits, requests, args.repeats))
            result = {way: round(min(times), 3) for way, times in medians.items()}
            ratio = round(result["widening topk"] / result["kernel"], 2)
            print(json.dumps({"rows": rows, "logits": shape, **result, "topk/kernel": ratio}))


if __name__ == "__main__":
    main()
