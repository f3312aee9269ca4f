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
