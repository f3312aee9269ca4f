"""Conveyor's CPU kernel for a step's short causal convolution over each row's kept inputs
(`csrc/recurrent/short_conv.cpp`) against torch's depthwise `conv1d` over each row's state and
tokens, and where the state cache uses it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops as cpu_ops
from engine.kv import state_cache
from engine.kv.state_cache import StateCache, StateStep
from tests.helpers import needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("recurrent"), "the C++ kernels must build on the test machine"


def reference(inputs, states, taps, bias, slots, lens, silu):
    """Each row's state then its tokens through torch's depthwise convolution; the new states."""
    kept, channels = states.shape[1:]
    outs, new = [], states.clone()
    start = 0
    for slot, length in zip(slots.tolist(), lens.tolist(), strict=True):
        extended = torch.cat([states[slot], inputs[start : start + length]])
        weight = taps.t()[:, None, :]  # [channels, 1, width]
        out = F.conv1d(extended.t()[None], weight, bias, groups=channels)[0].t()
        outs.append(F.silu(out) if silu else out)
        new[slot] = extended[-kept:]
        start += length
    return torch.cat(outs), new


@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("lens", [[1, 1, 1], [2, 1, 7, 3], [9], [1, 2]])
@pytest.mark.parametrize(("with_bias", "silu"), [(False, True), (True, False)])
def test_matches_torch_conv1d(width, lens, with_bias, silu):
    """Rows shorter and longer than the kept inputs, in any slots; the slots no row names stay
    as they were."""
    torch.manual_seed(len(lens) * width)
    channels, slots_total = 37, 6
    inputs = torch.randn(sum(lens), channels + 5)[:, 3 : 3 + channels]  # a slice, as projected
    states = torch.randn(slots_total, width - 1, channels)
    taps = torch.randn(width, channels)
    bias = torch.randn(channels) if with_bias else None
    slots = torch.randperm(slots_total)[: len(lens)]
    query_lens = torch.tensor(lens)
    expected, held = reference(inputs, states, taps, bias, slots, query_lens, silu)
    out = cpu_ops.short_conv(inputs, states, taps, bias, slots, query_lens, silu)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(states, held)


def through_kernel_and_torch(monkeypatch, cache, inputs, taps, bias):
    """`cache.convolve` (silu) through the kernel, then from the same states through torch's
    route: the kernel's calls, its output and states, and torch's output (its states left in
    the cache)."""
    before = cache.layers[0].clone()
    calls = []
    real = cpu_ops.short_conv
    monkeypatch.setattr(cpu_ops, "short_conv", lambda *a: calls.append(a) or real(*a))
    out = cache.convolve(0, inputs, taps, bias, silu=True)
    after = cache.layers[0].clone()
    cache.layers[0].copy_(before)
    monkeypatch.setattr(state_cache, "_own_convolution", lambda inputs, state: False)
    expected = cache.convolve(0, inputs, taps, bias, silu=True)
    return calls, out, after, expected


def test_the_state_cache_convolves_through_the_kernel_as_through_torch(monkeypatch):
    """`StateCache.convolve` on fp32 CPU rows takes the kernel, with the torch route's results."""
    torch.manual_seed(5)
    lens = np.array([3, 1, 5])
    cache = StateCache([((2, 8), None)], 4, torch.float32, torch.device("cpu"))
    cache.layers[0].normal_()
    host = np.array([2, 0, 3])
    cache.step = StateStep(torch.from_numpy(host), host, lens, torch.device("cpu"))
    inputs, taps, bias = torch.randn(9, 8), torch.randn(3, 8), torch.randn(8)
    calls, out, after, expected = through_kernel_and_torch(monkeypatch, cache, inputs, taps, bias)
    assert len(calls) == 1
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, cache.layers[0])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(slots=torch.tensor([0, 9])), "slot 9 is outside the states"),
        (lambda a: a.update(query_lens=torch.tensor([2, 2])), "sum past the inputs"),
        (lambda a: a.update(query_lens=torch.tensor([1, 1])), "must sum to the inputs' rows"),
        (lambda a: a.update(query_lens=torch.tensor([3, 0])), "at least one token"),
        (lambda a: a.update(inputs=a["inputs"].double()), "inputs must be fp32"),
        (lambda a: a.update(inputs=a["inputs"].t().contiguous().t()), "contiguous channels"),
        (lambda a: a.update(taps=a["taps"][:, :4].contiguous()), "taps must be"),
        (lambda a: a.update(sources=torch.tensor([0, 2])), "a source is outside the states"),
    ],
)
def test_refuses_what_it_cannot_read(change, message):
    args = dict(
        inputs=torch.randn(3, 8),
        states=torch.randn(2, 2, 8),
        taps=torch.randn(3, 8),
        bias=None,
        slots=torch.tensor([0, 1]),
        query_lens=torch.tensor([1, 2]),
        silu=False,
    )
    change(args)
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.short_conv(**args)


@pytest.mark.parametrize("width", [3, 4])
def test_chained_rows_read_the_states_the_rows_before_them_wrote(width):
    """A request verifying drafts (a row a token, each row after its first from the slot the
    row before wrote) beside rows from their own slots: the same outputs and states as each
    row run alone, in order, from its source's state copied into its slot."""
    torch.manual_seed(width)
    channels = 19
    lens = [1, 1, 1, 3, 1]
    slots = torch.tensor([0, 4, 5, 2, 3])
    sources = torch.tensor([0, 0, 4, 2, 1])  # rows 1 and 2 chain; row 4 reads slot 1
    inputs = torch.randn(sum(lens), channels)
    states = torch.randn(6, width - 1, channels)
    taps, bias = torch.randn(width, channels), torch.randn(channels)
    held, outs, start = states.clone(), [], 0
    for row, length in enumerate(lens):
        held[slots[row]] = held[sources[row]]
        one = cpu_ops.short_conv(
            inputs[start : start + length],
            held,
            taps,
            bias,
            slots[row : row + 1],
            torch.tensor([length]),
            True,
        )
        outs.append(one)
        start += length
    out = cpu_ops.short_conv(inputs, states, taps, bias, slots, torch.tensor(lens), True, sources)
    torch.testing.assert_close(out, torch.cat(outs), rtol=0, atol=0)
    assert torch.equal(states, held)


def test_the_state_cache_runs_verifying_rows_through_the_kernel_in_one_call(monkeypatch):
    """Where requests verify drafts, `StateCache.convolve` on fp32 CPU rows runs every row in
    one kernel call, each from its source, with the results of torch's waves."""
    torch.manual_seed(6)
    batch = SimpleNamespace(
        state_slots=np.array([0, 4, 5, 2, 3]),
        query_lens=np.array([1, 1, 1, 1, 4]),
        context_lens=np.array([7, 8, 9, 5, 3]),
        state_sources=np.array([-1, 0, 4, -1, -1]),
    )
    cache = StateCache([((2, 8), None)], 6, torch.float32, torch.device("cpu"))
    cache.layers[0].normal_()
    cache.begin(batch)  # type: ignore[arg-type]
    assert len(cache.waves) == 3
    inputs, taps, bias = torch.randn(8, 8), torch.randn(3, 8), torch.randn(8)
    calls, out, after, expected = through_kernel_and_torch(monkeypatch, cache, inputs, taps, bias)
    assert len(calls) == 1 and calls[0][-1].tolist() == [0, 0, 4, 2, 3]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, cache.layers[0])
