"""Predicted Outputs against none, in one engine and one run: chat requests that ask the model to
repeat or lightly fix a passage (code and prose), each given the passage as its `prediction`
(tokenized as the server does) or not, four runs per concurrency (without, with, with,
without), the slots kept full for `--rounds` requests each. Reports output tok/s of each way
(the mean of its two runs), their ratio and the share of the prediction's drafts kept.

    python benchmarks/predicted_outputs.py --concurrency 1 4 16

With `--own-replies` each request's prediction is the model's own greedy reply (served once
before): every draft is kept, so the ratio is the ceiling of drafting on this model and machine
(what a step of drafts costs against the tokens it gives), with random weights too.
"""

from __future__ import annotations

import argparse
import time

from engine_setup import add_engine_arguments, add_load_arguments, engine_config, timed_engine_core
from speculation import PASSAGES, copy_prompts, print_row

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams


def run(
    core: EngineCore,
    prompts: list[list[int]],
    predictions: list[tuple[int, ...]] | None,
    output_len: int,
    rounds: int,
    tag: str,
) -> dict:
    """Serve each prompt `rounds` times with `len(prompts)` in flight, greedy, up to
    `output_len` tokens each (a reply ends where the model ends it)."""
    queue = [i for _ in range(rounds) for i in range(len(prompts))]
    submitted = produced = kept = refused = 0

    def submit() -> None:
        nonlocal submitted
        index = queue[submitted]
        prediction = predictions[index] if predictions is not None else ()
        params = SamplingParams(temperature=0, max_tokens=output_len, prediction=prediction)
        core.add_request(f"{tag}-{submitted}", prompts[index], params)
        submitted += 1

    for _ in prompts:
        submit()
    start = time.perf_counter()
    while core.has_unfinished():
        for output in core.step():
            produced += len(output.new_token_ids)
            if output.finished:
                kept += output.num_prediction_kept
                refused += output.num_prediction_refused
                if submitted < len(queue):
                    submit()
    elapsed = time.perf_counter() - start
    return {"tok_per_s": produced / elapsed, "kept": kept, "refused": refused}


def own_replies(
    core: EngineCore, prompts: list[list[int]], output_len: int
) -> list[tuple[int, ...]]:
    """The model's greedy reply to each prompt, `output_len` tokens (EOS ignored)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    replies: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        core.add_request(f"own-{i}", prompt, params)
        replies[f"own-{i}"] = []
    while core.has_unfinished():
        for output in core.step():
            replies[output.request_id] += output.new_token_ids
    return [tuple(replies[f"own-{i}"]) for i in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser, [1, 4, 16], output_len=160)
    parser.add_argument("--rounds", type=int, default=2, help="requests per slot")
    parser.add_argument(
        "--own-replies", action="store_true", help="predict each reply as the model writes it"
    )
    args = parser.parse_args()
    core, _, info = timed_engine_core(engine_config(args))
    print(f"# {info.model_name} {info.dtype} on {info.device}, predicted outputs")
    tokenizer = core.tokenizer
    for concurrency in args.concurrency:
        prompts = copy_prompts(core, concurrency)
        passages = [PASSAGES[i % len(PASSAGES)] for i in range(concurrency)]
        predictions = [tuple(tokenizer.encode(p, add_special_tokens=False)) for p in passages]
        if args.own_replies:
            predictions = own_replies(core, prompts, args.output_len)
        run(core, prompts, None, 1, 1, f"c{concurrency}-cached")  # prompts cached for all
        rates: dict[str, list[float]] = {"off": [], "on": []}
        share = 0.0
        for turn, way in enumerate(["off", "on", "on", "off"]):
            given = predictions if way == "on" else None
            tag = f"c{concurrency}-{turn}"
            result = run(core, prompts, given, args.output_len, args.rounds, tag)
            rates[way].append(result["tok_per_s"])
            if way == "on":
                share = result["kept"] / max(1, result["kept"] + result["refused"])
        print_row(concurrency, rates, share)


if __name__ == "__main__":
    main()
