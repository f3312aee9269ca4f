"""Sleep mode (`--enable-sleep-mode`): the engine gives its memory back and takes it again,
serving transformers' greedy tokens after each wake-up."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import SamplingParams
from engine.worker.sleep_mode import DiscardedModel
from tests.conftest import DEVICES
from tests.saved_models import PROMPT, engine_on, greedy, oracle, saved_llama

LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        "served": saved_llama(tmp_path_factory.mktemp("served"), with_tokenizer=True, seed=0),
        "next": saved_llama(tmp_path_factory.mktemp("next"), seed=2),
    }


@pytest.fixture(params=DEVICES)
async def engine(folders, request):
    options = {"device": request.param, "enable_sleep_mode": True}
    async with engine_on(folders["served"], **options) as engine:
        yield engine


@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_gives_the_cache_back_and_the_wake_up_serves_the_same_tokens(
    engine, folders, level
):
    runner = engine.core.runner
    before = await greedy(engine)
    assert before == oracle(folders["served"])
    await engine.sleep(level)
    assert engine.is_sleeping and runner.kv_cache.released
    assert runner.kv_cache.num_bytes == 0
    assert isinstance(runner.model, DiscardedModel) == (level == 2)
    await engine.wake_up()
    assert not engine.is_sleeping and not engine.is_paused
    assert await greedy(engine) == before


async def test_requests_in_flight_are_aborted_and_new_ones_wait_for_the_wake_up(engine):
    stream = engine.generate(PROMPT, LONG)
    first = await stream.__anext__()
    await engine.sleep(1)
    rest = [output async for output in stream]
    assert rest[-1].finish_reason == "abort" and not first.finished
    waiting = asyncio.ensure_future(greedy(engine))
    for _ in range(5):
        await asyncio.sleep(0.01)
    assert not waiting.done()
    await engine.resume()  # asleep, the resume takes effect at the wake-up
    assert engine.is_sleeping and not waiting.done()
    await engine.wake_up(("kv_cache",))
    await engine.wake_up(("weights",))
    assert len(await waiting) == 8


async def test_new_weights_loaded_while_asleep_wake_the_weights(engine, folders):
    await engine.sleep(2)
    await engine.reload_weights(str(folders["next"]))
    assert engine.is_sleeping  # the KV cache still sleeps
    await engine.wake_up(("kv_cache",))
    assert not engine.is_sleeping
    assert await greedy(engine) == oracle(folders["next"])


async def test_a_pause_of_the_caller_s_own_outlasts_the_wake_up(engine):
    await engine.pause("abort")
    await engine.sleep(1)
    await engine.wake_up()
    assert engine.is_paused and not engine.is_sleeping
    await engine.resume()
    assert len(await greedy(engine)) == 8


async def test_bad_levels_and_tags_are_refused(engine):
    with pytest.raises(InvalidRequestError, match="level must be 1 or 2"):
        await engine.sleep(3)
    await engine.sleep(1)
    with pytest.raises(InvalidRequestError, match="tags must be among"):
        await engine.wake_up(("optimizer",))
    assert engine.is_sleeping
    await engine.wake_up()


async def test_without_the_flag_the_engine_does_not_sleep(folders):
    async with engine_on(folders["served"]) as engine:
        with pytest.raises(InvalidRequestError, match="--enable-sleep-mode"):
            await engine.sleep(1)
        assert not engine.is_sleeping and not engine.is_paused


async def test_a_resume_while_falling_asleep_waits_for_the_wake_up(engine):
    stream = engine.generate(PROMPT, LONG)
    await stream.__anext__()
    sleeping = asyncio.ensure_future(engine.sleep(1))
    await asyncio.sleep(0)
    await engine.resume()
    await sleeping
    assert engine.is_sleeping and engine.is_paused
    assert [output async for output in stream][-1].finish_reason == "abort"
    await engine.wake_up()
    assert not engine.is_paused and len(await greedy(engine)) == 8
