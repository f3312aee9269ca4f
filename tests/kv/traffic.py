"""Random prefix-cache traffic on a bare block manager: prompts that share a few prefixes
arrive, take their cached blocks, compute the rest and publish it, and leave."""

from __future__ import annotations

import random

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager


def request_with(tokens: list[int], name: str = "r", **fields: object) -> Request:
    return Request(
        name,
        list(tokens),
        SamplingParams(max_tokens=4),
        0.0,
        10_000,
        eos_token_ids=frozenset({0}),
        **fields,  # type: ignore[arg-type]
    )


def arrive(
    manager: BlockManager, rng: random.Random, prefixes: list[list[int]], name: str, vocab: int
) -> Request | None:
    """A prompt of one of the `prefixes` and a few tokens more: its cached blocks claimed, the
    rest allocated, computed and published (None, and nothing held, where blocks ran out)."""
    tokens = rng.choice(prefixes) + [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
    request = request_with(tokens, name)
    manager.claim(request, manager.cached_prefix(request))
    request.num_computed_tokens = len(request.block_ids) * manager.block_size
    if not manager.allocate(request, request.num_tokens):
        manager.free(request)
        return None
    request.num_computed_tokens = request.num_tokens
    manager.cache_full_blocks(request)
    return request
