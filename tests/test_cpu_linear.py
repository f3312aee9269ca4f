"""CPU linear layers: fp32 weights packed for oneDNN, 16-bit weights in fp32, and the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_kernels, cpu_linear, model_loader
from engine.cpu_linear import (
    SMALL_BATCH_ROWS,
    SMALL_BATCH_ROWS_PLAIN,
    HalfWeightLinear,
    PackedLinear,
    convert_linears,
    fbgemm_fp16_available,
    onednn_linear_available,
    pack_linears,
)
from engine.model_loader import half_weights_in_fp32, use_half_weights
from engine.sampling_params import SamplingParams
from tests.helpers import reference_greedy, run_all, tiny_core, tiny_llama, tokens_of

needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16_available(),
                                  reason="this torch build has no fbgemm fp16 GEMM")
needs_onednn = pytest.mark.skipif(not onednn_linear_available(),
                                  reason="this torch build cannot pack weights for oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_layer_matches_f_linear(rows: int, with_bias: bool) -> None:
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=with_bias)
    layer = PackedLinear(linear.weight, linear.bias)
    x = torch.randn(2, rows, 96)
    out = layer(x)
    assert out.shape == (2, rows, 40)
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, linear.weight)


@needs_onednn
def test_packed_model_greedy_equals_generate() -> None:
    prompts = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [reference_greedy(tiny_llama(), p, 10) for p in prompts]
    model = tiny_llama()
    assert pack_linears(model) == 7 * model.config.num_hidden_layers + 1
    core, _ = tiny_core(model)
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1,
                                  SMALL_BATCH_ROWS_PLAIN, SMALL_BATCH_ROWS_PLAIN + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("own_kernel", [True, False])
def test_layer_matches_fp32_product_of_rounded_weights(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                       with_bias: bool, onednn: bool,
                                                       own_kernel: bool) -> None:
    if onednn and not onednn_linear_available():
        pytest.skip("this torch build cannot pack weights for oneDNN")
    assert cpu_kernels.half_linear_available(), "the C++ kernels must build on the test machine"
    monkeypatch.setattr(cpu_linear, "onednn_linear_available", lambda: onednn)
    monkeypatch.setattr(cpu_kernels, "half_linear_available", lambda: own_kernel)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=with_bias)
    layer = HalfWeightLinear(linear.weight, linear.bias)
    assert (layer.large is not None) is onednn
    assert (layer.weight_fp16 is not None) is own_kernel and (layer.packed is None) is own_kernel
    assert layer.small_rows == (SMALL_BATCH_ROWS if onednn else SMALL_BATCH_ROWS_PLAIN)
    x = torch.randn(1, rows, 96)
    expected = F.linear(x, linear.weight.half().float(), linear.bias)
    out = layer(x)
    assert out.shape == (1, rows, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, linear.weight.half().float())


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 8, 1), (2, 13, 5), (3, 96, 17), (4, 100, 40), (5, 1000, 9),
                          (7, 24, 3), (8, 40, 20), (9, 64, 33), (16, 37, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_own_fp16_kernel_matches_the_fp32_product(rows: int, in_features: int,
                                                  out_features: int, with_bias: bool) -> None:
    """Every tile shape (1 to 4 rows of x, 1, 2 or 4 rows of w) and inner sizes that leave a
    remainder after the 8-wide steps."""
    assert cpu_kernels.half_linear_available()
    torch.manual_seed(rows + in_features)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features).half()
    bias = torch.randn(out_features) if with_bias else None
    out = cpu_kernels.half_linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(out, expected.float(), rtol=1e-5, atol=1e-4)


def test_own_fp16_kernel_refuses_bad_inputs() -> None:
    x, weight = torch.randn(2, 8), torch.randn(3, 8).half()
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_kernels.half_linear(x[:, :4], weight, None)
    with pytest.raises(RuntimeError, match="fp32 and w fp16"):
        cpu_kernels.half_linear(x, weight.float(), None)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.half_linear(torch.randn(8, 2).t(), weight, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.half_linear(x, weight, torch.randn(4))


@needs_fbgemm
def test_conversion_swaps_linears_and_keeps_what_fp16_cannot_hold() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)),
                          nn.Linear(4, 2))
    with torch.no_grad():
        model[3].weight[0, 0] = 1e6
    x = torch.randn(3, 8)
    before = model(x)
    assert convert_linears(model) == 2
    assert isinstance(model[0], HalfWeightLinear)
    assert isinstance(model[2][0], HalfWeightLinear)
    assert type(model[3]) is nn.Linear
    torch.testing.assert_close(model(x), before, rtol=1e-2, atol=1e-2)


@needs_fbgemm
def test_tied_embeddings_stay_fp32() -> None:
    model = tiny_llama(tie_word_embeddings=True)
    use_half_weights(model, torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert isinstance(model.get_output_embeddings(), HalfWeightLinear)


@needs_fbgemm
def test_bf16_model_greedy_equals_generate_with_the_same_weights() -> None:
    """The oracle: transformers computing in fp32 over the bf16-rounded weights."""
    prompts = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = tiny_llama(dtype=torch.bfloat16).float()
    expected = [reference_greedy(reference, p, 10) for p in prompts]
    model = tiny_llama(dtype=torch.bfloat16)
    use_half_weights(model, torch.bfloat16)
    core, _ = tiny_core(model)
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


@pytest.mark.parametrize(("dtype", "device", "native", "expected"), [
    (torch.bfloat16, "cpu", False, True),
    (torch.float16, "cpu", False, True),
    (torch.bfloat16, "cpu", True, False),
    (torch.float32, "cpu", False, False),
    (torch.bfloat16, "cuda", False, False),
])
def test_when_half_weights_apply(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype,
                                 device: str, native: bool, expected: bool) -> None:
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "cpu_supports_fp16", lambda: native)
    assert half_weights_in_fp32(dtype, torch.device(device)) is expected
