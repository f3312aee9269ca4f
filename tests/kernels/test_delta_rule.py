"""Conveyor's CPU kernel for a decode token of each row through the gated delta rule
(`csrc/recurrent/delta_rule.cpp`) against transformers' token-by-token reference, and where
Qwen3.5's layers use it."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

from engine.kernels.cpu import ops as cpu_ops
from engine.models import qwen3_5
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("recurrent"), "the C++ kernels must build on the test machine"


def rule_inputs(rows: int, key_heads: int, heads: int, key_dims: int, value_dims: int, slots: int):
    q, k = (torch.randn(rows, key_heads, key_dims) * 2 for _ in range(2))
    v = torch.randn(rows, heads, value_dims)
    g, beta = -2 * torch.rand(rows, heads), torch.rand(rows, heads)
    states = torch.randn(slots, heads, key_dims, value_dims)
    return q, k, v, g, beta, states


def reference(q, k, v, g, beta, held):
    """transformers' recurrent rule, a row a sequence of one token: the outputs and new states."""
    out, new = torch_recurrent_gated_delta_rule(
        *(t[:, None] for t in (q, k, v, g, beta)),
        initial_state=held.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return out[:, 0], new


@pytest.mark.parametrize(
    ("rows", "key_heads", "heads", "key_dims", "value_dims"),
    [(1, 16, 16, 128, 128), (5, 2, 4, 8, 6), (9, 4, 12, 13, 7), (3, 1, 3, 64, 33)],
)
def test_matches_transformers_recurrent_rule(rows, key_heads, heads, key_dims, value_dims):
    """Each row's output and its slot's new state, value heads sharing key heads or not, dims
    that fill no vector or several; the slots no row names stay as they were."""
    torch.manual_seed(rows * heads)
    q, k, v, g, beta, states = rule_inputs(rows, key_heads, heads, key_dims, value_dims, rows + 3)
    slots = torch.randperm(rows + 3)[:rows]
    others = [s for s in range(rows + 3) if s not in slots.tolist()]
    untouched = states[others].clone()
    expected, held = reference(q, k, v, g, beta, states[slots])
    out = cpu_ops.gated_delta_decode(q, k, v, g, beta, states, slots)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[slots], held, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[others], untouched)


def test_tokens_in_turn_follow_the_reference():
    """Twenty decode steps of one row, each from the state the one before left."""
    torch.manual_seed(4)
    q, k, v, g, beta, states = rule_inputs(20, 2, 4, 16, 16, 2)
    expected, held = torch_recurrent_gated_delta_rule(
        *(t[None] for t in (q, k, v, g, beta)),
        initial_state=states[1:].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    slot = torch.tensor([1])
    outs = [
        cpu_ops.gated_delta_decode(*(t[i : i + 1] for t in (q, k, v, g, beta)), states, slot)
        for i in range(20)
    ]
    torch.testing.assert_close(torch.cat(outs), expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[1:], held, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
def test_rows_in_a_chain_each_read_the_state_the_row_before_wrote(kernel):
    """A request verifying drafts: rows 0..4 run from slot 1 (its own, in place), then each row
    from the slot the row before wrote (6, 2, 7, 4), beside another request's row in slot 0;
    every row's output and slot equal those tokens taken in turn, and slot 1 holds only row
    0's."""
    torch.manual_seed(9)
    q, k, v, g, beta, states = rule_inputs(6, 2, 4, 16, 8, 8)
    slots, sources = [1, 0, 6, 2, 7, 4], [1, 0, 1, 6, 2, 7]
    chain = [0, 2, 3, 4, 5]
    expected, _ = torch_recurrent_gated_delta_rule(
        *(t[chain][None] for t in (q, k, v, g, beta)),
        initial_state=states[1:2].clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    steps = [states[1:2].clone()]
    for row in chain:
        stepped = steps[-1].clone()
        cpu_ops.gated_delta_decode(
            *(t[row : row + 1] for t in (q, k, v, g, beta)), stepped, torch.tensor([0])
        )
        steps.append(stepped)
    alone, held_alone = reference(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], states[0:1])
    decode = qwen3_5.decode_rows if kernel else qwen3_5.decode_rows_torch
    out = decode(q, k, v, g, beta, states, slots, sources)
    torch.testing.assert_close(out[chain], expected[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1:2], alone, rtol=1e-5, atol=1e-5)
    for i, row in enumerate(chain):
        torch.testing.assert_close(states[slots[row]], steps[i + 1][0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states[0:1], held_alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(slots=torch.tensor([0, 7])), "slot 7 is outside the states"),
        (lambda a: a.update(sources=torch.tensor([0, 9])), "a source is outside the states"),
        (lambda a: a.update(q=a["q"].double()), "q must be contiguous fp32"),
        (lambda a: a.update(v=a["v"][:, :3].contiguous()), "multiple of the key heads"),
        (lambda a: a.update(states=a["states"].half()), "states must be contiguous fp32"),
        (lambda a: a.update(g=a["g"][:, :2].contiguous()), "a value per value head"),
    ],
)
def test_refuses_what_it_cannot_read(change, message):
    q, k, v, g, beta, states = rule_inputs(2, 2, 4, 8, 8, 3)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, states=states, slots=torch.tensor([0, 2]))
    change(args)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.gated_delta_decode(**args)


def test_qwen3_5_decode_rows_run_the_kernel(monkeypatch):
    """The DeltaNet layers' decode rows on the CPU go through the kernel, from bf16 rows too, and
    give what the torch route gives."""
    calls = []
    real = cpu_ops.gated_delta_decode
    monkeypatch.setattr(cpu_ops, "gated_delta_decode", lambda *a: calls.append(a) or real(*a))
    torch.manual_seed(6)
    q, k, v, g, beta, states = rule_inputs(4, 2, 4, 8, 6, 6)
    q, k, v, beta = (t.bfloat16() for t in (q, k, v, beta))
    slots = [5, 1, 0, 3]
    copy = states.clone()
    out = qwen3_5.decode_rows(q, k, v, g, beta, states, slots)
    expected = qwen3_5.decode_rows_torch(q, k, v, g, beta, copy, slots)
    assert len(calls) == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, copy, rtol=1e-5, atol=1e-5)
