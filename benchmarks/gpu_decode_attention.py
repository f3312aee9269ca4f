"""Conveyor's Triton paged decode attention against SDPA over contiguous K/V, on a GPU: one
query token per sequence, `--seqs` sequences of `--context` tokens each, a Qwen2.5-1.5B-like
layer (12 query heads, 2 KV heads, head dim 128) in bf16, the cache in blocks of 16 scattered
over the pool. Prints the median of each way and their ratio per case, and the split count the
kernel chose.

    python benchmarks/gpu_decode_attention.py --seqs 1 8 64 --context 4096 32768

SDPA reads each sequence's K/V laid out contiguously (the best case for it, with no block table
to follow); a real step would first have to gather them. `--device cpu` runs the same code in
Triton's interpreter (`TRITON_INTERPRET=1`, tiny sizes only) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, DIM, BLOCK = 12, 2, 128, 16


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of `fn()`."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def case(seqs: int, context: int, device: torch.device, repeats: int) -> dict[str, object]:
    from engine.kernels.triton import paged_attention as kernels

    blocks_per_seq = -(-context // BLOCK)
    pool = seqs * blocks_per_seq
    dtype = torch.bfloat16
    key_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, dtype=dtype, device=device)
    value_cache = torch.randn_like(key_cache)
    tables = torch.randperm(pool, device=device).view(seqs, blocks_per_seq)
    lens = torch.full((seqs,), context, dtype=torch.int64, device=device)
    query = torch.randn(seqs, HEADS, DIM, dtype=dtype, device=device)
    # The same K/V, gathered once into [seqs, kv_heads, context, dim] for SDPA.
    keys = key_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    values = value_cache[tables].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    scale = DIM**-0.5

    def ours() -> torch.Tensor:
        return kernels.paged_decode(query, key_cache, value_cache, tables, lens, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            query[:, :, None], keys, values, scale=scale, enable_gqa=True
        )[:, :, 0]

    torch.testing.assert_close(ours().float(), sdpa().float(), atol=2e-2, rtol=2e-2)
    ours_ms, sdpa_ms = timed(ours, device, repeats), timed(sdpa, device, repeats)
    return {
        "seqs": seqs,
        "context": context,
        "splits": kernels.decode_splits(seqs, KV_HEADS, device),
        "triton_ms": round(ours_ms, 4),
        "sdpa_ms": round(sdpa_ms, 4),
        "sdpa_over_triton": round(sdpa_ms / ours_ms, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif torch.cuda.is_available():
        print(f"# {torch.cuda.get_device_name(device)}")
    for context in args.context:
        for seqs in args.seqs:
            print(json.dumps(case(seqs, context, device, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
