"""`conveyor bench offline`: the same requests three ways on one machine.

1. Conveyor's continuous batching;
2. the same engine forced to static batches (nothing is admitted until a whole batch is done);
3. batched `model.generate` with padding.

Writes `results.json` and PNG plots (throughput, latency CDF, KV cache usage over time) under
the output folder and prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch and the model load only when this benchmark runs, not with the CLI
    from engine.core.engine_core import EngineCore
    from engine.loading.model_loader import LoadedModel


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.output_lens)


@dataclass(slots=True)
class ModeResult:
    name: str
    seconds: float
    output_tokens: int
    latencies: list[float]
    kv_usage: list[tuple[float, float]] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.seconds

    def summary(self) -> dict[str, float | str | int]:
        ordered = sorted(self.latencies)
        return {
            "mode": self.name,
            "seconds": round(self.seconds, 2),
            "output_tokens": self.output_tokens,
            "output_tok_per_s": round(self.throughput, 1),
            "latency_p50_s": round(ordered[len(ordered) // 2], 2),
            "latency_max_s": round(ordered[-1], 2),
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument(
        "--batch-size", type=int, default=16, help="sequences at once in every mode"
    )
    parser.add_argument("--min-input-len", type=int, default=16)
    parser.add_argument("--max-input-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=16)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("bench-results/offline"))
    parser.add_argument("--skip-generate", action="store_true")


def make_workload(args: argparse.Namespace, vocab: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [
        [
            rng.randrange(100, vocab - 100)
            for _ in range(rng.randint(args.min_input_len, args.max_input_len))
        ]
        for _ in range(args.num_requests)
    ]
    outputs = [rng.randint(args.min_output_len, args.max_output_len) for _ in prompts]
    return Workload(prompts, outputs)


def run_engine(core: EngineCore, workload: Workload, name: str) -> ModeResult:
    manager = core.scheduler.block_manager
    start = time.perf_counter()
    for i, (prompt, length) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        core.add_request(
            f"{name}-{i}", prompt, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
        )
    latencies: list[float] = []
    usage: list[tuple[float, float]] = []
    produced = 0
    while core.has_unfinished():
        outputs = core.step()
        now = time.perf_counter() - start
        usage.append((now, manager.usage))
        produced += sum(len(o.new_token_ids) for o in outputs)
        latencies.extend(now for o in outputs if o.finished)
    return ModeResult(name, time.perf_counter() - start, produced, latencies, usage)


def run_generate(loaded: LoadedModel, workload: Workload, batch_size: int) -> ModeResult:
    """Padded batches through `model.generate`; a batch runs until its longest member is done."""
    import torch

    model = loaded.model
    model.set_attn_implementation("sdpa")
    pad = loaded.tokenizer.pad_token_id or 0
    start = time.perf_counter()
    latencies: list[float] = []
    useful = 0
    for first in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[first : first + batch_size]
        lengths = workload.output_lens[first : first + batch_size]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device
        )
        longest = max(lengths)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=pad,
            )
        latencies.extend([time.perf_counter() - start] * len(prompts))
        useful += sum(lengths)
    return ModeResult("generate", time.perf_counter() - start, useful, latencies)


def plot(results: list[ModeResult], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(
        [r.name for r in results],
        [r.throughput for r in results],
        color=["#2a9d8f", "#e9c46a", "#e76f51"][: len(results)],
    )
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput, same requests")
    paths.append(_save(fig, folder / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for result in results:
        ordered = sorted(result.latencies)
        ax.step(
            ordered,
            [(i + 1) / len(ordered) for i in range(len(ordered))],
            where="post",
            label=result.name,
        )
    ax.set_xlabel("request latency (s)")
    ax.set_ylabel("fraction of requests done")
    ax.set_title("Latency CDF")
    ax.legend()
    paths.append(_save(fig, folder / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for result in results:
        if result.kv_usage:
            ax.plot(
                [t for t, _ in result.kv_usage], [u for _, u in result.kv_usage], label=result.name
            )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("KV cache blocks in use (fraction)")
    ax.set_title("KV cache usage over time")
    ax.legend()
    paths.append(_save(fig, folder / "kv_cache_usage.png"))
    return paths


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    from engine.factory import core_from_model
    from engine.loading.model_loader import load_model, resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = resolve_dtype(args.dtype, device, args.model)
    loaded = load_model(args.model, dtype, device)
    workload = make_workload(args, loaded.model.config.vocab_size)
    base = EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 30), max_num_seqs=args.batch_size)
    results = []
    for name, config in (("continuous", base), ("static", replace(base, static_batching=True))):
        core, _ = core_from_model(loaded, config, device, dtype)
        run_engine(core, Workload(workload.prompts[:2], [2, 2]), f"warmup-{name}")
        results.append(run_engine(core, workload, name))
        print(json.dumps(results[-1].summary()), flush=True)
    if not args.skip_generate:
        results.append(run_generate(loaded, workload, args.batch_size))
        print(json.dumps(results[-1].summary()), flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    ratios = {
        f"continuous_vs_{r.name}": round(results[0].throughput / r.throughput, 2)
        for r in results[1:]
    }
    report = {
        "model": loaded.name,
        "dtype": str(dtype).removeprefix("torch."),
        "device": str(device),
        "num_requests": args.num_requests,
        "batch_size": args.batch_size,
        "results": [r.summary() for r in results],
        "throughput_ratios": ratios,
    }
    (args.output / "results.json").write_text(json.dumps(report, indent=2))
    for path in plot(results, args.output):
        print(f"wrote {path}")
    print(json.dumps(ratios))
    return 0
