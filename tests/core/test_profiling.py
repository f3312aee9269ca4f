"""Step profiles on demand: vLLM's `--profiler-config` read and checked; a profile that starts
after its delay and stops after its steps; torch's trace of the step thread, with the model's
operators in it, written where the config says."""

from __future__ import annotations

import gzip
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from engine.core.async_engine import AsyncEngine
from engine.core.profiling import ProfilerConfig, ProfilerStateError, StepProfiler
from engine.core.sampling_params import SamplingParams
from tests.helpers import tiny_core
from tests.server_utils import until

GREEDY = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)


def test_the_config_takes_vllms_fields_and_refuses_the_rest(tmp_path):
    config = ProfilerConfig.of(
        {"profiler": "torch", "torch_profiler_dir": "traces", "max_iterations": 3}
    )
    assert config.enabled and config.max_iterations == 3 and Path(config.folder).is_absolute()
    assert not ProfilerConfig.of({}).enabled
    for fields, message in [
        ({"profiler": "torch", "unknown": 1}, "unknown profiler config fields: unknown"),
        ({"profiler": "torch", "torch_profiler_dir": "t", "max_iterations": "3"}, "integer"),
        ({"profiler": "torch", "torch_profiler_dir": "t", "delay_iterations": True}, "integer"),
        ({"profiler": "torch", "torch_profiler_dir": "t", "ignore_frontend": 1}, "bool"),
        ({"profiler": "torch", "torch_profiler_dir": "t", "max_iterations": -1}, "0 or more"),
        ({"profiler": "torch"}, "needs torch_profiler_dir"),
        ({"profiler": "cuda", "torch_profiler_dir": "t"}, "unknown profiler 'cuda'"),
    ]:
        with pytest.raises(ValueError, match=message):
            ProfilerConfig.of(fields)


class Counted:
    """A recorder that notes when it starts and stops, counted in steps."""

    def __init__(self, log: list[str], fail: bool = False) -> None:
        self.log, self.fail = log, fail

    def start(self) -> None:
        if self.fail:
            raise RuntimeError("no profiler here")
        self.log.append("start")

    def stop(self) -> Counted:
        self.log.append("stop")
        return self

    def save(self) -> list[str]:
        return []


def ticks(profiler: StepProfiler, log: list[str], steps: int) -> list:
    """What `steps` steps see: the log after each, and any recording a tick ended."""
    seen = []
    for step in range(steps):
        log.append(f"step {step}")
        if profiler.tick() is not None:
            seen.append(f"saved after step {step}")
    return seen


def test_a_profile_starts_after_its_delay_and_stops_after_its_steps():
    log: list[str] = []
    config = ProfilerConfig("torch", "t", delay_iterations=2, max_iterations=3)
    profiler = StepProfiler(config, lambda: Counted(log))
    profiler.start()
    assert log == [] and profiler.active
    assert ticks(profiler, log, 7) == ["saved after step 4"]
    assert log == [
        "step 0",
        "step 1",
        "start",  # after two steps...
        "step 2",
        "step 3",
        "step 4",
        "stop",  # ...for three
        "step 5",
        "step 6",
    ]
    assert not profiler.active


def test_a_profile_runs_until_stopped_and_one_at_a_time():
    log: list[str] = []
    profiler = StepProfiler(ProfilerConfig("torch", "t"), lambda: Counted(log))
    with pytest.raises(ProfilerStateError, match="not running"):
        profiler.stop()
    profiler.start()
    with pytest.raises(ProfilerStateError, match="already running"):
        profiler.start()
    assert ticks(profiler, log, 50) == []
    assert profiler.stop() is not None and log[0] == "start" and log[-1] == "stop"
    # Stopped before its delay ran out: nothing was recorded, nothing to save.
    delayed = StepProfiler(ProfilerConfig("torch", "t", delay_iterations=5), lambda: Counted(log))
    delayed.start()
    ticks(delayed, log, 2)
    assert delayed.stop() is None and not delayed.active


def test_a_profiler_that_cannot_start_leaves_the_steps_running(caplog):
    log: list[str] = []
    config = ProfilerConfig("torch", "t", delay_iterations=1)
    profiler = StepProfiler(config, lambda: Counted(log, fail=True))
    profiler.start()
    assert ticks(profiler, log, 3) == []
    assert not profiler.active and "the profiler failed to start" in caplog.text


def trace_names(path: str) -> set[str]:
    with gzip.open(path, "rt") as file:
        return {event.get("name", "") for event in json.load(file)["traceEvents"]}


@asynccontextmanager
async def profiled(tiny_model, folder: Path, **options) -> AsyncIterator[AsyncEngine]:
    """A running engine with profiles on demand into `folder`, one request run under a
    profile started first; shut down on leaving."""
    config = ProfilerConfig("torch", str(folder), torch_profiler_with_stack=False, **options)
    engine = AsyncEngine(*tiny_core(tiny_model, profiler=config))
    await engine.start()
    try:
        await engine.start_profile()
        async for _ in engine.generate([5, 6, 7, 8], GREEDY):
            pass
        yield engine
    finally:
        await engine.shutdown()


async def test_the_trace_holds_the_step_threads_operators(tiny_model, tmp_path):
    async with profiled(tiny_model, tmp_path) as engine:
        assert engine.info.profiling
        trace, summary = await engine.stop_profile()
        # The model's own operators, run on the step thread, not only this thread's.
        names = trace_names(trace)
        assert "aten::embedding" in names and any(n.startswith("aten::") for n in names)
        assert Path(trace).parent == tmp_path and "Self CPU" in Path(summary).read_text()
        with pytest.raises(ProfilerStateError, match="not running"):
            await engine.stop_profile()


async def test_a_profile_of_so_many_steps_saves_itself(tiny_model, tmp_path):
    async with profiled(tiny_model, tmp_path, max_iterations=2) as engine:
        # Saved off the step thread: a hang guard, not a timing.
        await until(lambda: any(tmp_path.glob("*.summary.txt")), 60, "the saved profile")
        [trace] = tmp_path.glob("*.pt.trace.json.gz")
        assert "aten::embedding" in trace_names(str(trace))
        with pytest.raises(ProfilerStateError, match="not running"):
            await engine.stop_profile()


async def test_profiling_is_refused_unless_configured(tiny_model):
    engine = AsyncEngine(*tiny_core(tiny_model))
    await engine.start()
    try:
        assert not engine.info.profiling
        with pytest.raises(ProfilerStateError, match="--profiler-config"):
            await engine.start_profile()
    finally:
        await engine.shutdown()


async def test_a_profile_running_at_shutdown_is_saved(tiny_model, tmp_path):
    async with profiled(tiny_model, tmp_path):
        pass  # left running
    [trace] = tmp_path.glob("*.pt.trace.json.gz")
    assert "aten::embedding" in trace_names(str(trace))
