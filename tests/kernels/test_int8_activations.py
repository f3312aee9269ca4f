"""Q4_1, Q8_0 and Q4_K blocks and 4-bit groups multiplied against activations rounded to 8-bit
blocks (`--int8-activations`, `csrc/linear/int8_panels.cpp`): each product equals the weights
times the rounded inputs, a row does not depend on its batch, and a model served this way rounds
its own activations alike, through the fused decode layer and the LM head too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QType

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import DecodeRoute
from engine.kernels.cpu.linear import PanelLinear, pack_linears, use_gguf_blocks
from engine.loading import gguf_blocks, gguf_file
from engine.loading.model_loader import load_model
from engine.models.llama import PagedLlamaLayer
from server.cli import build_parser, engine_config
from tests.gguf_files import write_gguf
from tests.helpers import (
    chat_tokenizer,
    int8_layer_errors,
    needs_panels,
    round_to_int8_blocks,
    run_all,
    tiny_core,
    tiny_tokenizer,
)
from tests.kernels.test_decode_layer import decode_step
from tests.loading.test_gguf_blocks import PROMPTS, converted, gguf_rows, load_fp32  # noqa: F401
from tests.loading.test_gguf_file import wide_llama

pytestmark = needs_panels


FORMATS = ["q4_1", "q8_0"]


def int8_layer(
    out: int, in_features: int, bias: torch.Tensor | None = None, seed: int = 0, fmt: str = "q4_1"
) -> PanelLinear:
    rows = torch.from_numpy(gguf_rows(fmt, out, in_features, seed))
    return PanelLinear.of_blocks(gguf_blocks.FORMATS[fmt], rows, bias, int8_activations=True)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("out", [40, 48])
def test_int8_panels_hold_the_rows_exactly(fmt: str, out: int) -> None:
    block = gguf_blocks.FORMATS[fmt]
    rows = torch.from_numpy(gguf_rows(fmt, out, 160))
    layer = PanelLinear.of_blocks(block, rows, None, int8_activations=True)
    assert layer.int8_activations and layer.block_format == block
    assert layer.panels.dtype == torch.int8
    assert layer.panels.shape == (-(-out // 16), 160 // 32, block.group_bytes)
    assert torch.equal(layer.weight, gguf_blocks.dequantize_rows(block, rows))


@pytest.mark.parametrize("fmt", FORMATS)
def test_product_is_the_weights_times_the_rounded_inputs(fmt: str) -> None:
    """1 to 130 rows (passes of 1-4 rows, a partly filled last panel), with a bias, a block of
    zeros and a large outlier: equal to fp64 over the rounded inputs within fp32 rounding, and
    not to the product over the unrounded inputs."""
    torch.manual_seed(0)
    bias = torch.randn(40)
    layer = int8_layer(40, 160, bias, fmt=fmt)
    x = torch.randn(130, 160)
    x[3, 32:64] = 0.0
    x[5, 7] = 300.0
    for count in (1, 2, 3, 4, 5, 7, 13, 64, 130):
        rounded = round_to_int8_blocks(x[:count]).double()
        expected = F.linear(rounded, layer.weight.double(), bias.double())
        torch.testing.assert_close(layer(x[:count]).double(), expected, rtol=1e-5, atol=1e-4)
    exact = F.linear(x, layer.weight, bias)
    assert (layer(x) - exact).abs().max() > 1e-3


def test_q8_0_products_at_the_extremes_of_8_bits() -> None:
    """Q8_0 weights of -128 and 127 against inputs rounded to -127 and 127, signs aligned so that
    the first row's pairs of products reach what 8 bits allow (2 * 128 * 127): still exact."""
    q = torch.tensor([-128, -128, 127, 127] * 8, dtype=torch.int8).repeat(16, 2)  # [16, 64]
    q[1::2] = -q[1::2].clamp(min=-127)
    scale = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)
    blocks = torch.cat([scale.expand(16, 2, 2), q.view(torch.uint8).view(16, 2, 32)], dim=2)
    layer = PanelLinear.of_blocks(
        gguf_blocks.Q8_0, blocks.reshape(16, 68), None, int8_activations=True
    )
    x = torch.tensor([-1.0, -1.0, 1.0, 1.0] * 16).repeat(3, 1)
    x[1] = -x[1]
    expected = F.linear(round_to_int8_blocks(x).double(), layer.weight.double())
    assert expected.abs().max() == 0.5 * 64 * 127.5  # the products are as large as they get
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_does_not_depend_on_its_batch(fmt: str) -> None:
    layer = int8_layer(48, 96, fmt=fmt)
    x = torch.randn(9, 96)
    batched = layer(x)
    for row in (0, 4, 8):
        assert torch.equal(layer(x[row : row + 1]), batched[row : row + 1])


@pytest.mark.parametrize("fmt", ["q4_k", "q4_g"])
def test_q4_k_and_4_bit_groups_multiply_as_q4_1_with_fp16_scales(fmt: str) -> None:
    """Q4_K's blocks and AWQ's or GPTQ's 4-bit groups (fp32 scales and minima) take Q4_1's int8
    panels, their scales and minima rounded to fp16 (each within 2**-11 of itself, or fp16's
    smallest step), and the product is those weights times the rounded inputs."""
    block = gguf_blocks.FORMATS[fmt]
    rows = torch.from_numpy(gguf_rows(fmt, 40, 512))
    layer = PanelLinear.of_blocks(block, rows, None, int8_activations=True)
    assert layer.int8_activations and layer.block_format == gguf_blocks.Q4_1
    d, m, q = gguf_blocks.split_rows(block, rows)
    assert m is not None
    rounded = d.half().float().unsqueeze(-1) * q.float() + m.half().float().unsqueeze(-1)
    assert torch.equal(layer.weight, rounded.reshape(40, 512))
    exact = gguf_blocks.dequantize_rows(block, rows)
    terms = (d.abs().unsqueeze(-1) * q.float() + m.abs().unsqueeze(-1)).reshape(40, 512)
    assert not torch.equal(layer.weight, exact)
    assert ((layer.weight - exact).abs() <= 2**-11 * terms * 1.001 + 2**-24 * 17).all()
    x = torch.randn(13, 512)
    expected = F.linear(round_to_int8_blocks(x).double(), layer.weight.double())
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-4)


def test_a_scale_too_large_for_fp16_keeps_the_exact_blocks() -> None:
    rows = torch.from_numpy(gguf_rows("q4_g", 16, 64))
    d, m, q = gguf_blocks.split_rows(gguf_blocks.Q4_G, rows)
    d[3, 1] = 1e6
    huge = gguf_blocks.group_rows(d, m, q)
    layer = PanelLinear.of_blocks(gguf_blocks.Q4_G, huge, None, int8_activations=True)
    assert not layer.int8_activations and layer.block_format == gguf_blocks.Q4_K
    assert torch.equal(layer.weight, gguf_blocks.dequantize_rows(gguf_blocks.Q4_G, huge))


def test_joined_int8_projections() -> None:
    parts = [int8_layer(out, 64, seed=seed) for seed, out in enumerate((64, 32, 32))]
    joined = PanelLinear.joined(parts)
    assert joined is not None and joined.int8_activations
    x = torch.randn(3, 64)
    assert torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=1))


def test_kernel_refuses_bad_int8_panels() -> None:
    layer = int8_layer(16, 64)
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_ops.panel_linear(torch.randn(2, 96), layer.panels, None, 16)
    with pytest.raises(RuntimeError, match="int8 block panels must be"):
        cpu_ops.panel_linear(torch.randn(2, 64), layer.panels[..., :100].contiguous(), None, 16)


@pytest.fixture
def int8_model(converted: Path) -> torch.nn.Module:  # noqa: F811
    """The tiny converted GGUF model with int8 projections and LM head (Q8_0)."""
    model = load_fp32(converted)
    blocks = gguf_blocks.load(converted)
    assert use_gguf_blocks(model, blocks, int8_activations=True) == 2 * 7 + 1
    pack_linears(model)
    rounded = [
        name
        for name, m in model.named_modules()
        if isinstance(m, PanelLinear) and m.int8_activations
    ]
    assert len(rounded) == 2 * 7 + 1 and "lm_head" in rounded
    return model


def test_a_served_model_s_projections_round_their_own_inputs(int8_model) -> None:
    """Every projection the engine runs (q/k/v and gate/up joined) gives its weights times its
    inputs rounded to 8-bit blocks, on the model's own activations."""
    core, _ = tiny_core(int8_model, attention_backend="cpu", with_tokenizer=False)
    layers = [
        m for m in core.runner.model.modules() if isinstance(m, PanelLinear) and m.int8_activations
    ]
    assert len(layers) == 2 * 4 + 1
    errors = int8_layer_errors(layers)
    run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    assert len(errors) == 2 * 4 + 1 and max(errors) < 1e-3


def test_the_fused_decode_layer_takes_int8_panels(
    int8_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step through the fused layer equals the layers op by op, to the bit."""
    fused_logits, fused_cache = decode_step(int8_model, True, monkeypatch, prompts=PROMPTS)
    plain_logits, plain_cache = decode_step(int8_model, False, monkeypatch, prompts=PROMPTS)
    assert torch.equal(fused_logits, plain_logits)
    assert torch.equal(fused_cache, plain_cache)
    core, _ = tiny_core(int8_model, attention_backend="cpu", with_tokenizer=False)
    layers = [m for m in core.runner.model.modules() if isinstance(m, PagedLlamaLayer)]
    assert all(layer.qkv_proj.int8_activations for layer in layers)
    assert core.runner.model.fused_decode.route is DecodeRoute.STACK


def test_cli_flag_reaches_the_engine_config() -> None:
    assert engine_config(
        build_parser().parse_args(["serve", "--int8-activations"])
    ).int8_activations
    assert not engine_config(build_parser().parse_args(["serve"])).int8_activations


def test_loading_asks_for_int8_panels_only_where_they_apply(
    converted: Path,  # noqa: F811  (the fixture imported above)
    caplog: pytest.LogCaptureFixture,
) -> None:
    cpu = torch.device("cpu")
    tiny_tokenizer().save_pretrained(converted)
    loaded = load_model(str(converted), torch.float32, cpu, int8_activations=True)
    assert (
        sum(1 for m in loaded.model.modules() if isinstance(m, PanelLinear) and m.int8_activations)
        == 2 * 7 + 1
    )
    assert "has no effect" not in caplog.text
    load_model(str(converted), torch.bfloat16, cpu, int8_activations=True)
    assert "--int8-activations has no effect here" in caplog.text


def q4_k_m_types(name: str) -> QType:
    """llama.cpp's Q4_K_M: Q4_K throughout, but Q6_K values and MLP down projections in some
    layers (here the first) and the head."""
    if name.startswith("token_embd"):
        return QType.F32
    if name.startswith("output") or (
        name.startswith("blk.0.") and (".attn_v." in name or ".ffn_down." in name)
    ):
        return QType.Q6_K
    return QType.Q4_K


def test_a_q4_k_m_file_s_q4_k_layers_round_their_inputs(tmp_path: Path) -> None:
    """A GGUF file in Q4_K_M's mix: its Q4_K projections multiply against rounded inputs, as Q4_1
    int8 panels, but not q and k beside a Q6_K v (joined, they keep exact blocks); the Q6_K
    ones keep their exact blocks."""
    path = tmp_path / "tiny.gguf"
    write_gguf(path, wide_llama(), chat_tokenizer(), q4_k_m_types)
    folder = tmp_path / "converted"
    gguf_file.convert(path, folder, "tiny")
    config = EngineConfig(
        model=str(folder), dtype="float32", int8_activations=True, cache=CacheConfig(num_blocks=64)
    )
    core, loaded, _ = create_engine_core(config)
    rounded = {
        name
        for name, m in loaded.model.named_modules()
        if isinstance(m, PanelLinear) and m.int8_activations
    }
    first = {
        f"model.layers.0.{part}" for part in ("self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
    }
    second = {f"model.layers.1.{part}" for part in PROJECTIONS}
    assert rounded == first | second
    layers = [
        m for m in core.runner.model.modules() if isinstance(m, PanelLinear) and m.int8_activations
    ]
    assert len(layers) == 2 + 4  # layer 0's o and joined gate/up; layer 1's qkv, o, gate/up, down
    errors = int8_layer_errors(layers)
    run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=2))
    assert errors and max(errors) < 1e-3


PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
