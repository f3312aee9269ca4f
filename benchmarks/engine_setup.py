"""The engine options the benchmarks that drive `EngineCore` directly share, and the engine they
build: the model, its dtype, the KV cache's dtype (in a 1 GiB cache), 8-bit activations, the
tensor-parallel size, `--compile`, and `--load-format dummy` (random weights of the model's
shape, none read), its KV cache resident before anything is timed."""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Sequence
from typing import Any

from engine.core.config import CacheConfig, EngineConfig, ServingInfo
from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.loading.model_loader import LoadedModel


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--int8-activations", action="store_true")
    parser.add_argument("--keep-blocks", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--compile", action="store_true", help="torch.compile the layers")


def add_load_arguments(
    parser: argparse.ArgumentParser, concurrency: list[int] | None = None, output_len: int = 128
) -> None:
    """The load a run puts on the engine: requests in flight, and their random prompts' and
    outputs' lengths in tokens."""
    default = concurrency if concurrency is not None else [1, 16, 64]
    parser.add_argument("--concurrency", type=int, nargs="+", default=default)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=output_len)


def timed_engine_core(config: EngineConfig) -> tuple[EngineCore, LoadedModel, ServingInfo]:
    """`create_engine_core(config)` with its KV cache's pages faulted in before anything is
    timed: on the CPU they become resident as blocks are first written, so a first run (or the
    first of two engines compared) would pay for them and a later one not."""
    core, loaded, info = create_engine_core(config)
    cache = core.runner.kv_cache.tensor
    if cache.device.type == "cpu":
        cache.zero_()
    return core, loaded, info


def engine_config(args: argparse.Namespace, **options: Any) -> EngineConfig:
    """The engine `args` ask for, with any other `EngineConfig` fields in `options`."""
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        int8_activations=args.int8_activations,
        keep_blocks=args.keep_blocks,
        tensor_parallel_size=args.tensor_parallel_size,
        load_format=args.load_format,
        compile=args.compile,
        cache=CacheConfig(kv_cache_memory=1 << 30, dtype=args.kv_cache_dtype),
        **options,
    )


def output_rate(
    core: EngineCore,
    concurrency: int,
    args: argparse.Namespace,
    seed: int,
    loras: Sequence[Any] = (None,),
) -> float:
    """Output tokens/s of `concurrency` requests of random `args.input_len`-token prompts and
    `args.output_len` greedy tokens (EOS ignored) all at once, request `i` under
    `loras[i % len(loras)]`."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(concurrency):
        prompt = [rng.randrange(100, core.vocab_size - 100) for _ in range(args.input_len)]
        core.add_request(f"bench-{seed}-{i}", prompt, params, lora=loras[i % len(loras)])
    start, produced = time.perf_counter(), 0
    while core.has_unfinished():
        produced += sum(len(output.new_token_ids) for output in core.step())
    return produced / (time.perf_counter() - start)
