"""Conveyor's CPU paged decode attention alone, as a decode step runs it: one query token per
sequence over every layer's K/V cache in turn, so K and V stream from memory as in the engine.
The default model's shape (9 query heads, 3 kv heads, head dim 64, 30 layers), in blocks of 32
(the CPU's default; `--block-size` for others).

    python benchmarks/decode_attention.py --seqs 1 16 64 --context 192 \\
        --cache-dtype float32 bfloat16 float8_e5m2

`--placement scattered` puts each sequence's blocks anywhere in the cache, `--placement
in-order` back to back, and `--placement shared` gives every sequence the same few blocks, so
that K and V stay in the caches and the time is the attention's arithmetic alone; `--pages
small` holds the cache in 4 KiB pages instead of the engine's 2 MiB ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.core.config import DEFAULT_BLOCK_SIZES
from engine.kernels.cpu import huge_pages, malloc_tuning
from engine.kernels.cpu import ops as cpu_ops

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def cache_layer(
    shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator, huge: bool
) -> torch.Tensor:
    values = torch.randn(shape, generator=generator).to(dtype)
    if not huge:
        return values
    return huge_pages.zeros(shape, dtype).copy_(values)


def block_tables(
    seqs: int, per_seq: int, placement: str, generator: torch.Generator
) -> torch.Tensor:
    """`[seqs, per_seq]` block ids: a cache of its own per sequence, scattered or in order, or
    one sequence's blocks for all."""
    if placement == "shared":
        return torch.arange(per_seq).repeat(seqs, 1)
    blocks = seqs * per_seq
    if placement == "scattered":
        return torch.randperm(blocks, generator=generator).view(seqs, per_seq)
    return torch.arange(blocks).view(seqs, per_seq)


def step_ms(
    seqs: int,
    context: int,
    cache_dtype: torch.dtype,
    placement: str,
    repeats: int,
    huge: bool,
    block_size: int,
) -> float:
    generator = torch.Generator().manual_seed(0)
    per_seq = -(-context // block_size)
    tables = block_tables(seqs, per_seq, placement, generator)
    shape = (int(tables.max()) + 1, block_size, KV_HEADS, DIM)
    caches = [
        tuple(cache_layer(shape, cache_dtype, generator, huge) for _ in range(2))
        for _ in range(LAYERS)
    ]
    lens = torch.full((seqs,), context, dtype=torch.int64)
    query = torch.randn(seqs, HEADS, DIM, generator=generator)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for key, value in caches:
            cpu_ops.paged_decode(query, key, value, tables, lens, DIM**-0.5)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, default=192)
    parser.add_argument("--cache-dtype", nargs="+", default=["float32", "bfloat16", "float8_e5m2"])
    parser.add_argument(
        "--placement", choices=["scattered", "in-order", "shared"], default="scattered"
    )
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZES["cpu"])
    parser.add_argument(
        "--pages",
        choices=["huge", "small"],
        default="huge",
        help="the cache in 2 MiB pages, as the engine holds it, or in 4 KiB",
    )
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("Conveyor's CPU kernels did not build on this machine")
    malloc_tuning.keep_freed_memory()  # as the engine runs: scratch reused, not faulted in anew
    for seqs in args.seqs:
        row: dict[str, object] = {
            "seqs": seqs,
            "context": args.context,
            "block_size": args.block_size,
            "placement": args.placement,
            "pages": args.pages,
        }
        for name in args.cache_dtype:
            row[f"{name}_ms"] = round(
                step_ms(
                    seqs,
                    args.context,
                    getattr(torch, name),
                    args.placement,
                    args.repeats,
                    args.pages == "huge",
                    args.block_size,
                ),
                2,
            )
        print(json.dumps(row))


if __name__ == "__main__":
    main()
