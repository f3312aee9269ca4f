"""Layers of experts on the CPU, three ways in turn: the one op (`cpu_ops.expert_mlps`), the
loop over the chosen experts (`ExpertLinears.by_expert`) and, for scale where bf16 panels run, a
dense gated MLP as wide as the experts a row runs (the same bytes a row reads, in bf16). The
median milliseconds a layer at each row count; every layer holds its own weights, so they
stream from memory as in a decode step. `--weights`: bf16 panels (AVX-512 BF16), fp16 or fp32
panels over fp32 rows (any x86-64 level), or random MXFP4 or Q4_K blocks (gpt-oss as published,
a Q4_K GGUF file's experts; multiplied in bf16 where that runs, else widened to fp32); with
`--clamped` the experts run gpt-oss's clamped SwiGLU instead of silu.

    PYTHONPATH=. python benchmarks/expert_layers.py --rows 1 16 64 [--weights fp16] [--clamped]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear
from engine.loading import gguf_blocks
from engine.models.experts import ClampedSwiGLU, ExpertLinears


def panels(out: int, into: int, storage: torch.dtype = torch.bfloat16) -> PanelLinear:
    return PanelLinear(torch.randn(out, into) / into**0.5, None, storage)


def blocks(out: int, into: int) -> PanelLinear:
    """MXFP4 blocks of random codes under scales about 1 / 16, multiplied in bf16 where that
    runs."""
    codes = torch.randint(0, 256, (out, into // 32, 16), dtype=torch.uint8)
    scales = torch.randint(120, 124, (out, into // 32, 1), dtype=torch.uint8)
    rows = torch.cat([scales, codes], dim=-1).reshape(out, -1)
    layer = PanelLinear.of_blocks(gguf_blocks.MXFP4, rows, None)
    layer.multiply_in_bf16()
    return layer


def k_blocks(out: int, into: int) -> PanelLinear:
    """Q4_K super-blocks of random scales and codes under d = 1 / 64 and dmin = 1 / 128."""
    rows = torch.randint(0, 256, (out, into // 256, 144), dtype=torch.uint8)
    rows[..., :4] = torch.tensor([1 / 64, 1 / 128], dtype=torch.float16).view(torch.uint8)
    layer = PanelLinear.of_blocks(gguf_blocks.Q4_K, rows.reshape(out, -1), None)
    layer.multiply_in_bf16()
    return layer


def maker(weights: str) -> Callable[[int, int], PanelLinear]:
    if weights == "mxfp4":
        return blocks
    if weights == "q4_k":
        return k_blocks
    storage = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[weights]
    return lambda out, into: panels(out, into, storage)


def expert_layers(args: argparse.Namespace) -> list[ExpertLinears]:
    make = maker(args.weights)
    clamped = ClampedSwiGLU(1.702, 7.0) if args.clamped else None
    layers = []
    for _ in range(args.layers):
        gate_up = [make(2 * args.inter, args.hidden) for _ in range(args.experts)]
        down = [make(args.hidden, args.inter) for _ in range(args.experts)]
        experts = ExpertLinears(
            gate_up,  # type: ignore[arg-type]
            down,  # type: ignore[arg-type]
            nn.SiLU(),
            silu=clamped is None,
            clamped=clamped,
        )
        if not experts.group():
            raise SystemExit(f"the experts did not group ({args.weights} panels here?)")
        layers.append(experts)
    return layers


def median_ms(run: Callable[[], None], layers: int, passes: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times) / layers


def ways(
    layers: list[ExpertLinears],
    dense: list[tuple[GatedPanelLinear, PanelLinear]],
    rows: int,
    top_k: int,
) -> tuple[int, dict[str, Callable[[], None]]]:
    """How many experts `rows` random rows choose, and the ways over those rows."""
    experts = layers[0]
    x = torch.randn(rows, cast(PanelLinear, experts.down[0]).out_features)
    chosen = torch.stack([torch.randperm(experts.num_experts)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k)

    def one_op() -> None:
        for layer in layers:
            layer(x, chosen, weights)

    def loop() -> None:
        for layer in layers:
            layer.by_expert(x, chosen, weights)

    def dense_mlp() -> None:
        for gated, down in dense:
            down(gated(x, bf16_out=True))

    runs = {"one_op": one_op, "loop": loop}
    if dense:
        runs["dense"] = dense_mlp
    return int(chosen.unique().numel()), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument(
        "--weights", choices=["bf16", "fp16", "fp32", "mxfp4", "q4_k"], default="bf16"
    )
    parser.add_argument("--clamped", action="store_true", help="gpt-oss's clamped SwiGLU")
    args = parser.parse_args()
    torch.manual_seed(0)
    layers = expert_layers(args)
    width = args.top_k * args.inter
    dense = []
    for _ in range(args.layers if cpu_ops.bf16_panels_available() else 0):
        gated = GatedPanelLinear.of(panels(width, args.hidden), panels(width, args.hidden))
        assert gated is not None
        dense.append((gated, panels(args.hidden, width)))
    with torch.inference_mode():
        for rows in args.rows:
            chosen, runs = ways(layers, dense, rows, args.top_k)
            result = {"rows": rows, "experts_chosen": chosen}
            for name, run in runs.items():
                result[f"{name}_ms"] = round(median_ms(run, args.layers, args.passes), 3)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
