"""The greedy LM head: where every row of a step samples greedily from its raw logits, the bf16
panels' product keeps each row's best output as it goes (`panel_argmax`) instead of writing the
logits out, and the tokens are the ones the sampler would take from those logits."""

from __future__ import annotations

import pytest
import torch

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear
from engine.loading.model_loader import LinearForm, use_linear_form
from tests.helpers import (
    bf16_reference,
    needs_bf16_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
)


def head(
    out_features: int, in_features: int, bias: torch.Tensor | None = None, seed: int = 0
) -> PanelLinear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    return PanelLinear(weight, bias, torch.bfloat16)


def choose(layer: PanelLinear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fused choice, the argmax of the written logits)."""
    logits = cpu_ops.panel_linear(x, layer.panels, layer.padded_bias, layer.out_features)
    return layer.greedy(x), logits.argmax(dim=-1)


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(5, 8), (37, 32), (1000, 64), (4099, 96), (49152, 64)]
)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_fused_choice_is_the_argmax_of_the_logits(
    out_features: int, in_features: int, rows: int, with_bias: bool
) -> None:
    bias = torch.randn(out_features) if with_bias else None
    layer = head(out_features, in_features, bias)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    fused, written = choose(layer, x)
    assert fused.dtype == torch.int64 and fused.shape == (rows,)
    assert torch.equal(fused, written)
    # bf16 rows are the ones the product rounds fp32 rows to.
    assert torch.equal(layer.greedy(x.bfloat16()), written)


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"), [(37, 32, 3), (4099, 96, 64), (49152, 64, 5)]
)
def test_the_fused_choice_is_torchs_best_logit(
    out_features: int, in_features: int, rows: int
) -> None:
    """Against torch alone: the chosen column's logit, computed by torch in fp64 from the bf16
    rows and weights, is the row's largest up to fp32 summation error."""
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(1))
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    layer = PanelLinear(weight, bias, torch.bfloat16)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    logits = (x.bfloat16().double() @ weight.bfloat16().double().T) + bias.double()
    chosen = layer.greedy(x)
    best = logits.max(dim=-1).values
    assert torch.all(best - logits.gather(1, chosen[:, None])[:, 0] <= 1e-4 * best.abs() + 1e-4)


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
def test_equal_maxima_choose_the_first_column() -> None:
    weight = torch.randn(70, 32, generator=torch.Generator().manual_seed(1))
    weight[[20, 45, 69]] = weight[3].clone()
    layer = PanelLinear(weight, None, torch.bfloat16)
    x = weight[3].repeat(4, 1)
    fused, written = choose(layer, x)
    assert written.tolist() == [3] * 4
    assert torch.equal(fused, written)


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
def test_nan_and_infinite_rows_choose_as_argmax_does() -> None:
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    nans = torch.zeros(70)
    nans[[33, 50]] = float("nan")
    minus_inf = torch.full((70,), float("-inf"))
    plus_inf = torch.zeros(70)
    plus_inf[[9, 60]] = float("inf")
    for bias, expected in ((nans, 33), (minus_inf, 0), (plus_inf, 9)):
        fused, written = choose(head(70, 32, bias), x)
        assert written.tolist() == [expected] * 3
        assert torch.equal(fused, written)


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
def test_padding_columns_are_never_chosen() -> None:
    """37 columns fill three panels of 16: the 11 zero-padded ones sum to 0, above every real
    column here."""
    layer = head(37, 32, torch.full((37,), -1e4))
    fused, written = choose(layer, torch.randn(8, 32))
    assert (written < 37).all()
    assert torch.equal(fused, written)


@needs_bf16_panels
def test_the_fused_choice_refuses_bad_inputs() -> None:
    layer = head(40, 32)
    with pytest.raises(RuntimeError, match="input sizes"):
        cpu_ops.panel_argmax(torch.randn(2, 16), layer.panels, None, 40)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_ops.panel_argmax(torch.randn(2, 32), layer.panels, None, 60)
    with pytest.raises(RuntimeError, match="bias must be fp32"):
        cpu_ops.panel_argmax(torch.randn(2, 32), layer.panels, torch.randn(40), 40)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        cpu_ops.panel_argmax(torch.randn(2, 32).double(), layer.panels, None, 40)
    fp32 = PanelLinear(torch.randn(40, 32), None)
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_ops.panel_argmax(torch.randn(2, 32), fp32.panels, None, 40)
    assert not fp32.chooses_greedily and layer.chooses_greedily


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of each fused choice the engine makes."""
    calls: list[int] = []
    real = cpu_ops.panel_argmax

    def counted(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(cpu_ops, "panel_argmax", counted)
    return calls


def bf16_core():
    model = tiny_llama(dtype=torch.bfloat16)
    use_linear_form(model, LinearForm.BF16_PANELS)
    core, _ = tiny_core(model)
    assert isinstance(core.runner.model.lm_head, PanelLinear)
    return core


@needs_bf16_panels
def test_greedy_steps_choose_in_the_head_and_follow_the_oracle(fused_calls: list[int]) -> None:
    prompts = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outputs = run_all(bf16_core(), prompts, params)
    reference = bf16_reference("bf16")
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(reference, prompt, 10)
    # Every token of the three requests was chosen in the head.
    assert sum(fused_calls) == 3 * 10


@needs_bf16_panels
def test_a_step_that_needs_logits_writes_them(fused_calls: list[int]) -> None:
    """A request with logprobs makes its steps compute the logits for every row; the greedy
    request beside it takes the same tokens either way."""
    prompts = [[5, 9, 33, 2], [7] * 13]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    mixed = run_all(bf16_core(), prompts, [greedy, with_logprobs])
    assert fused_calls == []
    assert all(o.logprobs is not None for o in mixed["req-1"])
    alone = run_all(bf16_core(), prompts, greedy)
    assert len(fused_calls) == 6
    assert [tokens_of(mixed[k]) for k in mixed] == [tokens_of(alone[k]) for k in alone]
    core = bf16_core()
    core.runner.greedy_in_model = False
    through_logits = run_all(core, prompts, greedy)
    assert len(fused_calls) == 6
    assert [tokens_of(v) for v in through_logits.values()] == [tokens_of(v) for v in alone.values()]
