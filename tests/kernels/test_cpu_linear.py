"""CPU linear layers: Conveyor's panel kernel, oneDNN and fbgemm fallbacks, and the oracle."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import build as cpu_build
from engine.kernels.cpu import linear as cpu_linear
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import (
    SMALL_BATCH_ROWS,
    SMALL_BATCH_ROWS_PLAIN,
    GatedPanelLinear,
    HalfWeightLinear,
    PackedLinear,
    PanelLinear,
    convert_linears,
    fbgemm_fp16_available,
    onednn_linear_available,
    pack_linears,
)
from engine.loading import model_loader
from engine.loading.model_loader import (
    LinearForm,
    half_weights_in_fp32,
    use_linear_form,
)
from engine.models import build_causal_lm
from engine.models.llama import PagedLlamaLayer
from tests.helpers import (
    NO_BF16_PANELS,
    bf16_reference,
    needs_bf16_panels,
    needs_panels,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
)

needs_fbgemm = pytest.mark.skipif(
    not fbgemm_fp16_available(), reason="this torch build has no fbgemm fp16 GEMM"
)
needs_onednn = pytest.mark.skipif(
    not onednn_linear_available(), reason="this torch build cannot pack weights for oneDNN"
)


@pytest.fixture(params=[True, False], ids=["panels", "torch"])
def panels(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Run a test with Conveyor's panel kernel, and again as where it cannot build."""
    if request.param:
        assert cpu_ops.panel_linear_available(), "the C++ kernels must build here"
    else:
        monkeypatch.setattr(cpu_ops, "panel_linear_available", lambda: False)
    return request.param


@pytest.fixture(params=["bf16", "fp16", "torch"])
def half_weights(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How a bf16 model's linear layers run between fp32 activations: bf16 panels (CPUs with
    AVX-512 BF16), fp16 panels, or torch's fbgemm fp16-weight GEMM where the kernels cannot
    build."""
    if request.param == "bf16":
        if NO_BF16_PANELS:
            pytest.skip(NO_BF16_PANELS)
        return request.param
    monkeypatch.setattr(cpu_ops, "bf16_panels_available", lambda: False)
    monkeypatch.setattr(model_loader, "bf16_panels_available", lambda: False)
    if request.param == "torch":
        if not fbgemm_fp16_available():
            pytest.skip("this torch build has no fbgemm fp16 GEMM")
        monkeypatch.setattr(cpu_ops, "panel_linear_available", lambda: False)
    return request.param


HALF_WEIGHT_LAYERS = {"bf16": PanelLinear, "fp16": PanelLinear, "torch": HalfWeightLinear}
PANEL_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


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
    paged = next(m for m in core.runner.model.modules() if isinstance(m, PagedLlamaLayer))
    # fp32 weights take fp32 rows: nothing is rounded on the way.
    hidden = torch.randn(3, paged.input_norm.weight.shape[0])
    assert paged._norm(paged.input_norm, hidden, paged.qkv_proj).dtype == torch.float32
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


@needs_fbgemm
@pytest.mark.parametrize(
    "rows",
    [
        1,
        7,
        SMALL_BATCH_ROWS,
        SMALL_BATCH_ROWS + 1,
        SMALL_BATCH_ROWS_PLAIN,
        SMALL_BATCH_ROWS_PLAIN + 1,
        300,
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("onednn", [True, False])
def test_fbgemm_layer_matches_fp32_product_of_rounded_weights(
    monkeypatch: pytest.MonkeyPatch, rows: int, with_bias: bool, onednn: bool
) -> None:
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


@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 8, 1),
        (1, 24, 64),
        (1, 40, 100),
        (2, 13, 5),
        (2, 96, 80),
        (3, 96, 17),
        (3, 40, 64),
        (4, 100, 40),
        (5, 1000, 9),
        (6, 24, 32),
        (7, 24, 3),
        (8, 40, 20),
        (13, 64, 33),
        (16, 37, 64),
        (64, 96, 48),
        (20, 9000, 18),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
def test_panel_kernel_matches_the_exact_product(
    rows: int, in_features: int, out_features: int, with_bias: bool, storage: torch.dtype
) -> None:
    """One to three rows over several panels at a time and one at a time, passes of 4 to 6
    rows, a last panel with spare columns, and rows in chunks (9000 inputs leave room for 6
    rows per chunk)."""
    assert cpu_ops.panel_linear_available()
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
        cpu_ops.panel_linear(x[:, :4].contiguous(), panels, None, 3)
    with pytest.raises(RuntimeError, match="number of panels"):
        cpu_ops.panel_linear(x, panels, None, 17)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        cpu_ops.panel_linear(x.double(), panels, None, 3)
    with pytest.raises(RuntimeError, match="fp32, fp16, bf16 pairs or uint8 blocks"):
        cpu_ops.panel_linear(x, panels.double(), None, 3)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.panel_linear(torch.randn(8, 2).t(), panels, None, 3)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.panel_linear(x, panels, torch.randn(3), 3)


def bf16_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What bf16 panels compute: x rounded to bf16 times the bf16 weight, summed exactly (fp64
    here; the kernel sums in fp32)."""
    bias = None if bias is None else bias.detach().double()
    return F.linear(x.bfloat16().double(), weight.detach().bfloat16().double(), bias).float()


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features"),
    [
        (1, 8, 1),
        (1, 24, 64),
        (1, 40, 100),
        (1, 64, 200),
        (2, 14, 5),
        (2, 96, 80),
        (3, 96, 17),
        (3, 40, 64),
        (4, 100, 40),
        (5, 1000, 9),
        (8, 24, 32),
        (9, 24, 3),
        (13, 64, 33),
        (16, 38, 64),
        (64, 96, 48),
        (20, 9000, 18),
        (4, 64, 1000),
        (33, 48, 700),
        (16, 2000, 520),
        (150, 2000, 300),
        (1, 32, 16),
        (17, 64, 48),
        (70, 576, 200),
        (33, 160, 700),
        (100, 1536, 40),
        (250, 576, 33),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.usefixtures("bf16_products")
def test_bf16_panels_multiply_bf16_rounded_inputs(
    rows: int, in_features: int, out_features: int, with_bias: bool
) -> None:
    """One row over 8 panels at a time, two over 4, three over 2, then passes of up to 8 rows
    over 2 panels or a last odd one, a last panel with spare columns, rows in chunks (9000
    inputs: 8 rows a chunk), inputs not a multiple of 16; many panels hand each thread several
    runs, each taken as the one before ends; 150 rows of 2000 inputs go as chunks of 64, 64
    and 22 rows, each with its runs of the 19 panels. In tiles (inputs a multiple of 32; others
    keep the dot products): rows in blocks of 16 two at a time, a last block of a few rows, a
    last odd panel, chunks of 32 rows a multiple (1536 inputs: 64 rows a chunk)."""
    torch.manual_seed(rows + in_features)
    linear = nn.Linear(in_features, out_features, bias=with_bias)
    layer = PanelLinear(linear.weight, linear.bias, torch.bfloat16)
    assert layer.panels.shape == (-(-out_features // 16), in_features // 2, 32)
    assert layer.bf16_activations and "bfloat16 x bf16 activations" in repr(layer)
    x = torch.randn(rows, in_features)
    out = layer(x)
    assert out.shape == (rows, out_features) and out.dtype == torch.float32
    torch.testing.assert_close(
        out, bf16_product(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-4
    )
    assert torch.equal(layer.weight, linear.weight.detach().bfloat16().float())


@needs_bf16_panels
@pytest.mark.parametrize("in_features", [200, 192])
@pytest.mark.usefixtures("bf16_products")
def test_bf16_panel_rows_do_not_depend_on_their_batch(in_features: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, 150)
    layer = PanelLinear(linear.weight, linear.bias, torch.bfloat16)
    x = torch.randn(64, in_features)
    batched = layer(x)
    for rows in (1, 2, 3, 4, 8, 9, 17):
        assert torch.equal(layer(x[:rows]), batched[:rows]), rows
    assert torch.equal(layer(x[40:41]), batched[40:41])


def test_bf16_panels_pair_the_input_features() -> None:
    """Each pair of inputs holds each column's two weights side by side; unpacking inverts it."""
    weight = torch.arange(20 * 6, dtype=torch.float32).view(20, 6)
    panels = cpu_linear.pack_panels(weight, torch.bfloat16)
    assert panels.shape == (2, 3, 32)
    assert panels[0, 1, :4].tolist() == [2.0, 3.0, 8.0, 9.0]  # column 0, then 1, inputs 2-3
    assert panels[1, 0, 6:8].tolist() == [114.0, 115.0]  # column 19, inputs 0-1
    assert panels[1, 0, 8:].abs().sum() == 0  # spare columns
    assert torch.equal(cpu_linear.unpack_panels(panels, 20), weight)


def test_bf16_panels_of_the_wrong_width_are_refused() -> None:
    assert cpu_ops.panel_linear_available()
    with pytest.raises(RuntimeError, match=r"bf16 panels must be \[panels, in / 2, 32\]"):
        cpu_ops.panel_linear(torch.randn(2, 8), torch.ones(1, 8, 16, dtype=torch.bfloat16), None, 3)


BF16_STORAGE = pytest.param(torch.bfloat16, marks=needs_bf16_panels)


@pytest.mark.parametrize("storage", [torch.float32, torch.float16, BF16_STORAGE])
@pytest.mark.parametrize("rows", [1, 2, 3, 9, 64])
def test_a_residual_adds_to_the_product_as_after_it(storage: torch.dtype, rows: int) -> None:
    """The skip connection added as the product is stored (bf16 panels) or right after (other
    panels) equals `residual + x W^T + b` computed apart, to the bit."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40)
    layer = PanelLinear(linear.weight, linear.bias, storage)
    x, residual = torch.randn(rows, 96), torch.randn(rows, 40)
    before = residual.clone()
    assert torch.equal(layer(x, residual), residual + layer(x))
    assert torch.equal(residual, before)
    assert torch.equal(
        layer(x.view(1, rows, 96), residual.view(1, rows, 40)),
        (residual + layer(x)).view(1, rows, 40),
    )


def test_a_residual_of_the_wrong_shape_is_refused() -> None:
    layer = PanelLinear(torch.randn(40, 96), None)
    with pytest.raises(RuntimeError, match="residual must be contiguous fp32"):
        cpu_ops.panel_linear(torch.randn(2, 96), layer.panels, None, 40, torch.randn(2, 41))
    with pytest.raises(RuntimeError, match="residual must be contiguous fp32"):
        cpu_ops.panel_linear(
            torch.randn(2, 96), layer.panels, None, 40, torch.randn(2, 40).double()
        )


def gate_and_up(
    in_features: int,
    inter: int,
    with_bias: bool,
    gelu: bool = False,
    clamped: tuple[float, float] | None = None,
) -> tuple[PanelLinear, PanelLinear, GatedPanelLinear]:
    torch.manual_seed(in_features + inter)
    gate, up = (
        nn.Linear(in_features, inter, bias=with_bias),
        nn.Linear(in_features, inter, bias=with_bias),
    )
    layers = [PanelLinear(m.weight, m.bias, torch.bfloat16) for m in (gate, up)]
    gated = GatedPanelLinear.of(*layers, gelu=gelu, clamped=clamped)
    assert gated is not None
    return layers[0], layers[1], gated


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "in_features", "inter"),
    [
        (1, 8, 1),
        (1, 64, 200),
        (1, 40, 72),
        (2, 96, 80),
        (2, 14, 5),
        (3, 40, 64),
        (3, 96, 17),
        (5, 100, 40),
        (9, 24, 3),
        (16, 38, 64),
        (64, 96, 48),
        (20, 9000, 18),
        (8, 64, 600),
        (40, 96, 330),
        (150, 2000, 200),
        (17, 64, 48),
        (70, 576, 200),
        (250, 576, 40),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "clamped_swiglu"])
@pytest.mark.usefixtures("bf16_products")
def test_gated_panels_equal_the_projection_then_the_activation(
    rows: int, in_features: int, inter: int, with_bias: bool, activation: str
) -> None:
    """silu(gate) * up (or GELU's tanh approximation's, or the clamped SwiGLU under a limit its
    sums pass) from gate/up panel pairs equals, to the bit, both projections through the bf16
    panels followed by `silu_mul` (`gelu_tanh_mul`, `clamped_swiglu_mul`): one row over 4 pairs
    at a time, two over 2, three over 1, then passes of up to 8 rows, spare columns, rows in
    chunks."""
    clamped = (1.702, 0.3) if activation == "clamped_swiglu" else None
    gate, up, gated = gate_and_up(in_features, inter, with_bias, activation == "gelu_tanh", clamped)
    panels = -(-inter // 16)
    assert gated.panels.shape == (panels, 2, in_features // 2, 32)
    assert torch.equal(gated.panels[:, 0], gate.panels)
    assert torch.equal(gated.panels[:, 1], up.panels)
    named = "clamped swiglu(gate, up)" if clamped else f"{activation}(gate) * up"
    assert named in repr(gated)
    x = torch.randn(rows, in_features)
    out = gated(x)
    assert out.shape == (rows, inter) and out.dtype == torch.float32
    both = torch.cat([gate(x), up(x)], dim=1)
    if clamped is not None:
        expected = cpu_ops.clamped_swiglu_mul(both, *clamped)
        assert bool((both.abs() > clamped[1]).any())  # the clamps bite
    else:
        expected = getattr(cpu_ops, f"{activation}_mul")(both)
    assert torch.equal(out, expected)
    assert torch.equal(gated(x.view(1, rows, in_features)), expected.view(1, rows, inter))


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "in_features", "inter"),
    [(1, 8, 1), (2, 14, 5), (3, 96, 17), (16, 38, 64), (70, 576, 200)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_panels_give_gate_and_up_before_the_activation(
    rows: int, in_features: int, inter: int, with_bias: bool
) -> None:
    """What LoRA adapters change before the activation: gate and up from the panel pairs in one
    pass, in order, equal to the bit each projection's own product, and activated they are the
    gated op's output."""
    gate, up, gated = gate_and_up(in_features, inter, with_bias)
    x = torch.randn(rows, in_features)
    both = gated.gate_and_up(x)
    assert both.shape == (rows, 2 * inter)
    assert torch.equal(both, torch.cat([gate(x), up(x)], dim=1))
    assert torch.equal(cpu_ops.silu_mul(both), gated(x))


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "in_features", "inter"),
    [(1, 64, 200), (3, 40, 72), (16, 96, 330), (150, 2000, 200), (70, 576, 200)],
)
@pytest.mark.usefixtures("bf16_products")
def test_gated_bf16_rows_feed_a_bf16_product_as_it_would_round_them(
    rows: int, in_features: int, inter: int
) -> None:
    """With `bf16_out` the gated product writes its rows rounded to bf16 (spare columns of the
    last panel left out), equal to the bit to rounding its fp32 rows; a bf16 product over them
    gives the bits it gives over the fp32 rows, with or without a residual."""
    _, _, gated = gate_and_up(in_features, inter, True)
    x = torch.randn(rows, in_features)
    fp32 = gated(x)
    rounded = gated(x, bf16_out=True)
    assert rounded.dtype == torch.bfloat16 and rounded.shape == (rows, inter)
    assert torch.equal(rounded, fp32.bfloat16())
    down = PanelLinear(torch.randn(48, inter), torch.randn(48), torch.bfloat16)
    residual = torch.randn(rows, 48)
    assert torch.equal(down(rounded), down(fp32))
    assert torch.equal(down(rounded, residual), down(fp32, residual))
    assert down(rounded).dtype == torch.float32
    # The gated product takes bf16 rows too, as it would round fp32 ones.
    assert torch.equal(gated(x.bfloat16()), fp32)
    assert torch.equal(gated(x.bfloat16(), bf16_out=True), rounded)


@needs_bf16_panels
def test_only_bf16_panels_take_bf16_rows() -> None:
    x = torch.randn(4, 32).bfloat16()
    for storage in (torch.float32, torch.float16):
        layer = PanelLinear(torch.randn(16, 32), None, storage)
        with pytest.raises(RuntimeError, match="x must be fp32 \\(or bf16 over bf16 panels\\)"):
            cpu_ops.panel_linear(x, layer.panels, None, 16)
        # The layer widens them to fp32 rows for such panels.
        assert torch.equal(layer(x), layer(x.float()))


@needs_bf16_panels
@pytest.mark.parametrize("in_features", [200, 192])
@pytest.mark.usefixtures("bf16_products")
def test_gated_rows_do_not_depend_on_their_batch(in_features: int) -> None:
    _, _, gated = gate_and_up(in_features, 150, True)
    x = torch.randn(64, in_features)
    batched = gated(x)
    for rows in (1, 2, 3, 4, 8, 9, 17):
        assert torch.equal(gated(x[:rows]), batched[:rows]), rows
    assert torch.equal(gated(x[40:41]), batched[40:41])


@needs_bf16_panels
@pytest.mark.parametrize(
    ("rows", "in_features"), [(1, 96), (3, 96), (16, 96), (64, 96), (150, 2000), (150, 576)]
)
@pytest.mark.usefixtures("bf16_products")
def test_bf16_products_do_not_depend_on_the_thread_count(rows: int, in_features: int) -> None:
    """Runs of panels go to whichever thread is free; every output is one pass's sums, so the
    bits are the same on one thread or several, over many runs (1000 outputs: 63 panels), and
    over several chunks of rows (2000 inputs: 64 rows a chunk)."""
    torch.manual_seed(rows)
    plain = PanelLinear(torch.randn(1000, in_features), torch.randn(1000), torch.bfloat16)
    _, _, gated = gate_and_up(in_features, 1000, True)
    x = torch.randn(rows, in_features)
    threads = torch.get_num_threads()
    try:
        outputs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outputs.append((plain(x), gated(x), plain(x, x[:, :1].expand(rows, 1000).contiguous())))
    finally:
        torch.set_num_threads(threads)
    for other in outputs[1:]:
        for first, then in zip(outputs[0], other, strict=True):
            assert torch.equal(first, then)


@pytest.mark.skipif(
    "amx_bf16" not in cpu_build.cpu_flags().split(), reason="this CPU has no AMX-BF16"
)
def test_amx_cpus_run_the_bf16_products_in_tiles() -> None:
    """Where the CPU has AMX-BF16, the kernel grants the tiles and the products use them; the
    tiles and the dot products give the same sums but for the last bits of their rounding."""
    assert cpu_ops.bf16_tiles_available()
    torch.manual_seed(0)
    layer = PanelLinear(torch.randn(300, 576), torch.randn(300), torch.bfloat16)
    x = torch.randn(40, 576)
    before = cpu_ops.use_bf16_tiles(False)
    try:
        dot_products = layer(x)
        assert cpu_ops.use_bf16_tiles(True) is False
        tiles = layer(x)
    finally:
        cpu_ops.use_bf16_tiles(before)
    assert before is True
    torch.testing.assert_close(tiles, dot_products, rtol=1e-5, atol=1e-5)


@needs_bf16_panels
def test_gated_panels_need_two_bf16_projections_alike() -> None:
    gate, up, _ = gate_and_up(32, 48, True)
    assert GatedPanelLinear.of(gate, PanelLinear(torch.randn(48, 32), None, torch.bfloat16)) is None
    assert (
        GatedPanelLinear.of(gate, PanelLinear(torch.randn(64, 32), torch.randn(64), torch.bfloat16))
        is None
    )
    assert GatedPanelLinear.of(PanelLinear(torch.randn(48, 32), torch.randn(48)), up) is None
    assert GatedPanelLinear.of(gate, nn.Linear(32, 48)) is None


@pytest.mark.parametrize("storage", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_layer_splits_into_two_over_views_of_its_panels(
    storage: torch.dtype, with_bias: bool
) -> None:
    """Phi-3's one gate/up projection taken apart: each part's outputs are the whole layer's
    columns to the bit, over its panels as held (no copy); a cut inside a panel, or at either
    end, is refused."""
    torch.manual_seed(3)
    linear = nn.Linear(40, 90, bias=with_bias)
    whole = PanelLinear(linear.weight, linear.bias, storage)
    parts = whole.split(48)
    assert parts is not None
    first, second = parts
    assert (first.out_features, second.out_features) == (48, 42)
    assert second.panels.data_ptr() == whole.panels[3].data_ptr()
    x = torch.randn(5, 40)
    out = whole(x)
    assert torch.equal(first(x), out[:, :48])
    assert torch.equal(second(x), out[:, 48:])
    assert all(whole.split(at) is None for at in (40, 0, 96, 90))


@needs_bf16_panels
@pytest.mark.usefixtures("bf16_products")
def test_one_gate_up_projection_split_makes_gated_panels() -> None:
    """Gate and up held as one bf16 layer (Phi-3's) split and paired: the gated op equals the
    one layer's product followed by `silu_mul`, to the bit."""
    torch.manual_seed(4)
    linear = nn.Linear(64, 96, bias=False)
    whole = PanelLinear(linear.weight, None, torch.bfloat16)
    parts = whole.split(48)
    assert parts is not None
    gated = GatedPanelLinear.of(*parts)
    assert gated is not None
    x = torch.randn(3, 64)
    assert torch.equal(gated(x), cpu_ops.silu_mul(whole(x)))


@needs_bf16_panels
def test_the_gated_op_refuses_bad_inputs() -> None:
    _, _, gated = gate_and_up(32, 48, True)
    x = torch.randn(2, 32)
    with pytest.raises(RuntimeError, match=r"panels must be contiguous bf16"):
        cpu_ops.gated_linear(x, gated.panels[:, 0], None, 48)
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_ops.gated_linear(torch.randn(2, 30), gated.panels, None, 48)
    with pytest.raises(RuntimeError, match="inter does not match"):
        cpu_ops.gated_linear(x, gated.panels, None, 49)
    with pytest.raises(RuntimeError, match="bias must be"):
        cpu_ops.gated_linear(x, gated.panels, torch.randn(48), 48)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        cpu_ops.gated_linear(x.double(), gated.panels, None, 48)


def test_panel_layers_take_any_leading_shape_and_fuse() -> None:
    torch.manual_seed(1)
    first, second = nn.Linear(32, 20), nn.Linear(32, 12)
    layer = PanelLinear(first.weight, first.bias, torch.float16)
    fused = layer.remade(
        torch.cat([first.weight, second.weight]), torch.cat([first.bias, second.bias])
    )
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
    model = nn.Sequential(
        nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 2)
    )
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
    use_linear_form(model, LinearForm.BF16_PANELS)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert isinstance(model.get_output_embeddings(), PanelLinear)


def test_bf16_model_greedy_equals_generate_with_the_same_weights(half_weights: str) -> None:
    """The oracle: transformers computing in fp32 over the bf16-rounded weights (and, for bf16
    panels, over bf16-rounded inputs to each linear layer)."""
    prompts = [[5, 9, 33, 2], list(range(40, 120)), [7] * 13]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reference = bf16_reference(half_weights)
    expected = [reference_greedy(reference, p, 10) for p in prompts]
    model = tiny_llama(dtype=torch.bfloat16)
    use_linear_form(model, LinearForm.BF16_PANELS)
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, HALF_WEIGHT_LAYERS[half_weights])
    if half_weights != "torch":
        assert layer.panels.dtype == PANEL_DTYPES[half_weights]
    core, _ = tiny_core(model)
    paged = next(m for m in core.runner.model.modules() if isinstance(m, PagedLlamaLayer))
    # bf16 panels: RMSNorm hands q/k/v and gate/up their rows in bf16, and the gated product
    # the down projection.
    hidden = torch.randn(3, paged.input_norm.weight.shape[0])
    rows = torch.bfloat16 if half_weights == "bf16" else torch.float32
    assert paged._norm(paged.input_norm, hidden, paged.qkv_proj).dtype == rows
    assert paged._norm(paged.post_attention_norm, hidden, paged.gate_up_proj).dtype == rows
    assert paged._activation(hidden).dtype == rows
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


@needs_bf16_panels
def test_bf16_prompt_products_in_chunks_and_over_a_cached_prefix(tmp_path) -> None:
    """A bf16 checkpoint's prompts attend in bf16 products also when they run in chunks after
    tokens already cached, and after a prefix another prompt left in the cache: greedy still
    equals the oracle."""
    from engine.core.config import CacheConfig, EngineConfig
    from engine.factory import create_engine_core
    from tests.helpers import tiny_tokenizer

    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    config = EngineConfig(
        model=str(tmp_path),
        device="cpu",
        max_num_batched_tokens=24,
        cache=CacheConfig(num_blocks=64, block_size=8),
    )
    core, _, _ = create_engine_core(config)
    assert core.runner.backend.bf16_prompts
    first = list(range(40, 120))
    second = [*first[:64], 7, 3, 250, 18, 99]
    reference = bf16_reference("bf16")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for prompt, cached in ((first, 0), (second, 64)):
        outputs = run_all(core, [prompt], params)["req-0"]
        assert outputs[-1].num_cached_tokens == cached
        assert tokens_of(outputs) == reference_greedy(reference, prompt, 8)


@pytest.mark.parametrize(
    ("dtype", "device", "native", "bf16_panels", "expected"),
    [
        (torch.bfloat16, "cpu", False, False, True),
        (torch.float16, "cpu", False, False, True),
        (torch.bfloat16, "cpu", True, False, False),  # torch's bf16 products
        (torch.bfloat16, "cpu", True, True, True),  # bf16 panels
        (torch.float16, "cpu", True, True, False),  # native fp16: torch's products
        (torch.float32, "cpu", False, False, False),
        (torch.bfloat16, "cuda", False, False, False),
    ],
)
def test_when_half_weights_apply(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    device: str,
    native: bool,
    bf16_panels: bool,
    expected: bool,
) -> None:
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "cpu_supports_fp16", lambda: native)
    monkeypatch.setattr(model_loader, "bf16_panels_available", lambda: bf16_panels)
    assert half_weights_in_fp32(dtype, torch.device(device)) is expected


@pytest.mark.parametrize(
    ("dtype", "device", "native", "bf16_panels", "packs", "expected"),
    [
        (torch.bfloat16, "cpu", True, True, True, LinearForm.BF16_PANELS),
        (torch.bfloat16, "cpu", False, False, True, LinearForm.HALF_WEIGHTS),
        (torch.bfloat16, "cpu", True, False, True, LinearForm.TORCH),  # torch's bf16 products
        (torch.float32, "cpu", True, True, True, LinearForm.FP32_PANELS),
        (torch.float32, "cpu", False, False, False, LinearForm.TORCH),  # no kernels built
        (torch.float32, "cuda", False, False, True, LinearForm.TORCH),
        (torch.bfloat16, "cuda", True, True, True, LinearForm.TORCH),
    ],
)
def test_the_linear_form_is_chosen_in_one_place(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    device: str,
    native: bool,
    bf16_panels: bool,
    packs: bool,
    expected: LinearForm,
) -> None:
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "bf16_panels_available", lambda: bf16_panels)
    monkeypatch.setattr(model_loader, "fp32_packing_supported", lambda: packs)
    assert model_loader.choose_linear_form(dtype, torch.device(device)) is expected


@pytest.mark.parametrize(
    ("stored", "native", "half", "expected"),
    [
        (torch.bfloat16, False, True, torch.bfloat16),  # 16-bit weights, fp32 compute
        (torch.float16, False, True, torch.float16),
        (torch.float32, False, True, torch.float32),
        (None, False, True, torch.float32),  # the config names no dtype
        (torch.bfloat16, False, False, torch.float32),  # no 16-bit-weight product here
        (torch.float32, True, True, torch.bfloat16),  # native bf16
    ],
)
def test_auto_dtype_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
    stored: torch.dtype | None,
    native: bool,
    half: bool,
    expected: torch.dtype,
) -> None:
    monkeypatch.setattr(model_loader, "checkpoint_dtype", lambda model, trust: stored)
    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: native)
    monkeypatch.setattr(model_loader, "half_weights_supported", lambda: half)
    assert model_loader.resolve_dtype("auto", torch.device("cpu"), "some/model") == expected
    assert model_loader.resolve_dtype("float32", torch.device("cpu"), "x") == torch.float32


def test_a_bf16_checkpoint_served_with_auto_keeps_16_bits(
    tmp_path,
    half_weights: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--dtype auto` on a CPU without native bf16 (fp16 panels, fbgemm) or with AVX-512 BF16
    (bf16 panels): the bf16 checkpoint keeps 16-bit weights and K/V, carries fp32 activations,
    and greedy equals transformers in fp32 over the same weights (and bf16-rounded inputs to
    each linear layer for bf16 panels)."""
    from engine.core.config import CacheConfig, EngineConfig
    from engine.factory import create_engine_core
    from tests.helpers import tiny_tokenizer

    monkeypatch.setattr(model_loader, "cpu_supports_bf16", lambda: half_weights == "bf16")
    tiny_llama(dtype=torch.bfloat16).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert model_loader.checkpoint_dtype(str(tmp_path)) == torch.bfloat16
    config = EngineConfig(
        model=str(tmp_path), device="cpu", cache=CacheConfig(num_blocks=64, block_size=8)
    )
    core, loaded, info = create_engine_core(config)
    assert (info.dtype, info.kv_cache_dtype) == ("bfloat16", "bfloat16")
    # With bf16 panels the prompts attend in bf16 products too, which the oracle keeps in fp32.
    assert core.runner.backend.bf16_prompts == (half_weights == "bf16")
    layer = loaded.model.model.layers[0].mlp.down_proj
    assert isinstance(layer, HALF_WEIGHT_LAYERS[half_weights])
    if half_weights != "torch":
        assert layer.panels.dtype == PANEL_DTYPES[half_weights]
    prompts = [[5, 9, 33, 2], list(range(40, 120))]
    reference = bf16_reference(half_weights)
    expected = [reference_greedy(reference, p, 8) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts))] == expected


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of every distinct storage the modules' parameters and buffers lie in."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for module in modules
        for t in [*module.parameters(), *module.buffers()]
    }
    return sum(storages.values())


@pytest.mark.parametrize(
    "form",
    [
        pytest.param(LinearForm.FP32_PANELS, marks=needs_panels),
        pytest.param(LinearForm.BF16_PANELS, marks=needs_bf16_panels),  # gate/up gated
    ],
)
def test_fused_panels_keep_no_second_copy(form: LinearForm) -> None:
    """Joined q/k/v panels and gated gate/up panels are built from the loaded model's panels,
    which then hold views of them: no weight is held twice, and the loaded model computes as
    before (the gate and up views through a copy each)."""
    model = tiny_llama(dtype=torch.bfloat16 if form is LinearForm.BF16_PANELS else torch.float32)
    use_linear_form(model, form)
    ids = torch.tensor([[5, 9, 33, 2, 70]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
    held = weight_bytes(model)
    paged = build_causal_lm(model, "conveyor")
    layer = next(m for m in paged.modules() if isinstance(m, PagedLlamaLayer))
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.panels.untyped_storage().data_ptr() == (
        layer.qkv_proj.panels.untyped_storage().data_ptr()
    )
    if form is LinearForm.BF16_PANELS:
        assert isinstance(layer.gate_up_proj, GatedPanelLinear)
    assert mlp.up_proj.panels.untyped_storage().data_ptr() == (
        layer.gate_up_proj.panels.untyped_storage().data_ptr()
    )
    assert weight_bytes(model, paged) == held
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
