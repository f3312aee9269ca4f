"""Output tokens/s of the engine itself (no HTTP): random prompts, fixed output lengths, EOS
ignored, all requests submitted at once with `--concurrency` in flight.

    python benchmarks/engine_throughput.py --concurrency 1 16 64

Greedy by default; `--temperature` (with `--top-p`) samples instead.

With `--both-bf16-products` (a bf16 model on a CPU with AMX-BF16) each concurrency runs twice
in turn with the products in AMX tiles and in AVX-512 BF16 dot products, each row tagged. With
`--both-heads` the decode steps of each run take turns choosing their greedy tokens in the LM
head and from logits handed to the sampler, and the median step of each way is reported (a
difference of a few percent shows only step by step on a noisy machine). With
`--both-schedulings` each concurrency runs four times, steps in turn and overlapped (async
scheduling) taking turns, each row tagged; on a GPU that is the figure async scheduling is
for, with the median step of each (the engine's own decode step). With `--both-decode-routes`
(a CPU) each concurrency runs four times, the decode route the model chose (the fused layers)
and op by op taking turns, each row tagged.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from engine_setup import add_engine_arguments, add_load_arguments, engine_config, timed_engine_core

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import DecodeRoute, FusedDecode
from engine.worker.compilation import is_compiled


def run(
    core: EngineCore,
    concurrency: int,
    input_len: int,
    output_len: int,
    seed: int,
    both_heads: bool = False,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> dict[str, float]:
    rng = random.Random(seed)
    vocab = core.vocab_size
    params = SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=output_len, ignore_eos=True
    )
    for i in range(concurrency):
        prompt = [rng.randrange(100, vocab - 100) for _ in range(input_len)]
        core.add_request(f"bench-{seed}-{i}", prompt, params)
    start = time.perf_counter()
    first_token: dict[str, float] = {}
    step_times: list[float] = []
    produced = 0
    while core.has_unfinished():
        if both_heads:
            core.runner.greedy_in_model = len(step_times) % 2 == 1
        step_start = time.perf_counter()
        outputs = core.step()
        step_times.append(time.perf_counter() - step_start)
        for output in outputs:
            first_token.setdefault(output.request_id, time.perf_counter() - start)
            produced += len(output.new_token_ids)
    elapsed = time.perf_counter() - start
    decode_steps = step_times[1:] or step_times
    heads = {}
    if both_heads:
        core.runner.greedy_in_model = True
        heads = step_medians_by_head(step_times, output_len - 1)
    return {
        "concurrency": concurrency,
        "output_tokens": produced,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(produced / elapsed, 1),
        "ttft_mean_ms": round(1000 * statistics.mean(first_token.values()), 1),
        "step_ms_median": round(1000 * statistics.median(decode_steps), 1),
        **heads,
    }


def step_medians_by_head(step_times: list[float], decode_steps: int) -> dict[str, float]:
    """Median decode step of each way, from a run whose step i chose in the head when i is odd;
    the last `decode_steps` steps are the decode steps (the prefill came first)."""
    first = len(step_times) - decode_steps
    by_way: dict[str, list[float]] = {"in_head": [], "logits": []}
    for i in range(first, len(step_times)):
        by_way["in_head" if i % 2 else "logits"].append(step_times[i])
    return {
        f"step_ms_median_{way}": round(1000 * statistics.median(times), 2)
        for way, times in by_way.items()
        if times
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="on CUDA, no decode graphs")
    parser.add_argument("--both-bf16-products", action="store_true")
    parser.add_argument("--both-heads", action="store_true")
    parser.add_argument("--both-schedulings", action="store_true")
    parser.add_argument("--both-decode-routes", action="store_true")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    args = parser.parse_args()
    if args.both_bf16_products and not cpu_ops.bf16_tiles_available():
        raise SystemExit("the bf16 products have no AMX tiles here")
    if sum([args.both_bf16_products, args.both_schedulings, args.both_decode_routes]) > 1:
        raise SystemExit("compare the bf16 products, the schedulings or the routes, one at once")
    config = engine_config(
        args,
        max_num_batched_tokens=args.max_num_batched_tokens,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
    )
    core, _, info = timed_engine_core(config)
    graphs = "CUDA graphs" if core.runner.graphs is not None else "eager"
    layers = getattr(core.runner.model, "layers", [])
    compiled = ", layers compiled" if any(is_compiled(layer) for layer in layers) else ""
    print(
        f"# {info.model_name} {info.dtype} on {info.device}, "
        f"{core.runner.backend.name} attention, {graphs}{compiled}"
    )
    for _ in range(args.warmup):
        run(core, 2, 16, 4, seed=-1)
    modes: list[str | None] = [None]
    if args.both_bf16_products:
        modes = ["tiles", "dot", "dot", "tiles"]
    elif args.both_schedulings:
        modes = ["in_turn", "overlapped", "overlapped", "in_turn"]
    elif args.both_decode_routes:
        modes = ["chosen", "op_by_op", "op_by_op", "chosen"]
    chosen = getattr(core.runner.model, "fused_decode", None)
    if args.both_decode_routes and chosen is None:
        raise SystemExit("this model has no fused decode to compare")
    for seed, concurrency in enumerate(args.concurrency):
        for turn, mode in enumerate(modes):
            tags = {}
            if mode in ("tiles", "dot"):
                cpu_ops.use_bf16_tiles(mode == "tiles")
                tags = {"bf16_products": mode}
            elif mode in ("chosen", "op_by_op"):
                off = FusedDecode(DecodeRoute.OPS, reason="--both-decode-routes")
                core.runner.model.fused_decode = chosen if mode == "chosen" else off
                tags = {"decode_route": mode}
            elif mode is not None:
                core.overlap = mode == "overlapped"
                tags = {"scheduling": mode}
            result = run(
                core,
                concurrency,
                args.input_len,
                args.output_len,
                seed * len(modes) + turn,
                args.both_heads,
                args.temperature,
                args.top_p,
            )
            print(json.dumps({**result, **tags}))


if __name__ == "__main__":
    main()
