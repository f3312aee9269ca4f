"""Plain-data scheduler harness: no torch, a fake runner that samples token 7."""

from __future__ import annotations

from engine.core.config import SchedulerConfig
from engine.core.outputs import ModelRunnerOutput
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kv.block_manager import BlockManager
from engine.scheduling.scheduler import Scheduler, SchedulerOutput

FAKE_TOKEN = 7


def create_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 128,
    enable_caching: bool = False,
    clock=None,
    **config: object,
) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=max_model_len, **config),
        BlockManager(num_blocks, block_size, enable_caching),
    )
    if clock is not None:
        scheduler.clock = clock
    return scheduler


def create_request(
    request_id: str, prompt_len: int, max_tokens: int = 4, **params: object
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=[100 + i for i in range(prompt_len)],
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        arrival_time=0.0,
        max_total_tokens=10**9,
        eos_token_ids=frozenset({0}),
    )


def fake_runner_output(output: SchedulerOutput, token: int = FAKE_TOKEN) -> ModelRunnerOutput:
    """Sample `token` for each request whose chunk reaches its last known token."""
    result = ModelRunnerOutput()
    for item in output.scheduled:
        if item.completes_sequence:
            result.sampled_token_ids[item.request.request_id] = token
    return result


def step(scheduler: Scheduler, token: int = FAKE_TOKEN) -> SchedulerOutput:
    output = scheduler.schedule()
    scheduler.update_from_output(output, fake_runner_output(output, token))
    scheduler.check_invariants()
    return output


def drain(scheduler: Scheduler) -> None:
    """Step until every request has finished (invariants checked after each step)."""
    while scheduler.has_unfinished():
        step(scheduler)


def scheduled_counts(output: SchedulerOutput) -> dict[str, int]:
    return {item.request.request_id: item.num_tokens for item in output.scheduled}
