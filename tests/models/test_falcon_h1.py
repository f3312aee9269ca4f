"""Falcon-H1 (`FalconH1ForCausalLM`) on Conveyor's decoder: attention and Mamba2 side by side in
every layer (each layer's K/V in the paged cache, its Mamba2 states in the state cache), then a
gated MLP, with every µP multiplier away from one so each counts; the mixer's output normed with
its gate after or before the norm, or only gated. Greedy tokens and prompt logprobs equal
transformers', under chunked prefill, preemption and mixed steps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconH1Config

from engine.core.sampling_params import SamplingParams
from engine.models.falcon_h1 import FalconH1Layer, PagedFalconH1ForCausalLM
from tests.helpers import (
    check_prompt_logprobs,
)
from tests.models.recurrent import (
    check_saved_checkpoint,
    drawn_mamba2,
    served_under_pressure,
)
from tests.models.test_model_families import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)

# Three layers; Mamba2 of 8 heads of 16 dims, two groups of 8 state dims.
SHAPE = COMMON | dict(
    num_hidden_layers=3,
    head_dim=16,
    mamba_d_ssm=128,
    mamba_n_heads=8,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    lm_head_multiplier=0.7,
    embedding_multiplier=1.3,
    mlp_multipliers=[0.8, 1.2],
    key_multiplier=0.9,
    attention_in_multiplier=1.1,
    attention_out_multiplier=0.6,
    ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
    ssm_in_multiplier=0.9,
    ssm_out_multiplier=1.3,
)
# The mixer's output only gated (Falcon-H1's checkpoints), or normed in groups, gated after the
# norm or before it.
KINDS = {
    "gated": dict(mamba_rms_norm=False),
    "norm-then-gate": dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
    "gate-then-norm": dict(mamba_rms_norm=True, mamba_norm_before_gate=False),
}


def build(kind: str = "gated"):
    """A tiny random Falcon-H1, its norms, steps, decays and skips drawn so they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FalconH1Config(**SHAPE, **KINDS[kind])).eval()
    return drawn_mamba2(model)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    core = served_under_pressure(build(kind), MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedFalconH1ForCausalLM)
    assert all(isinstance(layer, FalconH1Layer) for layer in paged.layers)
    assert [layer.mamba.normed for layer in paged.layers] == [kind != "gated"] * 3
    # Every layer attends and keeps its convolution's last 3 inputs of x, B and C (128 + 2 * 2
    # * 8 channels) and its scan's 8 x 16 x 8 state.
    assert core.runner.kv_cache.spec.num_layers == 3
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    assert shapes == [(64, 3, 160), (64, 8, 16, 8)] * 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    check_saved_checkpoint(build(), tmp_path, MAX_NEW)
