"""A prefill step's prompt attention on the CPU: `--prompts` fresh prompts of `--tokens` tokens
over every layer's own cache (so K/V stream from memory as in a step), in one call per layer
(`paged_prefill_rows`, written straight into the layer's output) against one call per prompt
(`paged_prefill`) with each result copied into the layer's output, and, where the CPU has
AVX-512 BF16, one call per layer in bf16 products (as a bf16 model's prompts attend). The
default model's shape (9 query heads, 3 kv heads, head dim 64, 30 layers), bf16 cache in
scattered blocks of 32; the runs alternate, so a slow spell of the machine touches all alike.

    python benchmarks/prefill_step_attention.py --prompts 16 --tokens 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.core.config import DEFAULT_BLOCK_SIZES
from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu import ops as cpu_ops

HEADS, KV_HEADS, DIM, LAYERS = 9, 3, 64, 30


def step_ms(prompts: int, tokens: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(0)
    block_size = DEFAULT_BLOCK_SIZES["cpu"]
    per_prompt = -(-tokens // block_size)
    blocks = prompts * per_prompt
    shape = (blocks, block_size, KV_HEADS, DIM)
    caches = [
        (
            torch.randn(shape, generator=generator).bfloat16(),
            torch.randn(shape, generator=generator).bfloat16(),
        )
        for _ in range(LAYERS)
    ]
    table = torch.randperm(blocks, generator=generator).view(prompts, per_prompt).contiguous()
    query = torch.randn(prompts * tokens, HEADS, DIM, generator=generator)
    starts = torch.arange(prompts, dtype=torch.int64) * tokens
    lens = torch.full((prompts,), tokens, dtype=torch.int64)
    contexts = torch.zeros(prompts, dtype=torch.int64)
    scale = DIM**-0.5

    def one_call(bf16: bool = False) -> None:
        for key, value in caches:
            out = torch.empty_like(query)
            cpu_ops.paged_prefill_rows(
                query, key, value, out, starts, lens, contexts, table, scale, bf16
            )

    def per_prompt_calls() -> None:
        for key, value in caches:
            out = torch.empty_like(query)
            for p in range(prompts):
                rows = slice(p * tokens, (p + 1) * tokens)
                out[rows] = cpu_ops.paged_prefill(query[rows], key, value, table[p], 0, scale)

    runs: dict[str, Callable[[], None]] = {
        "one_call_ms": one_call,
        "per_prompt_ms": per_prompt_calls,
    }
    if cpu_ops.bf16_prefill_available():
        runs["one_call_bf16_ms"] = lambda: one_call(bf16=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # first calls allocate and start threads
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(1000 * (time.perf_counter() - start))
    return {name: round(statistics.median(t), 2) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("Conveyor's CPU kernels did not build on this machine")
    malloc_tuning.keep_freed_memory()  # as the engine runs: scratch reused, not faulted in anew
    row: dict[str, object] = {"prompts": args.prompts, "tokens": args.tokens}
    row.update(step_ms(args.prompts, args.tokens, args.repeats))
    print(json.dumps(row))


if __name__ == "__main__":
    main()
