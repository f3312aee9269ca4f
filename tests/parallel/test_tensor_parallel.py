"""Tensor parallelism over two gloo ranks (this process and one worker process): the same
tokens as one rank and as transformers, under chunked prefill and preemption; seeded sampling
alike at both sizes; a dead worker stops the engine with an error, and no process outlives it."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from engine.core.async_engine import AsyncEngine
from engine.core.config import CacheConfig, EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.errors import EngineDeadError, WorkerFailedError
from engine.core.profiling import ProfilerConfig
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import SpeculativeConfig
from engine.factory import create_engine_core
from engine.parallel.workers import WorkerPool
from tests.core.test_engine_greedy import record_chunking
from tests.core.test_profiling import trace_names
from tests.core.test_speculation import ScriptedDrafter
from tests.helpers import chat_tokenizer, reference_greedy, run_all, tiny_llama, tokens_of

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=MAX_NEW, ignore_eos=True)


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (1, 4, 9, 17, 26, 33, 6, 40)]


@pytest.fixture(scope="module")
def references() -> list[list[int]]:
    model = tiny_llama()
    return [reference_greedy(model, prompt, MAX_NEW) for prompt in prompts()]


def config(folder: Path, size: int, num_blocks: int = 128, **options: object) -> EngineConfig:
    return EngineConfig(
        model=str(folder),
        dtype="float32",
        tensor_parallel_size=size,
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        **options,  # type: ignore[arg-type]
    )


@contextmanager
def engine_core(engine_config: EngineConfig) -> Iterator[EngineCore]:
    core, _, _ = create_engine_core(engine_config)
    try:
        yield core
    finally:
        core.close()


def workers_of(core: EngineCore) -> WorkerPool:
    workers = core.runner.workers
    assert workers is not None
    return workers


def all_tokens(core: EngineCore, params: SamplingParams) -> list[list[int]]:
    outputs = run_all(core, prompts(), params)
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked"
    return [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))]


def forked_tokens(core: EngineCore) -> tuple[dict[str, list[int]], bool]:
    """Two sampled sequences of one prompt (`n=2`: the second shares the first's prompt
    blocks, its partial last block copied); their tokens, and whether a step copied blocks."""
    copied = False
    schedule = core.scheduler.schedule

    def spy():
        nonlocal copied
        output = schedule()
        copied = copied or bool(output.block_copies)
        return output

    core.scheduler.schedule = spy  # type: ignore[method-assign]
    prompt = list(range(10, 23))  # 13 tokens: the last block of 4 is partly filled
    for index, name in enumerate("ab"):
        params = SamplingParams(temperature=0.8, seed=index, max_tokens=8, ignore_eos=True)
        fork = "a" if index else None
        core.add_request(name, prompt, params, "p", index, fork_of=fork, siblings=2)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    while core.has_unfinished():
        for output in core.step():
            tokens["ab"[output.index]] += output.new_token_ids
    core.scheduler.schedule = schedule  # type: ignore[method-assign]
    return tokens, copied


def test_two_ranks_give_one_ranks_tokens(model_dir, references):
    with engine_core(config(model_dir, 1)) as one:
        one_greedy, one_seeded = all_tokens(one, GREEDY), all_tokens(one, SEEDED)
        one_forked, _ = forked_tokens(one)
    with engine_core(config(model_dir, 2)) as two:
        workers = workers_of(two)
        assert two.runner.model.shard.shape.local_kv_heads == 1
        assert all_tokens(two, GREEDY) == one_greedy == references
        assert all_tokens(two, SEEDED) == one_seeded
        assert one_seeded != one_greedy, "the seeded run sampled"
        two_forked, copied = forked_tokens(two)
        assert copied, "the fork copied a block on every rank"
        assert two_forked == one_forked and two_forked["a"] != two_forked["b"]
    assert all(process.exitcode == 0 for process in workers.processes), "workers stopped cleanly"


def test_chunked_prefill_and_preemption_across_ranks(model_dir, references):
    tight = config(model_dir, 2, num_blocks=24, max_num_batched_tokens=16)
    with engine_core(tight) as core:
        chunked = record_chunking(core)
        assert all_tokens(core, GREEDY) == references
        assert core.scheduler.num_preemptions > 0
        assert any(chunked)


def test_overlapped_steps_across_ranks(model_dir, references):
    """Async scheduling: each step's placeholders take the tokens rank 0 broadcasts from its
    previous step, on every rank; seeded sampling and preemption as in turn."""
    with engine_core(config(model_dir, 1)) as one:
        one_seeded = all_tokens(one, SEEDED)
    tight = config(model_dir, 2, num_blocks=24, async_scheduling=True)
    with engine_core(tight) as core:
        assert core.overlap
        sent = spy_sent(core)
        assert all_tokens(core, GREEDY) == references
        assert core.scheduler.num_preemptions > 0
        assert all_tokens(core, SEEDED) == one_seeded
    assert any(len(inputs.previous_rows) for inputs in sent), "no step took a placeholder"


def spy_sent(core: EngineCore) -> list:
    """Every step description rank 0 sends to the workers."""
    workers, sent = workers_of(core), []
    send = workers.send

    def spy(inputs):
        sent.append(inputs)
        send(inputs)

    workers.send = spy  # type: ignore[method-assign]
    return sent


def test_calibrated_fp8_scales_are_the_same_on_every_rank(tmp_path):
    """Calibrated on the first step, each layer's scales are the largest over all ranks' heads,
    so two ranks store K/V as one rank does and give its tokens. K here reach far past e5m2's
    largest value (57344): a rank left with scales of 1.0 saturates them and answers otherwise."""
    model = tiny_llama()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1e5)
    model.save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)

    def tokens(size: int, calibrate: bool) -> list[list[int]]:
        cache = CacheConfig(
            block_size=4, num_blocks=128, dtype="fp8_e5m2", calculate_kv_scales=calibrate
        )
        options = dict(dtype="float32", attention_backend="torch", cache=cache)
        engine = EngineConfig(model=str(tmp_path), tensor_parallel_size=size, **options)
        with engine_core(engine) as core:
            return all_tokens(core, GREEDY)

    one = tokens(1, calibrate=True)
    assert tokens(2, calibrate=True) == one
    assert tokens(1, calibrate=False) != one


def test_a_forward_pass_that_fails_on_rank_0_stops_the_engine(model_dir, monkeypatch):
    """Rank 0 fails inside the step, after the workers started it: the ranks no longer agree,
    so the step is not retried in halves; the engine stops and the workers go."""
    core, _, _ = create_engine_core(config(model_dir, 2))
    workers = workers_of(core)
    try:
        head = core.runner.model.lm_head

        def broken(hidden):
            raise RuntimeError("boom")

        monkeypatch.setattr(head, "forward", broken)
        core.add_request("r", [5, 6, 7], GREEDY)
        with pytest.raises(WorkerFailedError, match="the step failed on rank 0: boom"):
            core.step()
    finally:
        core.close()
    assert not any(process.is_alive() for process in workers.processes)
    assert multiprocessing.active_children() == []


def test_a_model_that_does_not_divide_is_refused_before_any_worker_starts(model_dir, monkeypatch):
    started = []
    monkeypatch.setattr(WorkerPool, "start", lambda *args: started.append(args))
    with pytest.raises(ValueError, match="4 attention heads do not divide by 3"):
        create_engine_core(config(model_dir, 3))
    assert started == [] and multiprocessing.active_children() == []


def test_the_transformers_implementation_is_refused_before_any_worker_starts(model_dir):
    with pytest.raises(ValueError, match="Conveyor's model implementation only"):
        create_engine_core(config(model_dir, 2, model_impl="transformers"))
    assert multiprocessing.active_children() == []


async def test_a_killed_worker_fails_its_requests_and_stops_the_engine(model_dir):
    core, _, info = create_engine_core(config(model_dir, 2))
    assert info.tensor_parallel_size == 2
    engine = AsyncEngine(core, info)
    await engine.start()
    worker = workers_of(core).processes[0]
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    received = 0
    try:
        with pytest.raises(WorkerFailedError, match="rank 1 exited with code -9"):
            async with asyncio.timeout(120):  # a hang guard, not a timing
                async for output in engine.generate([5, 6, 7], long):
                    received += len(output.new_token_ids)
                    if received >= 3 and worker.is_alive():
                        os.kill(worker.pid, signal.SIGKILL)
        assert 3 <= received < 400
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="rank 1"):
            engine.submit([5], GREEDY)
    finally:
        await engine.shutdown()
    assert multiprocessing.active_children() == []


def test_drafts_verified_across_ranks(model_dir, references):
    """Speculation: a step's draft rows run on every rank as decode rows, and the greedy
    tokens stay one rank's."""
    spec = SpeculativeConfig(3, 1, 1, disable_by_batch_size=64)
    with engine_core(config(model_dir, 2, num_blocks=48, speculative=spec)) as core:
        truths = {f"req-{i}": truth for i, truth in enumerate(references)}
        core.drafter = ScriptedDrafter(truths, 3, 3, limit=64)
        assert all_tokens(core, GREEDY) == references
        drafts = core.take_stats().drafts
        assert 0 < drafts.num_accepted_tokens < drafts.num_draft_tokens


def test_every_rank_records_the_profile_rank_0_is_asked_for(model_dir, references, tmp_path):
    traces = ProfilerConfig("torch", str(tmp_path), torch_profiler_with_stack=False)
    with engine_core(config(model_dir, 2, profiler=traces)) as core:
        assert core.profiler is not None
        core.profiler.start()
        assert all_tokens(core, GREEDY) == references
        recording = core.profiler.stop()
        assert recording is not None
        rank_0 = recording.save()
        deadline = time.monotonic() + 60  # rank 1 saves on a thread of its own: a hang guard
        while not list(tmp_path.glob("*rank1*.summary.txt")) and time.monotonic() < deadline:
            time.sleep(0.05)
    [rank_1] = tmp_path.glob("*rank1*.pt.trace.json.gz")
    for trace in (rank_0[0], rank_1):
        names = trace_names(str(trace))
        # Each rank's share of the model, and the all-reduces that join the shares.
        assert "aten::embedding" in names and any("all_reduce" in n for n in names), trace


def test_rank_0_warns_where_the_ranks_caches_together_outgrow_the_host(
    model_dir, monkeypatch, caplog
):
    """Both ranks' CPU caches live in one host's memory: a budget each rank's cache fits alone
    but the two together do not is warned about, once."""
    from engine.worker import host_memory

    budget = 4 << 20
    monkeypatch.setattr(host_memory, "available_bytes", lambda: budget + budget // 2)
    with caplog.at_level(logging.WARNING, logger="engine.worker.host_memory"):
        cache = CacheConfig(block_size=4, kv_cache_memory=budget)
        two_ranks = EngineConfig(
            model=str(model_dir), dtype="float32", tensor_parallel_size=2, cache=cache
        )
        with engine_core(two_ranks) as core:
            assert core.runner.kv_cache.num_bytes > budget * 3 // 4
    assert caplog.text.count("the KV caches of 2 ranks take") == 1, caplog.text
