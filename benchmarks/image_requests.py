"""Image requests: Conveyor's engine against transformers' `generate` on the same image-text
model, device and prompts, in one run. Each request is one user turn of a random image (a
different one each, so no prefix cache hit) and a line of text; outputs of fixed length, EOS
ignored, greedy, every request submitted at once; transformers runs them as one padded batch.
The two take turns (Conveyor, transformers, transformers, Conveyor) at each concurrency.

    python benchmarks/random_vlm.py /tmp/smolvlm
    python benchmarks/image_requests.py --model /tmp/smolvlm --concurrency 1 8

With `--beside-text N`, N text requests decode while the image requests arrive instead, on
Conveyor alone, with the step's encoder budget and without it (every image encoded in the step
that reaches it), in turn: the text requests' longest wait between two tokens, and the image
requests' mean TTFT.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import time
from typing import Any

import numpy as np
import torch
from engine_setup import add_engine_arguments, engine_config, timed_engine_core
from transformers import AutoModelForImageTextToText

from engine.core.engine_core import EngineCore
from engine.core.images import ImageInputs
from engine.core.sampling_params import SamplingParams


def image(seed: int, size: int) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def prompts(processor: Any, count: int, size: int, seed: int) -> list[dict[str, Any]]:
    """`count` processed user turns, each with its own random image."""
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = processor.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
    return [
        dict(processor(text=[text], images=[[image(seed * 1000 + i, size)]], return_tensors="pt"))
        for i in range(count)
    ]


def run_conveyor(
    core: EngineCore, processed: list[dict[str, Any]], image_token: int, output_len: int
) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    first: dict[str, float] = {}
    for i, inputs in enumerate(processed):
        ids, images = _request(inputs, image_token)
        core.add_request(f"r{i}", ids, params, images=images)
    produced = 0
    while core.has_unfinished():
        for output in core.step():
            produced += len(output.new_token_ids)
            first.setdefault(output.request_id, time.perf_counter() - start)
    elapsed = time.perf_counter() - start
    return _figures(produced, elapsed, list(first.values()))


def run_beside_text(
    core: EngineCore, processed: list[dict[str, Any]], image_token: int, texts: int
) -> dict[str, float]:
    """Text requests decoding (64-token prompts, long outputs) while the image requests
    arrive after their first token; the text requests' longest gap between tokens."""
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(texts):
        core.add_request(f"t{i}", list(range(100, 164)), params)
    core.step()  # their prompts
    last = dict.fromkeys((f"t{i}" for i in range(texts)), time.perf_counter())
    start, gap, first = time.perf_counter(), 0.0, {}
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i, inputs in enumerate(processed):
        ids, images = _request(inputs, image_token)
        core.add_request(f"r{i}", ids, short, images=images)
    while len(first) < len(processed) or any(r.startswith("r") for r in _unfinished(core)):
        for output in core.step():
            now = time.perf_counter()
            if output.request_id in last:
                gap = max(gap, now - last[output.request_id])
                last[output.request_id] = now
            else:
                first.setdefault(output.request_id, now - start)
    core.abort_requests(list(last))
    return {
        "text_longest_gap_s": round(gap, 2),
        "image_mean_ttft_s": round(sum(first.values()) / len(first), 2),
    }


def _request(inputs: dict[str, Any], image_token: int) -> tuple[list[int], ImageInputs]:
    """A processed turn's prompt ids and its image, as the engine takes them."""
    ids = inputs["input_ids"][0].tolist()
    digest = hashlib.sha256(inputs["pixel_values"].numpy().tobytes()).digest()
    return ids, ImageInputs.of(ids, image_token, [digest], inputs)


def _unfinished(core: EngineCore) -> list[str]:
    scheduler = core.scheduler
    return [r.request_id for r in [*scheduler.running, *scheduler.waiting]]


def run_transformers(
    model: Any, processed: list[dict[str, Any]], pad: int, output_len: int
) -> dict[str, float]:
    batch = _padded(processed, pad)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **batch,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad,
        )
    elapsed = time.perf_counter() - start
    produced = (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    return _figures(produced, elapsed, [])


def _padded(processed: list[dict[str, Any]], pad: int) -> dict[str, torch.Tensor]:
    """The turns as one left-padded batch (every image here has the same tiles)."""
    width = max(p["input_ids"].shape[1] for p in processed)
    ids = torch.full((len(processed), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(processed):
        length = p["input_ids"].shape[1]
        ids[row, width - length :] = p["input_ids"][0]
        mask[row, width - length :] = 1
    batch = {"input_ids": ids, "attention_mask": mask}
    for key in processed[0]:
        if key not in batch:
            batch[key] = torch.cat([_left_padded(p, key, width) for p in processed])
    return batch


def _left_padded(processed: dict[str, Any], key: str, width: int) -> torch.Tensor:
    """A turn's `key`, left-padded with zeros to `width` where it has one entry a token (Gemma
    3's `token_type_ids`)."""
    value = processed[key]
    length = processed["input_ids"].shape[1]
    if value.dim() != 2 or value.shape[1] != length or length == width:
        return value
    return torch.nn.functional.pad(value, (width - length, 0))


def _figures(produced: int, elapsed: float, ttfts: list[float]) -> dict[str, float]:
    figures = {
        "output_tokens": produced,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(produced / elapsed, 1),
    }
    if ttfts:
        figures["mean_ttft_s"] = round(sum(ttfts) / len(ttfts), 3)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    add_engine_arguments(parser)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=512)
    parser.add_argument("--beside-text", type=int, default=0, metavar="N")
    args = parser.parse_args()
    if args.beside_text:
        beside_text(args)
        return
    core, loaded, info = timed_engine_core(engine_config(args))
    assert info.image_token_id is not None, "--model must be an image-text model"
    hf = AutoModelForImageTextToText.from_pretrained(args.model, dtype=getattr(torch, info.dtype))
    hf.eval()
    pad = loaded.tokenizer.pad_token_id or 0
    tokens = prompts(loaded.processor, 1, args.image_size, seed=0)[0]["input_ids"].shape[1]
    print(f"# {info.model_name} {info.dtype} on {info.device}; {tokens} prompt tokens a request")
    warm = prompts(loaded.processor, 2, args.image_size, seed=0)
    run_conveyor(core, warm, info.image_token_id, 4)
    run_transformers(hf, warm, pad, 4)
    for concurrency in args.concurrency:
        processed = prompts(loaded.processor, concurrency, args.image_size, seed=concurrency)
        runs = {"conveyor": [], "transformers": []}
        for who in ("conveyor", "transformers", "transformers", "conveyor"):
            if who == "conveyor":
                core.scheduler.block_manager.reset_cache()  # the same images again
                figures = run_conveyor(core, processed, info.image_token_id, args.output_len)
            else:
                figures = run_transformers(hf, processed, pad, args.output_len)
            runs[who].append(figures)
        print(json.dumps({"concurrency": concurrency, **runs}))


def beside_text(args: argparse.Namespace) -> None:
    core, loaded, info = timed_engine_core(engine_config(args))
    assert info.image_token_id is not None, "--model must be an image-text model"
    budgeted = core.scheduler.config
    unlimited = dataclasses.replace(budgeted, max_num_encoder_input_tokens=1 << 30)
    print(f"# {info.model_name} {info.dtype} on {info.device}; {args.beside_text} text requests")
    for concurrency in args.concurrency:
        runs: dict[str, list[dict[str, float]]] = {"budget": [], "no budget": []}
        for way in ("budget", "no budget", "no budget", "budget"):
            core.scheduler.config = budgeted if way == "budget" else unlimited
            core.scheduler.block_manager.reset_cache()
            processed = prompts(loaded.processor, concurrency, args.image_size, seed=len(runs[way]))
            runs[way].append(
                run_beside_text(core, processed, info.image_token_id, args.beside_text)
            )
        print(json.dumps({"images": concurrency, **runs}))


if __name__ == "__main__":
    main()
