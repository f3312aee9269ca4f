"""MXFP4 block panels multiplied in AVX-512 BF16 dot products (`csrc/linear/mxfp4_bf16.cpp`):
against the product of the weights the format defines and the inputs rounded to bf16, computed
in float64 by torch, and to the bit against bf16 panels of those weights; rows independent of
their batch; every scale byte the product takes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear, blocks_in_bf16, pad_to_panels
from engine.loading import gguf_blocks
from engine.loading.mxfp4_experts import gguf_rows
from tests.helpers import needs_bf16_panels
from tests.models.test_gpt_oss import mxfp4_weight

pytestmark = needs_bf16_panels


@pytest.fixture
def dot_products() -> Iterator[None]:
    """The bf16 panels' products in AVX-512 BF16 dot products, as this product runs (not in
    AMX tiles, which round their sums apart in the last bits)."""
    before = cpu_ops.use_bf16_tiles(False)
    yield
    cpu_ops.use_bf16_tiles(before)


def random_mxfp4(out: int, inputs: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 rows `[out, inputs / 32 * 17]` of random codes under scales either side of 1,
    and the fp32 weights `[out, inputs]` they stand for, by the format's definition."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, out, inputs // 32)
    blocks = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 132, shape, generator=generator, dtype=torch.uint8)
    return gguf_rows(blocks, scales)[0].contiguous(), mxfp4_weight(blocks, scales)[0]


def product(x: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None, out: int):
    panels = gguf_blocks.pack_panels(gguf_blocks.MXFP4, rows)
    padded = None if bias is None else pad_to_panels(bias)
    return cpu_ops.mxfp4_bf16_linear(x, panels, padded, out)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 100])
@pytest.mark.parametrize(("out", "inputs"), [(37, 96), (64, 256)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.usefixtures("dot_products")
def test_the_product_is_that_of_the_defined_weights_and_bf16_inputs(
    rows: int, out: int, inputs: int, with_bias: bool
) -> None:
    """Every output within fp32 summation of torch's float64 product of the inputs rounded to
    bf16 and the weights the codes and scales define (plus bias), and equal to the bit to bf16
    panels of those weights: the columns of a last, partly filled panel, one to a hundred
    rows."""
    weights_rows, weight = random_mxfp4(out, inputs, seed=rows)
    generator = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, inputs, generator=generator)
    bias = torch.randn(out, generator=generator) if with_bias else None
    rounded = x.bfloat16().double()
    expected = rounded @ weight.double().T + (0 if bias is None else bias.double())
    bound = 1e-6 * (rounded.abs() @ weight.double().abs().T) + 1e-6
    got = product(x, weights_rows, bias, out)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert ((got.double() - expected).abs() <= bound).all()
    assert torch.equal(got, PanelLinear(weight, bias, torch.bfloat16)(x))
    # Rounded once more, the inputs are the same: the product rounds them to bf16 itself.
    assert torch.equal(product(x.bfloat16().float(), weights_rows, bias, out), got)


@pytest.mark.parametrize("inputs", [64, 1024])
def test_rows_do_not_depend_on_their_batch(inputs: int) -> None:
    """A row's outputs are the same to the bit alone, among a few rows (widened in registers)
    and among many (widened once into a buffer)."""
    rows, _ = random_mxfp4(80, inputs)
    x = torch.randn(40, inputs, generator=torch.Generator().manual_seed(2))
    whole = product(x, rows, None, 80)
    for count in (1, 2, 3, 6, 8, 13):
        assert torch.equal(product(x[:count].contiguous(), rows, None, 80), whole[:count])
    assert torch.equal(product(x[39:].contiguous(), rows, None, 80), whole[39:])


@pytest.mark.usefixtures("dot_products")
def test_every_scale_byte_it_takes_scales_as_gguf_widens_it() -> None:
    """Each E8M0 byte from 16 to 239 (rows 1 to 14 of 16 rows of 16 scales) under every code:
    the identity's product gives the weights as GGUF's rows widen. Rows 0 and 15 hold bytes
    past `MXFP4_BF16_SCALES`, whose weights bf16 does not hold as normal numbers: a layer with
    one of them keeps the fp32 product, a layer without them takes this one."""
    scales = torch.arange(256, dtype=torch.uint8).view(16, 16, 1)
    codes = torch.arange(256, dtype=torch.uint8).roll(5).view(16, 16).expand(16, 16, 16)
    rows = torch.cat([scales, codes], dim=-1).reshape(16, -1).contiguous()
    expected = gguf_blocks.dequantize_rows(gguf_blocks.MXFP4, rows)
    assert set(expected[8, :32].tolist()) == set(gguf_blocks.MXFP4_LEVELS)  # byte 128
    got = product(torch.eye(512), rows, None, 16)
    assert torch.equal(got[:, 1:15], expected[1:15].T)
    for kept, held in ((rows[1:15], True), (rows[1:], False), (rows[:15], False)):
        layer = PanelLinear.of_blocks(gguf_blocks.MXFP4, kept.contiguous(), None)
        assert layer.multiply_in_bf16() is held and layer.bf16_blocks is held
    # The zero columns that fill a last panel do not count.
    assert PanelLinear.of_blocks(gguf_blocks.MXFP4, rows[1:4].contiguous(), None).multiply_in_bf16()


def test_bad_inputs_are_refused() -> None:
    rows, _ = random_mxfp4(16, 64)
    panels = gguf_blocks.pack_panels(gguf_blocks.MXFP4, rows)
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_ops.mxfp4_bf16_linear(torch.ones(2, 32), panels, None, 16)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        cpu_ops.mxfp4_bf16_linear(torch.ones(2, 64, dtype=torch.bfloat16), panels, None, 16)
    q8 = gguf_blocks.pack_panels(gguf_blocks.Q8_0, torch.zeros(16, 2 * 34, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="MXFP4 block panels"):
        cpu_ops.mxfp4_bf16_linear(torch.ones(2, 64), q8, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_ops.mxfp4_bf16_linear(torch.ones(2, 64), panels, None, 17)


@pytest.mark.usefixtures("dot_products")
def test_a_layer_of_a_bf16_model_multiplies_its_blocks_in_bf16() -> None:
    """`blocks_in_bf16` turns a model's MXFP4 layers (only those) to the bf16 product: equal to
    the bit to a bf16 panel layer of the same weights, a residual added as after it."""
    rows, weight = random_mxfp4(48, 128)
    bias = torch.randn(48)
    model = torch.nn.Sequential(
        PanelLinear.of_blocks(gguf_blocks.MXFP4, rows, bias),
        PanelLinear(torch.randn(48, 128), None),
    )
    assert blocks_in_bf16(model) == 1 and model[0].bf16_blocks and not model[1].bf16_blocks
    assert "mxfp4 blocks x bf16 activations" in repr(model[0])
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(4))
    residual = torch.randn(3, 5, 48)
    got = model[0](x, residual)
    assert torch.equal(got, PanelLinear(weight, bias, torch.bfloat16)(x, residual))
    assert torch.equal(got, model[0](x) + residual)
