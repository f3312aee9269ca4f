"""Conveyor's own Llama-family decoder against the Hugging Face model it was built from."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from engine.core.sampling_params import SamplingParams
from engine.models import DECODER_ONLY, build_causal_lm
from engine.models.hf import TransformersCausalLM
from engine.models.llama import PagedLlamaForCausalLM
from engine.worker.input_batch import build_input_batch
from tests.helpers import (
    reference_greedy,
    run_all,
    tiny_core,
    tiny_llama,
    tokens_of,
    transformers_attention,
)
from tests.models.test_model_families import FAMILIES, build


def step_logits(model, impl: str, prompt: list[int]) -> torch.Tensor:
    """Prefill logits of every prompt position through the engine's runner."""
    core, _ = tiny_core(model, model_impl=impl)
    runner = core.runner
    assert runner.model.name == impl
    params = SamplingParams(temperature=0, max_tokens=1)
    core.add_request("r", prompt, params)
    scheduled = core.scheduler.schedule()
    batch = build_input_batch(scheduled.scheduled, runner.kv_cache.block_size)
    with torch.inference_mode():
        return runner.forward(batch, np.arange(len(prompt)))


@pytest.mark.parametrize("family", ["llama", *sorted(FAMILIES)])
def test_logits_match_the_hugging_face_model(family: str) -> None:
    model = tiny_llama() if family == "llama" else build(family)
    rng = random.Random(3)  # one generator: a prompt of distinct tokens, which rotary tells apart
    prompt = [rng.randrange(2, 320) for _ in range(21)]
    assert len(set(prompt)) > 10
    ours = step_logits(model, "conveyor", prompt)
    if type(model).__name__ in DECODER_ONLY:  # no paged attention in its layers: its own forward
        with torch.no_grad(), transformers_attention(model):
            theirs = model(torch.tensor([prompt])).logits[0]
    else:
        theirs = step_logits(model, "transformers", prompt)
    assert ours.shape == (21, 320)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_transformers_implementation_still_matches_generate() -> None:
    model = tiny_llama()
    prompts = [[5, 9, 33, 2], list(range(40, 90)), [7] * 13]
    core, _ = tiny_core(model, model_impl="transformers", max_num_batched_tokens=16)
    outputs = run_all(core, prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 8)


def test_auto_picks_conveyor_for_llama_and_transformers_otherwise() -> None:
    assert isinstance(build_causal_lm(tiny_llama()), PagedLlamaForCausalLM)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert isinstance(build_causal_lm(gpt2), TransformersCausalLM)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        build_causal_lm(gpt2, "conveyor")
    with pytest.raises(ValueError, match="unknown model implementation"):
        build_causal_lm(tiny_llama(), "vllm")


def test_fused_projections_share_no_storage_with_the_source() -> None:
    """Fusing copies q/k/v into one weight; the Hugging Face model is left as it was."""
    model = tiny_llama()
    q_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    ours = PagedLlamaForCausalLM(model)
    fused = ours.layers[0].qkv_proj.weight
    assert fused.shape[0] == 64 + 2 * 32
    torch.testing.assert_close(fused[:64], q_before)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, q_before)


def storages(*modules: torch.nn.Module) -> dict[int, int]:
    """Bytes of every distinct storage the modules' parameters lie in."""
    return {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
        for module in modules
        for p in module.parameters()
    }


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_fused_projections_keep_no_second_copy(family: str) -> None:
    """q/k/v and gate/up are fused without copying the weights twice: the source projections
    become views of their rows of the fused ones, and the source model computes as before."""
    model = tiny_llama() if family == "llama" else build(family)
    before = {name: p.clone() for name, p in model.named_parameters()}
    weight_bytes = sum(storages(model).values())
    paged = build_causal_lm(model, "conveyor")
    assert isinstance(paged, PagedLlamaForCausalLM)
    for layer, source in zip(paged.layers, model.model.layers, strict=True):
        attn, mlp = source.self_attn, source.mlp
        for fused, parts in [
            (layer.qkv_proj, (attn.q_proj, attn.k_proj, attn.v_proj)),
            (layer.gate_up_proj, (mlp.gate_proj, mlp.up_proj)),
        ]:
            shared = {p.weight.untyped_storage().data_ptr() for p in parts}
            assert shared == {fused.weight.untyped_storage().data_ptr()}
            if fused.bias is not None:  # qwen2's q/k/v
                assert attn.q_proj.bias.untyped_storage().data_ptr() == (
                    fused.bias.untyped_storage().data_ptr()
                )
    assert sum(storages(model, paged).values()) == weight_bytes
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_dummy_load_format_serves_random_weights_from_the_config_alone(tmp_path) -> None:
    """`--load-format dummy`: a folder with only a config and a tokenizer serves, over the
    weights transformers' own initialisation gives that config under the engine's seed."""
    from transformers import AutoModelForCausalLM

    from engine.core.config import CacheConfig, EngineConfig
    from engine.factory import create_engine_core
    from tests.helpers import tiny_tokenizer

    config = tiny_llama().config
    config.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    assert not list(tmp_path.glob("*.safetensors"))
    engine = EngineConfig(
        model=str(tmp_path),
        dtype="float32",
        device="cpu",
        load_format="dummy",
        cache=CacheConfig(num_blocks=64, block_size=8),
    )
    core, _, _ = create_engine_core(engine)
    torch.manual_seed(engine.seed)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    prompts = [[5, 9, 33, 2], list(range(40, 60))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = run_all(core, prompts, params)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(reference, prompt, 6)
    with pytest.raises(ValueError, match="unknown load format 'pt'"):
        EngineConfig(load_format="pt")
    from server.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--load-format", "dummy"])
    assert engine_config(args).load_format == "dummy"
