"""Embeddings per second of the pooling runner (`--runner pooling`) against transformers' own
batched forward (`model.model(ids).last_hidden_state[:, -1]`) on the same random prompts and
the same device, taking turns (engine, transformers, transformers, engine) at each batch size.

    python benchmarks/embeddings.py --batch 1 16 64 --input-len 128 [--model M --dtype bfloat16]

The engine runs each batch as requests through its scheduler (chunked at
`--max-num-batched-tokens`, prefix cache off so each turn computes every token); transformers
runs it as one padded-free forward of the whole batch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from engine_setup import add_engine_arguments, engine_config, timed_engine_core
from transformers import AutoModelForCausalLM

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams

POOL = SamplingParams(temperature=0, max_tokens=1)


def engine_turn(core: EngineCore, prompts: list[list[int]], tag: str) -> float:
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}-{i}", prompt, POOL)
    done = 0
    while core.has_unfinished():
        done += sum(output.embedding is not None for output in core.step())
    assert done == len(prompts)
    return time.perf_counter() - start


@torch.inference_mode()
def transformers_turn(model: torch.nn.Module, prompts: list[list[int]]) -> float:
    ids = torch.tensor(prompts, device=model.device)
    start = time.perf_counter()
    states = model.model(ids).last_hidden_state[:, -1].float()
    if states.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    config = engine_config(
        args,
        runner="pooling",
        enable_prefix_caching=False,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    core, loaded, info = timed_engine_core(config)
    dtype = getattr(torch, info.dtype)
    reference = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).to(info.device)
    reference.eval()
    print(f"# {info.model_name} {info.dtype} on {info.device}, {args.input_len}-token prompts")
    rng = random.Random(0)
    for batch in args.batch:
        prompts = [
            [rng.randrange(100, core.vocab_size - 100) for _ in range(args.input_len)]
            for _ in range(batch)
        ]
        engine_turn(core, prompts[:2], "warm")
        transformers_turn(reference, prompts[:2])
        times: dict[str, list[float]] = {"engine": [], "transformers": []}
        for turn in range(args.rounds):
            for way in ("engine", "transformers", "transformers", "engine"):
                if way == "engine":
                    times[way].append(engine_turn(core, prompts, f"b{batch}-{turn}"))
                else:
                    times[way].append(transformers_turn(reference, prompts))
        rates = {way: batch / statistics.median(t) for way, t in times.items()}
        print(
            json.dumps(
                {
                    "batch": batch,
                    "engine_per_s": round(rates["engine"], 1),
                    "transformers_per_s": round(rates["transformers"], 1),
                    "engine_over_transformers": round(rates["engine"] / rates["transformers"], 2),
                }
            )
        )


if __name__ == "__main__":
    main()
