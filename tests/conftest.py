from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors. The variable must be
# set before triton.language is first imported (transformers imports it), so it comes first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.kernels.cpu import ops as cpu_ops
from tests.helpers import tiny_llama

# pytest-xdist runs the suite in `-n auto` workers (pyproject's addopts): as many as the CPUs, at
# most MAX_WORKERS (each holds torch and its own models, and many start servers).
MAX_WORKERS = 4


def usable_cpus() -> int:
    """The CPUs this process may run on (all of the machine's where the OS cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return min(usable_cpus(), MAX_WORKERS)


def worker_threads() -> int:
    """Each worker's share of the CPUs: OpenMP threads that outnumber the cores spin against each
    other's workers (a parallel region waits for its slowest thread)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, usable_cpus() // workers)


if "PYTEST_XDIST_WORKER" in os.environ:
    # The servers and ranks that tests start inherit the share too.
    os.environ["OMP_NUM_THREADS"] = str(worker_threads())
    torch.set_num_threads(worker_threads())


@pytest.fixture
def split_threads() -> Iterator[int]:
    """Run a test's kernels on at least two threads, whatever each worker's share, so that the
    kernels' splits of their work across threads run on every machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield torch.get_num_threads()
    torch.set_num_threads(before)


CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.cuda,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ],
)
DEVICES = ["cpu", CUDA]
# Where Triton kernels run: the GPU, else the interpreter on the CPU. Triton installs on Linux
# x86-64 only (a dev extra there); elsewhere its tests are skipped.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed on this platform"
)


@pytest.fixture(params=["tiles", "dot_products"])
def bf16_products(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with the bf16 products in AMX tiles (CPUs with AMX-BF16) and again in AVX-512
    BF16 dot products, as on CPUs without AMX."""
    tiles = request.param == "tiles"
    if tiles and not cpu_ops.bf16_tiles_available():
        pytest.skip("this CPU has no AMX-BF16 tiles")
    before = cpu_ops.use_bf16_tiles(tiles)
    yield request.param
    cpu_ops.use_bf16_tiles(before)


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
