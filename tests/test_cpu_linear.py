"""CPU linear layers: Conveyor's panel kernel, oneDNN and fbgemm fallbacks, and the oracle."""

from __future__ import annotations

import copy

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
    PanelLinear,
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


@pytest.fixture(params=[True, False], ids=["panels", "torch"])
def panels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with Conveyor's panel kernel, and again as where it cannot build."""
    if request.param:
        assert cpu_kernels.panel_linear_available(), "the C++ kernels must build here"
    else:
        monkeypatch.setattr(cpu_kernels, "panel_linear_available", lambda: False)
    return request.param


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


def test_packed_model_greedy_equals_generate(panels: bool) -> None:
    if not panels and not onednn_linear_available():
        pytest.skip("this torch build cannot pack weights for oneDNN")
    prompts = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    expected = [reference_greedy(tiny_llama(), p, 10) for p in prompts]
    model = tiny_llama()
    assert pack_linears(model) == 7 * model.config.num_hidden_layers + 1
    kind = PanelLinear if panels else PackedLinear
    assert isinstance(model.get_output_embeddings(), kind)
    core, _ = tiny_core(model)
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


@needs_fbgemm
@pytest.mark.parametrize("rows", [1, 7, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1,
                                  SMALL_BATCH_ROWS_PLAIN, SMALL_BATCH_ROWS_PLAIN + 1, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("onednn", [True, False])
def test_fbgemm_layer_matches_fp32_product_of_rounded_weights(monkeypatch: pytest.MonkeyPatch,
                                                              rows: int, with_bias: bool,
                                                              onednn: bool) -> None:
    if onednn and not onednn_linear_available():
        pytest.skip("this torch build cannot pack weights for oneDNN")
    monkeypatch.setattr(cpu_linear, "onednn_linear_available", lambda: onednn)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=with_bias)
    layer = HalfWeightLinear(linear.weight, linear.bias)
    assert (layer.large is not None) is onednn
    assert layer.small_rows == (SMALL_BATCH_ROWS if onednn else SMALL_BATCH_ROWS_PLAIN)
    x = torch.randn(1, rows, 96)
    expected = F.linear(x, linear.weight.half().float(), linear.bias)
    out = layer(x)
    assert out.shape == (1, rows, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(layer.weight, linear.weight.half().float())


@pytest.mark.parametrize(("rows", "in_features", "out_features"),
                         [(1, 8, 1), (1, 24, 64), (1, 40, 100), (2, 13, 5), (2, 96, 80),
                          (3, 96, 17), (3, 40, 64), (4, 100, 40), (5, 1000, 9), (6, 24, 32),
                          (7, 24, 3), (8, 40, 20), (13, 64, 33), (16, 37, 64), (64, 96, 48),
                          (20, 9000, 18)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_panel_kernel_matches_the_exact_product(rows: int, in_features: int, out_features: int,
                                                with_bias: bool, storage: torch.dtype) -> None:
    """One to three rows over several panels at a time and one at a time, passes of 4 to 6
    rows, a last panel with spare columns, and rows in chunks (9000 inputs leave room for 6
    rows per chunk)."""
    assert cpu_kernels.panel_linear_available()
    torch.manual_seed(rows + in_features)
    linear = nn.Linear(in_features, out_features, bias=with_bias)
    layer = PanelLinear(linear.weight, linear.bias, storage)
    x = torch.randn(rows, in_features)
    weight = linear.weight.detach().to(storage).double()
    bias = None if linear.bias is None else linear.bias.detach().double()
    expected = F.linear(x.double(), weight, bias).float()
    out = layer(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer.weight, linear.weight.detach().to(storage).float())
    assert (layer.bias is None) is (not with_bias)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_panel_rows_do_not_depend_on_their_batch(storage: torch.dtype) -> None:
    """Each output sums its products in the same order on every path, so a row computed alone,
    or in any batch, is bit for bit the same."""
    torch.manual_seed(0)
    linear = nn.Linear(200, 72)
    layer = PanelLinear(linear.weight, linear.bias, storage)
    x = torch.randn(64, 200)
    batched = layer(x)
    for rows in (1, 2, 3, 6, 7, 13):
        assert torch.equal(layer(x[:rows]), batched[:rows]), rows
    assert torch.equal(layer(x[40:41]), batched[40:41])


def test_panel_kernel_refuses_bad_inputs() -> None:
    x = torch.randn(2, 8)
    panels = PanelLinear(torch.randn(3, 8), None).panels
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_kernels.panel_linear(x[:, :4].contiguous(), panels, None, 3)
    with pytest.raises(RuntimeError, match="number of panels"):
        cpu_kernels.panel_linear(x, panels, None, 17)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        cpu_kernels.panel_linear(x.double(), panels, None, 3)
    with pytest.raises(RuntimeError, match="fp32, fp16 or uint8 blocks"):
        cpu_kernels.panel_linear(x, panels.double(), None, 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_kernels.panel_linear(torch.randn(8, 2).t(), panels, None, 3)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_kernels.panel_linear(x, panels, torch.randn(3), 3)


def test_panel_layers_take_any_leading_shape_and_fuse() -> None:
    torch.manual_seed(1)
    first, second = nn.Linear(32, 20), nn.Linear(32, 12)
    layer = PanelLinear(first.weight, first.bias, torch.float16)
    fused = layer.remade(torch.cat([first.weight, second.weight]),
                        torch.cat([first.bias, second.bias]))
    assert fused.panels.dtype == torch.float16 and fused.out_features == 32
    x = torch.randn(2, 3, 32)
    out = fused(x)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out[..., :20], layer(x), rtol=0, atol=0)
    assert "float16" in repr(fused)


def test_conversion_swaps_linears_and_keeps_what_fp16_cannot_hold(panels: bool) -> None:
    if not panels and not fbgemm_fp16_available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    kind = PanelLinear if panels else HalfWeightLinear
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)),
                          nn.Linear(4, 2))
    with torch.no_grad():
        model[3].weight[0, 0] = 1e6
    x = torch.randn(3, 8)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for layer in (rounded[0], rounded[2][0]):
            layer.weight.copy_(layer.weight.half().float())
    before = rounded(x)
    assert convert_linears(model) == 2
    assert isinstance(model[0], kind)
    assert isinstance(model[2][0], kind)
    assert type(model[3]) is nn.Linear
    torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-5)


def test_tied_embeddings_stay_fp32() -> None:
    model = tiny_llama(tie_word_embeddings=True)
    use_half_weights(model, torch.bfloat16)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert isinstance(model.get_output_embeddings(), PanelLinear)


def test_bf16_model_greedy_equals_generate_with_the_same_weights(panels: bool) -> None:
    """The oracle: transformers computing in fp32 over the bf16-rounded weights."""
    if not panels and not fbgemm_fp16_available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
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


@pytest.mark.parametrize(("stored", "native", "half", "expected"), [
    (torch.bfloat16, False, True, torch.bfloat16),  # 16-bit weights, fp32 compute
    (torch.float16, False, True, torch.float16),
    (torch.float32, False, True, torch.float32),
    (None, False, True, torch.float32),  # the config names no dtype
    (torch.bfloat16, False, False, torch.float32),  # no 16-bit-weight product here
    (torch.float32, True, True, torch.bfloat16),  # native bf16
])
def test_auto_dtype_on_the_cpu(monkeypatch: pytest.MonkeyPatch, stored: torch.dtype | None,
                               native: bool, half: bool, expected: torch.dtype) -> None:
    monkeypatch.setattr(model_loader, "checkpoint_dtype", lambda model, trust: stored)
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "half_weights_supported", lambda: half)
    assert model_loader.resolve_dtype("auto", torch.device("cpu"), "some/model") == expected
    assert model_loader.resolve_dtype("float32", torch.device("cpu"), "x") == torch.float32


def test_a_bf16_checkpoint_served_with_auto_keeps_16_bits(tmp_path, panels: bool,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           ) -> None:
    """`--dtype auto` on a CPU without native bf16: the bf16 checkpoint keeps 16-bit weights
    and K/V, computes in fp32, and greedy equals transformers in fp32 over the same weights."""
    from engine.config import CacheConfig, EngineConfig
    from engine.factory import create_engine_core
    from tests.helpers import tiny_tokenizer

    if not panels and not fbgemm_fp16_available():
        pytest.skip("this torch build has no fbgemm fp16 GEMM")
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: False)
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert model_loader.checkpoint_dtype(str(tmp_path)) == torch.bfloat16
    config = EngineConfig(model=str(tmp_path), device="cpu",
                          cache=CacheConfig(num_blocks=64, block_size=8))
    core, loaded, info = create_engine_core(config)
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, PanelLinear if panels else HalfWeightLinear)
    prompts = [[5, 9, 33, 2], list(range(40, 120))]
    reference = tiny_llama(dtype=torch.bfloat16).float()
    expected = [reference_greedy(reference, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected
