"""GGUF block panels multiplied in AVX-512 BF16 dot products (`csrc/linear/block_bf16.cpp`):
every format a block layer holds (Q4_1, Q8_0, Q4_K, Q6_K, and Q8_K for the rest), against
torch's float64 product of the inputs rounded to bf16 and the weights the blocks define; rows
independent of their batch; refused inputs."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import PanelLinear, blocks_in_bf16
from engine.loading import gguf_blocks
from tests.helpers import needs_bf16_panels
from tests.loading.test_gguf_blocks import BLOCK_FORMATS, INPUTS, block_layer, gguf_rows

pytestmark = needs_bf16_panels

FORMATS = [fmt for fmt in BLOCK_FORMATS if fmt != "mxfp4"]  # MXFP4's: test_mxfp4_bf16.py


def bf16_layer(fmt: str, out: int, seed: int = 0) -> tuple[PanelLinear, torch.Tensor]:
    """A block layer of `fmt` that multiplies in bf16, and the fp32 weight it holds."""
    layer = block_layer(fmt, out, INPUTS[fmt], seed)
    weight = layer.weight
    assert layer.multiply_in_bf16() and layer.bf16_blocks
    return layer, weight


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 40])
def test_the_product_is_that_of_the_blocks_weights_and_bf16_inputs(fmt: str, rows: int) -> None:
    """Every output within fp32 summation of torch's float64 product of the inputs rounded to
    bf16 and the weights the blocks define (plus bias), for the columns of a last, partly
    filled panel too."""
    layer, weight = bf16_layer(fmt, 37, seed=rows)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, INPUTS[fmt], generator=generator)
    bias = torch.randn(37, generator=generator)
    layer = PanelLinear._of_panels(layer.panels, bias, 37, INPUTS[fmt])
    assert layer.multiply_in_bf16()
    rounded = x.bfloat16().double()
    expected = rounded @ weight.double().T + bias.double()
    bound = 2e-6 * (rounded.abs() @ weight.double().abs().T) + 1e-6
    got = layer(x)
    assert got.shape == (rows, 37) and ((got.double() - expected).abs() <= bound).all()
    # The block sums take the inputs as the product rounds them: rounded again, the same.
    assert torch.equal(layer(x.bfloat16().float()), got)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0", "q4_k", "q6_k", "q5_k"])
def test_rows_do_not_depend_on_their_batch(fmt: str) -> None:
    """A row's outputs are the same to the bit alone, among a few rows (q widened in
    registers) and among many (widened once into a buffer)."""
    layer, _ = bf16_layer(fmt, 80)
    x = torch.randn(30, INPUTS[fmt], generator=torch.Generator().manual_seed(2))
    whole = layer(x)
    for count in (1, 2, 3, 6, 8, 13):
        assert torch.equal(layer(x[:count]), whole[:count])
    assert torch.equal(layer(x[29:]), whole[29:])


def test_a_bf16_model_takes_the_bf16_products_for_its_uint8_blocks_only() -> None:
    """`blocks_in_bf16` turns block layers to the bf16 products; int8 panels (8-bit
    activations) and fp32 panels keep theirs."""
    model = torch.nn.Sequential(
        block_layer("q4_k", 32, INPUTS["q4_k"]),
        PanelLinear.of_blocks(
            gguf_blocks.Q4_1,
            torch.from_numpy(gguf_rows("q4_1", 32, 64)),
            None,
            int8_activations=True,
        ),
        PanelLinear(torch.randn(32, 64), None),
    )
    assert blocks_in_bf16(model) == 1
    assert [m.bf16_blocks for m in model] == [True, False, False]
    assert "q4_k blocks x bf16 activations" in repr(model[0])


def test_bad_inputs_are_refused() -> None:
    layer = block_layer("q8_0", 16, 64)
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_ops.block_bf16_linear(torch.ones(2, 32), layer.panels, None, 16)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        cpu_ops.block_bf16_linear(torch.ones(64, 2).t(), layer.panels, None, 16)
    mxfp4 = block_layer("mxfp4", 16, 64)
    with pytest.raises(RuntimeError, match=r"\(Q8_K\)\]"):
        cpu_ops.block_bf16_linear(torch.ones(2, 64), mxfp4.panels, None, 16)
    with pytest.raises(RuntimeError, match="out_features"):
        cpu_ops.block_bf16_linear(torch.ones(2, 64), layer.panels, None, 40)
