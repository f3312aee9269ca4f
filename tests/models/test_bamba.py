"""Bamba (`BambaForCausalLM`) on Conveyor's decoder: Mamba2 layers (their states in the state
cache) between attention layers that rotate half of each head's dims, each with a SwiGLU MLP;
greedy tokens and prompt logprobs equal transformers', under chunked prefill, preemption and mixed
steps, from a saved checkpoint too."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, BambaConfig

from engine.core.sampling_params import SamplingParams
from engine.models.bamba import PagedBambaForCausalLM
from engine.models.llama import PagedLlamaLayer
from engine.models.mamba2 import Mamba2Layer
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
# Four layers, the second attending; Mamba2 of 8 heads of 16 dims, two groups of 8 state dims.
SHAPE = COMMON | dict(
    num_hidden_layers=4,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
)


def build():
    """A tiny random Bamba, its norms, steps, decays and skips drawn so they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(BambaConfig(**SHAPE)).eval()
    return drawn_mamba2(model)


def test_greedy_matches_generate_under_chunking_and_preemption():
    core = served_under_pressure(build(), MAX_NEW)
    paged = core.runner.model
    assert isinstance(paged, PagedBambaForCausalLM)
    kinds = [type(layer) for layer in paged.layers]
    assert kinds == [Mamba2Layer, PagedLlamaLayer, Mamba2Layer, Mamba2Layer]
    assert paged.layers[1].rotary_dim == 8  # half of each head's 16 dims
    assert core.runner.kv_cache.spec.num_layers == 1
    shapes = [tuple(s.shape) for s in core.runner.kv_cache.states.layers]
    assert shapes == [(64, 3, 160), (64, 8, 16, 8)] * 3


def test_prompt_logprobs_equal_transformers():
    check_prompt_logprobs(build(), chunk=7, length=30)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    check_saved_checkpoint(build(), tmp_path, MAX_NEW)
