"""Conveyor's CPU kernel for a prompt chunk through Mamba1's selective scan
(`csrc/recurrent/mamba1_scan.cpp`) against the torch form a token at a time, and where the
mixers use it."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.models import mamba1
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("recurrent"), "the C++ kernels must build on the test machine"


def chunk_inputs(tokens: int, rows: int, channels: int, state_dims: int):
    """Rows side by side as the state cache hands a prompt chunk's over: `[tokens, rows *
    channels]` and `[tokens, rows * state dims]`, the states `[rows * channels, state dims]`."""
    x = torch.randn(tokens, rows * channels)
    steps = torch.rand(tokens, rows * channels)
    b, c = torch.randn(tokens, rows * state_dims), torch.randn(tokens, rows * state_dims)
    a = -torch.rand(channels, state_dims) * 4
    return x, steps, b, c, a, torch.randn(rows * channels, state_dims)


@pytest.mark.parametrize(
    ("tokens", "rows", "channels", "state_dims"),
    [(1, 1, 8, 16), (37, 3, 12, 16), (70, 2, 5, 5), (9, 4, 7, 21)],
)
def test_equals_the_torch_form_token_by_token(tokens, rows, channels, state_dims):
    """The outputs and each row's new states; state dims of whole vectors, a tail, or both."""
    torch.manual_seed(tokens * rows)
    x, steps, b, c, a, held = chunk_inputs(tokens, rows, channels, state_dims)
    theirs = held.clone()
    shape = (tokens, rows, channels, state_dims)

    def per_channel(t: torch.Tensor) -> torch.Tensor:
        return t.view(tokens, rows, 1, state_dims).expand(shape).flatten(1, 2)

    want = mamba1.prompt_rows(x, steps, per_channel(b), per_channel(c), a.repeat(rows, 1), theirs)
    got = mamba1.side_by_side_rows(x, steps, b, c, a, held)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(held, theirs, rtol=1e-4, atol=1e-4)


def test_the_mixers_take_the_kernel_on_the_cpu(monkeypatch):
    calls = []
    real = cpu_ops.mamba1_prompt_scan
    monkeypatch.setattr(
        cpu_ops, "mamba1_prompt_scan", lambda *args: calls.append(args[0].shape) or real(*args)
    )
    x, steps, b, c, a, held = chunk_inputs(6, 2, 4, 8)
    mamba1.side_by_side_rows(x, steps, b, c, a, held)
    assert calls == [torch.Size([6, 2, 4])]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t | {"x": t["x"].double()}, "x must be contiguous fp32"),
        (lambda t: t | {"steps": t["steps"][:, :1].contiguous()}, "steps must be shaped as x"),
        (lambda t: t | {"c": t["c"][:, :, :3].contiguous()}, "b and c must be"),
        (lambda t: t | {"rates": t["rates"][:2]}, "rates must be"),
        (lambda t: t | {"states": t["states"][:1]}, "states must be"),
    ],
)
def test_wrong_inputs_are_refused(change, message):
    x, steps = torch.randn(3, 2, 4), torch.rand(3, 2, 4)
    b, c = torch.randn(3, 2, 5), torch.randn(3, 2, 5)
    args = dict(x=x, steps=steps, b=b, c=c, rates=-torch.rand(4, 5), states=torch.randn(2, 4, 5))
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.mamba1_prompt_scan(**change(args))
