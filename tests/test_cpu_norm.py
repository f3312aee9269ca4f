"""Conveyor's one-pass CPU RMSNorm against torch's, and where the model uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import cpu_kernels
from engine.models import llama


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_kernels.load(), "the C++ kernels must build on the test machine"


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 7), (17, 64), (300, 576), (5000, 32)])
def test_matches_torch(rows, dim):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, dim) * 3, torch.randn(dim)
    out = cpu_kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), weight, 1e-5), rtol=1e-5, atol=1e-5)


def test_refuses_bad_inputs():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_kernels.rms_norm(x, weight[:4], 1e-5)
    with pytest.raises(RuntimeError, match="must be fp32"):
        cpu_kernels.rms_norm(x.double(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.rms_norm(torch.randn(8, 2).t(), weight, 1e-5)


def test_the_model_takes_it_for_fp32_rows_on_the_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_kernels, "rms_norm",
                        lambda x, w, eps: calls.append(x.shape) or F.rms_norm(x, w.shape, w, eps))
    weight = torch.randn(8)
    llama.rms_norm(torch.randn(4, 8), weight, 1e-6)
    llama.rms_norm(torch.randn(8, 4).t(), weight, 1e-6)  # strided: torch's
    llama.rms_norm(torch.randn(4, 3, 8), weight, 1e-6)  # per-head rows: torch's
    llama.rms_norm(torch.randn(4, 8).bfloat16(), weight.bfloat16(), 1e-6)  # bf16: torch's
    assert calls == [(4, 8)]
