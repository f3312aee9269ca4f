"""An adapter of the default model (30 layers, grouped-query attention, Q4_1 panels on a CPU):
greedy tokens under it equal PEFT's merged model's, and differ from the base model's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.factory import create_engine_core
from engine.loading.default_model import default_model_dir
from tests.helpers import reference_greedy
from tests.lora.adapters import ATTENTION, MLP, LoraConfig, PeftModel, get_peft_model

pytestmark = pytest.mark.default_model
TOKENS = 16


def checkpoint():
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


def test_greedy_tokens_under_an_adapter_of_the_default_model_equal_peft(tmp_path):
    config = EngineConfig(
        dtype="float32",
        cache=CacheConfig(num_blocks=128),
        enable_lora=True,
        lora_modules=(("demo", str(tmp_path)),),
    )
    torch.manual_seed(0)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=ATTENTION + MLP, init_lora_weights=False)
    adapted = get_peft_model(checkpoint(), lora)
    with torch.no_grad():
        for name, weight in adapted.named_parameters():
            if "lora_B" in name:
                weight.normal_(std=0.1)
    adapted.save_pretrained(str(tmp_path))
    core, loaded, _ = create_engine_core(config)
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours of the rainbow."}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    for i, name in enumerate([None, "demo"]):
        core.add_request(f"r{i}", prompt, params, lora=core.loras.get(name) if name else None)
    got: dict[str, list[int]] = {"r0": [], "r1": []}
    while core.has_unfinished():
        for output in core.step():
            got[output.request_id] += output.new_token_ids
    merged = PeftModel.from_pretrained(checkpoint(), str(tmp_path)).merge_and_unload()
    assert got["r1"] == reference_greedy(merged, prompt, TOKENS)
    assert got["r1"] != got["r0"] == reference_greedy(checkpoint(), prompt, TOKENS)
