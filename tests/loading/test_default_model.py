"""The embedded default model (SmolLM2-135M-Instruct), fetched and converted once into the cache."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.core.config import CacheConfig, EngineConfig
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.factory import create_engine_core
from engine.kernels.cpu.linear import PanelLinear
from engine.loading.default_model import default_model_dir
from tests.helpers import (
    NO_PANELS,
    int8_layer_errors,
    reference_greedy,
    run_all,
    teacher_forced_argmax,
    text_of,
    tokens_of,
)

pytestmark = pytest.mark.default_model


@pytest.fixture(
    scope="module",
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.cuda,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        ),
    ],
)
def default_engine(request):
    # float32: in bf16 this small model's two best first tokens nearly tie.
    config = EngineConfig(dtype="float32", device=request.param, cache=CacheConfig(num_blocks=512))
    core, loaded, info = create_engine_core(config)
    return core, loaded.tokenizer, info


def chat_prompt(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_serves_the_default_model_with_its_context(default_engine):
    _, tokenizer, info = default_engine
    assert info.model_name == "SmolLM2-135M-Instruct"
    assert info.max_model_len == 8192
    assert tokenizer.chat_template


def test_greedy_answer_names_paris(default_engine):
    core, tokenizer, _ = default_engine
    prompt = chat_prompt(tokenizer, "What is the capital of France?")
    outputs = run_all(core, [prompt], SamplingParams(temperature=0, max_tokens=30))["req-0"]
    assert "Paris" in text_of(outputs)
    assert outputs[-1].finish_reason == "stop"


def test_a_schema_reply_holds_its_listed_keys_and_ends(default_engine):
    """The schema says nothing of other keys: held to those it lists, the model ends the
    document (left open, it wrote keys of its own until max_tokens)."""
    core, tokenizer, _ = default_engine
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    structured = StructuredOutputs("json", json.dumps(person), "response_format")
    params = SamplingParams(temperature=0, max_tokens=200, structured=structured)
    prompt = chat_prompt(tokenizer, "Give a person as JSON.")
    outputs = run_all(core, [prompt], params)["req-0"]
    assert outputs[-1].finish_reason == "stop"
    assert set(json.loads(text_of(outputs))) == {"name", "age"}


def test_seed_reproduces_text_alone_and_inside_a_busy_batch(default_engine):
    core, tokenizer, _ = default_engine
    prompt = chat_prompt(tokenizer, "Write a short poem about the sea.")
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone_first = text_of(run_all(core, [prompt], seeded)["req-0"])
    alone_second = text_of(run_all(core, [prompt], seeded)["req-0"])
    others = [chat_prompt(tokenizer, f"Tell me fact number {i} about cats.") for i in range(7)]
    busy_params = [SamplingParams(temperature=1.2, max_tokens=30)] * 7 + [seeded]
    busy = run_all(core, [*others, prompt], busy_params)
    assert alone_first == alone_second
    assert text_of(busy["req-7"]) == alone_first
    other_seed = SamplingParams(
        temperature=1.0, top_p=0.95, seed=99, max_tokens=24, ignore_eos=True
    )
    assert text_of(run_all(core, [prompt], other_seed)["req-0"]) != alone_first


def test_cpu_engine_reads_the_q4_1_blocks_and_matches_generate(default_engine):
    """On the CPU every projection reads the GGUF's Q4_1 blocks and the LM head its Q8_0 ones,
    widened to exactly the fp32 weights: greedy tokens equal transformers' on the checkpoint."""
    core, tokenizer, info = default_engine
    if info.device != "cpu" or NO_PANELS:
        pytest.skip(f"the GGUF blocks are read by Conveyor's CPU kernels: {NO_PANELS}")
    formats = [
        m.block_format.name
        for m in core.runner.model.modules()
        if isinstance(m, PanelLinear) and m.block_format is not None
    ]
    assert formats.count("q4_1") == 30 * 4 and formats.count("q8_0") == 1
    # The folder stays a plain checkpoint for servers that load every top-level safetensors.
    assert [p.name for p in default_model_dir().glob("*.safetensors")] == ["model.safetensors"]
    reference = AutoModelForCausalLM.from_pretrained(
        default_model_dir(), dtype=torch.float32
    ).eval()
    prompt = chat_prompt(tokenizer, "Name three colours of the rainbow.")
    expected = reference_greedy(reference, prompt, 24)
    outputs = run_all(
        core, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    )["req-0"]
    assert tokens_of(outputs) == expected


def test_int8_activations_round_inputs_and_keep_the_model_s_choices() -> None:
    """`--int8-activations`: the 120 Q4_1 projections and the Q8_0 LM head give their weights
    times their inputs rounded to 8-bit blocks (checked on the engine's own activations, outliers
    and all), and over the exact model's greedy answers they still pick its token at 90% of
    positions or more (rounding errors grow through 30 layers, so tokens are not expected
    equal)."""
    if NO_PANELS:
        pytest.skip(f"int8 panels are read by Conveyor's CPU kernels: {NO_PANELS}")
    core, loaded, _ = create_engine_core(
        EngineConfig(
            dtype="float32", device="cpu", int8_activations=True, cache=CacheConfig(num_blocks=256)
        )
    )
    layers = [
        m for m in core.runner.model.modules() if isinstance(m, PanelLinear) and m.int8_activations
    ]
    assert len(layers) == 30 * 4 + 1
    errors = int8_layer_errors(layers)
    tokenizer = loaded.tokenizer
    prompts = [
        chat_prompt(tokenizer, question)
        for question in (
            "Name three colours of the rainbow.",
            "Write a haiku about autumn.",
            "List the planets of the solar system.",
        )
    ]
    run_all(core, prompts, SamplingParams(temperature=0, max_tokens=2))
    # The projections once each (the prompts' prefill; the decode step runs the fused layer),
    # the LM head at both steps.
    assert len(errors) == 30 * 4 + 2 and max(errors) < 1e-3
    exact = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    agree = total = 0
    for prompt in prompts:
        answer = reference_greedy(exact, prompt, 32)
        picked = teacher_forced_argmax(loaded.model, prompt + answer)[len(prompt) - 1 : -1]
        agree += sum(a == b for a, b in zip(picked, answer, strict=True))
        total += len(answer)
    assert agree >= 0.9 * total
