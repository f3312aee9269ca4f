"""Granite 4 (`GraniteMoeHybridForCausalLM`) on Conveyor's decoder: Mamba2 layers whose convolution
inputs and scan state each request keeps in the state cache, between attention layers (NoPE, or
rotated where the config says so), with experts beside a shared MLP or that MLP alone; greedy
tokens and prompt logprobs equal transformers', under chunked prefill, preemption and mixed
steps. The scan itself is checked against transformers' reference functions."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, GraniteMoeHybridConfig
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf_granite

from engine.core.sampling_params import SamplingParams
from engine.models.granite_hybrid import (
    GraniteAttentionLayer,
    Mamba2Layer,
    PagedGraniteHybridForCausalLM,
)
from engine.models.ssd import SSD_CHUNK, decode_rows, decode_rows_torch, prompt_rows
from tests.helpers import (
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tokens_of,
)
from tests.models.recurrent import (
    check_saved_checkpoint,
    drawn_mamba2,
    served_under_pressure,
)
from tests.models.test_model_families import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
BLOCKS = ["mamba", "attention", "mamba", "mamba"]

# Mamba2 of 8 heads of 16 dims (twice the hidden size), two groups of 8 state dims; Granite's
# scalars away from one so they count.
SHAPE = COMMON | dict(
    num_hidden_layers=len(BLOCKS),
    layer_types=BLOCKS,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    shared_intermediate_size=96,
    embedding_multiplier=2.0,
    residual_multiplier=0.5,
    attention_multiplier=0.3,
    logits_scaling=1.5,
)
# Granite 4's kinds: the hybrid with experts beside the shared MLP (NoPE), and a dense one (the
# shared MLP alone) whose attention rotates.
KINDS = {
    "experts": lambda: GraniteMoeHybridConfig(**SHAPE, num_local_experts=6, num_experts_per_tok=2),
    "dense": lambda: GraniteMoeHybridConfig(
        **SHAPE, num_local_experts=0, position_embedding_type="rope"
    ),
}


def build(kind: str = "experts"):
    """A tiny random Granite 4, its norms, steps, decays and skips drawn so they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(KINDS[kind]()).eval()
    return drawn_mamba2(model)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    model = build(kind)
    core = served_under_pressure(model, MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedGraniteHybridForCausalLM)
    kinds = [Mamba2Layer if b == "mamba" else GraniteAttentionLayer for b in BLOCKS]
    assert [type(layer) for layer in paged.layers] == kinds
    assert [
        layer.rotates for layer in paged.layers if isinstance(layer, GraniteAttentionLayer)
    ] == [kind == "dense"]
    assert [layer.moe is not None for layer in paged.layers] == [kind == "experts"] * len(BLOCKS)
    assert core.runner.kv_cache.spec.num_layers == 1
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    # The convolution's last 3 inputs of x, B and C (128 + 2 * 2 * 8 channels); 8 x 16 x 8.
    assert shapes == [(64, 3, 160), (64, 8, 16, 8)] * 3


def test_a_prompt_longer_than_a_chunk_of_the_scan():
    """A prompt run in one step over several of the scan's chunks, then decoded."""
    model = build()
    prompt = [random.Random(7).randrange(2, 320) for _ in range(2 * SSD_CHUNK + 22)]
    core, _ = tiny_core(model, max_model_len=200)
    outputs = run_all(core, [prompt], GREEDY)
    assert tokens_of(outputs["req-0"]) == reference_greedy(model, prompt, MAX_NEW)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


@pytest.mark.parametrize("form", [decode_rows, decode_rows_torch])
def test_decode_rows_equal_transformers_state_update(form):
    """Rows of one token each from their own slots: the outputs and states transformers'
    `mamba2_selective_state_update` gives (its skip left out), other slots untouched; on the
    CPU's kernel (where built) and in torch's ops."""
    torch.manual_seed(1)
    rows, heads, dims, groups, size = 3, 4, 6, 2, 5
    state = torch.randn(6, heads, dims, size)
    slots = torch.tensor([4, 0, 2])
    x, steps = torch.randn(rows, heads, dims), torch.rand(rows, heads) + 0.1
    b, c = torch.randn(rows, groups, size), torch.randn(rows, groups, size)
    a = -torch.rand(heads) - 0.2
    expected_state = state[slots].clone()
    expected = hf_granite.mamba2_selective_state_update(
        expected_state,
        x,
        steps[..., None].expand(-1, -1, dims),
        a[:, None, None].expand(-1, dims, size),
        b,
        c,
    )
    untouched = state[[1, 3, 5]].clone()
    got = form(x, steps, b, c, a, state, slots)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(state[slots], expected_state)
    assert torch.equal(state[[1, 3, 5]], untouched)


@pytest.mark.parametrize("tokens", [1, 5, SSD_CHUNK, 2 * SSD_CHUNK + 9])
def test_prompt_rows_equal_transformers_chunk_scan(tokens):
    """A prompt from a state: the outputs and final state transformers' `mamba2_chunk_scan`
    gives (its own chunks of 256, no skip)."""
    torch.manual_seed(2)
    heads, dims, groups, size = 4, 6, 2, 5
    x, steps = torch.randn(tokens, heads, dims), torch.rand(tokens, heads) * 0.5 + 0.05
    b, c = torch.randn(tokens, groups, size), torch.randn(tokens, groups, size)
    a = -torch.rand(heads) - 0.2
    state = torch.randn(heads, dims, size)
    expected, expected_state = hf_granite.mamba2_chunk_scan(
        x[None],
        steps[None],
        a,
        b[None],
        c[None],
        256,
        initial_states=state[None],
        return_final_states=True,
    )
    got = prompt_rows(x, steps, a, b, c, state)
    torch.testing.assert_close(got, expected[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(state, expected_state[0], atol=1e-4, rtol=1e-4)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    """A Granite 4 checkpoint as saved serves from its folder with transformers' tokens."""
    check_saved_checkpoint(build(), tmp_path, MAX_NEW)


def test_prompts_of_one_length_run_the_scan_together():
    """Prompts of the same length in one step run the chunked scan as one, each row's heads from
    its own state: the same tokens as each alone."""
    model = build()
    rng = random.Random(8)
    same = [[rng.randrange(2, 320) for _ in range(9)] for _ in range(3)]
    expected = [reference_greedy(model, p, MAX_NEW) for p in same]
    core, _ = tiny_core(model)
    outputs = run_all(core, same, GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(3)] == expected
