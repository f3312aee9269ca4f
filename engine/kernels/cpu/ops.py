"""Conveyor's C++ kernels for the CPU, as torch ops: paged decode and prefill attention
(`csrc/attention/paged_decode.cpp`, `csrc/attention/paged_prefill.cpp`) and the K/V store
(`csrc/attention/kv_store.cpp`), linear layers over weights packed in panels
(`csrc/linear/panel_linear.cpp`; bf16 weights in AMX tiles or AVX-512 BF16 dot products,
`csrc/linear/bf16_panels.cpp`, which also runs a gated MLP's gate/up projection and activation as
one op, and a layer of experts over such panels in one op, `csrc/linear/expert_mlps.cpp`),
RMSNorm, rotary embeddings and the gated MLP's activation in one pass each
(`csrc/elementwise/rms_norm.cpp`, `csrc/elementwise/rotary.cpp`, `csrc/elementwise/silu_mul.cpp`),
a whole decoder layer for a step of decode rows that runs those kernels back to back
(`csrc/fused_decode/decode_layer.cpp`), the greedy choice over a step's logits
(`csrc/elementwise/argmax.cpp`), a random one from its top-k and top-p
(`csrc/elementwise/nucleus_draw.cpp`), a decode token of each row through the gated delta rule
(`csrc/recurrent/delta_rule.cpp`), a decode token of each row through Mamba2's scan
(`csrc/recurrent/ssd_decode.cpp`) and a step's short causal convolution over each row's kept
inputs (`csrc/recurrent/short_conv.cpp`).

`cpu_build` compiles them on first use, in groups (`cpu_build.GROUPS`) that fall back apart:
`has(group)` says whether a group's ops loaded; where none can build (no compiler, not x86-64)
callers keep the pure-torch attention and torch's products.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import cache

import torch

from engine.kernels.cpu import build as cpu_build

logger = logging.getLogger(__name__)


@cache
def build_result() -> cpu_build.BuildResult:
    """Compile (once per machine) and load what builds here; registers `torch.ops.conveyor.*`."""
    from engine.core.paths import cache_dir

    return cpu_build.build(cache_dir() / "kernels")


def load() -> bool:
    """Whether any of the kernels loaded."""
    return bool(build_result().built)


@torch.compiler.assume_constant_result
def has(group: str) -> bool:
    """Whether the ops of this group (`cpu_build.GROUPS`: attention, linear, elementwise,
    fused_decode, recurrent) loaded. A constant to torch.compile (the build is done before it
    traces)."""
    return group in build_result().built


@cache
def register_fakes() -> None:
    """Tell torch.compile the shapes and dtypes of what the ops a layer runs between attention
    calls return (`worker/compilation.py`), so it traces them as opaque calls."""
    bf16, fp32 = torch.bfloat16, torch.float32
    fakes: dict[str, Callable[..., torch.Tensor]] = {
        "rms_norm": lambda x, weight, eps, bf16_out=False: x.new_empty(
            x.shape, dtype=bf16 if bf16_out else x.dtype
        ),
        "head_rms_norm": lambda x, weight, eps: x.new_empty(x.shape),
        "rotary": lambda x, cos, sin: x.new_empty(x.shape),
        "silu_mul": lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)),
        "gelu_tanh_mul": lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)),
        "clamped_swiglu_mul": lambda x, alpha, limit: x.new_empty((x.shape[0], x.shape[1] // 2)),
        "panel_linear": lambda x, panels, bias, out_features, residual=None: x.new_empty(
            (x.shape[0], out_features), dtype=fp32
        ),
        "gated_linear": lambda x, panels, bias, inter, bf16_out=False, gelu=False, clamped=None: (
            x.new_empty((x.shape[0], inter), dtype=bf16 if bf16_out else fp32)
        ),
    }
    for name, fake in fakes.items():
        if hasattr(torch.ops.conveyor, name):
            torch.library.register_fake(f"conveyor::{name}", fake)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per row over its paged K/V: `[rows, heads, dim]` in and out.

    `key_cache`/`value_cache` are one layer's `[blocks, block_size, kv_heads, dim]`;
    `block_table` `[rows, width]` and `seq_lens` `[rows]` are int64. With a `window`, a row
    attends to its last `window` tokens only; a `softcap` caps each score as
    `softcap * tanh(score / softcap)`; `sinks` (`[heads]`) join each head's softmax with no
    value.
    """
    return torch.ops.conveyor.paged_decode(
        _heads_contiguous(query),
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        scale,
        window,
        softcap,
        sinks,
    )


def paged_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    blocks: torch.Tensor,
    context: int,
    scale: float,
    bf16: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A sequence's query tokens `[tokens, heads, dim]` (fp32) attending causally over its K/V
    in the paged cache: token i sits at position `context + i`. `blocks` are the sequence's
    block ids (int64), covering `context + tokens` positions; its K/V are already stored. With
    a `window`, a token sees only its last `window` positions, itself included; with a
    `softcap` the scores are capped as `softcap * tanh(score / softcap)` (Gemma 2's); with
    `sinks` (`[heads]`, gpt-oss's) each head's logit joins its softmax with no value.

    The products are fp32, or with `bf16` (a bf16 cache, `bf16_prefill_available()`) bf16 dot
    products as torch's flash attention computes a bf16 model's: query rows and softmax weights
    rounded to bf16, sums and the softmax in fp32."""
    return torch.ops.conveyor.paged_prefill(
        _heads_contiguous(query),
        key_cache,
        value_cache,
        blocks,
        context,
        scale,
        bf16,
        window,
        softcap,
        sinks,
    )


def paged_prefill_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    contexts: torch.Tensor,
    table: torch.Tensor,
    scale: float,
    bf16: bool = False,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """`paged_prefill` for a step's sequences in one call (with its `window`, `softcap` and
    `sinks`): sequence i's query rows `[starts[i],
    starts[i] + lens[i])` sit at positions `contexts[i]` on, over the blocks of `table[i]`;
    their attention goes to the same rows of `out` (contiguous fp32, the query's shape), other
    rows are left as they are. `starts`, `lens`, `contexts` `[n]` and `table` `[n, width]` are
    int64; the runs lie in order and apart."""
    torch.ops.conveyor.paged_prefill_rows(
        _heads_contiguous(query),
        key_cache,
        value_cache,
        out,
        starts,
        lens,
        contexts,
        table,
        scale,
        bf16,
        window,
        softcap,
        sinks,
    )


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """New fp32 K and V `[tokens, kv_heads, dim]` (heads and dims contiguous, rows may be
    strided) to their slots (int64 `[tokens]`) of one layer's cache, rounded to its dtype as
    `Tensor.to` rounds."""
    torch.ops.conveyor.store_kv(key, value, key_cache, value_cache, slots)


def _heads_contiguous(query: torch.Tensor) -> torch.Tensor:
    """`[rows, heads, dim]` with heads and dims contiguous, as the attention kernels read it;
    rows may stay strided (a view into a fused projection's output)."""
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        return query.contiguous()
    return query


@cache
def panel_linear_available() -> bool:
    """The linear kernels loaded and this CPU runs the panel product (AVX2, F16C and FMA)."""
    return has("linear") and _multiplies(torch.ones(1, 8, 16, dtype=torch.float16))


@cache
def bf16_panels_available() -> bool:
    """The panel product runs over bf16 panels here: the CPU has AVX-512 BF16 dot products."""
    return panel_linear_available() and _multiplies(torch.ones(1, 4, 32, dtype=torch.bfloat16))


def bf16_tiles_available() -> bool:
    """The bf16 panel products can run in AMX tiles here (the CPU has AMX-BF16 and the kernel
    grants this process the tiles); they do unless `use_bf16_tiles(False)`."""
    return bf16_panels_available() and bool(torch.ops.conveyor.bf16_tiles_available())


def use_bf16_tiles(on: bool) -> bool:
    """Run the bf16 panel products in AMX tiles where available (the default), or in AVX-512
    BF16 dot products; returns the setting before. For tests and benchmarks that compare the
    two in one process: the two round a product's sums differently in the last bits."""
    return bf16_panels_available() and bool(torch.ops.conveyor.set_bf16_tiles(on))


def bf16_prefill_available() -> bool:
    """The prefill kernel's bf16 products run here (the same AVX-512 BF16 as the bf16 panels)."""
    return bf16_panels_available()


def _multiplies(panels: torch.Tensor) -> bool:
    """The panel product over these all-ones panels of 8 inputs and 3 outputs runs here and
    gives 8 for each output."""
    try:
        out = panel_linear(torch.ones(1, 8), panels, None, 3)
    except RuntimeError:
        return False
    return bool(torch.equal(out, torch.full((1, 3), 8.0)))


def panel_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x W^T + b` for fp32 `x [rows, in]` and W packed as `[ceil(out / 16), in, 16]` panels
    (fp32 or fp16), as `[ceil(out / 16), in / 2, 32]` bf16 panels of input pairs (x rounded to
    bf16, or bf16 already; `cpu_linear.pack_panels`) or as GGUF block panels
    (`gguf_blocks.pack_panels`), `b` fp32 zero-padded to whole panels; plus `residual [rows,
    out]` where given (equal to the bit to adding it after). The output is fp32."""
    return torch.ops.conveyor.panel_linear(x, panels, bias, out_features, residual)


def mxfp4_bf16_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """`x W^T + b` for fp32 `x [rows, in]` rounded to bf16 and W in MXFP4 block panels
    (`gguf_blocks.pack_panels`), in AVX-512 BF16 dot products, every product summed in fp32:
    `[rows, out]` fp32. Runs where `bf16_panels_available()`."""
    return torch.ops.conveyor.mxfp4_bf16_linear(x, panels, bias, out_features)


def block_bf16_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """`x W^T + b` for fp32 `x [rows, in]` rounded to bf16 and W in Q4_1, Q8_0, Q4_K, Q6_K or
    Q8_K block panels (`gguf_blocks.pack_panels`), in AVX-512 BF16 dot products over the
    blocks' integers, each block's sums scaled in fp32: `[rows, out]` fp32. Runs where
    `bf16_panels_available()`."""
    return torch.ops.conveyor.block_bf16_linear(x, panels, bias, out_features)


def panel_argmax(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """Each row's index of its largest output of `panel_linear` over bf16 panels, as
    `argmax(dim=-1)` picks it (the first of equal maxima; the first NaN where a row has one),
    without writing the outputs: int64 `[rows]`."""
    return torch.ops.conveyor.panel_argmax(x, panels, bias, out_features)


def gated_linear(
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    inter: int,
    bf16_out: bool = False,
    gelu: bool = False,
    clamped: tuple[float, float] | None = None,
) -> torch.Tensor:
    """`silu(x Wg^T + bg) * (x Wu^T + bu)` (with `gelu`, GELU's tanh approximation for silu;
    with `clamped` `(alpha, limit)`, gpt-oss's clamped SwiGLU as `clamped_swiglu_mul` computes
    it) for fp32 `x [rows, in]`, the gate and up weights in bf16 panels side by side,
    `[ceil(inter / 16), 2, in / 2, 32]`, and their biases likewise
    (`cpu_linear.GatedPanelLinear`): `[rows, inter]` in fp32, or with `bf16_out` rounded to
    bf16 as the bf16 panels round their input rows."""
    return torch.ops.conveyor.gated_linear(
        x, panels, bias, inter, bf16_out, gelu, None if clamped is None else list(clamped)
    )


def expert_mlps(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    gate_up_bias: Sequence[torch.Tensor | None],
    down: Sequence[torch.Tensor],
    down_bias: Sequence[torch.Tensor | None],
    inter: int,
    gelu: bool = False,
    clamped: tuple[float, float] | None = None,
    fp32_rows: bool = False,
) -> torch.Tensor:
    """A layer of experts over fp32 rows `x [rows, hidden]` in one op
    (`csrc/linear/expert_mlps.cpp`): row `i` through its experts `experts[i]` (int64 `[rows,
    k]`), each expert's gate/up in gated bf16 panels (`gated_linear`'s) and its down in bf16
    panels, or both in block panels multiplied in bf16 (`block_bf16_linear`'s or
    `mxfp4_bf16_linear`'s, any of their formats, gate/up's gate then up), or
    with `fp32_rows` both in `panel_linear`'s fp32, fp16 or block panels over fp32 rows; one
    of each (and a padded bias or None) per expert, under the activation `gated_linear` names,
    the outputs times `weights[i]` (fp32 `[rows, k]`) summed in fp32, as `ExpertLinears`' loop
    over the experts sums them."""
    return torch.ops.conveyor.expert_mlps(
        x,
        experts,
        weights,
        list(gate_up),
        list(gate_up_bias),
        list(down),
        list(down_bias),
        inter,
        gelu,
        None if clamped is None else list(clamped),
        fp32_rows,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, bf16_out: bool = False
) -> torch.Tensor:
    """RMSNorm of fp32 rows `[rows, dim]` scaled by an fp32 `[dim]` weight; with `bf16_out`
    (AVX-512 BF16) rounded to bf16 as the bf16 panels round their input rows."""
    return torch.ops.conveyor.rms_norm(x, weight, eps, bf16_out)


def head_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of fp32 `[tokens, heads, dim]` (heads and dims contiguous, tokens at any stride)
    normed as one `rms_norm` row by its row of the fp32 `[heads, dim]` weight (Qwen3's per-head
    q/k norms); contiguous."""
    return torch.ops.conveyor.head_rms_norm(x, weight, eps)


def all_heads_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, q_heads: int, eps: float
) -> torch.Tensor:
    """q's heads of fp32 `[tokens, q heads + kv heads, dim]` (heads and dims contiguous, tokens
    at any stride) normed as one `rms_norm` row by the first `q_heads * dim` values of the fp32
    `[(q heads + kv heads) * dim]` weight, k's heads as another by the rest (OLMo 2's q/k norms
    over all heads); contiguous."""
    return torch.ops.conveyor.all_heads_rms_norm(x, weight, q_heads, eps)


def rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairs: bool = False
) -> torch.Tensor:
    """Half-split rotary embedding of fp32 `[tokens, heads, dim]` by `[tokens, 1, dim]` tables;
    with `pairs`, neighbouring dims turned as pairs (GLM's), each by its frequency in the
    tables' first half."""
    return torch.ops.conveyor.rotary(x, cos, sin, pairs)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for fp32 rows `[rows, 2 * inter]` holding gate then up."""
    return torch.ops.conveyor.silu_mul(x)


def gelu_tanh_mul(x: torch.Tensor) -> torch.Tensor:
    """`gelu(gate) * up` under GELU's tanh approximation (Gemma's), for fp32 rows
    `[rows, 2 * inter]` holding gate then up."""
    return torch.ops.conveyor.gelu_tanh_mul(x)


def clamped_swiglu_mul(x: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU for fp32 rows `[rows, 2 * inter]` holding gate then up: the
    gate capped at `limit`, the up clamped to `[-limit, limit]`, then `(up + 1) * gate *
    sigmoid(alpha * gate)`, the sigmoid in silu's operations."""
    return torch.ops.conveyor.clamped_swiglu_mul(x, alpha, limit)


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each row through the gated delta rule, row i from `states[slots[i]]`
    (`[slots, value heads, key dims, value dims]` fp32), updated in place: contiguous fp32 `q`, `k`
    `[rows, key heads, key dims]` as projected (the op l2-norms them), `v` `[rows, value heads,
    value dims]`, `g`, `beta` `[rows, value heads]`, int64 `slots` (distinct). With int64
    `sources`, row i reads its state from `states[sources[i]]` instead, and the rows run in
    order (a source may be an earlier row's slot). fp32 `[rows, value heads, value dims]`
    (`csrc/recurrent/delta_rule.cpp`)."""
    return torch.ops.conveyor.gated_delta_decode(q, k, v, g, beta, states, slots, sources)


def ssd_decode(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rates: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each row through Mamba2's scan, row i from `states[slots[i]]` (`[slots,
    heads, head dims, state dims]` fp32), updated in place: contiguous fp32 `x` `[rows, heads,
    head dims]`, `steps` `[rows, heads]` (after the bias and softplus), `b`, `c` `[rows, groups,
    state dims]`, `rates` `[heads]` (A, negative), int64 `slots` (distinct). With int64
    `sources`, row i reads its state from `states[sources[i]]` instead, and the rows run in order
    (a source may be an earlier row's slot). fp32 `[rows, heads, head dims]`, without the skip
    (`csrc/recurrent/ssd_decode.cpp`)."""
    return torch.ops.conveyor.ssd_decode(x, steps, b, c, rates, states, slots, sources)


def mamba1_prompt_scan(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rates: torch.Tensor,
    states: torch.Tensor,
) -> torch.Tensor:
    """A prompt chunk's tokens through Mamba1's scan, the chunks of one length side by side:
    contiguous fp32 `x`, `steps` `[tokens, rows, channels]` (after the bias and softplus), `b`,
    `c` `[tokens, rows, state dims]`, `rates` `[channels, state dims]` (A, negative), each row
    from `states` `[rows, channels, state dims]`, updated in place. fp32 `[tokens, rows,
    channels]`, without the skip (`csrc/recurrent/mamba1_scan.cpp`)."""
    return torch.ops.conveyor.mamba1_prompt_scan(x, steps, b, c, rates, states)


def mamba1_decode(
    x: torch.Tensor,
    steps: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    rates: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token of each row through Mamba1's scan, row i from `states[slots[i]]` (`[slots,
    channels, state dims]` fp32), updated in place: contiguous fp32 `x`, `steps` `[rows,
    channels]` (after the bias and softplus), `b`, `c` `[rows, state dims]`, `rates` `[channels,
    state dims]` (A, negative), int64 `slots` (distinct). With int64 `sources`, row i reads its
    state from `states[sources[i]]` instead, and the rows run in order (a source may be an
    earlier row's slot). fp32 `[rows, channels]`, without the skip
    (`csrc/recurrent/mamba1_scan.cpp`)."""
    return torch.ops.conveyor.mamba1_decode(x, steps, b, c, rates, states, slots, sources)


def short_conv(
    inputs: torch.Tensor,
    states: torch.Tensor,
    taps: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    query_lens: torch.Tensor,
    silu: bool,
    sources: torch.Tensor | None = None,
) -> torch.Tensor:
    """A step's causal convolution of `taps` (`[width, channels]`, oldest input first) over
    fp32 `inputs` (`[tokens, channels]`, channels contiguous; the rows' tokens in turn,
    `query_lens` of each), row r's earlier inputs from `states[slots[r]]` (`[slots, width - 1,
    channels]` fp32), which become its last `width - 1` inputs; plus `bias`, through silu where
    `silu`. With `sources`, row r reads `states[sources[r]]` instead, the rows in order, so that
    a row may read the state an earlier one wrote. fp32 `[tokens, channels]`
    (`csrc/recurrent/short_conv.cpp`)."""
    return torch.ops.conveyor.short_conv(
        inputs, states, taps, bias, slots, query_lens, silu, sources
    )


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, as `logits.argmax(dim=-1)` picks it, for
    contiguous fp32 `[rows, vocab]`: int64 `[rows]`."""
    return torch.ops.conveyor.argmax_rows(logits)


def nucleus_draw(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Each row's token drawn by the running sum of its kept tokens' probabilities (top-k with
    its ties, then the top-p nucleus, then min-p), at `uniforms[row]` of their total, for
    contiguous fp32 `[rows, vocab]` temperature-scaled logits, int64 `top_k` (the vocabulary's
    size where none) and fp32 `[rows]` parameters: int64 `[rows]`. A row of no allowed token
    gets its last (`csrc/elementwise/nucleus_draw.cpp`)."""
    return torch.ops.conveyor.nucleus_draw(logits, top_k, top_p, min_p, uniforms)


def apply_token_bitmask(logits: torch.Tensor, bits: torch.Tensor, rows: torch.Tensor) -> None:
    """Set to -inf, in place, each token of `logits` row `rows[i]` whose bit in `bits[i]` is
    clear (int32 words, bit j of word w for token 32 * w + j, as llguidance fills them)."""
    torch.ops.conveyor.apply_token_bitmask(logits, bits, rows)


def decode_layer(
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    heads: list[int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    eps: float,
    scale: float,
    window: int = 0,
    qk_norm: torch.Tensor | None = None,
    rotates: bool = True,
    out_norms: tuple[torch.Tensor, torch.Tensor] | None = None,
    gelu: bool = False,
    residual_scale: float = 1.0,
    softcap: float = 0.0,
    pairs: bool = False,
    norms_rotated: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A Llama-family decoder layer over fp32 decode rows `[rows, hidden]`, one op.

    `weights`: input norm, q/k/v panels, output panels, post-attention norm, gate/up panels,
    down panels (both norms empty: nothing is normed before the attention or the MLP, OLMo 2's
    layer); `biases`: the four projections' padded biases or None; `heads`: query heads, kv
    heads, head dim. Each row's new K/V go to its slot of the layer cache (fp32, or bf16, fp16
    or fp8 e5m2 rounded as stored), then it attends over its blocks up to its length (its last
    `window` tokens only, where given). With `qk_norm` (fp32 `[heads + kv heads, head dim]`)
    each q and k head is normed before the rotary, as `head_rms_norm` norms it, with `eps`; one
    of `[(heads + kv heads) * head dim]` norms q's heads as one row and k's as another, as
    `all_heads_rms_norm` norms them (OLMo 2's).
    The rotary turns each head's first `cos.shape[-1]` dims (a partial rotary where fewer than
    the head's), none where not `rotates`. With `out_norms` (fp32 `[hidden]` each, Gemma's) the
    attention's and the MLP's outputs are normed before they join the residual; with `gelu` the
    MLP gates with GELU's tanh approximation instead of silu; `residual_scale` multiplies those
    outputs before they join it (Granite's residual multiplier); `softcap` caps the scores as
    `paged_decode` caps them (Gemma 2's). With `pairs` the rotary turns neighbouring dims as
    pairs (GLM's, `rotary(pairs=True)`); with `norms_rotated` the q/k norm comes after the
    rotary (Hunyuan's); `sinks` (fp32 `[heads]`, gpt-oss's) join each head's softmax as
    `paged_decode` joins them.
    """
    attn_out_norm, mlp_out_norm = out_norms if out_norms is not None else (None, None)
    return torch.ops.conveyor.decode_layer(
        hidden,
        weights,
        biases,
        heads,
        cos,
        sin,
        key_cache,
        value_cache,
        slots,
        block_table,
        seq_lens,
        eps,
        scale,
        window,
        qk_norm,
        rotates,
        attn_out_norm,
        mlp_out_norm,
        gelu,
        residual_scale,
        softcap,
        pairs,
        norms_rotated,
        sinks,
    )


# The step's rotary rows: one table for every layer, or one per layer.
Rows = torch.Tensor | Sequence[torch.Tensor]
# Each layer's output norms (Gemma's) or None.
OutNorms = Sequence[tuple[torch.Tensor, torch.Tensor] | None]


def _per_layer(rows: Rows, layers: int) -> list[torch.Tensor]:
    return [rows] * layers if isinstance(rows, torch.Tensor) else list(rows)


def _flat_out_norms(out_norms: OutNorms | None, layers: int) -> list[torch.Tensor | None]:
    """Two a layer, None for a layer without them."""
    norms = out_norms if out_norms is not None else [None] * layers
    return [n for pair in norms for n in (pair if pair is not None else (None, None))]


def stack_region_applies(
    width: int,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    heads: list[int],
    cos: Rows,
    sin: Rows,
    qk_norms: list[torch.Tensor | None] | None = None,
    out_norms: OutNorms | None = None,
    gelu: list[bool] | None = None,
) -> bool:
    """Whether `decode_layers` runs these layers in one parallel region
    (`csrc/fused_decode/decode_stack.cpp`): every projection over bf16 panels, gate/up as gated
    pairs."""
    layers = len(weights) // 6
    return torch.ops.conveyor.stack_region_applies(
        width,
        weights,
        biases,
        heads,
        _per_layer(cos, layers),
        _per_layer(sin, layers),
        qk_norms if qk_norms is not None else [None] * layers,
        _flat_out_norms(out_norms, layers),
        gelu if gelu is not None else [False] * layers,
    )


def decode_layers(
    hidden: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    heads: list[int],
    cos: Rows,
    sin: Rows,
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    slots: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    eps: float,
    scale: float,
    window: int | Sequence[int] = 0,
    qk_norms: list[torch.Tensor | None] | None = None,
    rotates: list[bool] | None = None,
    out_norms: OutNorms | None = None,
    gelu: list[bool] | None = None,
    residual_scales: list[float] | None = None,
    softcaps: list[float] | None = None,
    pairs: list[bool] | None = None,
    norms_rotated: list[bool] | None = None,
    sinks: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """`decode_layer` for every layer of a stack in turn, in one op: `weights` and `biases` are
    each layer's back to back; `key_caches`/`value_caches`, `qk_norms` (None: no layer norms
    its q and k heads), `rotates` (None: every layer rotates), `out_norms` (None: no layer norms
    its outputs), `gelu` (None: every layer gates with silu), `residual_scales` (None: every
    layer adds its outputs as they are), `softcaps` (None: no layer caps its scores), `pairs`
    (None: every layer's rotary turns halves), `norms_rotated` (None: every q/k norm comes
    before the rotary) and `sinks` (None: no layer has them) one per layer; `cos`/`sin` and
    `window` one for all or one per layer."""
    layers = len(key_caches)
    return torch.ops.conveyor.decode_layers(
        hidden,
        weights,
        biases,
        heads,
        _per_layer(cos, layers),
        _per_layer(sin, layers),
        key_caches,
        value_caches,
        slots,
        block_table,
        seq_lens,
        eps,
        scale,
        [window] * layers if isinstance(window, int) else list(window),
        qk_norms if qk_norms is not None else [None] * layers,
        rotates if rotates is not None else [True] * layers,
        _flat_out_norms(out_norms, layers),
        gelu if gelu is not None else [False] * layers,
        residual_scales if residual_scales is not None else [1.0] * layers,
        softcaps if softcaps is not None else [0.0] * layers,
        pairs if pairs is not None else [False] * layers,
        norms_rotated if norms_rotated is not None else [False] * layers,
        sinks if sinks is not None else [None] * layers,
    )
