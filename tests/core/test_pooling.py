"""The pooling runner (`--runner pooling`): each prompt's last hidden state, as transformers'
model computes it, whatever the chunking and the prefix cache; nothing sampled after it."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from engine.attention.hf import register
from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import pooling_mode
from engine.kernels.cpu.linear import pack_linears
from tests.helpers import needs_panels, run_all, tiny_core, tiny_llama

PROMPTS = [[5, 9, 33, 2, 17], list(range(40, 80)), [7] * 13, list(range(40, 80)), [3]]
POOL = SamplingParams(temperature=0, max_tokens=1)


def last_hidden(model, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) at the prompt's last token."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            out = model.model(torch.tensor([prompt]))
    finally:
        model.set_attn_implementation(register())
    return out.last_hidden_state[0, -1].float()


@pytest.mark.parametrize("chunk", [512, 16])
def test_each_prompt_gives_transformers_last_hidden_state(chunk):
    """Whole prompts and prompts in 16-token chunks beside others; the repeated prompt reads
    its blocks from the prefix cache."""
    model = tiny_llama()
    core, _ = tiny_core(model, runner="pooling", max_num_batched_tokens=chunk)
    outputs = run_all(core, PROMPTS, POOL)
    for i, prompt in enumerate(PROMPTS):
        [final] = [o for o in outputs[f"req-{i}"] if o.finished]
        assert final.embedding is not None and final.embedding.shape == (64,)
        torch.testing.assert_close(
            final.embedding, last_hidden(model, prompt), atol=1e-4, rtol=1e-4
        )
        assert final.num_output_tokens == 1
    assert core.scheduler.block_manager.num_used_blocks == 0


@needs_panels
def test_conveyors_cpu_kernels_pool_the_same_states():
    """Over fp32 panels (and the fused decode stack for the one-token prompt)."""
    model = tiny_llama()
    pack_linears(model)
    core, _ = tiny_core(model, runner="pooling")
    outputs = run_all(core, PROMPTS, POOL)
    for i, prompt in enumerate(PROMPTS):
        final = outputs[f"req-{i}"][-1]
        assert final.embedding is not None
        torch.testing.assert_close(
            final.embedding, last_hidden(model, prompt), atol=1e-4, rtol=1e-4
        )


def test_a_generating_engine_returns_no_embedding():
    core, _ = tiny_core(tiny_llama())
    outputs = run_all(core, PROMPTS[:1], POOL)
    assert all(o.embedding is None for o in outputs["req-0"])


def test_the_routes_line_names_the_runner(caplog):
    with caplog.at_level(logging.INFO, logger="engine.factory"):
        tiny_core(tiny_llama(), runner="pooling")
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("routes: ")]
    assert "runner pooling (each prompt's last hidden state, no sampling)" in line
    assert "sampling torch" not in line


def test_pooling_never_overlaps_and_names_what_it_needs():
    assert not EngineConfig(runner="pooling", async_scheduling=True).overlaps("cuda")
    with pytest.raises(ValueError, match="unknown runner"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="runs on one device"):
        EngineConfig(runner="pooling", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="Conveyor's model implementation"):
        tiny_core(tiny_llama(), runner="pooling", model_impl="transformers")


def test_a_model_pooled_otherwise_is_refused(tmp_path):
    """A sentence-transformers folder names its pooling; only the last token's is served."""
    pooling = tmp_path / "1_Pooling"
    pooling.mkdir()
    config = {"word_embedding_dimension": 64, "include_prompt": True}
    (pooling / "config.json").write_text(json.dumps({**config, "pooling_mode_mean_tokens": True}))
    assert pooling_mode(str(tmp_path)) == "mean"
    with pytest.raises(ValueError, match="pools its embeddings by mean"):
        tiny_core(tiny_llama(), runner="pooling", model_path=str(tmp_path))
    (pooling / "config.json").write_text(json.dumps({**config, "pooling_mode_lasttoken": True}))
    assert pooling_mode(str(tmp_path)) == "lasttoken"
    tiny_core(tiny_llama(), runner="pooling", model_path=str(tmp_path))
    assert pooling_mode("") is None and pooling_mode(str(tmp_path / "none")) is None
