"""New weights while serving (`AsyncEngine.reload_weights`): greedy tokens follow transformers
on the new weights, the prefix cache of the old ones is forgotten, and a checkpoint that does
not fit is refused with the old weights still served."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.errors import InvalidRequestError
from engine.loading import overrides
from tests.conftest import DEVICES
from tests.helpers import tiny_core
from tests.saved_models import engine_on, greedy, oracle, saved_llama


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served checkpoint (with its tokenizer), a trainer's next one of the same shape
    (weights and config only), and two that do not fit it."""
    made = {
        "served": {"seed": 0, "with_tokenizer": True},
        "next": {"seed": 1},
        "deeper": {"num_layers": 3},
        "other_vocab": {"vocab_size": 352},
        "broken": {"seed": 3},
    }
    folders = {
        name: saved_llama(tmp_path_factory.mktemp(name), **shape) for name, shape in made.items()
    }
    weights = folders["broken"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short, as a crashed copy leaves it
    return folders


@pytest.fixture(params=DEVICES)
async def engine(folders, request):
    """The served checkpoint loaded as `conveyor serve` loads it; on a GPU its steps replay
    CUDA graphs, captured again over new weights."""
    async with engine_on(folders["served"], device=request.param) as engine:
        yield engine


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
        ("broken", "Cannot load weights from .*broken"),
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


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_in_16_bits_new_weights_answer_as_a_server_started_on_them(folders, dtype):
    """Whatever linear form start-up picks for the dtype on this CPU (bf16 panels, fp16
    weights computed in fp32, or torch's own), new weights swapped in answer exactly as a
    server started on them does."""
    tokenizer = str(folders["served"])  # the trainer's folder holds weights alone
    async with engine_on(folders["next"], dtype=dtype, tokenizer=tokenizer) as fresh:
        expected = await greedy(fresh)
    async with engine_on(folders["served"], dtype=dtype) as engine:
        assert await greedy(engine) != expected
        await engine.reload_weights(str(folders["next"]))
        assert await greedy(engine) == expected


async def test_new_weights_run_with_the_served_model_s_config_overrides(
    folders, tmp_path, monkeypatch
):
    """Under --hf-overrides the new checkpoint gets the same overrides: it answers as a server
    started on it with them, not as its own config says."""
    monkeypatch.setattr(overrides, "cache_dir", lambda: tmp_path)
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    changed = {
        "hf_overrides": {"max_position_embeddings": 512, "rope_parameters": yarn},
        "tokenizer": str(folders["served"]),
    }
    prompt = list(range(10, 200))
    async with engine_on(folders["next"], **changed) as fresh:
        expected = await greedy(fresh, prompt)
    assert expected != oracle(folders["next"], prompt)  # the override changes the answer
    async with engine_on(folders["served"], **changed) as engine:
        await engine.reload_weights(str(folders["next"]))
        assert await greedy(engine, prompt) == expected
