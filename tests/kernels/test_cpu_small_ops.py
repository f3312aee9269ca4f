"""Conveyor's one-pass CPU RMSNorm, rotary embedding, gated activation and greedy argmax against
torch, and where the model and the sampler use them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu import ops as cpu_ops
from engine.models import layers, llama
from tests.helpers import needs_bf16_panels, needs_cpu_kernels

pytestmark = needs_cpu_kernels


@pytest.fixture(scope="module", autouse=True)
def kernels():
    assert cpu_ops.has("elementwise"), "the C++ kernels must build on the test machine"


def spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, ...]]:
    """The shapes of the first argument of each call to the real kernel `name`."""
    real, calls = getattr(cpu_ops, name), []

    def recorded(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return real(x, *args, **kwargs)

    monkeypatch.setattr(cpu_ops, name, recorded)
    return calls


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 7), (17, 64), (300, 576), (5000, 32)])
def test_matches_torch(rows, dim):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, dim) * 3, torch.randn(dim)
    out = cpu_ops.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), weight, 1e-5), rtol=1e-5, atol=1e-5)


@needs_bf16_panels
@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (3, 7), (17, 64), (300, 576)])
def test_bf16_rows_are_the_fp32_rows_rounded(rows, dim):
    """For a bf16 product: the same rows, rounded to bf16 as that product rounds its input
    (to nearest, ties to even), spare lanes of the last 16 left out."""
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, dim) * 3, torch.randn(dim)
    out = cpu_ops.rms_norm(x, weight, 1e-5, bf16_out=True)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, dim)
    assert torch.equal(out, cpu_ops.rms_norm(x, weight, 1e-5).bfloat16())


def test_refuses_bad_inputs():
    x, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        cpu_ops.rms_norm(x, weight[:4], 1e-5)
    with pytest.raises(RuntimeError, match="must be fp32"):
        cpu_ops.rms_norm(x.double(), weight, 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.rms_norm(torch.randn(8, 2).t(), weight, 1e-5)


def test_the_model_takes_it_for_fp32_rows_on_the_cpu(monkeypatch):
    calls = spy(monkeypatch, "rms_norm")
    weight, x = torch.randn(8), torch.randn(4, 8)
    torch.testing.assert_close(
        layers.rms_norm(x, weight, 1e-6), F.rms_norm(x, weight.shape, weight, 1e-6)
    )
    layers.rms_norm(torch.randn(8, 4).t(), weight, 1e-6)  # strided: torch's
    layers.rms_norm(torch.randn(4, 3, 8), weight, 1e-6)  # per-head rows: torch's
    layers.rms_norm(torch.randn(4, 8).bfloat16(), weight.bfloat16(), 1e-6)  # bf16: torch's
    assert calls == [(4, 8)]


def reference_head_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Qwen3 q/k norm in fp32: each head by its mean square, then the weight."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize(
    ("tokens", "heads", "dim"), [(1, 24, 128), (7, 3, 16), (33, 5, 6), (400, 12, 64)]
)
def test_head_norm_matches_torch_over_heads_inside_a_wider_projection(tokens, heads, dim):
    """Qwen3's per-head q/k norm: q and k heads read where the q/k/v projection left them (rows
    at its stride), each by its own weight row; equal to torch's within fp32 rounding."""
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, (heads + 2) * dim) * 3
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    weight = torch.randn(heads, dim)
    out = cpu_ops.head_rms_norm(x, weight, 1e-6)
    assert out.is_contiguous() and out.shape == (tokens, heads, dim)
    expected = reference_head_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # Each head by its own row: another weight for the last head changes only that head.
    other = weight.clone()
    other[-1] += 1
    changed = cpu_ops.head_rms_norm(x, other, 1e-6)
    assert torch.equal(changed[:, :-1], out[:, :-1]) and not torch.equal(changed, out)


def test_head_norm_refuses_bad_inputs():
    x, weight = torch.randn(3, 2, 8), torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.head_rms_norm(x, weight[:1], 1e-6)
    with pytest.raises(RuntimeError, match="must be fp32"):
        cpu_ops.head_rms_norm(x.double(), weight, 1e-6)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.head_rms_norm(torch.randn(3, 8, 2).transpose(1, 2), weight, 1e-6)


@pytest.mark.parametrize(
    ("tokens", "heads", "kv_heads", "dim"), [(1, 16, 8, 64), (7, 3, 1, 16), (33, 4, 2, 6)]
)
def test_all_heads_norm_matches_torch_over_q_and_k_inside_a_wider_projection(
    tokens, heads, kv_heads, dim
):
    """OLMo 2's q/k norms: q's heads normed as one row by the first part of the weight, k's
    as another by the rest, read where the q/k/v projection left them; equal to torch's over
    the flattened q and k within fp32 rounding."""
    torch.manual_seed(tokens)
    qk_heads = heads + kv_heads
    fused = torch.randn(tokens, (qk_heads + kv_heads) * dim) * 3
    x = fused[:, : qk_heads * dim].view(tokens, qk_heads, dim)
    weight = torch.randn(qk_heads * dim)
    out = cpu_ops.all_heads_rms_norm(x, weight, heads, 1e-6)
    assert out.is_contiguous() and out.shape == (tokens, qk_heads, dim)
    q, k = x[:, :heads].reshape(tokens, -1), x[:, heads:].reshape(tokens, -1)
    expected = torch.cat(
        [
            reference_head_norm(q, weight[: heads * dim], 1e-6),
            reference_head_norm(k, weight[heads * dim :], 1e-6),
        ],
        dim=1,
    )
    torch.testing.assert_close(out.view(tokens, -1), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.all_heads_rms_norm(x, weight[:-1], heads, 1e-6)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.all_heads_rms_norm(x, weight, qk_heads, 1e-6)


def test_the_model_norms_fp32_q_and_k_heads_on_the_cpu_in_one_pass(monkeypatch):
    """A `[heads, dim]` weight over fp32 heads takes the per-head kernel; bf16 heads and a
    weight that broadcasts over heads stay torch's."""
    calls = spy(monkeypatch, "head_rms_norm")
    x, weight = torch.randn(4, 3, 8), torch.randn(3, 8)
    torch.testing.assert_close(
        layers.rms_norm(x, weight, 1e-6), reference_head_norm(x, weight, 1e-6)
    )
    layers.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    layers.rms_norm(x, weight[:1], 1e-6)
    assert calls == [(4, 3, 8)]


def torch_rotary(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@pytest.mark.parametrize(
    ("tokens", "heads", "dim", "rotary_dim"),
    [
        (1, 12, 64, 64),
        (7, 3, 2, 2),
        (33, 5, 6, 6),
        (400, 9, 128, 128),
        (5, 4, 128, 96),
        (3, 2, 16, 0),
    ],
)
def test_rotary_is_torchs_to_the_bit(tokens, heads, dim, rotary_dim):
    """Every dim of each head rotated, or its first ones (a partial rotary, Phi-4-mini's 96 of
    128) and the rest passed as they are, or none."""
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, (heads + 2) * dim)  # q/k heads inside a wider projection
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.randn(1, tokens, rotary_dim) * 10
    cos, sin = angles.cos()[0, :, None, :], angles.sin()[0, :, None, :]
    out = cpu_ops.rotary(x, cos, sin)
    turned = torch_rotary(x[..., :rotary_dim], cos, sin)
    expected = torch.cat([turned, x[..., rotary_dim:]], dim=-1)
    assert out.is_contiguous() and torch.equal(out, expected)
    if 0 < rotary_dim < dim:
        assert torch.equal(out, layers.rotate(x, cos, sin))


def torch_paired_rotary(x, cos, sin):
    """GLM's rotary as a complex product: each neighbouring pair (x[2i], x[2i + 1]) times
    cos[i] + i sin[i] (the tables' first half)."""
    half = cos.shape[-1] // 2
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], half, 2).contiguous())
    turn = torch.complex(cos[..., :half], sin[..., :half])
    return torch.view_as_real(pairs * turn).flatten(-2)


@pytest.mark.parametrize(
    ("tokens", "heads", "dim", "rotary_dim"), [(1, 12, 64, 64), (7, 3, 16, 8), (33, 5, 6, 6)]
)
def test_paired_rotary_turns_neighbouring_dims_as_torch_does(
    tokens, heads, dim, rotary_dim, monkeypatch
):
    """GLM's, ERNIE 4.5's and Helium's rotary: each head's first dims turned as neighbouring
    pairs by the tables' first half, the rest passed: torch's complex product within fp32
    rounding, and the model's op-by-op rotation to the bit."""
    torch.manual_seed(tokens)
    fused = torch.randn(tokens, (heads + 2) * dim)
    x = fused[:, : heads * dim].view(tokens, heads, dim)
    freqs = torch.randn(tokens, 1, rotary_dim // 2) * 10
    angles = torch.cat([freqs, freqs], dim=-1)  # Hugging Face's table: the frequencies twice
    cos, sin = angles.cos(), angles.sin()
    out = cpu_ops.rotary(x, cos, sin, pairs=True)
    assert out.is_contiguous()
    expected = torch.cat(
        [torch_paired_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], -1
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, cpu_ops.rotary(x, cos, sin))
    monkeypatch.setattr(layers, "_one_pass_rotary", lambda x, cos: False)  # torch's own ops
    assert torch.equal(out, layers.rotate_pairs(x, cos, sin))


def test_rotary_refuses_bad_inputs():
    x, table = torch.randn(3, 2, 8), torch.randn(3, 1, 8)
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.rotary(x, table[:2], table[:2])
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.rotary(x[..., :7], table[..., :7], table[..., :7])  # odd dim
    with pytest.raises(RuntimeError, match="do not match"):
        cpu_ops.rotary(x, torch.randn(3, 1, 10), torch.randn(3, 1, 10))  # wider than the heads
    with pytest.raises(RuntimeError, match="must be fp32"):
        cpu_ops.rotary(x.double(), table, table)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.rotary(x.transpose(0, 1).contiguous().transpose(0, 1), table, table)


def test_the_model_rotates_fp32_rows_on_the_cpu_in_one_pass(monkeypatch):
    calls = spy(monkeypatch, "rotary")
    table, x = torch.randn(4, 1, 8), torch.randn(4, 3, 8)
    assert torch.equal(layers.rotate(x, table, table), torch_rotary(x, table, table))
    layers.rotate(torch.randn(4, 3, 8).bfloat16(), table.bfloat16(), table.bfloat16())
    layers.rotate(torch.randn(3, 4, 8).transpose(0, 1), table, table)  # heads strided: torch's
    assert calls == [(4, 3, 8)]


def torch_clamped_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU (alpha 1.702, limit 7) as transformers computes it."""
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    return (up + 1) * (gate * torch.sigmoid(gate * 1.702))


# Each one-pass gated activation (over rows of gate then up) and torch's own of gate and up.
GATED = {
    "silu_mul": (cpu_ops.silu_mul, lambda gate, up: F.silu(gate) * up),
    "gelu_tanh_mul": (
        cpu_ops.gelu_tanh_mul,
        lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    ),
    "clamped_swiglu_mul": (
        lambda x: cpu_ops.clamped_swiglu_mul(x, 1.702, 7.0),
        torch_clamped_swiglu,
    ),
}


@pytest.mark.parametrize("kernel", sorted(GATED))
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (3, 5), (16, 64), (300, 1536)])
def test_gated_activations_match_torch(kernel, rows, inter):
    """silu, GELU's tanh approximation (computed as x / (1 + exp(-2u)) rather than torch's
    0.5 x (1 + tanh(u))) and the clamped SwiGLU (its sigmoid in silu's operations), against
    torch's own over gate and up, in fp64: where tanh(u) nears -1, torch's fp32 GELU loses its
    digits to 1 + tanh(u), and the kernel's keeps them. The clamps bite: values past 7 either
    side."""
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate_up[0, :5] = torch.tensor([-100.0, 100.0, 0.0, -1e20, 1e20])  # exp's clamped range
    gate_up[-1, -3:] = torch.tensor([-9.0, 9.0, 7.5])  # up past the clamp
    exact = gate_up.double()
    op, reference = GATED[kernel]
    expected = reference(exact[:, :inter], exact[:, inter:])
    out = op(gate_up)
    torch.testing.assert_close(out.double(), expected, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("kernel", sorted(GATED))
def test_gated_activations_lanes_equal_the_scalar_tail(kernel):
    """Eight lanes at a time, then one by one: the same value gives the same bits either way,
    so a column's result does not depend on where the vector loop stops; a NaN stays NaN in
    both."""
    values = torch.randn(40) * 6
    values[7] = float("nan")
    gate_up = torch.zeros(40, 18)  # inter 9: lanes 0-7, then column 8 alone
    gate_up[:, 0] = gate_up[:, 8] = values
    gate_up[:, 9] = gate_up[:, 17] = 1.5
    out = GATED[kernel][0](gate_up)
    assert torch.equal(out[:7, 0], out[:7, 8]) and torch.equal(out[8:, 0], out[8:, 8])
    assert out[7, 0].isnan() and out[7, 8].isnan()


def test_the_clamped_swiglu_wants_a_positive_limit():
    with pytest.raises(RuntimeError, match="limit must be positive"):
        cpu_ops.clamped_swiglu_mul(torch.randn(2, 8), 1.702, 0.0)


@pytest.mark.parametrize("kernel", sorted(GATED))
def test_gated_activations_refuse_bad_inputs(kernel):
    op = GATED[kernel][0]
    with pytest.raises(RuntimeError, match=rf"{kernel}: x must be \[rows, 2 \* inter\]"):
        op(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="must be fp32"):
        op(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="contiguous"):
        op(torch.randn(8, 2).t())


def test_the_model_gates_fp32_silu_rows_on_the_cpu_in_one_pass(monkeypatch):
    from tests.helpers import tiny_llama

    calls = spy(monkeypatch, "silu_mul")
    layer = llama.PagedLlamaLayer(tiny_llama().model.layers[0], 0)
    assert layer.silu
    hidden = torch.randn(3, layer.gate_up_proj.in_features)
    expected = layer.down_proj(
        layer.act_fn(layer.gate_up_proj(hidden)[:, : layer.intermediate])
        * layer.gate_up_proj(hidden)[:, layer.intermediate :]
    )
    residual = torch.randn(3, layer.down_proj.out_features)
    torch.testing.assert_close(layer._mlp(hidden, residual), residual + expected)
    layer.silu = False  # another activation: torch's
    torch.testing.assert_close(layer._mlp(hidden, residual), residual + expected)
    assert calls == [(3, 2 * layer.intermediate)]


def test_the_model_gates_fp32_gelu_rows_on_the_cpu_in_one_pass(monkeypatch):
    """Gemma's GELU (tanh's approximation) in one pass: close to torch's own activation."""
    from engine.models.gemma import PagedGemmaLayer
    from tests.models.test_attention_features import build

    calls = spy(monkeypatch, "gelu_tanh_mul")
    layer = PagedGemmaLayer(build("gemma3").model.layers[0], 0)
    assert layer.gelu_tanh and not layer.silu
    hidden = torch.randn(3, layer.gate_up_proj.in_features)
    gate_up = layer.gate_up_proj(hidden)
    expected = layer.down_proj(
        layer.act_fn(gate_up[:, : layer.intermediate]) * gate_up[:, layer.intermediate :]
    )
    torch.testing.assert_close(layer._mlp_output(hidden), expected, rtol=1e-5, atol=1e-6)
    assert calls == [(3, 2 * layer.intermediate)]


@pytest.mark.parametrize(
    ("rows", "vocab"), [(1, 1), (3, 7), (2, 8), (5, 9), (64, 49152), (17, 1003)]
)
def test_argmax_matches_torch(rows, vocab):
    torch.manual_seed(vocab)
    x = torch.randn(rows, vocab) * 5
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_takes_the_first_of_equal_maxima_and_the_first_nan_as_torch_does():
    x = torch.zeros(6, 40)
    x[0, [3, 11, 30]] = 2.0  # ties within and across eight-lane steps
    x[1, [37, 39]] = 5.0  # ties in the tail after the last full step
    x[2] = float("-inf")  # nothing beats -inf: index 0
    x[3, [5, 20]] = float("inf")
    x[4, [9, 33]] = float("nan")  # NaN wins wherever it is
    x[4, 2] = 100.0
    x[5, 39] = float("nan")  # a NaN in the tail
    expected = x.argmax(dim=-1)
    assert expected.tolist() == [3, 37, 0, 5, 9, 39]
    assert torch.equal(cpu_ops.argmax_rows(x), expected)


def test_argmax_refuses_bad_inputs():
    with pytest.raises(RuntimeError, match="must be fp32"):
        cpu_ops.argmax_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.argmax_rows(torch.randn(8, 2).t())
    with pytest.raises(RuntimeError, match="rows, vocab"):
        cpu_ops.argmax_rows(torch.randn(8))


def test_the_sampler_chooses_with_it_for_fp32_logits_on_the_cpu(monkeypatch):
    from engine.worker import sampler

    calls = spy(monkeypatch, "argmax_rows")
    x = torch.randn(3, 50)
    assert torch.equal(sampler.row_argmax(x), x.argmax(dim=-1))
    assert torch.equal(sampler.row_argmax(x.bfloat16()), x.bfloat16().argmax(dim=-1))
    assert calls == [(3, 50)]  # bf16 went to torch


def reference_token_mask(logits: torch.Tensor, bits: torch.Tensor, rows: list[int]) -> None:
    """Bit j of word w allows token 32 * w + j; every other token of a listed row gets -inf."""
    vocab = logits.shape[1]
    for k, row in enumerate(rows):
        for token in range(vocab):
            word = int(bits[k, token // 32]) & 0xFFFFFFFF if token // 32 < bits.shape[1] else 0
            if not (word >> (token % 32)) & 1:
                logits[row, token] = float("-inf")


@pytest.mark.parametrize("vocab", [64, 77, 320])
def test_the_token_mask_bans_exactly_the_cleared_bits(vocab: int) -> None:
    torch.manual_seed(vocab)
    logits = torch.randn(5, vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32)
    bits[0] = -1  # everything allowed
    bits[1, 0] = 0  # the first 32 tokens banned
    rows = [4, 1, 2]
    expected = logits.clone()
    reference_token_mask(expected, bits, rows)
    cpu_ops.apply_token_bitmask(logits, bits, torch.tensor(rows))
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[[0, 3]]).all() and torch.isfinite(logits[4]).all()


def test_the_token_mask_refuses_rows_out_of_range() -> None:
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.apply_token_bitmask(
            torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([2])
        )
