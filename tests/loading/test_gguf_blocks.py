"""GGUF blocks as the CPU's panel product reads them (`engine/loading/gguf_blocks.py`,
`csrc/include/block_panels.h`): they widen to exactly GGUF's own dequantization, the product over
them equals the product over the fp32 weights to the bit, and a model converted from a GGUF file
holds its blocks and still gives transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from transformers import AutoModelForCausalLM, GgufConfig

from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.fused_decode import DecodeRoute
from engine.kernels.cpu.linear import PanelLinear, pack_linears, use_gguf_blocks
from engine.loading import block_budget, gguf_blocks
from engine.loading.gguf_tensors import model_tensors
from engine.loading.model_loader import (
    HALF_FORMS,
    LinearForm,
    choose_linear_form,
    load_weights,
    use_gguf_blocks_beside,
)
from engine.models.llama import PagedLlamaLayer
from engine.worker import host_memory
from engine.worker.routes import linear_forms
from tests.gguf_files import stored
from tests.helpers import needs_panels, reference_greedy, run_all, tiny_core, tokens_of
from tests.kernels.test_cpu_linear import weight_bytes

pytestmark = needs_panels

QTYPES = {
    "q4_0": GGMLQuantizationType.Q4_0,
    "q4_1": GGMLQuantizationType.Q4_1,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_k": GGMLQuantizationType.Q4_K,
    "q6_k": GGMLQuantizationType.Q6_K,
    "q5_0": GGMLQuantizationType.Q5_0,
    "q5_1": GGMLQuantizationType.Q5_1,
    "q5_k": GGMLQuantizationType.Q5_K,
    "q3_k": GGMLQuantizationType.Q3_K,
    "iq4_nl": GGMLQuantizationType.IQ4_NL,
    "iq4_xs": GGMLQuantizationType.IQ4_XS,
    "mxfp4": GGMLQuantizationType.MXFP4,
}
# GGUF's types panels hold: 32-wide blocks (MXFP4's scale bytes and codes as they are), K-quants'
# 256-wide super-blocks cut to 32, and the 5-bit types, Q3_K and the IQ4 types as Q8_K panels.
GGUF_FORMATS = [
    *("q4_1", "q8_0", "q4_k", "q6_k", "q5_0", "q5_1", "q5_k", "q3_k", "iq4_nl", "iq4_xs", "mxfp4")
]
# Not GGUF's: AWQ's and GPTQ's groups as 32-wide blocks with fp32 scales and minima.
GROUP_FORMATS = ["q4_g", "q8_g"]
BLOCK_FORMATS = GGUF_FORMATS + GROUP_FORMATS
# Input features per test layer: a span of 128 and one of 32 for 32-wide blocks, and two
# super-blocks for K-quants.
INPUTS = {fmt: 512 if gguf_blocks.FORMATS[fmt].block == 256 else 160 for fmt in BLOCK_FORMATS}
HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 64, 96, 4, 2, 96
PROMPTS = [[5, 9, 33, 2], list(range(10, 90)), [7] * 13]


def gguf_rows(fmt: str, out: int, in_features: int, seed: int = 0) -> np.ndarray:
    """A random `[out, in]` weight quantized by GGUF's own code (K-quants: random super-blocks,
    which GGUF's code only dequantizes), or random groups: rows of blocks, uint8."""
    if fmt in GROUP_FORMATS:
        return group_rows(fmt, out, in_features, seed)[0].numpy()
    weight = np.random.default_rng(seed).standard_normal((out, in_features)).astype(np.float32)
    return stored(weight, QTYPES[fmt], seed)


def group_rows(fmt: str, out: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Q4_G or Q8_G rows of random blocks (fp16 scales, minima `-scale * zero`), and the
    weight `[out, in]` they stand for: `scale * (q - zero)`."""
    generator = torch.Generator().manual_seed(seed)
    blocks = in_features // 32
    d = (torch.rand(out, blocks, generator=generator) * 0.1 + 0.01).half().float()
    bits = 4 if fmt == "q4_g" else 8
    q = torch.randint(0, 2**bits, (out, blocks, 32), generator=generator)
    zero = torch.randint(0, 2**bits, (out, blocks, 1), generator=generator)
    weight = (d.unsqueeze(-1).double() * (q - zero)).float().reshape(out, -1)
    if bits == 4:
        rows = gguf_blocks.group_rows(d, -d * zero[..., 0], q.to(torch.uint8))
    else:
        rows = gguf_blocks.group_rows(d, d * (128 - zero[..., 0]), (q - 128).to(torch.int8))
    return rows, weight


def block_layer(fmt: str, out: int, in_features: int, seed: int = 0) -> PanelLinear:
    return PanelLinear.of_blocks(
        gguf_blocks.FORMATS[fmt], torch.from_numpy(gguf_rows(fmt, out, in_features, seed)), None
    )


@pytest.mark.parametrize("fmt", GROUP_FORMATS)
def test_group_rows_dequantize_to_scale_times_q_less_zero(fmt: str) -> None:
    """AWQ's and GPTQ's weights, `scale * (q - zero)` with fp16 scales: exact as `d * q + m` in
    fp32, through the rows and through the panels."""
    rows, weight = group_rows(fmt, 40, 160)
    assert torch.equal(gguf_blocks.dequantize_rows(gguf_blocks.FORMATS[fmt], rows), weight)
    assert torch.equal(PanelLinear.of_blocks(gguf_blocks.FORMATS[fmt], rows, None).weight, weight)


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_rows_dequantize_as_gguf_does(fmt: str) -> None:
    """Split into 32-wide blocks (K-quants' scales multiplied out), then widened: GGUF's own
    dequantization, to the bit."""
    rows = gguf_rows(fmt, 24, INPUTS[fmt])
    ours = gguf_blocks.dequantize_rows(gguf_blocks.FORMATS[fmt], torch.from_numpy(rows))
    assert torch.equal(ours, torch.from_numpy(dequantize(rows, QTYPES[fmt])))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # GGUF's, as ours
def test_every_mxfp4_scale_and_code_widens_as_gguf_dequantizes_it() -> None:
    """Each E8M0 scale byte (those below 2 give subnormal halves, 2 ** -128 and 2 ** -127; the
    largest overflow, as in GGUF's own dequantization) under every pair of E2M1 codes, through
    the rows, the panels and the kernel."""
    scales = torch.arange(256, dtype=torch.uint8).view(16, 16, 1)
    codes = torch.arange(256, dtype=torch.uint8).roll(5).view(1, 1, 256).expand(16, 16, 256)
    rows = torch.cat([scales, codes.reshape(16, 16, 16, 16)[:, :, 0]], dim=-1)
    rows = torch.cat([rows, torch.cat([scales, codes.reshape(16, 16, 16, 16)[:, :, 1]], -1)], 1)
    rows = rows.reshape(16, -1).contiguous()  # blocks b and 16 + b of row r: scale 16 r + b
    expected = torch.from_numpy(dequantize(rows.numpy(), QTYPES["mxfp4"]))
    assert torch.equal(gguf_blocks.dequantize_rows(gguf_blocks.MXFP4, rows), expected)
    layer = PanelLinear.of_blocks(gguf_blocks.MXFP4, rows, None)
    assert layer.block_format is gguf_blocks.MXFP4 and torch.equal(layer.weight, expected)
    # The kernel's widening: the identity's product is the weights, for rows 1 to 14 (row 0's
    # scales make subnormals, which a thread may flush; row 15's overflow).
    assert torch.equal(layer(torch.eye(1024))[:, 1:15], expected[1:15].T)
    assert set(expected[8, :32].tolist()) == set(gguf_blocks.MXFP4_LEVELS)  # scale byte 128
    # The subnormal half scales by their bits: where subnormals flush to zero (as the engine
    # sets its threads), they compare as zero.
    scales = gguf_blocks.split_rows(gguf_blocks.MXFP4, rows)[0]
    assert scales[0, :2, 0].view(torch.int32).tolist() == [0x00200000, 0x00400000]
    assert expected.isinf().any()


def test_q4_0_rows_become_q4_1_rows_of_the_same_weights() -> None:
    """`d * (q - 8)` as `d * q + m` with `m = -8 d`: exact, in GGUF's dequantization and in the
    panels; a scale whose minimum would overflow fp16 keeps the layer in fp32."""
    rows = torch.from_numpy(gguf_rows("q4_0", 24, 96))
    as_q4_1 = gguf_blocks.q4_0_as_q4_1(rows)
    assert as_q4_1 is not None and as_q4_1.shape == (24, 3 * 20)
    expected = torch.from_numpy(dequantize(rows.numpy(), QTYPES["q4_0"]))
    assert torch.equal(gguf_blocks.dequantize_rows(gguf_blocks.Q4_1, as_q4_1), expected)
    assert torch.equal(PanelLinear.of_blocks(gguf_blocks.Q4_1, as_q4_1, None).weight, expected)
    huge = rows.clone().view(24, 3, 18)
    huge[0, 1, 0:2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    assert gguf_blocks.q4_0_as_q4_1(huge.view(24, -1)) is None


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("out", [40, 48])
def test_block_panels_hold_the_rows_exactly(fmt: str, out: int) -> None:
    """Packed in panels of 16 columns (the last one partly filled for 40), widened back."""
    block, inputs = gguf_blocks.FORMATS[fmt], INPUTS[fmt]
    rows = torch.from_numpy(gguf_rows(fmt, out, inputs))
    layer = PanelLinear.of_blocks(block, rows, None)
    held = gguf_blocks.GROUP_FORMATS[block.group_bytes]  # the 5-bit types: Q8_K
    assert (layer.in_features, layer.out_features, layer.block_format) == (inputs, out, held)
    assert layer.panels.shape == (-(-out // 16), inputs // 32, block.group_bytes)
    assert torch.equal(layer.weight, gguf_blocks.dequantize_rows(block, rows))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_product_over_blocks_equals_fp32_panels_to_the_bit(fmt: str) -> None:
    """Widened in registers (up to 6 rows) or span by span into a scratch panel (more rows),
    the weights and the order of the sums are those of fp32 panels: equal to the bit. 40
    outputs leave a partly filled panel."""
    torch.manual_seed(0)
    rows = torch.from_numpy(gguf_rows(fmt, 40, INPUTS[fmt]))
    bias = torch.randn(40)
    blocks = PanelLinear.of_blocks(gguf_blocks.FORMATS[fmt], rows, bias)
    dense = PanelLinear(blocks.weight, bias)
    x = torch.randn(130, INPUTS[fmt])
    for count in (1, 2, 3, 4, 5, 6, 7, 8, 13, 64, 130):
        assert torch.equal(blocks(x[:count]), dense(x[:count])), count
    torch.testing.assert_close(blocks(x), F.linear(x, blocks.weight, bias), rtol=1e-5, atol=1e-4)


def test_joined_projections_keep_their_blocks() -> None:
    """q, k and v joined into one projection share their panels as held."""
    parts = [block_layer("q4_1", out, 64, seed) for seed, out in enumerate((64, 32, 32))]
    joined = PanelLinear.joined(parts)
    assert joined is not None and joined.block_format == gguf_blocks.Q4_1
    assert torch.equal(joined.weight, torch.cat([p.weight for p in parts]))
    x = torch.randn(3, 64)
    assert torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=1))
    assert PanelLinear.joined([block_layer("q4_1", 40, 64), parts[1]]) is None


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_any_block_panels_widen_as_q8_k_panels_to_the_same_product(fmt: str) -> None:
    """Q8_K (8-bit q, fp32 scales per 16 inputs and minima per 32) holds every format's
    weights exactly, and the product over it equals the fp32 panels' to the bit."""
    torch.manual_seed(0)
    layer = block_layer(fmt, 40, INPUTS[fmt])
    wide = gguf_blocks.as_q8_k(layer.panels)
    assert wide.shape == (3, INPUTS[fmt] // 32, gguf_blocks.Q8_K.group_bytes)
    assert torch.equal(gguf_blocks.dequantize_panels(wide, 40), layer.weight)
    x = torch.randn(9, INPUTS[fmt])
    dense = PanelLinear(layer.weight, None)
    for count in (1, 2, 9):
        product = cpu_ops.panel_linear(x[:count], wide, None, 40)
        assert torch.equal(product, dense(x[:count])), count


@pytest.mark.parametrize(("q_fmt", "v_fmt"), [("q4_k", "q6_k"), ("q4_1", "q8_0")])
def test_projections_of_two_formats_join_as_q8_k(q_fmt: str, v_fmt: str) -> None:
    """A Q4_K_M layer's q and k (Q4_K) and v (Q6_K) joined into one projection: Q8_K panels of
    the same weights, each part a view of its own, the product unchanged to the bit."""
    inputs = INPUTS[q_fmt]
    parts = [
        block_layer(fmt, out, inputs, seed)
        for seed, (fmt, out) in enumerate([(q_fmt, 64), (q_fmt, 32), (v_fmt, 32)])
    ]
    weights = [p.weight for p in parts]
    x = torch.randn(3, inputs)
    products = [p(x) for p in parts]
    joined = PanelLinear.joined(parts)
    assert joined is not None and joined.block_format == gguf_blocks.Q8_K
    assert torch.equal(joined.weight, torch.cat(weights))
    assert torch.equal(joined(x), torch.cat(products, dim=1))
    assert all(p.panels._base is joined.panels for p in parts)
    assert all(torch.equal(p.weight, w) for p, w in zip(parts, weights, strict=True))


def test_kernel_refuses_bad_block_panels() -> None:
    layer = block_layer("q8_0", 16, 64)
    with pytest.raises(RuntimeError, match="input sizes differ"):
        cpu_ops.panel_linear(torch.randn(2, 96), layer.panels, None, 16)
    with pytest.raises(RuntimeError, match="block panels must be"):
        cpu_ops.panel_linear(torch.randn(2, 64), layer.panels[..., :100].contiguous(), None, 16)


def write_tiny_gguf(path: Path, layers: int = 2) -> None:
    """A random Llama in GGUF: Q4_1 projections, a Q8_0 embedding tied to the LM head."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    head_dim = HIDDEN // HEADS
    writer.add_tensor(
        "token_embd.weight", gguf_rows("q8_0", VOCAB, HIDDEN, seed=100), raw_dtype=QTYPES["q8_0"]
    )
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    shapes = {
        "attn_q": (HIDDEN, HIDDEN),
        "attn_k": (KV_HEADS * head_dim, HIDDEN),
        "attn_v": (KV_HEADS * head_dim, HIDDEN),
        "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }
    for layer in range(layers):
        writer.add_tensor(f"blk.{layer}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        writer.add_tensor(f"blk.{layer}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
        for seed, (name, shape) in enumerate(shapes.items()):
            writer.add_tensor(
                f"blk.{layer}.{name}.weight",
                gguf_rows("q4_1", *shape, seed=10 * layer + seed),
                raw_dtype=QTYPES["q4_1"],
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GGUF converted as the default model is: dequantized by transformers and saved,
    its blocks kept beside."""
    folder = tmp_path_factory.mktemp("gguf")
    write_tiny_gguf(folder / "tiny.gguf")
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="tiny.gguf", quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(folder / "model")
    blocks = {}
    for tensor in model_tensors(folder / "tiny.gguf", model):
        blocks |= tensor.blocks
    gguf_blocks.save(blocks, folder / "model")
    return folder / "model"


def load_fp32(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def block_layers(model: torch.nn.Module) -> list[PanelLinear]:
    return [m for m in model.modules() if isinstance(m, PanelLinear) and m.block_format is not None]


def test_read_blocks_widen_to_the_converted_weights(converted: Path) -> None:
    """Every projection (q and k rows unpermuted as transformers does) and the tied LM head."""
    blocks = gguf_blocks.load(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert len(blocks) == 2 * 7 + 1
    assert blocks["lm_head"][0] == gguf_blocks.Q8_0
    for name, (fmt, rows) in blocks.items():
        weight = model.get_submodule(name).weight
        assert torch.equal(gguf_blocks.dequantize_rows(fmt, rows), weight), name


def test_a_converted_model_serves_its_blocks_and_matches_generate(converted: Path) -> None:
    reference = load_fp32(converted)
    expected = [reference_greedy(reference, p, 12) for p in PROMPTS]
    model = load_fp32(converted)
    use_gguf_blocks_beside(model, converted)
    pack_linears(model)
    assert len(block_layers(model)) == 2 * 7 + 1
    core, _ = tiny_core(model, attention_backend="cpu", with_tokenizer=False)
    layers = [m for m in core.runner.model.modules() if isinstance(m, PagedLlamaLayer)]
    assert all(layer.qkv_proj.block_format == gguf_blocks.Q4_1 for layer in layers)
    assert core.runner.model.fused_decode.route is DecodeRoute.STACK
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_keeps_its_blocks_when_asked(
    converted: Path, dtype: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    """`--keep-blocks`: a bf16 or fp16 model holds the folder's blocks instead of 16-bit
    panels of their weights, in fewer bytes; beside bf16 panels they multiply in bf16 dot
    products (inputs rounded to bf16, as the bf16 panels round theirs), beside fp16 ones in
    fp32 as an fp32 model's do. Greedy tokens are transformers' in fp32 over the same weights
    (the blocks' exact, the others rounded to `dtype`; inputs to each linear layer rounded to
    bf16 for bf16). Without it, nothing is kept."""
    cpu = torch.device("cpu")
    form = choose_linear_form(dtype, cpu)
    if form not in HALF_FORMS:
        pytest.skip(f"{dtype} runs torch's own products on this CPU (native 16-bit arithmetic)")
    kept = load_weights(str(converted), dtype, cpu, keep_blocks=True)[0]
    plain = load_weights(str(converted), dtype, cpu)[0]
    held = block_layers(kept)
    assert len(held) == 2 * 7 + 1 and not block_layers(plain)
    assert all(layer.bf16_blocks is (form is LinearForm.BF16_PANELS) for layer in held)
    # The start-up line names the route.
    in_bf16 = "blocks x bf16 activations)" in linear_forms(kept)
    assert in_bf16 is (form is LinearForm.BF16_PANELS)
    assert weight_bytes(kept) < 0.75 * weight_bytes(plain)
    # The other weights (embeddings, norms) as the model holds them: rounded to `dtype`.
    reference = AutoModelForCausalLM.from_pretrained(converted, dtype=dtype).float().eval()
    exact = load_fp32(converted)
    for name in gguf_blocks.load(converted):
        weight = exact.get_submodule(name).weight.detach().clone()
        reference.get_submodule(name).weight = torch.nn.Parameter(weight)  # the head untied
    if form is LinearForm.BF16_PANELS:
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_pre_hook(lambda _, args: (args[0].bfloat16().float(),))
    expected = [reference_greedy(reference, p, 12) for p in PROMPTS]
    core, _ = tiny_core(
        kept, attention_backend="cpu", with_tokenizer=False, kv_cache_dtype="float32"
    )
    outputs = run_all(core, PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(PROMPTS))] == expected
    load_weights(str(converted), torch.float32, cpu, keep_blocks=True)
    assert "--keep-blocks has no effect here" in caplog.text


def test_keep_blocks_is_a_serve_flag() -> None:
    """`--keep-blocks` keeps them, `--no-keep-blocks` widens them, neither leaves it to the
    memory left."""
    from server.cli import build_parser, engine_config

    def kept(*flags: str) -> bool | None:
        return engine_config(build_parser().parse_args(["serve", *flags])).keep_blocks

    assert kept("--keep-blocks") is True
    assert kept("--no-keep-blocks") is False
    assert kept() is None


def test_block_sizes_are_read_from_the_files_headers(converted: Path) -> None:
    """The blocks' bytes and the weights they hold, as loading them gives; the others are the
    checkpoint's tensors outside the block layers (a plain folder's fp32 copies of those layers
    are not counted)."""
    from safetensors.torch import load_file

    sizes = block_budget.block_sizes(converted)
    blocks = gguf_blocks.load(converted)
    assert sizes.blocks == sum(rows.nbytes for _, rows in blocks.values())
    assert sizes.weights == sum(
        rows.shape[0] * gguf_blocks.in_features(fmt, rows) for fmt, rows in blocks.values()
    )
    others = [
        tensor.nbytes
        for file in converted.glob("*.safetensors")
        for name, tensor in load_file(file).items()
        if name.removesuffix(".weight") not in blocks
    ]
    assert others and sizes.others == sum(others)


def test_the_blocks_stay_where_the_widened_weights_and_kv_cache_would_not_fit() -> None:
    """Widened to 16 bits, 8 Gi weights take 16 GiB beside 1 GiB of other tensors: with a 4 GiB
    KV cache that fits 90% of 32 GiB, not of 16 GiB; a larger KV cache tips 32 GiB over too;
    where the host does not say what is left, nothing is kept."""
    gib = 2**30
    sizes = block_budget.BlockSizes(blocks=3 * gib, weights=8 * gib, others=gib)
    why = block_budget.why_keep_blocks
    assert why(sizes, torch.bfloat16, 4 * gib, 32 * gib) == ""
    reason = why(sizes, torch.bfloat16, 4 * gib, 16 * gib)
    for figure in ("17.00 GiB", "4.00 GiB", "90% of the 16.00 GiB", "kept, they take 4.00 GiB"):
        assert figure in reason
    assert why(sizes, torch.float16, 12 * gib, 32 * gib)
    assert why(sizes, torch.bfloat16, 4 * gib, None) == ""


def test_a_kv_budget_beyond_the_memory_in_any_form_leaves_small_weights_widened() -> None:
    """A 4 GiB KV cache in 3 GiB of memory fits beside neither form: weights that widen to 0.36
    GiB (the default model's) take less than half of what fits, so they widen; 17 GiB of widened
    weights in 16 GiB beside a 32 GiB budget stay blocks, and so do weights just over half."""
    gib = 2**30
    why = block_budget.why_keep_blocks
    small = block_budget.BlockSizes(blocks=gib // 10, weights=3 * gib // 20, others=gib // 16)
    assert why(small, torch.bfloat16, 4 * gib, 3 * gib) == ""
    large = block_budget.BlockSizes(blocks=3 * gib, weights=8 * gib, others=gib)
    assert why(large, torch.bfloat16, 32 * gib, 16 * gib)
    half = block_budget.FITS * 3 * gib / 2
    over = block_budget.BlockSizes(blocks=gib // 10, weights=int(half) // 2 + 1, others=0)
    assert over.widened(torch.bfloat16) > half
    assert why(over, torch.bfloat16, 4 * gib, 3 * gib)
    under = block_budget.BlockSizes(blocks=gib // 10, weights=int(half) // 2, others=0)
    assert why(under, torch.bfloat16, 4 * gib, 3 * gib) == ""


@pytest.mark.parametrize("short", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_keeps_its_blocks_where_widened_they_would_not_fit(
    converted: Path,
    short: bool,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Neither `--keep-blocks` nor `--no-keep-blocks`: the blocks stay, with a warning, where the
    memory left holds the KV cache beside the blocks but not beside the widened weights, and
    widen where it holds both; `--no-keep-blocks` widens them however short it is."""
    cpu = torch.device("cpu")
    if choose_linear_form(dtype, cpu) not in HALF_FORMS:
        pytest.skip(f"{dtype} runs torch's own products on this CPU (native 16-bit arithmetic)")
    sizes = block_budget.block_sizes(converted)
    reserve = 2**20
    between = (sizes.kept() + sizes.widened(dtype)) / 2 + reserve
    available = int(between / block_budget.FITS) if short else 2**50
    monkeypatch.setattr(host_memory, "available_bytes", lambda: available)
    auto = load_weights(str(converted), dtype, cpu, keep_blocks=None, kv_reserve=reserve)
    assert len(block_layers(auto[0])) == (2 * 7 + 1 if short else 0)
    assert ("keeping the checkpoint's quantized blocks" in caplog.text) is short
    widened = load_weights(str(converted), dtype, cpu, keep_blocks=False)[0]
    assert not block_layers(widened)


def test_blocks_that_do_not_hold_the_weights_are_left_alone(
    converted: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocks = gguf_blocks.load(converted)
    name = "model.layers.1.mlp.up_proj"
    blocks[name] = (gguf_blocks.Q4_1, torch.from_numpy(gguf_rows("q4_1", FFN, HIDDEN, seed=999)))
    model = load_fp32(converted)
    assert use_gguf_blocks(model, blocks) == 2 * 7
    assert f"do not hold their layer's weights: 1 ({name}" in caplog.text
    pack_linears(model)
    assert model.get_submodule(name).panels.dtype == torch.float32
    assert model.get_submodule("model.layers.0.mlp.up_proj").block_format == gguf_blocks.Q4_1
