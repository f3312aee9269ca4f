"""Benchmark workloads: random prompts, a shared prefix, or a replayed JSONL trace."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request to send. `prompt` is token ids (exact length) or text; `arrival` is the
    offset in seconds from the start for trace replay (None: paced by the load shape)."""

    prompt: list[int] | str
    prompt_len: int
    output_len: int
    arrival: float | None = None
    priority: int = 0
    response_format: dict[str, Any] | None = None


def token_pool(tokenizer: Any) -> list[int]:
    """Ordinary token ids to draw random prompts from (no special tokens)."""
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(low, high)


def random_workload(
    num: int, input_len: int, output_len: int, pool: list[int], seed: int, range_ratio: float = 0.0
) -> list[BenchRequest]:
    """Prompts of random tokens; lengths uniform in mean * (1 ± range_ratio). Each seed gives
    fresh prompts, so a server's prefix cache cannot help."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num):
        length = _lengths(rng, input_len, range_ratio)
        prompt = [rng.choice(pool) for _ in range(length)]
        requests.append(BenchRequest(prompt, length, _lengths(rng, output_len, range_ratio)))
    return requests


def shared_prefix_workload(
    num: int, prefix_len: int, suffix_len: int, output_len: int, pool: list[int], seed: int
) -> list[BenchRequest]:
    """One common prefix (a system prompt) and a different question per request."""
    rng = random.Random(seed)
    prefix = [rng.choice(pool) for _ in range(prefix_len)]
    return [
        BenchRequest(
            prefix + [rng.choice(pool) for _ in range(suffix_len)],
            prefix_len + suffix_len,
            output_len,
        )
        for _ in range(num)
    ]


def trace_workload(
    path: Path, pool: list[int], seed: int, count_tokens: Callable[[str], int] = len
) -> list[BenchRequest]:
    """JSONL lines with `timestamp` (seconds), `output_len`, and `prompt` text or `input_len`
    (random tokens); `count_tokens` measures text prompts."""
    rng = random.Random(seed)
    requests = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if "prompt" in entry:
            prompt: list[int] | str = entry["prompt"]
            length = count_tokens(entry["prompt"])
        else:
            length = int(entry["input_len"])
            prompt = [rng.choice(pool) for _ in range(length)]
        requests.append(
            BenchRequest(prompt, length, int(entry["output_len"]), float(entry["timestamp"]))
        )
    start = min((r.arrival or 0.0 for r in requests), default=0.0)
    return [
        BenchRequest(r.prompt, r.prompt_len, r.output_len, (r.arrival or 0.0) - start)
        for r in sorted(requests, key=lambda r: r.arrival or 0.0)
    ]


HIGH_PRIORITY, LOW_PRIORITY = 0, 1


def answer_schema(name: str = "answer") -> dict[str, Any]:
    """A JSON object holding one free string: the model writes for as long as it would
    unconstrained, so a run with the schema and one without produce alike many tokens."""
    return {
        "type": "object",
        "properties": {name: {"type": "string"}},
        "required": [name],
        "additionalProperties": False,
    }


def with_json_schema(requests: list[BenchRequest], fresh: bool) -> list[BenchRequest]:
    """Every request asks for `answer_schema` in `response_format`: the same schema for all
    (compiled once by the server), or with `fresh` a schema of its own (compiled per request,
    which shows in the time to first token)."""
    out = []
    for i, r in enumerate(requests):
        name = f"answer_{i}" if fresh else "answer"
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": answer_schema(name)}}
        out.append(replace(r, response_format=fmt))
    return out


def with_priorities(
    requests: list[BenchRequest], high_share: float, seed: int
) -> list[BenchRequest]:
    """Mark a `high_share` of the requests high priority (0) and the rest low (1)."""
    rng = random.Random(seed + 1)
    return [
        BenchRequest(
            r.prompt,
            r.prompt_len,
            r.output_len,
            r.arrival,
            HIGH_PRIORITY if rng.random() < high_share else LOW_PRIORITY,
            r.response_format,
        )
        for r in requests
    ]


def as_text(requests: list[BenchRequest], tokenizer: Any) -> list[BenchRequest]:
    """Token-id prompts decoded to text (for the chat endpoint, which takes no token ids)."""
    return [
        r
        if isinstance(r.prompt, str)
        else BenchRequest(
            tokenizer.decode(r.prompt),
            r.prompt_len,
            r.output_len,
            r.arrival,
            r.priority,
            r.response_format,
        )
        for r in requests
    ]
