"""Draft-model speculation (vLLM's `draft_model` method): a second model writes the drafts,
the served model verifies them. Greedy tokens stay transformers' (`generate` is the oracle)
whatever the draft, a draft that is the served model is always kept, and both KV caches give
back every block."""

from __future__ import annotations

import json
import logging
import random

import jsonschema
import pytest
import torch

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams, StructuredOutputs
from engine.core.speculation import SpeculativeConfig
from engine.worker.draft_model import ModelDrafter
from tests.conftest import CUDA
from tests.helpers import (
    chat_tokenizer,
    reference_greedy,
    run_all,
    text_of,
    tiny_core,
    tiny_llama,
    tiny_tokenizer,
    tokens_of,
)

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _noisy(scale: float) -> torch.nn.Module:
    """The served tiny model with noise on every weight: a draft that agrees with it often,
    not always."""
    model = tiny_llama()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model


def _foreign_tokenizer():
    """The tiny tokenizer with one more token: another vocabulary."""
    tokenizer = chat_tokenizer()  # a copy
    tokenizer.add_tokens(["<extra>"])
    return tokenizer


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Draft model folders: the served model itself, a noisy copy, another model of one
    layer, and one whose tokenizer is not the served model's."""
    models = {
        "same": (tiny_llama(), tiny_tokenizer()),
        "noisy": (_noisy(0.08), tiny_tokenizer()),
        "other": (tiny_llama(seed=3, num_layers=1), tiny_tokenizer()),
        "foreign": (tiny_llama(), _foreign_tokenizer()),
    }
    folders = {}
    for name, (model, tokenizer) in models.items():
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[name] = str(folder)
    return folders


def _spec(folder: str, count: int = 4, **fields: object) -> SpeculativeConfig:
    fields.setdefault("disable_by_batch_size", 64)  # drafts in every step, not as measured
    return SpeculativeConfig(count, method="draft_model", model=folder, **fields)  # type: ignore[arg-type]


def _prompts(count: int = 6) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(2, 320) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def _assert_released(core) -> None:
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)
    assert drafter.num_shadows == 0
    assert drafter.blocks.num_free_blocks == drafter.blocks.num_blocks


@pytest.mark.parametrize("draft", ["same", "noisy", "other"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"num_blocks": 30, "max_model_len": 64},  # preemptions; the draft's cache short too
        {"max_num_batched_tokens": 9},  # catch-ups in chunks; drafts cut to the budget
        {"attention_backend": "torch"},
    ],
    ids=["plain", "preempted", "tight-budget", "torch-attention"],
)
def test_greedy_tokens_equal_generate_whatever_the_draft(
    drafts: dict[str, str], draft: str, options: dict
):
    core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts[draft]), **options)
    _check_greedy(core, draft)


def _check_greedy(core, draft: str) -> None:
    """The core's greedy replies are generate's; a draft that is the served model is always
    kept, a noisy copy of it sometimes; both caches are given back."""
    model = tiny_llama()
    prompts = _prompts()
    outputs = run_all(core, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 24), i
    stats = core.take_stats().drafts
    assert stats.num_drafts > 0
    if draft == "same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    if draft == "noisy":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_released(core)


@pytest.mark.parametrize("device", [CUDA])
@pytest.mark.parametrize("draft", ["same", "noisy"])
def test_on_a_gpu_both_models_replay_their_graphs_and_tokens_stay_generate_s(
    drafts: dict[str, str], draft: str, device: str
):
    core, _ = tiny_core(tiny_llama(), device=device, speculative=_spec(drafts[draft]))
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)
    assert core.runner.graphs is not None and drafter.runner.graphs is not None
    _check_greedy(core, draft)


def test_a_draft_that_is_the_served_model_writes_its_replies_in_fewer_steps(drafts):
    prompts = _prompts(3)
    steps = {}
    for name, spec in [("plain", None), ("drafted", _spec(drafts["same"], 4))]:
        core, _ = tiny_core(tiny_llama(), speculative=spec)
        for i, prompt in enumerate(prompts):
            core.add_request(f"req-{i}", prompt, GREEDY)
        count = 0
        while core.has_unfinished():
            core.step()
            count += 1
        steps[name] = count
    # 24 tokens: one from the prompt's step, then five a step (a bonus token and 4 drafts).
    assert steps["plain"] == 24
    assert steps["drafted"] == 1 + -(-23 // 5)


def test_sampled_requests_with_a_seed_write_what_they_would_without_drafts(drafts):
    prompts = _prompts(4)
    # The tiny model's distributions are flat: a low temperature keeps some drafts.
    params = SamplingParams(temperature=0.3, top_p=0.9, max_tokens=20, seed=7, ignore_eos=True)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    runs = [{key: tokens_of(parts) for key, parts in plain.items()}]
    for _ in range(2):
        core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts["same"], 3))
        outputs = run_all(core, prompts, params)
        runs.append({key: tokens_of(parts) for key, parts in outputs.items()})
        assert core.take_stats().drafts.num_accepted_tokens > 0
        _assert_released(core)
    assert runs[0] == runs[1] == runs[2]  # the same tokens as without a draft model
    assert all(len(tokens) == 20 for tokens in runs[0].values())


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}


def test_drafts_a_format_refuses_are_cut_and_replies_fit_it(drafts):
    structured = StructuredOutputs("json", json.dumps(SCHEMA))
    params = SamplingParams(temperature=0, max_tokens=60, structured=structured)
    prompts = _prompts(3)
    plain = run_all(tiny_core(tiny_llama())[0], prompts, params)
    core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts["same"]))
    outputs = run_all(core, prompts, params)
    for request_id, parts in outputs.items():
        jsonschema.validate(json.loads(text_of(parts)), SCHEMA)
        assert tokens_of(parts) == tokens_of(plain[request_id])
    assert core.take_stats().drafts.num_accepted_tokens > 0
    _assert_released(core)


@pytest.mark.parametrize("caching", [True, False])
def test_a_prompt_the_draft_computed_before_is_read_from_its_prefix_cache(drafts, caching):
    """Two requests with one 40-token prompt, one after the other: with prefix caching the
    second's catch-up computes only what follows the cached blocks (the tokens stay
    generate's); without it, the whole prompt again."""
    prompt = (_prompts(1)[0] * 40)[:40]
    core, _ = tiny_core(
        tiny_llama(), speculative=_spec(drafts["noisy"]), enable_prefix_caching=caching
    )
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)
    computed: list[int] = []
    execute = drafter.runner.execute

    def counted(scheduled):
        computed.append(scheduled.total_num_tokens)
        return execute(scheduled)

    drafter.runner.execute = counted  # type: ignore[method-assign]
    firsts = []
    for i in range(2):
        computed.clear()
        outputs = run_all(core, [prompt], GREEDY)
        assert tokens_of(outputs["req-0"]) == reference_greedy(tiny_llama(), prompt, 24), i
        firsts.append(computed[0])  # the round that first caught the shadow up
    if caching:  # the prompt's 10 full blocks were cached: only the first output token runs
        assert firsts == [41, 1]
    else:
        assert firsts == [41, 41]
    # Another tenant's salt shares nothing, in the draft's cache as in the served model's.
    computed.clear()
    core.add_request("salted", prompt, GREEDY, cache_salt="tenant-b")
    while core.has_unfinished():
        core.step()
    assert computed[0] == 41
    _assert_released(core)


def test_aborted_requests_give_back_the_draft_cache(drafts):
    core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts["same"]))
    for i, prompt in enumerate(_prompts(4)):
        core.add_request(f"req-{i}", prompt, GREEDY)
    for _ in range(3):
        core.step()
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)
    assert drafter.num_shadows == 4
    assert drafter.blocks.num_free_blocks < drafter.blocks.num_blocks
    core.abort_requests([f"req-{i}" for i in range(4)])
    _assert_released(core)


def test_a_failing_draft_model_costs_the_drafts_not_the_requests(drafts, caplog):
    model = tiny_llama()
    prompts = _prompts(3)
    core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts["same"]))
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)

    def broken(_):
        raise RuntimeError("draft step broke")

    drafter.runner.execute = broken  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="engine.worker.draft_model"):
        outputs = run_all(core, prompts, GREEDY)
    for i, prompt in enumerate(prompts):
        assert tokens_of(outputs[f"req-{i}"]) == reference_greedy(model, prompt, 24)
    assert core.take_stats().drafts.num_drafts == 0
    assert [r.message for r in caplog.records].count(
        "the draft model failed; its requests decode without drafts"
    ) == 1
    _assert_released(core)


def test_drafts_stop_where_the_draft_s_context_ends(drafts):
    """A draft model limited to 20 tokens drafts only while the sequence fits them."""
    core, _ = tiny_core(tiny_llama(), speculative=_spec(drafts["same"], draft_max_model_len=20))
    prompt = _prompts(1)[0][:10]
    outputs = run_all(core, [prompt], GREEDY)
    assert tokens_of(outputs["req-0"]) == reference_greedy(tiny_llama(), prompt, 24)
    stats = core.take_stats().drafts
    assert 0 < stats.num_draft_tokens <= 20 - len(prompt)
    _assert_released(core)


def test_vllm_s_fields_name_the_method_and_the_rest_is_refused():
    assert SpeculativeConfig.of(
        {"method": "draft_model", "model": "org/small", "num_speculative_tokens": 3}
    ) == SpeculativeConfig(3, method="draft_model", model="org/small")
    # A model with no method is a draft model, as in vLLM; "[ngram]" is the n-gram method.
    implied = SpeculativeConfig.of(
        {"model": "org/small", "num_speculative_tokens": 2, "max_model_len": 512}
    )
    assert (implied.method, implied.draft_max_model_len) == ("draft_model", 512)
    assert SpeculativeConfig.of({"model": "[ngram]", "num_speculative_tokens": 2}).method == (
        "ngram"
    )
    assert SpeculativeConfig.of(
        {"model": "org/small", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}
    ).uses_model
    for fields, message in [
        ({"model": "org/EAGLE-llama", "num_speculative_tokens": 2}, "'eagle' is not served"),
        ({"model": "org/eagle3-llama", "num_speculative_tokens": 2}, "'eagle3' is not served"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs the draft's"),
        ({"model": "a", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "draft_model: "),
        ({"model": "a", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, "one"),
        ({"model": 3, "num_speculative_tokens": 2, "method": "draft_model"}, "a string"),
        ({"model": "a", "num_speculative_tokens": 2, "max_model_len": 1}, "at least 2"),
    ]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.of(fields)
    with pytest.raises(ValueError, match="one device"):
        EngineConfig(speculative=_spec("org/small"), tensor_parallel_size=2)


def test_a_draft_of_another_tokenizer_or_a_longer_context_is_refused(drafts):
    with pytest.raises(ValueError, match="share one vocabulary"):
        tiny_core(tiny_llama(), speculative=_spec(drafts["foreign"]))
    with pytest.raises(ValueError, match="larger than its context of 512"):
        tiny_core(tiny_llama(), speculative=_spec(drafts["same"], draft_max_model_len=600))


def test_the_draft_cache_shares_the_budget_with_the_served_model_s(drafts):
    """Sized from memory, both caches get as many blocks, which the budget pays for
    together: one layer of draft beside two served is three halves of the bytes."""
    budget = 3 * 2**20
    served, _ = tiny_core(tiny_llama(), num_blocks=None, kv_cache_memory=budget)
    core, _ = tiny_core(
        tiny_llama(), num_blocks=None, kv_cache_memory=budget, speculative=_spec(drafts["other"])
    )
    alone = served.scheduler.block_manager.num_blocks
    shared = core.scheduler.block_manager.num_blocks
    assert shared == alone * 2 // 3
    drafter = core.drafter
    assert isinstance(drafter, ModelDrafter)
    assert drafter.blocks.num_blocks == shared
