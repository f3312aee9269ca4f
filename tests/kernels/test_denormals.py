"""Subnormal floats flushed to zero on the thread that runs CPU steps and on its team for torch's
parallel ops (`engine/kernels/cpu/denormals.py`, `csrc/elementwise/denormals.cpp`)."""

from __future__ import annotations

import platform
import threading
from collections.abc import Callable

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from tests.helpers import needs_cpu_kernels, run_all, tiny_core

pytestmark = [
    needs_cpu_kernels,
    pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86's MXCSR modes"),
]

SUBNORMAL = 1e-39  # below fp32's smallest normal number, 1.18e-38


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("elementwise"), "the C++ kernels must build on the test machine"


def on_new_thread(work: Callable[[], object]) -> object:
    """`work`'s result on a thread of its own (its team and modes are its own)."""
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(work()))
    thread.start()
    thread.join()
    return found[0]


def kept_subnormals() -> int:
    """How many subnormals a parallel op over a tensor large enough for every thread of the
    team keeps."""
    x = torch.full((1 << 20,), SUBNORMAL)
    return int((x * 1.0).count_nonzero())


def test_the_op_sets_the_mode_on_the_whole_team():
    def work() -> tuple[int, int, int]:
        torch.ops.conveyor.flush_denormals(False)
        kept = kept_subnormals()
        threads = torch.ops.conveyor.flush_denormals(True)
        return kept, threads, kept_subnormals()

    kept, threads, after = on_new_thread(work)  # type: ignore[misc]
    assert kept == 1 << 20 and threads == torch.get_num_threads() and after == 0


def test_a_cpu_step_flushes_on_its_thread():
    """The thread that runs an engine's steps has subnormals flushed from its first step."""
    core, _ = tiny_core()

    def work() -> tuple[int, int]:
        torch.ops.conveyor.flush_denormals(False)
        before = kept_subnormals()
        run_all(core, [[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))
        return before, kept_subnormals()

    before, after = on_new_thread(work)  # type: ignore[misc]
    assert before == 1 << 20 and after == 0
