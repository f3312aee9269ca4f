"""The default model's linear layers on the CPU, one pass over all of them per row count, with
their weights held four ways: the GGUF's Q4_1 / Q8_0 blocks (what fp32 loads), the same
multiplied against int8-rounded activations (`--int8-activations`), fp32 panels, fp16
panels (what bf16 loads on a CPU without native bf16) and, with AVX-512 BF16, bf16 panels times
bf16-rounded inputs (what bf16 loads there); and the Q8_0 LM head alone, exact and against
int8-rounded inputs.
They alternate, so a slow spell of the machine touches all alike; weights stream from memory as
in a decode step.

    python benchmarks/linear_layers.py --rows 1 4 16 64 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear
from engine.loading import gguf_blocks
from engine.loading.model_loader import load_model


def layer_sets() -> dict[str, list[PanelLinear]]:
    loaded = load_model(None, torch.float32, torch.device("cpu"))
    named = {
        name: m
        for name, m in loaded.model.named_modules()
        if isinstance(m, PanelLinear) and m.block_format is not None
    }
    if not named:
        raise SystemExit("the default model loaded without its GGUF blocks")
    rows = gguf_blocks.load(Path(loaded.path))
    blocks = list(named.values())
    sets = {
        "blocks": blocks,
        "int8": [PanelLinear.of_blocks(*rows[name], None, True) for name in named],
        "fp32": [PanelLinear(m.weight, None) for m in blocks],
        "fp16": [PanelLinear(m.weight, None, torch.float16) for m in blocks],
    }
    if cpu_ops.bf16_panels_available():
        sets["bf16"] = [PanelLinear(m.weight, None, torch.bfloat16) for m in blocks]
    return {
        **sets,
        "lm_head_exact": [named["lm_head"]],
        "lm_head_int8": [PanelLinear.of_blocks(*rows["lm_head"], None, True)],
    }


def one_pass(layers: list[PanelLinear], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 512])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    sets = layer_sets()
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {m.in_features: torch.randn(rows, m.in_features) for m in sets["blocks"]}
            times: dict[str, list[float]] = {name: [] for name in sets}
            for _ in range(args.repeats):
                for name, layers in sets.items():
                    times[name].append(one_pass(layers, inputs))
            print(
                json.dumps(
                    {
                        "rows": rows,
                        **{
                            f"{name}_ms": round(1000 * statistics.median(t), 2)
                            for name, t in times.items()
                        },
                    }
                )
            )


if __name__ == "__main__":
    main()
