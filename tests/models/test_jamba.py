"""Jamba (`JambaForCausalLM`) on Conveyor's decoder: Mamba1 layers (their convolution inputs and
scan states in the state cache) between attention layers without a rotary, with an MLP or
experts whose top-k softmax weights stay unnormalized; greedy tokens and prompt logprobs equal
transformers', under chunked prefill, preemption and mixed steps. The scan itself is checked
against transformers' state update."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, JambaConfig
from transformers.models.jamba import modeling_jamba as hf_jamba

from engine.models.jamba import JambaAttentionLayer, PagedJambaForCausalLM
from engine.models.mamba1 import SCAN_CHUNK, Mamba1Layer, decode_rows, prompt_rows
from tests.helpers import check_prompt_logprobs
from tests.models.recurrent import check_saved_checkpoint, drawn_mamba2, served_under_pressure
from tests.models.test_model_families import COMMON

MAX_NEW = 10
# Four layers, the second attending; experts (four, two a token) in every second layer's MLP.
SHAPE = COMMON | dict(
    num_hidden_layers=4,
    attn_layer_period=4,
    attn_layer_offset=1,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts_per_tok=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=8,
)
KINDS = {"dense": 1, "experts": 4}


def build(kind: str = "experts"):
    """A tiny random Jamba, its norms, steps, decays and skips drawn so they count."""
    torch.manual_seed(0)
    config = JambaConfig(**SHAPE, num_experts=KINDS[kind])
    return drawn_mamba2(AutoModelForCausalLM.from_config(config))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    model = build(kind)
    assert model.config.layer_types == [
        "linear_attention",
        "full_attention",
        *["linear_attention"] * 2,
    ]
    core = served_under_pressure(model, MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedJambaForCausalLM)
    kinds = [type(layer) for layer in paged.layers]
    assert kinds == [Mamba1Layer, JambaAttentionLayer, Mamba1Layer, Mamba1Layer]
    assert not paged.layers[1].rotates
    assert [layer.moe is not None for layer in paged.layers] == [False, kind == "experts"] * 2
    assert core.runner.kv_cache.spec.num_layers == 1
    # The convolution's last 3 inputs of 128 channels, the scan's 128 x 8 state, per layer.
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    assert shapes == [(64, 3, 128), (64, 128, 8)] * 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    check_saved_checkpoint(build(), tmp_path, MAX_NEW)


def _scan_inputs(tokens: int, channels: int = 6, size: int = 5):
    torch.manual_seed(3)
    x, steps = torch.randn(tokens, channels), torch.rand(tokens, channels) * 0.5 + 0.05
    b, c = torch.randn(tokens, size), torch.randn(tokens, size)
    return x, steps, b, c, -torch.rand(channels, size) - 0.2


def test_decode_rows_equal_transformers_state_update():
    """Rows of one token each from their own slots: the outputs and states transformers'
    `mamba_selective_state_update` gives (its skip and gate left out), other slots untouched."""
    x, steps, b, c, a = _scan_inputs(3)
    state = torch.randn(5, 6, 5)
    slots = torch.tensor([4, 0, 2])
    expected_state = state[slots].clone()
    expected = hf_jamba.mamba_selective_state_update(expected_state, x, steps, a, b, c)
    untouched = state[[1, 3]].clone()
    got = decode_rows(x, steps, b, c, a, state, slots)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(state[slots], expected_state)
    assert torch.equal(state[[1, 3]], untouched)


@pytest.mark.parametrize("tokens", [1, 7, SCAN_CHUNK + 9])
def test_prompt_rows_equal_transformers_token_by_token(tokens):
    """A prompt from a state: the outputs and final state of transformers' state update taken
    one token at a time."""
    x, steps, b, c, a = _scan_inputs(tokens)
    state = torch.randn(6, 5)
    expected_state, expected = state[None].clone(), []
    for t in range(tokens):
        update = hf_jamba.mamba_selective_state_update
        expected.append(
            update(expected_state, x[t : t + 1], steps[t : t + 1], a, b[t : t + 1], c[t : t + 1])
        )
    channels = b[:, None, :].expand(tokens, 6, 5)
    got = prompt_rows(x, steps, channels, c[:, None, :].expand(tokens, 6, 5), a, state)
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, expected_state[0], atol=1e-5, rtol=1e-5)
