"""Pausing and resuming generation between two steps (`AsyncEngine.pause` / `resume`)."""

from __future__ import annotations

import asyncio

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.errors import EngineDeadError, InvalidRequestError
from engine.core.pausing import PauseInterruptedError
from engine.core.sampling_params import SamplingParams
from tests.core.test_async_engine import blocks_in_use
from tests.helpers import run_all, tiny_core, tiny_tokenizer, tokens_of

PROMPT = tiny_tokenizer().encode("Hello there. How are you", add_special_tokens=False)
OTHER = PROMPT[:5]
LONG = SamplingParams(temperature=0, ignore_eos=True, max_tokens=60)


def expected(tiny_model, prompt, params=LONG) -> list[int]:
    core, _ = tiny_core(tiny_model)
    return tokens_of(run_all(core, [prompt], params)["req-0"])


async def started(engine: AsyncEngine, prompt=PROMPT, request_id=None, params=LONG):
    """A stream that has had its first delta, and that delta."""
    stream = engine.generate(prompt, params, request_id)
    return stream, [await stream.__anext__()]


async def drain(stream, outputs) -> list:
    return outputs + [output async for output in stream]


async def idle_ticks(engine: AsyncEngine, count: int = 20) -> None:
    """Let the loop run (and step, were it stepping) a while."""
    for _ in range(count):
        engine._wake_loop()
        await asyncio.sleep(0.005)


async def test_keep_freezes_requests_in_flight_and_they_go_on_unchanged(engine, tiny_model):
    stream, outputs = await started(engine)
    await engine.pause("keep")
    assert engine.is_paused and engine.core.has_unfinished()
    frozen = engine.core.scheduler.requests[stream_id(engine)].num_output_tokens
    await idle_ticks(engine)
    assert engine.core.scheduler.requests[stream_id(engine)].num_output_tokens == frozen
    await engine.resume()
    outputs = await drain(stream, outputs)
    assert tokens_of(outputs) == expected(tiny_model, PROMPT)
    assert outputs[-1].finish_reason == "length" and blocks_in_use(engine) == 0


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
async def test_each_mode_under_overlapped_steps(tiny_model, mode):
    """With async scheduling a step may be under way inside the core when the pause comes:
    a frozen request still continues unchanged, and aborted or finished ones free their
    blocks."""
    engine = AsyncEngine(*tiny_core(tiny_model, async_scheduling=True))
    await engine.start()
    try:
        stream, outputs = await started(engine)
        pausing = asyncio.ensure_future(engine.pause(mode))
        if mode == "wait":
            outputs = await drain(stream, outputs)
        await pausing
        await engine.resume()
        outputs = await drain(stream, outputs)
        want = "abort" if mode == "abort" else "length"
        assert outputs[-1].finish_reason == want
        if mode != "abort":
            assert tokens_of(outputs) == expected(tiny_model, PROMPT)
        assert blocks_in_use(engine) == 0
    finally:
        await engine.shutdown()


def stream_id(engine: AsyncEngine) -> str:
    (request_id,) = engine.core.scheduler.requests
    return request_id


async def test_requests_arriving_while_paused_wait_for_the_resume(engine, tiny_model):
    await engine.pause("abort")
    held = engine.generate(OTHER, LONG, "late")
    first = asyncio.ensure_future(held.__anext__())
    await idle_ticks(engine)
    assert not first.done() and not engine.core.has_unfinished()
    assert engine.num_unfinished == 1
    await engine.resume()
    outputs = await drain(held, [await first])
    assert tokens_of(outputs) == expected(tiny_model, OTHER)
    assert not engine.is_paused and blocks_in_use(engine) == 0


async def test_abort_ends_requests_in_flight_and_forgets_the_cache(engine):
    stream, outputs = await started(engine)
    await engine.pause("abort")
    outputs = await drain(stream, outputs)
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"
    assert blocks_in_use(engine) == 0 and not engine.core.has_unfinished()
    assert await engine.reset_prefix_cache() == 0  # nothing cached was left to forget
    await engine.resume()


@pytest.mark.parametrize("clear_cache", [True, False])
async def test_wait_lets_requests_in_flight_finish(engine, tiny_model, clear_cache):
    stream, outputs = await started(engine)
    pausing = asyncio.ensure_future(engine.pause("wait", clear_cache))
    await asyncio.sleep(0)
    late = engine.generate(OTHER, LONG)  # arrives during the drain: held
    late_first = asyncio.ensure_future(late.__anext__())
    outputs = await drain(stream, outputs)
    await pausing
    assert tokens_of(outputs) == expected(tiny_model, PROMPT)
    assert outputs[-1].finish_reason == "length" and not late_first.done()
    forgotten = await engine.reset_prefix_cache()
    assert (forgotten == 0) == clear_cache
    await engine.resume()
    assert tokens_of(await drain(late, [await late_first])) == expected(tiny_model, OTHER)


async def test_a_resume_before_the_pause_took_effect_interrupts_it(engine):
    stream, _ = await started(engine)
    pausing = asyncio.ensure_future(engine.pause("wait"))
    await asyncio.sleep(0)
    await engine.resume()
    with pytest.raises(PauseInterruptedError):
        await pausing
    assert not engine.is_paused
    await stream.aclose()


async def test_keep_over_a_draining_pause_freezes_at_once(engine):
    stream, _ = await started(engine)
    draining = asyncio.ensure_future(engine.pause("wait"))
    await engine.pause("keep")
    await draining  # it returns with the freeze, its request still in flight
    assert engine.core.has_unfinished()
    await engine.resume()
    await stream.aclose()


async def test_a_request_left_while_held_never_runs(engine):
    await engine.pause("keep")
    held = engine.generate(OTHER, LONG)
    first = asyncio.ensure_future(held.__anext__())
    await asyncio.sleep(0)
    first.cancel()  # the client went away: the stream aborts its request
    with pytest.raises(asyncio.CancelledError):
        await first
    await idle_ticks(engine, 3)
    assert engine._held == [] and engine.num_unfinished == 0
    await engine.resume()
    await idle_ticks(engine, 3)
    assert not engine.core.has_unfinished() and blocks_in_use(engine) == 0


async def test_shutdown_while_paused_ends_held_and_frozen_requests(tiny_model):
    engine = AsyncEngine(*tiny_core(tiny_model))
    await engine.start()
    stream, outputs = await started(engine)
    await engine.pause("keep")
    held = engine.generate(OTHER, LONG)
    held_first = asyncio.ensure_future(held.__anext__())
    await asyncio.sleep(0)
    await engine.shutdown()
    assert (await drain(stream, outputs))[-1].finish_reason == "abort"
    with pytest.raises(EngineDeadError):
        await held_first
    assert blocks_in_use(engine) == 0


async def test_an_unknown_mode_is_refused(engine):
    with pytest.raises(InvalidRequestError) as refused:
        await engine.pause("later")
    assert refused.value.param == "mode" and not engine.is_paused


async def test_abort_requests_by_the_ids_clients_see(engine):
    """A reply's id names the engine's ids under it (a suffix of the server's own where the
    client chose the id, one per prompt), never another request whose id merely starts so."""
    ids = ["cmpl-x-0a1b2c3d", "cmpl-x-0a1b2c3d-1", "cmpl-xy", "cmpl-x-other"]
    streams = [(await started(engine, OTHER, rid))[0] for rid in ids]
    assert sorted(engine.abort_requests(["cmpl-x"])) == ids[:2]
    assert engine.abort_requests([]) == []
    assert sorted(engine.abort_requests(None)) == sorted(ids)
    for stream in streams:
        outputs = [output async for output in stream]
        assert outputs[-1].finish_reason == "abort"
    assert blocks_in_use(engine) == 0
