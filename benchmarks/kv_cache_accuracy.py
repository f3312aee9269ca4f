"""What a narrower KV cache costs in accuracy: the default model scores cuts of a text (prompt
logprobs, prefilled in chunks so that later chunks read the earlier ones back from the cache)
with each cache dtype, fp8 with scales of 1.0 and with scales calibrated on the first step
(`--calculate-kv-scales`); prints, per cache, the perplexity and the mean and largest change of
each token's logprob against an fp32 cache.

    python benchmarks/kv_cache_accuracy.py --from-file README.md --tokens 1024 --cuts 4

Runs on the CPU through the torch attention backend, whose casts are those of a GPU's torch
path; `fp8_e4m3` (a GPU's `--kv-cache-dtype fp8`) is emulated there, since a CPU serves e5m2
only.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

import torch

from engine import factory
from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core

# (cache dtype, calibrate the scales)
VARIANTS = [
    ("float32", False),
    ("bfloat16", False),
    ("fp8_e5m2", False),
    ("fp8_e5m2", True),
    ("fp8_e4m3", False),
    ("fp8_e4m3", True),
]


def allow_e4m3_on_the_cpu() -> None:
    """Let the factory build an e4m3 cache on the CPU, as it does on a GPU."""
    chosen = factory.kv_cache_dtype

    def kv_cache_dtype(name, model_dtype, compute_dtype, device):  # type: ignore[no-untyped-def]
        if name == "fp8_e4m3" and device.type == "cpu":
            return torch.float8_e4m3fn
        return chosen(name, model_dtype, compute_dtype, device)

    factory.kv_cache_dtype = kv_cache_dtype  # type: ignore[assignment]


def score(cache: str, calibrate: bool, cuts: list[list[int]], chunk: int) -> list[float]:
    """Each cut's prompt logprobs (positions 1..n) through an engine with this cache."""
    config = EngineConfig(
        dtype="float32",
        attention_backend="torch",
        max_num_batched_tokens=chunk,
        max_num_seqs=1,
        enable_prefix_caching=False,
        cache=CacheConfig(kv_cache_memory=1 << 30, dtype=cache, calculate_kv_scales=calibrate),
    )
    core, _, _ = create_engine_core(config)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    scores: list[float] = []
    for i, cut in enumerate(cuts):
        core.add_request(str(i), cut, params)
        entries = []
        while core.has_unfinished():
            for output in core.step():
                entries.extend(output.prompt_logprobs or [])
        scores.extend(entry.logprob for entry in entries if entry is not None)
    return scores


def text_cuts(path: Path, tokens: int, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from engine.loading.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_default_model()))
    ids = tokenizer(path.read_text())["input_ids"]
    if len(ids) < tokens * count:
        raise SystemExit(f"{path} has {len(ids)} tokens, fewer than {tokens} x {count}")
    return [ids[i * tokens : (i + 1) * tokens] for i in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-file", type=Path, default=Path("README.md"))
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--cuts", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=128, help="tokens prefilled per step")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    logging.basicConfig(level=logging.WARNING, format="# %(message)s")
    logging.getLogger("engine.kv").setLevel(logging.INFO)  # the calibrated scales' range
    allow_e4m3_on_the_cpu()
    cuts = text_cuts(args.from_file, args.tokens, args.cuts)
    print(f"# default model, fp32 compute, torch attention; {args.cuts} x {args.tokens} tokens")
    reference = score("float32", False, cuts, args.chunk)
    for cache, calibrate in VARIANTS:
        scores = reference if cache == "float32" else score(cache, calibrate, cuts, args.chunk)
        changes = [abs(a - b) for a, b in zip(scores, reference, strict=True)]
        line = {
            "kv_cache": cache,
            "scales": "calibrated" if calibrate else ("1.0" if "fp8" in cache else "-"),
            "perplexity": round(math.exp(-sum(scores) / len(scores)), 4),
            "mean_logprob_change": round(sum(changes) / len(changes), 5),
            "max_logprob_change": round(max(changes), 4),
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
