"""Conveyor's CPU kernel for a decode token of each row through Mamba2's scan
(`csrc/recurrent/ssd_decode.cpp`) against transformers' `mamba2_selective_state_update`, and
where Granite 4's layers use it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (
    mamba2_selective_state_update,
)

from engine.kernels.cpu import ops as cpu_ops
from engine.models import ssd
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("recurrent"), "the C++ kernels must build on the test machine"


def scan_inputs(rows: int, heads: int, dims: int, groups: int, size: int, slots: int):
    x, steps = torch.randn(rows, heads, dims), torch.rand(rows, heads) * 2
    b, c = torch.randn(rows, groups, size), torch.randn(rows, groups, size)
    rates = -torch.rand(heads) * 4
    return x, steps, b, c, rates, torch.randn(slots, heads, dims, size)


@pytest.mark.parametrize(
    ("rows", "heads", "dims", "groups", "size"),
    [(1, 32, 64, 1, 128), (5, 4, 6, 2, 5), (9, 12, 7, 3, 21), (3, 8, 16, 8, 16)],
)
def test_matches_transformers_state_update(rows, heads, dims, groups, size):
    """Each row's output and its slot's new state, heads sharing groups or not, state dims that
    fill no vector of partial sums or several; the slots no row names stay as they were."""
    torch.manual_seed(rows * heads)
    x, steps, b, c, rates, states = scan_inputs(rows, heads, dims, groups, size, rows + 3)
    slots = torch.randperm(rows + 3)[:rows]
    others = [s for s in range(rows + 3) if s not in slots.tolist()]
    untouched = states[others].clone()
    held = states[slots].clone()
    expected = mamba2_selective_state_update(
        held,
        x,
        steps[..., None].expand(-1, -1, dims),
        rates[:, None, None].expand(-1, dims, size),
        b,
        c,
    )
    out = cpu_ops.ssd_decode(x, steps, b, c, rates, states, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], held, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[others], untouched)


def test_steps_in_turn_equal_the_torch_form():
    """Twenty tokens in turn through the kernel and through torch's form, from the same states."""
    torch.manual_seed(3)
    x, steps, b, c, rates, states = scan_inputs(4, 8, 16, 2, 24, 6)
    mine, theirs = states.clone(), states.clone()
    slots = torch.tensor([5, 1, 3, 0])
    for _ in range(20):
        x, steps = torch.randn_like(x), torch.rand_like(steps)
        b, c = torch.randn_like(b), torch.randn_like(c)
        got = cpu_ops.ssd_decode(x, steps, b, c, rates, mine, slots)
        want = ssd.decode_rows_torch(x, steps, b, c, rates, theirs, slots)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_rows_in_a_chain_each_read_the_state_the_row_before_wrote(kernel, monkeypatch):
    """A request verifying drafts: rows 0..3 from slot 2 (its own, in place), then each from the
    slot the row before wrote (5, 1, 6), beside another request's row in slot 0: each equals
    the tokens taken one call at a time."""
    torch.manual_seed(5)
    x, steps, b, c, rates, states = scan_inputs(5, 8, 6, 2, 12, 7)
    slots, sources = torch.tensor([2, 0, 5, 1, 6]), torch.tensor([2, 0, 2, 5, 1])
    expected, outs = states.clone(), []
    for row in range(5):
        one = slice(row, row + 1)
        state = expected[sources[row]].clone()[None]
        outs.append(
            ssd.decode_rows_torch(x[one], steps[one], b[one], c[one], rates, state, slots[:1] * 0)
        )
        expected[slots[row]] = state[0]
    if not kernel:
        monkeypatch.setattr(cpu_ops, "has", lambda group: False)
    out = ssd.decode_rows(x, steps, b, c, rates, states, slots, sources)
    torch.testing.assert_close(out, torch.cat(outs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected, rtol=1e-5, atol=1e-5)


def test_the_layers_take_the_kernel_on_the_cpu(monkeypatch):
    """`ssd.decode_rows` runs the op on CPU states, with the rows' groups as they are."""
    seen = []
    real = cpu_ops.ssd_decode
    monkeypatch.setattr(cpu_ops, "ssd_decode", lambda *a: seen.append(a[2].shape) or real(*a))
    x, steps, b, c, rates, states = scan_inputs(2, 4, 6, 2, 5, 3)
    ssd.decode_rows(x, steps, b, c, rates, states, torch.tensor([2, 0]))
    assert seen == [torch.Size([2, 2, 5])]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t | {"x": t["x"].double()}, "x must be contiguous fp32"),
        (lambda t: t | {"b": t["b"][:, :1].contiguous()}, "b and c must have one shape"),
        (lambda t: t | {"rates": t["rates"][:2]}, r"rates must be contiguous fp32 \[heads\]"),
        (lambda t: t | {"slots": torch.tensor([0, 7])}, "slot 7 is outside the states"),
        (lambda t: t | {"sources": torch.tensor([9, 0])}, "a source is outside the states"),
        (lambda t: t | {"states": t["states"][:, :, :, :4]}, "states must be contiguous"),
    ],
)
def test_wrong_inputs_are_refused(change, message):
    x, steps, b, c, rates, states = scan_inputs(2, 4, 6, 2, 5, 3)
    args = dict(x=x, steps=steps, b=b, c=c, rates=rates, states=states, slots=torch.tensor([0, 1]))
    args = change(args)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.ssd_decode(**args)
