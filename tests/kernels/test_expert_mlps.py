"""A layer of experts in one op (`csrc/linear/expert_mlps.cpp`): over gated bf16 panel pairs (silu
or gpt-oss's clamped SwiGLU), over block panels multiplied in bf16 (MXFP4, GGUF's formats) and
over the panels that multiply fp32 rows (fp32, fp16, blocks widened to fp32: every x86-64 level)
it equals `ExpertLinears`' loop over the experts to the bit (which equals the loop over the
joined gate/up layers), whatever the rows, choices, biases and threads, and MXFP4 experts equal
torch's float64 product of the weights the blocks define; it refuses what it cannot compute, and
`group` groups only what the op takes."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import pytest
import torch
from torch import nn

from engine.kernels.cpu import ops as cpu_ops
from engine.kernels.cpu.linear import GatedPanelLinear, PanelLinear
from engine.loading import gguf_blocks
from engine.loading.mxfp4_experts import gguf_rows
from engine.models.experts import ClampedSwiGLU, ExpertLinears
from tests.helpers import needs_bf16_panels, needs_panels
from tests.loading.test_gguf_blocks import block_layer
from tests.models.test_gpt_oss import mxfp4_weight

HIDDEN, INTER, EXPERTS = 96, 48, 8
# MXFP4 experts' intermediate size: a whole number of 32-input blocks.
MXFP4_INTER = 64
# gpt-oss's alpha, and a limit its random sums here pass often.
CLAMP = ClampedSwiGLU(1.702, 0.6)


def experts(
    biases: bool = False,
    inter: int = INTER,
    storage: torch.dtype = torch.bfloat16,
    seed: int = 0,
    clamped: ClampedSwiGLU | None = None,
) -> ExpertLinears:
    """Random experts in panels of `storage`, each gate/up one joined layer (gate rows first),
    under silu or `clamped`."""
    torch.manual_seed(seed)

    def layer(out: int, into: int) -> PanelLinear:
        bias = torch.randn(out) * 0.1 if biases else None
        return PanelLinear(torch.randn(out, into) / into**0.5, bias, storage)

    gate_up = [layer(2 * inter, HIDDEN) for _ in range(EXPERTS)]
    down = [layer(HIDDEN, inter) for _ in range(EXPERTS)]
    return ExpertLinears(
        gate_up,  # type: ignore[arg-type]
        down,  # type: ignore[arg-type]
        nn.SiLU(),
        silu=clamped is None,
        clamped=clamped,
    )


def random_mxfp4(out: int, inputs: int, generator: torch.Generator):
    """GGUF MXFP4 rows `[out, inputs / 32 * 17]` of random codes under scales about 1 / 8, and
    the fp32 weights they stand for, by the format's definition."""
    shape = (1, out, inputs // 32)
    codes = torch.randint(0, 256, (*shape, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(121, 125, shape, generator=generator, dtype=torch.uint8)
    return gguf_rows(codes, scales)[0].contiguous(), mxfp4_weight(codes, scales)[0]


class Mxfp4Experts:
    """Random experts in MXFP4 blocks multiplied in bf16, as gpt-oss's load, with the weights
    and biases they stand for."""

    def __init__(
        self, biases: bool, clamped: ClampedSwiGLU | None, seed: int = 0, in_bf16: bool = True
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.weights: list[tuple[torch.Tensor, ...]] = []
        gate_up, down = [], []
        for _ in range(EXPERTS):
            expert = []
            for out, into, into_list in (
                (2 * MXFP4_INTER, HIDDEN, gate_up),
                (HIDDEN, MXFP4_INTER, down),
            ):
                rows, weight = random_mxfp4(out, into, generator)
                bias = torch.randn(out, generator=generator) * 0.1 if biases else None
                layer = PanelLinear.of_blocks(gguf_blocks.MXFP4, rows, bias)
                assert layer.multiply_in_bf16() or not in_bf16
                into_list.append(layer)
                expert.append((weight, bias))
            self.weights.append(tuple(expert))
        self.layer = ExpertLinears(
            gate_up,
            down,
            nn.SiLU(),
            silu=clamped is None,
            clamped=clamped,  # type: ignore[arg-type]
        )


def choices(rows: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `k` distinct experts (some experts chosen by none) and fp32 weights."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, EXPERTS - 2, generator=generator)
    chosen = scores.topk(k, dim=-1).indices
    weights = torch.rand(rows, k, generator=generator)
    return chosen, weights / weights.sum(-1, keepdim=True)


@needs_bf16_panels
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("clamped", [None, CLAMP])
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 4), (3, 2), (13, 3), (64, 4), (150, 2)])
@pytest.mark.usefixtures("bf16_products")
def test_the_op_equals_the_loop_over_the_experts_to_the_bit(
    rows: int, k: int, biases: bool, clamped: ClampedSwiGLU | None
) -> None:
    joined = experts(biases, clamped=clamped)
    x = torch.randn(rows, HIDDEN)
    chosen, weights = choices(rows, k, seed=rows * k)
    with torch.inference_mode():
        before = joined.by_expert(x, chosen, weights)
        assert joined.group()
        assert all(isinstance(g, GatedPanelLinear) for g in joined.gate_up)
        looped = joined.by_expert(x, chosen, weights)
        grouped = joined(x, chosen, weights)
    assert torch.equal(looped, before)
    assert torch.equal(grouped, looped)
    # Not a sum of zeros: every row's chosen experts count.
    assert bool((grouped.abs().sum(-1) > 0).all())


@needs_bf16_panels
@pytest.mark.parametrize("biases", [False, True])
@pytest.mark.parametrize("clamped", [None, CLAMP])
@pytest.mark.parametrize(("rows", "k"), [(1, 1), (1, 4), (3, 2), (13, 3), (64, 4)])
def test_mxfp4_experts_in_one_op_equal_their_loop_to_the_bit(
    rows: int, k: int, biases: bool, clamped: ClampedSwiGLU | None
) -> None:
    held = Mxfp4Experts(biases, clamped, seed=rows + k)
    x = torch.randn(rows, HIDDEN)
    chosen, weights = choices(rows, k, seed=rows * k)
    with torch.inference_mode():
        looped = held.layer.by_expert(x, chosen, weights)
        assert held.layer.group()
        assert held.layer.grouped
        grouped = held.layer(x, chosen, weights)
    assert torch.equal(grouped, looped)
    assert bool((grouped.abs().sum(-1) > 0).all())


def fp32_row_experts(storage: str, biases: bool, clamped: ClampedSwiGLU | None) -> ExpertLinears:
    """Experts whose panels multiply fp32 rows: fp32, fp16, or MXFP4 blocks widened to fp32."""
    if storage == "mxfp4":
        return Mxfp4Experts(biases, clamped, seed=2, in_bf16=False).layer
    return experts(biases, storage=getattr(torch, storage), clamped=clamped)


@needs_panels
@pytest.mark.parametrize("storage", ["float32", "float16", "mxfp4"])
@pytest.mark.parametrize("clamped", [None, CLAMP])
@pytest.mark.parametrize(
    ("rows", "k", "biases"), [(1, 4, False), (3, 2, True), (13, 3, True), (64, 4, False)]
)
def test_experts_over_fp32_rows_in_one_op_equal_their_loop_to_the_bit(
    storage: str, rows: int, k: int, biases: bool, clamped: ClampedSwiGLU | None
) -> None:
    """The panels every x86-64 level multiplies (no AVX-512 needed): one op, equal to the bit
    to the loop, which runs each expert's products and activation one op each."""
    layer = fp32_row_experts(storage, biases, clamped)
    x = torch.randn(rows, HIDDEN)
    chosen, weights = choices(rows, k, seed=rows * k)
    with torch.inference_mode():
        looped = layer.by_expert(x, chosen, weights)
        assert layer.group() and layer.grouped
        assert all(isinstance(g, PanelLinear) for g in layer.gate_up)  # not paired
        grouped = layer(x, chosen, weights)
    assert torch.equal(grouped, looped)
    assert bool((grouped.abs().sum(-1) > 0).all())


# Each expert's gate/up and down formats: one format, or a K-quant file's mix.
GGUF_EXPERTS = [
    ("q4_k", "q4_k"),
    ("q6_k", "q6_k"),
    ("q8_0", "q8_0"),
    ("q4_1", "q4_1"),
    ("q4_k", "q6_k"),
]
# A K-quant's super-block of inputs.
SUPER = 256


def gguf_experts(gate_up_format: str, down_format: str, seed: int = 0) -> ExpertLinears:
    """Experts in GGUF blocks multiplied in bf16 (a GGUF file's kept beside a bf16 model), hidden
    and intermediate size one super-block each."""
    gate_up, down = [], []
    for e in range(EXPERTS):
        gate_up.append(block_layer(gate_up_format, 2 * SUPER, SUPER, seed + 2 * e))
        down.append(block_layer(down_format, SUPER, SUPER, seed + 2 * e + 1))
    for layer in [*gate_up, *down]:
        assert layer.multiply_in_bf16()
    return ExpertLinears(gate_up, down, nn.SiLU(), silu=True)  # type: ignore[arg-type]


@needs_bf16_panels
@pytest.mark.parametrize(("gate_up_format", "down_format"), GGUF_EXPERTS)
@pytest.mark.parametrize(("rows", "k"), [(1, 2), (3, 2), (13, 3)])
def test_gguf_experts_in_one_op_equal_their_loop_to_the_bit(
    gate_up_format: str, down_format: str, rows: int, k: int
) -> None:
    """Formats with a minimum (Q4_1, Q4_K: each block's row sums times it) and without."""
    layer = gguf_experts(gate_up_format, down_format, seed=rows)
    x = torch.randn(rows, SUPER)
    chosen, weights = choices(rows, k, seed=rows * k)
    with torch.inference_mode():
        looped = layer.by_expert(x, chosen, weights)
        assert layer.group() and layer.grouped
        grouped = layer(x, chosen, weights)
    assert torch.equal(grouped, looped)
    assert bool((grouped.abs().sum(-1) > 0).all())


def reference_experts(
    held: Mxfp4Experts, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """The layer in float64 from the weights the blocks define: each row rounded to bf16, its
    experts' gate/up, the activation, rounded to bf16 again, the down projection, weighed."""
    clamped = held.layer.clamped
    rows = x.bfloat16().double()
    out = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        for expert, weight in zip(chosen[r].tolist(), weights[r].double(), strict=True):
            (w1, b1), (w2, b2) = held.weights[expert]
            gate_up = rows[r] @ w1.double().T + (0 if b1 is None else b1.double())
            gate, up = gate_up.chunk(2)
            if clamped is None:
                activated = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=clamped.limit), up.clamp(-clamped.limit, clamped.limit)
                activated = (up + 1) * gate * torch.sigmoid(clamped.alpha * gate)
            rounded = activated.float().bfloat16().double()
            out[r] += weight * (rounded @ w2.double().T + (0 if b2 is None else b2.double()))
    return out


@needs_bf16_panels
@pytest.mark.parametrize("clamped", [None, CLAMP])
def test_mxfp4_experts_are_the_product_of_the_weights_the_blocks_define(
    clamped: ClampedSwiGLU | None,
) -> None:
    """Against torch's float64 layer over the decoded weights: within fp32 sums, but for where
    the activation's bf16 rounding falls the other way (a last-bit step of one intermediate
    value, then summed through the down projection)."""
    held = Mxfp4Experts(True, clamped, seed=9)
    assert held.layer.group()
    x = torch.randn(11, HIDDEN, generator=torch.Generator().manual_seed(3))
    chosen, weights = choices(11, 3, seed=4)
    with torch.inference_mode():
        got = held.layer(x, chosen, weights)
    expected = reference_experts(held, x, chosen, weights)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)
    assert (got.double() - expected).abs().median() < 1e-3


@needs_panels
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize(
    "form",
    [
        pytest.param("bf16", marks=needs_bf16_panels),
        pytest.param("mxfp4", marks=needs_bf16_panels),
        "float16",
    ],
)
def test_the_op_does_not_depend_on_the_thread_count(rows: int, form: str) -> None:
    if form == "bf16":
        paired = experts(biases=True)
    elif form == "mxfp4":
        paired = Mxfp4Experts(True, CLAMP).layer
    else:
        paired = fp32_row_experts(form, True, None)
    assert paired.group()
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
    assert paired.group()
    x = torch.randn(5, HIDDEN)
    chosen, weights = choices(5, 2, seed=3)
    with torch.inference_mode():
        once = paired(x, chosen, weights)
        torch.testing.assert_close(paired(x, chosen, 2 * weights), 2 * once, rtol=0, atol=0)
        other = paired(x, (chosen + 1) % EXPERTS, weights)
    assert not torch.allclose(other, once)


def op_call(layer: ExpertLinears, **fixed: object) -> tuple[Callable[..., torch.Tensor], dict]:
    """`cpu_ops.expert_mlps` over `layer`'s panels (no biases) for two random rows and their
    choices, with `fixed` arguments; and those arguments. The call takes changed ones."""
    chosen, weights = choices(2, 2, seed=1)
    args: dict[str, object] = dict(
        x=torch.randn(2, HIDDEN), experts=chosen, weights=weights,
        gate_up=[g.panels for g in layer.gate_up], gate_up_bias=[None] * EXPERTS,
        down=[d.panels for d in layer.down], down_bias=[None] * EXPERTS,
        inter=layer.intermediate, **fixed,
    )  # fmt: skip

    def call(**changed: object) -> torch.Tensor:
        return cpu_ops.expert_mlps(**(args | changed))  # type: ignore[arg-type]

    return call, args


@needs_bf16_panels
def test_the_op_refuses_what_it_cannot_compute() -> None:
    paired = experts()
    assert paired.group()
    call, args = op_call(paired)
    x, weights = cast(torch.Tensor, args["x"]), cast(torch.Tensor, args["weights"])
    gate_up, down = (
        cast(list[torch.Tensor], args["gate_up"]),
        cast(list[torch.Tensor], args["down"]),
    )
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
    with pytest.raises(RuntimeError, match=r"clamped is \[alpha, limit\]"):
        call(clamped=(1.0, 0.0))
    with pytest.raises(RuntimeError, match=r"clamped is \[alpha, limit\]"):
        call(clamped=(1.0, 7.0), gelu=True)
    assert call().shape == (2, HIDDEN)
    blocks = Mxfp4Experts(False, None).layer
    mx_gate_up = [g.panels for g in blocks.gate_up]
    mx_down = [d.panels for d in blocks.down]
    with pytest.raises(RuntimeError, match="block panels must be"):  # inter is another's
        call(gate_up=mx_gate_up, down=mx_down)
    with pytest.raises(RuntimeError, match="block panels must be"):
        call(gate_up=mx_gate_up, down=[d[:-1] for d in mx_down], inter=MXFP4_INTER)
    with pytest.raises(RuntimeError, match="gate/up panels must be"):  # the forms mixed
        call(gate_up=[gate_up[0], *mx_gate_up[1:]], down=mx_down, inter=MXFP4_INTER,
             experts=torch.tensor([[0, 1], [2, 3]]))  # fmt: skip
    assert call(gate_up=mx_gate_up, down=mx_down, inter=MXFP4_INTER).shape == (2, HIDDEN)


@needs_panels
def test_the_op_refuses_fp32_row_panels_it_cannot_compute() -> None:
    """Over fp32 rows (every x86-64 level): panels of another shape or dtype are refused with the
    reason, and the ones it takes give the loop's output."""
    layer = experts(storage=torch.float16)
    call, args = op_call(layer, fp32_rows=True)
    gate_up, down = (
        cast(list[torch.Tensor], args["gate_up"]),
        cast(list[torch.Tensor], args["down"]),
    )
    x, chosen = cast(torch.Tensor, args["x"]), cast(torch.Tensor, args["experts"])
    weights = cast(torch.Tensor, args["weights"])
    with pytest.raises(RuntimeError, match="with fp32_rows, panels must be"):
        call(down=[d[:-1] for d in down])
    with pytest.raises(RuntimeError, match="with fp32_rows, panels must be"):
        call(gate_up=[g.to(torch.bfloat16) for g in gate_up])
    with pytest.raises(RuntimeError, match="a bias must be fp32"):
        call(down_bias=[torch.zeros(HIDDEN + 1)] * EXPERTS)
    with torch.inference_mode():
        assert torch.equal(call(), layer.by_expert(x, chosen, weights))


@needs_bf16_panels
def test_only_what_the_op_takes_is_grouped() -> None:
    """bf16 experts under silu or the clamped SwiGLU with the intermediate size in whole panels,
    MXFP4 experts multiplied in bf16, and panels over fp32 rows, all of one kind; the rest
    keeps the loop."""
    ragged = experts(inter=40)  # gate and up meet inside a panel
    assert not ragged.group()
    int8 = experts(storage=torch.float32)
    int8.down[0].panels = int8.down[0].panels.to(torch.int8)  # 8-bit activations' panels
    assert not int8.group()
    gelu = experts()
    gelu.silu = False  # another activation, which the op does not compute
    assert not gelu.group()
    assert ragged.route == "expert by expert"
    clamped = experts(clamped=CLAMP)
    assert clamped.group()
    assert "clamped swiglu(gate, up)" in repr(clamped.gate_up[0])
    assert clamped.route == "one op (gated bf16 panel pairs)"
    blocks = Mxfp4Experts(False, CLAMP).layer
    assert blocks.group() and blocks.route == "one op (blocks over bf16 rows)"
    fp16 = experts(storage=torch.float16)
    assert fp16.group() and fp16.route == "one op (panels over fp32 rows)"
    mixed = Mxfp4Experts(False, CLAMP)
    mixed.layer.down[0].bf16_blocks = False  # one expert's down widens to fp32, the rest not
    assert not mixed.layer.group()
    x = torch.randn(3, HIDDEN)
    chosen, weights = choices(3, 2, seed=5)
    with torch.inference_mode():  # the loop serves what is not grouped
        torch.testing.assert_close(
            ragged(x, chosen, weights), ragged.by_expert(x, chosen, weights), rtol=0, atol=0
        )
