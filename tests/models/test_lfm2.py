"""LFM2 on Conveyor's decoder: short convolution layers whose last inputs each request keeps in
the state cache, between attention layers; greedy tokens and prompt logprobs equal
transformers', under chunked prefill, preemption and mixed steps, and every state slot comes
back."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, Lfm2Config

from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.speculation import SpeculativeConfig
from engine.kv.block_manager import BlockManager
from engine.kv.state_cache import conv_windows
from engine.kv.state_slots import StateSlots
from engine.models import build_causal_lm
from engine.models.lfm2 import PagedLfm2ForCausalLM, ShortConvLayer
from tests.core.test_engine_greedy import record_chunking
from tests.helpers import (
    check_prompt_logprobs,
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)
from tests.models.recurrent import check_saved_checkpoint
from tests.models.test_model_families import COMMON

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
# Convolution layers around the attention layers, the last one a convolution.
LAYER_TYPES = ["conv", "full_attention", "conv", "conv"]


def config(**overrides: object) -> Lfm2Config:
    shape = COMMON | {"num_hidden_layers": len(LAYER_TYPES)}
    return Lfm2Config(
        **shape,
        layer_types=LAYER_TYPES,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=False,
        **overrides,  # type: ignore[arg-type]
    )


def build(**overrides: object):
    """A tiny random LFM2, its norms and convolution biases drawn so that they count."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config(**overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.normal_(1.0, 0.3)
            elif name.endswith("conv.bias"):
                param.normal_(0.0, 0.5)
    return model


def prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(2, 320) for _ in range(n)] for n in (1, 2, 5, 9, 17, 30, 24)]


def test_conv_windows_read_each_rows_state_then_its_tokens():
    # Two rows: three tokens then one; two inputs of state each (width 3).
    windows, states = conv_windows(np.asarray([3, 1]), 3)
    # The pool is [row 0's state (0, 1), row 1's state (2, 3), tokens (4, 5, 6), (7)].
    assert windows.tolist() == [[0, 1, 4], [1, 4, 5], [4, 5, 6], [2, 3, 7]]
    assert states.tolist() == [[5, 6], [3, 7]]


@pytest.mark.parametrize("conv_bias", [False, True])
def test_greedy_matches_generate_under_chunking_and_preemption(conv_bias):
    model = build(conv_bias=conv_bias)
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    core, info = tiny_core(model, num_blocks=24, max_model_len=64, max_num_batched_tokens=10)
    chunked = record_chunking(core)
    outputs = run_all(core, prompts(), GREEDY)
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(prompts()))] == expected
    assert core.scheduler.num_preemptions > 0 and any(chunked)
    blocks = core.scheduler.block_manager
    assert blocks.num_used_blocks == 0
    assert blocks.state_slots is not None and blocks.state_slots.num_free == 64
    assert info.enable_prefix_caching and blocks.snapshots is not None  # resumed from snapshots
    paged = core.runner.model
    assert isinstance(paged, PagedLfm2ForCausalLM)
    kinds = [type(layer) is ShortConvLayer for layer in paged.layers]
    assert kinds == [kind == "conv" for kind in LAYER_TYPES]
    # The KV cache holds the one attention layer; the states the three convolutions.
    assert core.runner.kv_cache.spec.num_layers == 1
    states = core.runner.kv_cache.states
    assert states is not None and [tuple(s.shape) for s in states.layers] == [(64, 2, 64)] * 3


def test_prompt_logprobs_equal_transformers():
    check_prompt_logprobs(build(), chunk=7, length=30)


def test_a_slot_is_zeroed_for_each_new_request():
    """A request reusing a slot another finished in starts from zeros: the same tokens as
    alone."""
    model = build()
    expected = [reference_greedy(model, p, MAX_NEW) for p in prompts()]
    core, _ = tiny_core(model, max_num_seqs=1)
    for i, prompt in enumerate(prompts()):
        outputs = run_all(core, [prompt], GREEDY)
        assert tokens_of(outputs["req-0"]) == expected[i]
    assert core.scheduler.block_manager.state_slots.num_free == 1


@pytest.mark.parametrize("grid", [None, 8])
def test_parallel_samples_each_compute_their_own_state(grid):
    """`n > 1` samples do not share the leader's prompt blocks: each sibling runs the prompt
    itself, so greedy siblings give the leader's tokens; with snapshots of the states every 8
    tokens, each sibling starts from the prefix cache at 24, the last grid point before the
    30-token prompt's last token."""
    model = build()
    prompt = prompts()[5]
    assert len(prompt) == 30
    expected = reference_greedy(model, prompt, MAX_NEW)
    core, _ = tiny_core(model, mamba_block_size=grid)
    for i in range(3):  # as the engine queues `n = 3` samples
        fork_of = "r-0" if i else None
        core.add_request(f"r-{i}", prompt, GREEDY, "r", i, fork_of=fork_of, siblings=3)
    tokens: dict[int, list[int]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.index, []).extend(output.new_token_ids)
    assert len(tokens) == 3 and all(found == expected for found in tokens.values())
    assert core.scheduler.block_manager.state_slots.num_free == 64
    assert core.scheduler.prefix_cache_hits == (2 * 24 if grid else 0)


def test_a_request_that_finds_no_free_slot_waits():
    blocks = BlockManager(16, 4)
    blocks.state_slots = StateSlots(1)
    first, second = (Request(f"r{i}", [1, 2], GREEDY, 0.0, 64) for i in range(2))
    assert blocks.allocate(first, 2) and first.state_slot == 0
    assert not blocks.allocate(second, 2) and second.block_ids == []
    blocks.free(first)
    assert first.state_slot is None and blocks.allocate(second, 2) and second.state_slot == 0
    blocks.check_invariants()


def test_what_does_not_keep_states_is_refused_with_the_reason(tmp_path):
    with pytest.raises(ValueError, match="runs on Conveyor's model implementation only"):
        build_causal_lm(build(), "transformers")
    build().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    spec = SpeculativeConfig(2, method="draft_model", model=str(tmp_path))
    with pytest.raises(ValueError, match="a draft model with recurrent layers is not served"):
        tiny_core(tiny_llama(), speculative=spec)


def test_a_saved_checkpoint_serves_from_its_folder(tmp_path):
    check_saved_checkpoint(build(), tmp_path, MAX_NEW)


def test_the_states_take_their_share_of_the_kv_budget():
    """A fixed KV budget pays for the states first (a slot, and a snapshot for prefix caching,
    for each of `--max-num-seqs` requests), and the blocks get the rest."""
    model = build()
    budget = 400_000
    core, _ = tiny_core(model, num_blocks=None, kv_cache_memory=budget, max_num_seqs=8)
    states = core.runner.kv_cache.states
    spec = core.runner.kv_cache.spec
    assert states is not None and (states.num_slots, states.num_snapshots) == (8, 8)
    assert states.num_bytes == 2 * 8 * 3 * 2 * 64 * 4
    assert core.runner.kv_cache.num_blocks == (budget - states.num_bytes) // spec.bytes_per_block


def test_fewer_slots_where_half_the_budget_holds_fewer(caplog):
    """States take at most half of a fixed KV budget: where that holds fewer slots than
    `--max-num-seqs`, fewer requests run at once (said in a warning), each with its right
    tokens; a budget whose half holds no slot is refused, naming the flag."""
    model = build()
    slot = 3 * 2 * 64 * 4  # three convolutions' last two inputs of 64 channels, fp32
    budget = 15 * slot  # half holds seven slots; the blocks get the rest
    with caplog.at_level("WARNING", logger="engine.factory"):
        core, info = tiny_core(model, num_blocks=None, kv_cache_memory=budget, max_num_seqs=16)
    states = core.runner.kv_cache.states
    assert states is not None and states.num_slots == 7
    # Snapshots for prefix caching in a quarter of the budget: three.
    assert states.num_snapshots == 3 and info.enable_prefix_caching
    assert "holds 7 slots" in caplog.text and "--max-num-seqs 16" in caplog.text
    running: list[int] = []
    real_step = core.step

    def step():
        running.append(len(core.scheduler.running))
        return real_step()

    core.step = step  # type: ignore[method-assign]
    short = [[token] for token in range(10, 20)]  # a block each: fewer slots than blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = run_all(core, short, params)
    expected = [reference_greedy(model, p, 3) for p in short]
    assert [tokens_of(outputs[f"req-{i}"]) for i in range(len(short))] == expected
    assert max(running) == 7
    assert core.scheduler.block_manager.state_slots.num_free == 7
    with pytest.raises(ValueError, match=r"more than half the KV cache budget.*--kv-cache-memory"):
        tiny_core(model, num_blocks=None, kv_cache_memory=slot, max_num_seqs=8)
