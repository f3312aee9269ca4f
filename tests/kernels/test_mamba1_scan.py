"""Conveyor's CPU kernels for Mamba1's selective scan (`csrc/recurrent/mamba1_scan.cpp`): a prompt
chunk against the torch form a token at a time, a decode token of each row against torch's
gathered form (and rows verifying drafts chained), and where the mixers use them."""

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


def decode_inputs(rows: int, channels: int, state_dims: int, slots: int):
    x, steps = torch.randn(rows, channels), torch.rand(rows, channels)
    b, c = torch.randn(rows, state_dims), torch.randn(rows, state_dims)
    a = -torch.rand(channels, state_dims) * 4
    return x, steps, b, c, a, torch.randn(slots, channels, state_dims)


@pytest.mark.parametrize(("rows", "channels", "state_dims"), [(1, 8, 16), (5, 12, 16), (3, 7, 21)])
def test_decode_steps_in_turn_equal_the_torch_form(rows, channels, state_dims):
    """Twenty tokens in turn through the kernel and torch's gathered form, from the same states
    (state dims of whole vectors, or with a tail); slots no row names stay as they were."""
    torch.manual_seed(rows * channels)
    x, steps, b, c, a, states = decode_inputs(rows, channels, state_dims, rows + 3)
    mine, theirs = states.clone(), states.clone()
    slots = torch.randperm(rows + 3)[:rows]
    for _ in range(20):
        x, steps = torch.randn_like(x), torch.rand_like(steps)
        b, c = torch.randn_like(b), torch.randn_like(c)
        got = cpu_ops.mamba1_decode(x, steps, b, c, a, mine, slots)
        want = mamba1.decode_rows_torch(x, steps, b, c, a, theirs, slots)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    others = [slot for slot in range(rows + 3) if slot not in slots.tolist()]
    assert torch.equal(mine[others], states[others])
    assert not torch.equal(mine[slots], states[slots])


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_rows_in_a_chain_each_read_the_state_the_row_before_wrote(kernel, monkeypatch):
    """A request verifying drafts: rows 0..3 from slot 2 (its own, in place), then each from the
    slot the row before wrote (5, 1, 6), beside another request's row in slot 0: each equals
    the tokens taken one call at a time."""
    torch.manual_seed(5)
    x, steps, b, c, a, states = decode_inputs(5, 6, 16, 7)
    slots, sources = torch.tensor([2, 0, 5, 1, 6]), torch.tensor([2, 0, 2, 5, 1])
    expected, outs = states.clone(), []
    for row in range(5):
        one = slice(row, row + 1)
        state = expected[sources[row]].clone()[None]
        zero = torch.zeros(1, dtype=torch.int64)
        outs.append(mamba1.decode_rows_torch(x[one], steps[one], b[one], c[one], a, state, zero))
        expected[slots[row]] = state[0]
    if not kernel:
        monkeypatch.setattr(cpu_ops, "has", lambda group: False)
    out = mamba1.decode_rows(x, steps, b, c, a, states, slots, sources)
    torch.testing.assert_close(out, torch.cat(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-5)


def test_the_mixers_decode_with_the_kernel_on_the_cpu(monkeypatch):
    seen = []
    real = cpu_ops.mamba1_decode
    monkeypatch.setattr(cpu_ops, "mamba1_decode", lambda *a: seen.append(a[0].shape) or real(*a))
    x, steps, b, c, a, states = decode_inputs(2, 4, 8, 3)
    mamba1.decode_rows(x, steps, b, c, a, states, torch.tensor([2, 0]))
    assert seen == [torch.Size([2, 4])]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t | {"x": t["x"].double()}, "x must be contiguous fp32"),
        (lambda t: t | {"steps": t["steps"][:, :1].contiguous()}, "steps must be shaped as x"),
        (lambda t: t | {"c": t["c"][:, :3].contiguous()}, "b and c must have one shape"),
        (lambda t: t | {"rates": t["rates"][:2]}, "rates must be contiguous fp32"),
        (lambda t: t | {"states": t["states"][:, :, :4]}, "states must be contiguous fp32"),
        (lambda t: t | {"slots": torch.tensor([0, 7])}, "slot 7 is outside the states"),
        (lambda t: t | {"sources": torch.tensor([9, 0])}, "a source is outside the states"),
    ],
)
def test_wrong_decode_inputs_are_refused(change, message):
    x, steps, b, c, a, states = decode_inputs(2, 4, 5, 3)
    args = dict(x=x, steps=steps, b=b, c=c, rates=a, states=states, slots=torch.tensor([0, 1]))
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.mamba1_decode(**change(args))
