"""Tiny models saved to folders, served as `conveyor serve` loads them, and transformers' greedy
tokens over a saved folder (the oracle for weights loaded while serving)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from engine.core.async_engine import AsyncEngine
from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from tests.helpers import chat_tokenizer, reference_greedy, tiny_llama

PROMPT = [5, 9, 33, 2, 17, 40, 41, 42, 43]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def saved_llama(folder: Path, with_tokenizer: bool = False, **shape: Any) -> Path:
    """`tiny_llama(**shape)` saved to `folder` (a trainer's checkpoint: no tokenizer unless
    asked)."""
    tiny_llama(**shape).save_pretrained(folder)
    if with_tokenizer:
        chat_tokenizer().save_pretrained(folder)
    return folder


@asynccontextmanager
async def engine_on(folder: Path, **options: Any) -> AsyncIterator[AsyncEngine]:
    """A running engine that loaded `folder` as `conveyor serve` does (in fp32 unless
    `options` say another dtype)."""
    options = {"dtype": "float32", **options}
    config = EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=64), **options)
    engine = AsyncEngine.from_config(config)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def greedy(engine: AsyncEngine, prompt: list[int] = PROMPT) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(prompt, GREEDY):
        tokens += output.new_token_ids
    return tokens


def oracle(folder: Path, prompt: list[int] = PROMPT) -> list[int]:
    """transformers' greedy tokens for the model saved in `folder`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    return reference_greedy(model, prompt, GREEDY.max_tokens)
