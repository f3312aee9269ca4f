"""New weights while serving (`AsyncEngine.reload_weights`): greedy tokens follow transformers
on the new weights, the prefix cache of the old ones is forgotten, and a checkpoint that does
not fit is refused with the old weights still served."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.config import CacheConfig, EngineConfig
from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams
from tests.conftest import DEVICES
from tests.helpers import chat_tokenizer, reference_greedy, tiny_core, tiny_llama

PROMPT = [5, 9, 33, 2, 17, 40, 41, 42, 43]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served checkpoint (with its tokenizer), a trainer's next one of the same shape
    (weights and config only), and two that do not fit it."""
    made = {
        "served": tiny_llama(seed=0),
        "next": tiny_llama(seed=1),
        "deeper": tiny_llama(num_layers=3),
        "other_vocab": tiny_llama(vocab_size=352),
    }
    folders = {}
    for name, model in made.items():
        folders[name] = tmp_path_factory.mktemp(name)
        model.save_pretrained(folders[name])
    chat_tokenizer().save_pretrained(folders["served"])
    return folders


@pytest.fixture(params=DEVICES)
async def engine(folders, request):
    """The served checkpoint loaded as `conveyor serve` loads it; on a GPU its steps replay
    CUDA graphs, captured again over new weights."""
    config = EngineConfig(
        model=str(folders["served"]),
        dtype="float32",
        device=request.param,
        cache=CacheConfig(num_blocks=64),
    )
    engine = AsyncEngine.from_config(config)
    await engine.start()
    yield engine
    await engine.shutdown()


async def greedy(engine: AsyncEngine, prompt=PROMPT) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(prompt, GREEDY):
        tokens += output.new_token_ids
    return tokens


def oracle(folder: Path, prompt=PROMPT) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32").eval()
    return reference_greedy(model, prompt, GREEDY.max_tokens)


async def test_greedy_tokens_follow_the_new_weights(engine, folders):
    served = oracle(folders["served"])
    assert served != oracle(folders["next"])  # the two checkpoints answer differently
    assert await greedy(engine) == served
    await engine.reload_weights(str(folders["next"]), "step-1")
    assert await greedy(engine) == oracle(folders["next"])
    assert engine.weight_version == "step-1"
    await engine.reload_weights(str(folders["served"]))
    assert await greedy(engine) == served
    assert engine.weight_version == "step-1"  # no version given: the last one stays


async def test_the_old_weights_prefix_cache_is_forgotten(engine, folders):
    long_prompt = list(range(60, 100))
    await greedy(engine, long_prompt)
    blocks = engine.core.scheduler.block_manager
    assert blocks.num_cached_blocks > 0
    await engine.reload_weights(str(folders["next"]))
    assert blocks.num_cached_blocks == 0
    assert await greedy(engine, long_prompt) == oracle(folders["next"], long_prompt)


@pytest.mark.parametrize(
    ("name", "refusal"),
    [
        ("deeper", "do not fit the KV cache sized at start-up: 3 layers"),
        ("other_vocab", "not the served model's shape"),
        ("absent", "is not a checkpoint folder"),
    ],
)
async def test_a_checkpoint_that_does_not_fit_is_refused_and_the_old_one_serves(
    engine, folders, name, refusal
):
    path = folders.get(name, folders["served"] / "absent")
    with pytest.raises(InvalidRequestError, match=refusal) as refused:
        await engine.reload_weights(str(path), "bad")
    assert refused.value.param == "model_path" and engine.weight_version is None
    assert await greedy(engine) == oracle(folders["served"])


async def test_an_engine_with_adapters_refuses_new_weights(tiny_model, folders):
    engine = AsyncEngine(*tiny_core(tiny_model, enable_lora=True))
    await engine.start()
    try:
        with pytest.raises(InvalidRequestError, match="--enable-lora"):
            await engine.reload_weights(str(folders["next"]))
    finally:
        await engine.shutdown()
