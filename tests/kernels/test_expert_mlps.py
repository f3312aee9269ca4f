"""A layer of experts in one op (`csrc/linear/expert_mlps.cpp`): over gated bf16 panel pairs it
equals `ExpertLinears`' loop over the experts to the bit (which equals the loop over the joined
gate/up layers), whatever the rows, choices, biases and threads; it refuses what it cannot
compute, and `pair_gates` pairs only what the op takes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear
from engine.models.experts import ClampedSwiGLU, ExpertLinears
from tests.helpers import needs_bf16_panels

HIDDEN, INTER, EXPERTS = 96, 48, 8


def experts(
    biases: bool = False,
    inter: int = INTER,
    storage: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> ExpertLinears:
    """Random experts in panels of `storage`, each gate/up one joined layer (gate rows first)."""
    torch.manual_seed(seed)

    def layer(out: int, into: int) -> PanelLinear:
        bias = torch.randn(out) * 0.1 if biases else None
        return PanelLinear(torch.randn(out, into) / into**0.5, bias, storage)

    gate_up = [layer(2 * inter, HIDDEN) for _ in range(EXPERTS)]
    down = [layer(HIDDEN, inter) for _ in range(EXPERTS)]
    return ExpertLinears(gate_up, down, nn.SiLU(), silu=True)  # type: ignore[arg-type]


def choices(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` distinct experts (some experts chosen by none) and fp32 weights."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, EXPERTS - 2, generator=generator)
    chosen = scores.topk(k, dim=-1).indices
    weights = torch.rand(rows, k, generator=generator)
    return chosen, weights / weights.sum(-1, keepdim=True)


@needs_bf16_panels
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 4), (3, 2), (13, 3), (64, 4), (150, 2)])
@pytest.mark.usefixtures("bf16_products")
def test_the_op_equals_the_loop_over_the_experts_to_the_bit(
    rows: int, k: int, biases: bool
) -> None:
    joined = experts(biases)
    x = torch.randn(rows, HIDDEN)
    chosen, weights = choices(rows, k, seed=rows * k)
    with torch.inference_mode():
        before = joined.by_expert(x, chosen, weights)
        assert joined.pair_gates()
        assert all(isinstance(g, GatedPanelLinear) for g in joined.gate_up)
        looped = joined.by_expert(x, chosen, weights)
        grouped = joined(x, chosen, weights)
    assert torch.equal(looped, before)
    assert torch.equal(grouped, looped)
    # Not a sum of zeros: every row's chosen experts count.
    assert bool((grouped.abs().sum(-1) > 0).all())


@needs_bf16_panels
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_the_op_does_not_depend_on_the_thread_count(rows: int) -> None:
    paired = experts(biases=True)
    assert paired.pair_gates()
    x = torch.randn(rows, HIDDEN)
    chosen, weights = choices(rows, 3, seed=rows)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            with torch.inference_mode():
                outputs.append(paired(x, chosen, weights))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@needs_bf16_panels
def test_the_weights_and_the_choice_count() -> None:
    """Each row's sum is its experts' outputs times their weights: twice the weights give twice
    the sum, and a row's experts swapped for others give another output."""
    paired = experts()
    assert paired.pair_gates()
    x = torch.randn(5, HIDDEN)
    chosen, weights = choices(5, 2, seed=3)
    with torch.inference_mode():
        once = paired(x, chosen, weights)
        torch.testing.assert_close(paired(x, chosen, 2 * weights), 2 * once, rtol=0, atol=0)
        other = paired(x, (chosen + 1) % EXPERTS, weights)
    assert not torch.allclose(other, once)


@needs_bf16_panels
def test_the_op_refuses_what_it_cannot_compute() -> None:
    paired = experts()
    assert paired.pair_gates()
    gate_up = [g.panels for g in paired.gate_up]
    down = [d.panels for d in paired.down]
    none = [None] * EXPERTS
    x = torch.randn(2, HIDDEN)
    chosen, weights = choices(2, 2, seed=1)

    def call(**changed: object) -> torch.Tensor:
        args: dict[str, object] = dict(
            x=x, experts=chosen, weights=weights, gate_up=gate_up, gate_up_bias=none,
            down=down, down_bias=none, inter=INTER,
        )  # fmt: skip
        args.update(changed)
        return cpu_ops.expert_mlps(**args)  # type: ignore[arg-type]

    with pytest.raises(RuntimeError, match="expert 8 chosen of 8"):
        call(experts=torch.tensor([[0, 8], [1, 2]]))
    with pytest.raises(RuntimeError, match="weights must be contiguous fp32"):
        call(weights=weights.double())
    with pytest.raises(RuntimeError, match="one gate/up, down and bias"):
        call(down=down[:-1])
    with pytest.raises(RuntimeError, match="gate/up panels must be"):
        call(gate_up=[p.contiguous().view(-1, 2, HIDDEN // 2, 32)[:1] for p in gate_up])
    with pytest.raises(RuntimeError, match="down panels must be"):
        call(down=[d[:1] for d in down])
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        call(x=x.to(torch.bfloat16))
    assert call().shape == (2, HIDDEN)


@needs_bf16_panels
def test_only_bf16_silu_experts_in_whole_panels_pair() -> None:
    fp32 = experts(storage=torch.float32)
    assert not fp32.pair_gates()
    assert all(isinstance(g, PanelLinear) for g in fp32.gate_up)
    ragged = experts(inter=40)  # gate and up meet inside a panel
    assert not ragged.pair_gates()
    clamped = experts()
    clamped.clamped = ClampedSwiGLU(1.702, 7.0)
    assert not clamped.pair_gates()
    x = torch.randn(3, HIDDEN)
    chosen, weights = choices(3, 2, seed=5)
    with torch.inference_mode():  # the loop serves what does not pair
        torch.testing.assert_close(
            ragged(x, chosen, weights), ragged.by_expert(x, chosen, weights), rtol=0, atol=0
        )
