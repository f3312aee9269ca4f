from __future__ import annotations

import pytest
import torch

from tests.helpers import tiny_llama

CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.cuda,
           pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
)
DEVICES = ["cpu", CUDA]


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
