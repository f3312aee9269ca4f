"""The default model's LM head over bf16 panels (a CPU with AVX-512 BF16), two ways of taking a
step's greedy tokens: the logits written out and their argmax taken after
(`panel_linear` then `argmax_rows`), or each row's best column kept as the product's sums leave
the registers (`panel_argmax`). They alternate call by call, so a slow spell of the machine
touches both alike; the weights stream from memory as in a decode step.

    python benchmarks/greedy_head.py --rows 1 16 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.kernels.cpu import malloc_tuning
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear
from engine.loading.model_loader import load_model


def lm_head() -> PanelLinear:
    loaded = load_model(None, torch.bfloat16, torch.device("cpu"))
    head = loaded.model.get_output_embeddings()
    if not (isinstance(head, PanelLinear) and head.chooses_greedily):
        raise SystemExit("the LM head is not bf16 panels here (no AVX-512 BF16?)")
    return head


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    malloc_tuning.keep_freed_memory()
    head = lm_head()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, head.in_features, generator=generator)

            def logits_then_argmax(x: torch.Tensor = x) -> torch.Tensor:
                return cpu_ops.argmax_rows(head(x))

            def in_the_head(x: torch.Tensor = x) -> torch.Tensor:
                return head.greedy(x)

            if not torch.equal(logits_then_argmax(), in_the_head()):
                raise SystemExit("the two ways chose different tokens")
            times: dict[str, list[float]] = {"logits_then_argmax": [], "in_the_head": []}
            for _ in range(args.repeats):
                times["logits_then_argmax"].append(timed(logits_then_argmax))
                times["in_the_head"].append(timed(in_the_head))
            print(
                json.dumps(
                    {
                        "rows": rows,
                        **{
                            f"{name}_ms_{stat}": round(1000 * fn(t), 2)
                            for name, t in times.items()
                            for stat, fn in (("median", statistics.median), ("best", min))
                        },
                    }
                )
            )


if __name__ == "__main__":
    main()
