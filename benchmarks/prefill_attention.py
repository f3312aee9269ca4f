"""Prompt attention on the CPU: Conveyor's paged prefill kernel, reading K/V in place from the
cache, against torch's SDPA over the same K/V laid out contiguously, for one prompt at a time
over every layer. The default model's shape (9 query heads, 3 kv heads, head dim 64, 30
layers), in blocks of 32 (the CPU's default; `--block-size` for others), and over a bf16 cache
the kernel's bf16 products too (as a bf16 model's prompts attend, where the CPU has AVX-512
BF16); the runs alternate, so a slow spell of the machine touches all alike.

    python benchmarks/prefill_attention.py --tokens 128 512 2048 --cache-dtype float32 bfloat16

`--context N` runs the prompt as a chunk after N cached tokens (SDPA then takes an offset
causal mask, as the torch backend gives it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.core.config import DEFAULT_BLOCK_SIZES
from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu import ops as cpu_ops

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def layer_ms(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(LAYERS):
            run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def compare(
    tokens: int, context: int, cache_dtype: torch.dtype, repeats: int, block_size: int
) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    length = context + tokens
    blocks = -(-length // block_size)
    shape = (blocks, block_size, KV_HEADS, DIM)
    key = torch.randn(shape, generator=generator).to(cache_dtype)
    value = torch.randn(shape, generator=generator).to(cache_dtype)
    table = torch.randperm(blocks, generator=generator)
    query = torch.randn(tokens, HEADS, DIM, generator=generator)
    scale = DIM**-0.5
    # SDPA's inputs as the torch backend hands them over: [1, heads, tokens, dim] in fp32.
    q = query.transpose(0, 1).unsqueeze(0)
    k, v = (
        cache[table].flatten(0, 1)[:length].float().transpose(0, 1).unsqueeze(0)
        for cache in (key, value)
    )
    options: dict[str, object] = {"is_causal": True}
    if context:
        seen = torch.arange(length)[None, :] <= torch.arange(context, length)[:, None]
        options = {"attn_mask": seen[None, None]}

    def kernel(bf16: bool = False) -> object:
        return cpu_ops.paged_prefill(query, key, value, table, context, scale, bf16)

    def sdpa() -> object:
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **options)

    runs: dict[str, Callable[[], object]] = {"kernel_ms": kernel, "sdpa_ms": sdpa}
    if cache_dtype == torch.bfloat16 and cpu_ops.bf16_prefill_available():
        runs["kernel_bf16_ms"] = lambda: kernel(bf16=True)  # as a bf16 model's prompts attend
    for run in runs.values():
        run()  # first calls allocate and start threads
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(2):
        for name, run in runs.items():
            times[name].append(layer_ms(run, repeats))
    return {name: round(min(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--cache-dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZES["cpu"])
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("Conveyor's CPU kernels did not build on this machine")
    malloc_tuning.keep_freed_memory()  # as the engine runs: scratch reused, not faulted in anew
    for tokens in args.tokens:
        for name in args.cache_dtype:
            row: dict[str, object] = {
                "tokens": tokens,
                "context": args.context,
                "cache_dtype": name,
                "block_size": args.block_size,
            }
            row.update(
                compare(tokens, args.context, getattr(torch, name), args.repeats, args.block_size)
            )
            print(json.dumps(row))


if __name__ == "__main__":
    main()
