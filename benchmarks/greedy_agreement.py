"""How long Conveyor's greedy tokens follow transformers' on the default model: a few prompts,
greedy with EOS ignored, through the engine in `--dtype` and through transformers in fp32 and in
bf16; prints, per prompt, how many leading tokens agree with each (and bf16 with fp32).

    python benchmarks/greedy_agreement.py --dtype auto --tokens 48

With `--from-file PATH --prompt-tokens 512 1024 2048`, the prompts are instead consecutive cuts
of that many tokens of the file's text (long prompts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.loading.default_model import ensure_default_model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


def transformers_greedy(
    path: str, dtype: torch.dtype, prompts: list[list[int]], tokens: int
) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def conveyor_greedy(dtype: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    core, _, _ = create_engine_core(EngineConfig(dtype=dtype))
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    produced: dict[str, list[int]] = {}
    while core.has_unfinished():
        for output in core.step():
            produced.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [produced[str(i)] for i in range(len(prompts))]


def file_cuts(ids: list[int], lengths: list[int]) -> list[list[int]]:
    """Consecutive cuts of `ids`, one of each length."""
    if sum(lengths) > len(ids):
        raise SystemExit(f"the file has {len(ids)} tokens, fewer than the cuts' {sum(lengths)}")
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [ids[start : start + n] for start, n in zip(starts, lengths, strict=True)]


def agreeing(a: list[int], b: list[int]) -> int:
    """How many leading tokens the two share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--from-file", default=None)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    args = parser.parse_args()
    path = str(ensure_default_model())
    tokenizer = AutoTokenizer.from_pretrained(path)
    if args.from_file is None:
        prompts = [tokenizer(text).input_ids for text in PROMPTS]
        names = PROMPTS
    else:
        text = Path(args.from_file).read_text()
        prompts = file_cuts(tokenizer(text).input_ids, args.prompt_tokens)
        names = [f"{args.from_file}: {len(p)} tokens" for p in prompts]
    fp32 = transformers_greedy(path, torch.float32, prompts, args.tokens)
    bf16 = transformers_greedy(path, torch.bfloat16, prompts, args.tokens)
    ours = conveyor_greedy(args.dtype, prompts, args.tokens)
    for text, mine, ref32, ref16 in zip(names, ours, fp32, bf16, strict=True):
        print(
            json.dumps(
                {
                    "prompt": text,
                    "conveyor_vs_fp32": agreeing(mine, ref32),
                    "conveyor_vs_bf16": agreeing(mine, ref16),
                    "bf16_vs_fp32": agreeing(ref16, ref32),
                }
            )
        )


if __name__ == "__main__":
    main()
