"""Models with layers Conveyor's attention does not compute are refused at start-up with the
reason, not served wrong: before, a Qwen3.5 (Gated DeltaNet layers) ran on transformers' model
without its recurrent state and every greedy token sequence differed from `generate`'s (Qwen3.5,
Qwen3-Next, the Mamba hybrids and Mamba's own models now run on Conveyor's decoder with their
states; RWKV's are refused), and a Llama 4 past one chunk of its chunked layers gave other tokens
than `generate` too."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Llama4TextConfig,
    RwkvConfig,
)

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.models import build_causal_lm
from engine.models.layer_kinds import why_not_served
from tests.helpers import chat_tokenizer, reference_greedy, tiny_core, tiny_llama, tokens_of
from tests.models.test_moe import COMMON

TINY = {"vocab_size": 320, "hidden_size": 32, "num_hidden_layers": 2}
MODELS = {
    "rwkv": lambda: RwkvConfig(**TINY, attention_hidden_size=32, intermediate_size=64),
}
REASONS = {
    "rwkv": "recurrent model with no attention layers",
}


def build(name: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MODELS[name]()).eval()


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_recurrent_layers_are_refused_with_the_reason(name, impl):
    with pytest.raises(ValueError, match=REASONS[name]):
        build_causal_lm(build(name), impl)


def test_a_server_start_names_the_layers_it_cannot_serve(tmp_path):
    build("rwkv").save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    config = EngineConfig(
        model=str(tmp_path), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=16)
    )
    with pytest.raises(ValueError, match="Conveyor cannot serve RwkvForCausalLM"):
        create_engine_core(config)


def test_attention_of_every_kind_conveyor_computes_is_served():
    """Sliding and full layers side by side, and layers of experts alone, pass."""
    model = tiny_llama()
    model.config.num_hidden_layers = 4
    model.config.layer_types = ["sliding_attention", "full_attention", "moe", "full_attention"]
    assert why_not_served(model) == ""
    model.config.layer_types = ["indexed_attention"] * 4
    assert "indexed_attention layers attend in a way" in why_not_served(model)


def llama4():
    """A tiny Llama 4: three chunked layers of four (chunks of 16 tokens), experts every other
    layer."""
    config = Llama4TextConfig(
        **COMMON | {"num_hidden_layers": 4},
        intermediate_size=64,
        intermediate_size_mlp=96,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=16,
        interleave_moe_layer_step=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_llama4s_chunked_layers_serve_a_context_of_one_chunk_and_refuse_a_longer_one():
    """Within one chunk the chunked layers attend as causal attention does (greedy tokens equal
    transformers'); past it they would not, so a longer context is refused, saying how long a
    one to serve."""
    model = llama4()
    prompts = [[5, 9, 33], [7, 2, 70, 11, 90], [3] * 9]
    expected = [reference_greedy(model, p, 16 - len(p)) for p in prompts]
    core, _ = tiny_core(model, max_model_len=16, max_num_batched_tokens=8)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=16 - len(prompt), ignore_eos=True)
        core.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for output in core.step():
            outputs[output.request_id].append(output)
    assert [tokens_of(outputs[f"r{i}"]) for i in range(len(prompts))] == expected
    with pytest.raises(ValueError, match="serve it with --max-model-len 16 or less"):
        tiny_core(model, max_model_len=64)
