"""Chats of several turns against the engine itself (no HTTP), with prefix caching and without:
`--conversations` chats at once, each turn's prompt the chat so far (the last answer included)
and `--turn-len` new random tokens, `--output-len` greedy tokens (EOS ignored) an answer. For a
model whose layers keep recurrent states, prefix caching resumes a turn from the snapshot of its
states where the last answer last crossed the `--mamba-block-size` grid. The two engines take
turns within each round, so a slow spell of the machine touches both alike.

    python benchmarks/multi_turn.py --model /tmp/q35-bench --load-format dummy --turns 4
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from engine_setup import add_engine_arguments, engine_config, timed_engine_core

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def chats(core: EngineCore, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """Seconds of the whole run and the mean seconds to the first token of the later turns,
    and the share of those turns' prompt tokens found cached."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    history = [[] for _ in range(args.conversations)]
    start, later_ttft = time.perf_counter(), []
    hits, queries = core.scheduler.prefix_cache_hits, core.scheduler.prefix_cache_queries
    for turn in range(args.turns):
        first_len = args.first_len if turn == 0 else args.turn_len
        if turn == 1:  # the later turns' cache figures only
            hits, queries = core.scheduler.prefix_cache_hits, core.scheduler.prefix_cache_queries
        sent = time.perf_counter()
        for i, chat in enumerate(history):
            chat += [rng.randrange(100, core.vocab_size - 100) for _ in range(first_len)]
            core.add_request(f"{seed}-{turn}-{i}", list(chat), params)
        answers: dict[str, list[int]] = {}
        while core.has_unfinished():
            for output in core.step():
                if output.request_id not in answers and turn > 0:
                    later_ttft.append(time.perf_counter() - sent)
                answers.setdefault(output.request_id, []).extend(output.new_token_ids)
        for i, chat in enumerate(history):
            chat += answers[f"{seed}-{turn}-{i}"]
    cached = core.scheduler.prefix_cache_hits - hits
    asked = core.scheduler.prefix_cache_queries - queries
    return {
        "total_s": time.perf_counter() - start,
        "later_ttft_s": statistics.mean(later_ttft),
        "later_cached": cached / asked if asked else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-len", type=int, default=512)
    parser.add_argument("--turn-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--mamba-block-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cores = {}
    for caching in (True, False):
        config = engine_config(args, enable_prefix_caching=caching)
        cache = dataclasses.replace(config.cache, mamba_block_size=args.mamba_block_size)
        core, _, info = timed_engine_core(dataclasses.replace(config, cache=cache))
        cores[caching] = core
    print(f"# {info.model_name} {info.dtype} on {info.device}")
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for round_ in range(args.rounds):
        # Mirrored order each round; each run's chats are its own (never in the other's cache).
        order = (True, False) if round_ % 2 == 0 else (False, True)
        for index, caching in enumerate(order):
            runs[caching].append(chats(cores[caching], args, seed=2 * round_ + index))
    for caching, found in runs.items():
        summary = {key: round(statistics.mean(run[key] for run in found), 3) for key in found[0]}
        print(json.dumps({"prefix_caching": caching} | summary))
    for core in cores.values():
        core.close()


if __name__ == "__main__":
    main()
