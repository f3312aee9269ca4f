"""Mamba's own models, without attention (`MambaForCausalLM`, `Mamba2ForCausalLM`,
`FalconMambaForCausalLM`), on Conveyor's decoder: every block's mixer keeps its states in the
state cache, and the KV cache has no layers (its blocks only count tokens); greedy tokens and
prompt logprobs equal transformers', under chunked prefill, preemption and mixed steps, from a
saved checkpoint too."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, FalconMambaConfig, Mamba2Config, MambaConfig

from engine.models.mamba import MambaBlock, PagedMambaForCausalLM
from engine.models.mamba1 import Mamba1Mixer
from engine.models.mamba2 import Mamba2Mixer
from tests.helpers import check_prompt_logprobs, tiny_core
from tests.models.recurrent import check_saved_checkpoint, drawn_mamba2, served_under_pressure

MAX_NEW = 10
# transformers' Mamba models run on their own eager path alone.
ATTENTION = "eager"
SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=3,
    initializer_range=0.2,
    tie_word_embeddings=False,
    eos_token_id=0,
    bos_token_id=1,
    pad_token_id=0,
    state_size=8,
    expand=2,
    conv_kernel=4,
)
KINDS = {
    "mamba": lambda: MambaConfig(**SHAPE, time_step_rank=8),
    # Mamba2 of 8 heads of 16 dims in two groups.
    "mamba2": lambda: Mamba2Config(**SHAPE, num_heads=8, head_dim=16, n_groups=2),
    "falcon_mamba": lambda: FalconMambaConfig(**SHAPE, time_step_rank=8),
}
MIXERS = {"mamba": Mamba1Mixer, "mamba2": Mamba2Mixer, "falcon_mamba": Mamba1Mixer}


def build(kind: str = "mamba2"):
    """A tiny random model of the kind, its steps, decays and skips drawn so they count."""
    torch.manual_seed(0)
    return drawn_mamba2(AutoModelForCausalLM.from_config(KINDS[kind]()))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_greedy_matches_generate_under_chunking_and_preemption(kind):
    core = served_under_pressure(build(kind), MAX_NEW, ATTENTION)
    paged = core.runner.model
    assert isinstance(paged, PagedMambaForCausalLM)
    assert all(isinstance(layer, MambaBlock) for layer in paged.layers)
    assert all(type(layer.mamba) is MIXERS[kind] for layer in paged.layers)
    assert core.runner.kv_cache.spec.num_layers == 0 and core.runner.kv_cache.num_bytes == 0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prompt_logprobs_equal_transformers(kind):
    check_prompt_logprobs(build(kind), chunk=7, length=30)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    check_saved_checkpoint(build(), tmp_path, MAX_NEW, ATTENTION)


def test_blocks_without_memory_count_every_sequences_tokens():
    """No layer keeps K/V: the budget pays for the states alone, and there are blocks for two
    full-length sequences a slot."""
    core, _ = tiny_core(build(), num_blocks=None, max_model_len=96, max_num_seqs=8)
    assert core.runner.kv_cache.num_blocks >= 2 * 8 * 96 // 4
    assert not core.runner.kv_cache.released
