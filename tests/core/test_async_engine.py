"""The asyncio engine loop on a tiny model."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.errors import EngineDeadError, QueueFullError, RequestFailedError
from engine.core.sampling_params import SamplingParams
from tests.helpers import run_all, sabotage_steps, tiny_core, tiny_tokenizer, tokens_of

PROMPT = tiny_tokenizer().encode("Hello there. How are you", add_special_tokens=False)
GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=10)


async def collect(
    engine: AsyncEngine,
    params: SamplingParams = GREEDY,
    prompt=PROMPT,
    request_id: str | None = None,
) -> dict[int, list]:
    per_index: dict[int, list] = {}
    async for output in engine.generate(prompt, params, request_id):
        per_index.setdefault(output.index, []).append(output)
    return per_index


def blocks_in_use(engine: AsyncEngine) -> int:
    return engine.core.scheduler.block_manager.num_used_blocks


async def test_generate_streams_the_same_tokens_as_the_core(engine, tiny_model):
    reference_core, _ = tiny_core(tiny_model)
    expected = tokens_of(run_all(reference_core, [PROMPT], GREEDY)["req-0"])
    outputs = (await collect(engine))[0]
    assert tokens_of(outputs) == expected
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert blocks_in_use(engine) == 0


async def test_concurrent_requests_all_complete(engine):
    results = await asyncio.gather(*(collect(engine, prompt=PROMPT[: 3 + i]) for i in range(8)))
    assert all(len(tokens_of(r[0])) == 10 for r in results)
    assert blocks_in_use(engine) == 0 and engine.num_unfinished == 0


async def test_leaving_the_stream_early_aborts_and_frees_blocks(engine):
    stream = engine.generate(PROMPT, SamplingParams(temperature=0, ignore_eos=True, max_tokens=200))
    async for _ in stream:
        assert blocks_in_use(engine) > 0
        break
    await stream.aclose()
    for _ in range(100):
        if blocks_in_use(engine) == 0:
            break
        await asyncio.sleep(0.01)
    assert blocks_in_use(engine) == 0
    assert not engine.core.has_unfinished()


async def test_cancelled_consumer_aborts(engine):
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True)):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if not engine.core.has_unfinished():
            break
        await asyncio.sleep(0.01)
    assert blocks_in_use(engine) == 0


async def test_n_samples_stream_with_their_own_index(engine):
    params = SamplingParams(n=3, seed=11, max_tokens=6, ignore_eos=True)
    results = await collect(engine, params)
    assert sorted(results) == [0, 1, 2]
    assert all(r[-1].finished and len(tokens_of(r)) == 6 for r in results.values())
    # Sample i draws from seed + i: sample 0 equals a single request with the same seed.
    single = await collect(engine, SamplingParams(seed=11, max_tokens=6, ignore_eos=True))
    assert tokens_of(single[0]) == tokens_of(results[0])
    assert blocks_in_use(engine) == 0


async def test_the_largest_seed_s_samples_wrap_around(engine):
    """Seed 2^64 - 1 with n = 3 draws from seeds 2^64 - 1, 0 and 1 (it failed as out of range)."""
    results = await collect(engine, SamplingParams(n=3, seed=2**64 - 1, max_tokens=6))
    assert sorted(results) == [0, 1, 2]
    wrapped = await collect(engine, SamplingParams(seed=0, max_tokens=6))
    assert tokens_of(wrapped[0]) == tokens_of(results[1])
    assert blocks_in_use(engine) == 0


async def test_fail_all_ends_every_stream_with_the_error_and_frees_its_blocks(engine):
    long = SamplingParams(temperature=0, ignore_eos=True, max_tokens=500, n=2)
    streams = [engine.generate(PROMPT, long) for _ in range(3)]
    firsts = [await stream.__anext__() for stream in streams]
    assert all(first.new_token_ids for first in firsts)
    engine.fail_all(EngineDeadError("shutting down"))
    for stream in streams:
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
    await wait_for_idle(engine)
    assert blocks_in_use(engine) == 0 and engine.num_unfinished == 0
    assert engine.is_running


async def wait_for_idle(engine: AsyncEngine) -> None:
    for _ in range(1000):  # a bound, not a timing: the aborts land within a step or two
        if not engine.core.has_unfinished():
            return
        await asyncio.sleep(0.01)


async def test_a_failed_step_raises_in_the_stream_and_the_loop_goes_on(engine, monkeypatch):
    sabotage_steps(engine.core, monkeypatch, fail_on={2})
    received = []
    with pytest.raises(RequestFailedError):
        async for output in engine.generate(PROMPT, GREEDY):
            received.append(output)
    assert len(received) == 1  # the delta before the failure still arrived
    assert engine.is_running
    assert tokens_of((await collect(engine))[0])
    assert blocks_in_use(engine) == 0


async def test_full_queue_is_refused(tiny_model):
    engine = AsyncEngine(*tiny_core(tiny_model, max_waiting_requests=1))
    await engine.start()
    try:
        first = engine.generate(PROMPT, GREEDY)
        first_task = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError):
            await engine.generate(PROMPT, GREEDY).__anext__()
        await first_task
        await first.aclose()
    finally:
        await engine.shutdown()


async def test_event_loop_stays_responsive_while_stepping(engine):
    ticks = 0
    done = False

    async def ticker():
        nonlocal ticks
        while not done:
            ticks += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(ticker())
    steps = 0
    async for _ in engine.generate(PROMPT, SamplingParams(max_tokens=40, ignore_eos=True)):
        steps += 1
    done = True
    await task
    assert steps >= 1
    assert ticks > 40  # other coroutines ran between and during the steps


async def test_shutdown_aborts_in_flight_and_refuses_new_requests(tiny_model):
    core, info = tiny_core(tiny_model)
    engine = AsyncEngine(core, info)
    await engine.start()
    stream = engine.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
    first = await stream.__anext__()
    assert not first.finished
    await engine.shutdown()
    rest = [output async for output in stream]
    assert rest and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert core.scheduler.block_manager.num_used_blocks == 0
    with pytest.raises(EngineDeadError):
        await engine.generate(PROMPT, GREEDY).__anext__()
