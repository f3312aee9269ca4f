"""Layers of experts on the CPU over bf16 panels, three ways in turn: the one op
(`cpu_ops.expert_mlps`), the loop over the chosen experts (`ExpertLinears.by_expert`) and, for
scale, a dense gated MLP as wide as the experts a row runs (the same bytes a row reads, in
bf16). The median milliseconds a layer at each row count; every layer holds its own weights, so
they stream from memory as in a decode step. With `--mxfp4` the experts hold random MXFP4
blocks (gpt-oss as published); with `--clamped` they run gpt-oss's clamped SwiGLU instead of
silu. Needs AVX-512 BF16.

    PYTHONPATH=. python benchmarks/expert_layers.py --rows 1 16 64 [--mxfp4] [--clamped]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear
from engine.loading import gguf_blocks
from engine.models.experts import ClampedSwiGLU, ExpertLinears


def panels(out: int, into: int) -> PanelLinear:
    return PanelLinear(torch.randn(out, into) / into**0.5, None, torch.bfloat16)


def blocks(out: int, into: int) -> PanelLinear:
    """MXFP4 blocks of random codes under scales about 1 / 16, multiplied in bf16."""
    codes = torch.randint(0, 256, (out, into // 32, 16), dtype=torch.uint8)
    scales = torch.randint(120, 124, (out, into // 32, 1), dtype=torch.uint8)
    rows = torch.cat([scales, codes], dim=-1).reshape(out, -1)
    layer = PanelLinear.of_blocks(gguf_blocks.MXFP4, rows, None)
    if not layer.multiply_in_bf16():
        raise SystemExit("MXFP4 blocks do not multiply in bf16 here")
    return layer


def expert_layers(args: argparse.Namespace) -> list[ExpertLinears]:
    make = blocks if args.mxfp4 else panels
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
            raise SystemExit("the experts did not group (no bf16 panels here?)")
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
    layers: list[ExpertLinears], dense: list[tuple[GatedPanelLinear, PanelLinear]], rows: int
) -> tuple[int, dict[str, Callable[[], None]]]:
    """How many experts `rows` random rows choose, and the three ways over those rows."""
    experts = layers[0]
    top_k = dense[0][0].out_features // experts.intermediate
    x = torch.randn(rows, dense[0][0].in_features)
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

    return int(chosen.unique().numel()), {"one_op": one_op, "loop": loop, "dense": dense_mlp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--inter", type=int, default=384)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--passes", type=int, default=30)
    parser.add_argument("--mxfp4", action="store_true", help="experts in MXFP4 blocks")
    parser.add_argument("--clamped", action="store_true", help="gpt-oss's clamped SwiGLU")
    args = parser.parse_args()
    if not cpu_ops.bf16_panels_available():
        raise SystemExit("bf16 panels need AVX-512 BF16")
    torch.manual_seed(0)
    layers = expert_layers(args)
    width = args.top_k * args.inter
    dense = []
    for _ in range(args.layers):
        gated = GatedPanelLinear.of(panels(width, args.hidden), panels(width, args.hidden))
        assert gated is not None
        dense.append((gated, panels(args.hidden, width)))
    with torch.inference_mode():
        for rows in args.rows:
            chosen, runs = ways(layers, dense, rows)
            result = {"rows": rows, "experts_chosen": chosen}
            for name, run in runs.items():
                result[f"{name}_ms"] = round(median_ms(run, args.layers, args.passes), 3)
            print(json.dumps(result))


if __name__ == "__main__":
    main()
