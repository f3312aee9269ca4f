"""Speculation (n-gram drafts, suffix decoding's with `--method suffix`, or a draft model's with
`--draft-model`) against one token a step, in one engine and one run: each concurrency runs
four times, off, on, on, off, each run serving `--rounds` requests per slot with the slots kept
full (a request that ends is replaced by the next, as under steady load), its prompts cached by
a run before; it reports output tokens/s of each way (the mean of its two runs), their ratio,
and the share of draft tokens kept.

    python benchmarks/speculation.py --concurrency 1 16 64 --workload copy
    python benchmarks/speculation.py --concurrency 1 4 --draft-model ./small-model
    python benchmarks/speculation.py --concurrency 1 16 --method suffix --workload json

Suffix decoding keeps its tree of outputs from run to run (one drafter serves every "on" run),
as a server keeps it from request to request: later rounds of the same prompts, and the second
"on" run, draft from earlier replies.

`--workload copy`: chat requests that ask the model to repeat or lightly edit a passage (code and
prose), where a reply quotes its prompt, as in code editing, summaries that cite, or retrieval
answers; `json`: chat requests for a list of records under a JSON schema (the format enforced),
whose keys and punctuation repeat; `random`: random prompt tokens (vLLM's `random` dataset),
after which a small model soon repeats itself. Greedy, EOS ignored, from half to one and a half
times `--output-len` tokens each, the same lengths each run (a JSON reply ends where its document
does).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine_setup import add_engine_arguments, add_load_arguments, engine_config, timed_engine_core

from engine.core.engine_core import EngineCore
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.core.speculation import Drafter, SpeculativeConfig

PASSAGES = [
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(values)\n\n\ndef variance(values):\n    m = mean(values)\n"
    "    return sum((v - m) ** 2 for v in values) / len(values)\n",
    "The museum opens at nine in the morning and closes at six in the evening. Tickets are "
    "sold at the main entrance and online. Children under twelve enter for free, and students "
    "pay half price on weekdays. Guided tours leave every hour from the main hall.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n\n"
    "    def empty(self):\n        return not self.items\n",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air "
    "pressure is lower, so water boils at a lower temperature, and food takes longer to cook. "
    "A pressure cooker raises the pressure, and with it the boiling point.",
]
ASKS = [
    "Repeat the following text exactly, then stop:\n\n",
    "Rewrite the following text, changing nothing but fixing any mistakes:\n\n",
]


def copy_prompts(core: EngineCore, count: int) -> list[list[int]]:
    tokenizer = core.tokenizer
    prompts = []
    for i in range(count):
        text = ASKS[i % len(ASKS)] + PASSAGES[i % len(PASSAGES)]
        messages = [{"role": "user", "content": text}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


RECORDS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "colour": {"type": "string", "maxLength": 12},
                    "price": {"type": "number"},
                },
                "required": ["name", "colour", "price"],
                "additionalProperties": False,
            },
            "maxItems": 12,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
TOPICS = ["fruits", "vegetables", "flowers", "birds", "cars", "fabrics"]


def json_prompts(core: EngineCore, count: int) -> list[list[int]]:
    tokenizer = core.tokenizer
    prompts = []
    for i in range(count):
        text = (
            f"List ten {TOPICS[i % len(TOPICS)]} as JSON: an object whose items each have a "
            "name, a colour and a price."
        )
        messages = [{"role": "user", "content": text}]
        chat = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


def random_prompts(core: EngineCore, count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = core.vocab_size
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def run(
    core: EngineCore,
    prompts: list[list[int]],
    output_len: int,
    tag: str,
    schema: bool = False,
    rounds: int = 1,
) -> dict:
    """Serve each prompt `rounds` times, `len(prompts)` requests in flight: a request that
    ends is replaced by the next, as a server under steady load sees them (so requests that
    drafts speed up leave no tail of steps with few rows)."""
    structured = StructuredOutputs("json", json.dumps(RECORDS_SCHEMA)) if schema else None
    queue = [prompt for _ in range(rounds) for prompt in prompts]
    # Lengths from half to one and a half times `output_len`, the same in every run: requests
    # end at different steps either way, as a server's do.
    rng = random.Random(len(queue))
    lengths = [rng.randint(max(1, output_len // 2), max(1, 3 * output_len // 2)) for _ in queue]
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        params = SamplingParams(
            temperature=0, max_tokens=lengths[submitted], ignore_eos=True, structured=structured
        )
        core.add_request(f"{tag}-{submitted}", queue[submitted], params)
        submitted += 1

    for _ in prompts:
        submit()
    core.take_stats()
    start, produced = time.perf_counter(), 0
    drafted = kept = 0
    while core.has_unfinished():
        for output in core.step():
            produced += len(output.new_token_ids)
            if output.finished and submitted < len(queue):
                submit()
        drafts = core.take_stats().drafts
        drafted += drafts.num_draft_tokens
        kept += drafts.num_accepted_tokens
    elapsed = time.perf_counter() - start
    return {"tok_per_s": produced / elapsed, "drafted": drafted, "kept": kept}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    add_load_arguments(parser)
    parser.add_argument("--workload", choices=("copy", "json", "random"), default="copy")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument(
        "--draft-model", default=None, help="a model of the same tokenizer drafts (draft_model)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="requests per slot, each replaced as it ends"
    )
    parser.add_argument(
        "--method", choices=("ngram", "suffix"), default="ngram", help="without --draft-model"
    )
    parser.add_argument(
        "--suffix-fields",
        type=json.loads,
        default={},
        help="suffix decoding's vLLM fields, as JSON: '{\"suffix_decoding_max_spec_factor\": 2}'",
    )
    args = parser.parse_args()
    spec = speculative_config(args)
    core, _, info = timed_engine_core(engine_config(args, speculative=spec))
    drafter = core.drafter
    print(f"# {info.model_name} {info.dtype} on {info.device}, {args.workload} workload, {spec}")
    run(core, copy_prompts(core, 2), 8, "warmup")
    for seed, concurrency in enumerate(args.concurrency):
        if args.workload == "copy":
            prompts = copy_prompts(core, concurrency)
        elif args.workload == "json":
            prompts = json_prompts(core, concurrency)
        else:
            prompts = random_prompts(core, concurrency, args.input_len, seed)
        core.drafter = Drafter()
        run(core, prompts, 1, f"c{concurrency}-cached")  # every run then finds them cached
        rates: dict[str, list[float]] = {"off": [], "on": []}
        kept_share = 0.0
        for turn, way in enumerate(["off", "on", "on", "off"]):
            core.drafter = drafter if way == "on" else Drafter()
            tag = f"c{concurrency}-{turn}"
            result = run(core, prompts, args.output_len, tag, args.workload == "json", args.rounds)
            rates[way].append(result["tok_per_s"])
            if way == "on" and result["drafted"]:
                kept_share = result["kept"] / result["drafted"]
        print_row(concurrency, rates, kept_share)
    core.drafter = drafter


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The config the arguments name: a draft model, suffix decoding or n-gram drafts."""
    if args.draft_model:
        fields = {"method": "draft_model", "model": args.draft_model}
    elif args.method == "suffix":
        fields = {"method": "suffix", **args.suffix_fields}
    else:
        fields = {
            "method": "ngram",
            "prompt_lookup_min": args.prompt_lookup_min,
            "prompt_lookup_max": args.prompt_lookup_max,
        }
    fields["num_speculative_tokens"] = args.num_speculative_tokens
    fields["disable_by_batch_size"] = args.disable_by_batch_size
    return SpeculativeConfig.of(fields)


def print_row(concurrency: int, rates: dict[str, list[float]], kept_share: float) -> None:
    """One concurrency's line: output tok/s off and on (each the mean of its runs), their
    ratio and the share of draft tokens kept."""
    off, on = (sum(rates[w]) / len(rates[w]) for w in ("off", "on"))
    row = {
        "concurrency": concurrency,
        "off_tok_per_s": round(off, 1),
        "on_tok_per_s": round(on, 1),
        "on_over_off": round(on / off, 2),
        "drafts_kept": round(kept_share, 2),
    }
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
