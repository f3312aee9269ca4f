"""What `--compile` saves: every layer's pieces between attention calls (`project_qkv`, then
`after_attention` on its query as the attention output), run eagerly and compiled in turn,
round after round in one process, at each token count. Prints the median of each way and the
ratio, one JSON line per token count.

    python benchmarks/compiled_layers.py --tokens 1 16 64 256 [--model M --dtype bfloat16]

On a GPU each pass is timed between synchronizations; no CUDA graph is replayed (the step's
graphs replay the same kernels with less launch cost, so the ratio there is smaller).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
from engine_setup import add_engine_arguments, engine_config, timed_engine_core

from engine.models.llama import PagedLlamaForCausalLM, PagedLlamaLayer
from engine.worker.compilation import is_compiled

Pieces = tuple[Callable[..., tuple[torch.Tensor, ...]], Callable[..., torch.Tensor]]


def passes(layers: list[PagedLlamaLayer]) -> dict[str, list[Pieces]]:
    """Each layer's pieces as compiled (its own attributes) and as written (the class's)."""
    eager = [
        (
            lambda *a, layer=layer: PagedLlamaLayer.project_qkv(layer, *a),
            lambda *a, layer=layer: PagedLlamaLayer.after_attention(layer, *a),
        )
        for layer in layers
    ]
    compiled = [(layer.project_qkv, layer.after_attention) for layer in layers]
    return {"eager": eager, "compiled": compiled}


def one_pass(
    pieces: list[Pieces], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> float:
    synchronize(hidden.device)
    start = time.perf_counter()
    for project, after in pieces:
        query, _, _ = project(hidden, cos, sin)
        hidden = after(query.contiguous(), hidden)
    synchronize(hidden.device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure(model: PagedLlamaForCausalLM, tokens: int, rounds: int) -> dict[str, object]:
    layers = [layer for layer in model.layers if isinstance(layer, PagedLlamaLayer)]
    ways = passes(layers)
    device = model.embed_tokens.weight.device
    ids = torch.randint(100, 1000, (tokens,), device=device)
    hidden = model.embed_tokens(ids)
    cos, sin = model.rotary(hidden, torch.arange(tokens, device=device))
    times: dict[str, list[float]] = {way: [] for way in ways}
    for way in ways:  # warm-up
        one_pass(ways[way], hidden, cos, sin)
    for turn in range(rounds):
        order = list(ways) if turn % 2 == 0 else list(reversed(ways))
        for way in order:
            times[way].append(one_pass(ways[way], hidden, cos, sin))
    medians = {way: statistics.median(t) for way, t in times.items()}
    return {
        "tokens": tokens,
        **{f"{way}_ms": round(1000 * m, 3) for way, m in medians.items()},
        "compiled_over_eager": round(medians["compiled"] / medians["eager"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    args.compile = True
    core, _, info = timed_engine_core(engine_config(args))
    model = core.runner.model
    if not isinstance(model, PagedLlamaForCausalLM) or not is_compiled(model.layers[0]):
        raise SystemExit("the layers were not compiled (see the log's routes line)")
    print(f"# {info.model_name} {info.dtype} on {info.device}")
    for tokens in args.tokens:
        print(json.dumps(measure(model, tokens, args.rounds)))


if __name__ == "__main__":
    main()
