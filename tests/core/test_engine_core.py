"""Engine core behaviour on a tiny model: stops, lengths, logprobs, aborts, failures."""

from __future__ import annotations

import random

import pytest
import torch

from engine.core.config import CacheConfig
from engine.core.errors import InvalidRequestError, PromptTooLongError, RequestFailedError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.factory import block_size
from server.cli import build_parser, engine_config
from tests.helpers import (
    reference_greedy,
    run_all,
    sabotage_steps,
    text_of,
    tiny_core,
    tiny_tokenizer,
    tokens_of,
)

PROMPT = tiny_tokenizer().encode("Hello world! How are you", add_special_tokens=False)


def greedy(**params) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **params)


def reference_run(tiny_model, max_tokens: int = 24):
    core, _ = tiny_core(tiny_model)
    outputs = run_all(core, [PROMPT], greedy(max_tokens=max_tokens))["req-0"]
    return tokens_of(outputs), text_of(outputs)


def assert_all_blocks_free(core) -> None:
    manager = core.scheduler.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    core.scheduler.check_invariants()


def test_text_deltas_join_to_the_decoded_tokens(tiny_model):
    tokens, text = reference_run(tiny_model)
    assert text == tiny_tokenizer().decode(tokens, skip_special_tokens=True)
    assert len(text) > 0


def test_stop_string_across_tokens_truncates_and_frees(tiny_model):
    tokens, text = reference_run(tiny_model)
    stop = text[5:12]
    core, _ = tiny_core(tiny_model)
    outputs = run_all(core, [PROMPT], greedy(max_tokens=24, stop=(stop,)))["req-0"]
    assert text_of(outputs) == text[: text.index(stop)]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason == stop
    assert len(tokens_of(outputs)) < len(tokens)
    assert_all_blocks_free(core)


def test_stop_string_kept_when_asked(tiny_model):
    _, text = reference_run(tiny_model)
    stop = text[5:12]
    core, _ = tiny_core(tiny_model)
    params = greedy(max_tokens=24, stop=(stop,), include_stop_str_in_output=True)
    outputs = run_all(core, [PROMPT], params)["req-0"]
    assert text_of(outputs) == text[: text.index(stop) + len(stop)]


def test_max_tokens_ends_with_length(tiny_model):
    core, _ = tiny_core(tiny_model)
    outputs = run_all(core, [PROMPT], greedy(max_tokens=5))["req-0"]
    assert len(tokens_of(outputs)) == 5
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert outputs[-1].num_output_tokens == 5
    assert outputs[-1].num_prompt_tokens == len(PROMPT)


def test_generation_is_clamped_to_the_context(tiny_model):
    core, info = tiny_core(tiny_model, max_model_len=16)
    assert info.max_model_len == 16
    prompt = PROMPT[:10]
    outputs = run_all(core, [prompt], greedy(max_tokens=100))["req-0"]
    assert len(tokens_of(outputs)) == 6
    assert outputs[-1].finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model):
    tokens, _ = reference_run(tiny_model)
    eos = tokens[3]
    core, _ = tiny_core(tiny_model)
    core.eos_token_ids = frozenset({eos})
    outputs = run_all(core, [PROMPT], SamplingParams(temperature=0, max_tokens=24))["req-0"]
    assert tokens_of(outputs) == tokens[: tokens.index(eos) + 1]
    assert outputs[-1].finish_reason == "stop" and outputs[-1].stop_reason is None


def test_stop_token_ids_report_the_token(tiny_model):
    tokens, _ = reference_run(tiny_model)
    core, _ = tiny_core(tiny_model)
    outputs = run_all(core, [PROMPT], greedy(max_tokens=24, stop_token_ids=(tokens[4],)))
    final = outputs["req-0"][-1]
    assert final.finish_reason == "stop" and final.stop_reason == tokens[4]


def full_logprobs(model, tokens: list[int]) -> torch.Tensor:
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        from engine.attention.hf import register

        model.set_attn_implementation(register())
    return torch.log_softmax(logits.float(), dim=-1)


def test_sampled_logprobs_match_the_model(tiny_model):
    core, _ = tiny_core(tiny_model)
    outputs = run_all(core, [PROMPT], greedy(max_tokens=6, logprobs=2))["req-0"]
    tokens = tokens_of(outputs)
    reference = full_logprobs(tiny_model, PROMPT + tokens)
    entries = [entry for output in outputs for entry in output.logprobs]
    assert len(entries) == len(tokens)
    for i, entry in enumerate(entries):
        row = reference[len(PROMPT) - 1 + i]
        assert entry.token_id == tokens[i]
        assert entry.logprob == pytest.approx(row[tokens[i]].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(2).indices.tolist()


@pytest.mark.parametrize(
    "options", [{}, {"max_num_batched_tokens": 4}, {"num_blocks": 12, "max_model_len": 48}]
)
def test_prompt_logprobs_match_the_model(tiny_model, options):
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 320) for _ in range(n)] for n in (9, 17, 1, 13)]
    core, _ = tiny_core(tiny_model, **options)
    outputs = run_all(core, prompts, greedy(max_tokens=8, prompt_logprobs=1))
    for i, prompt in enumerate(prompts):
        first = outputs[f"req-{i}"][0]
        entries = first.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        reference = full_logprobs(tiny_model, prompt)
        for pos in range(1, len(prompt)):
            assert entries[pos].token_id == prompt[pos]
            assert entries[pos].logprob == pytest.approx(
                reference[pos - 1, prompt[pos]].item(), abs=1e-4
            )
            assert entries[pos].top[0][0] == int(reference[pos - 1].argmax())
        assert all(o.prompt_logprobs is None for o in outputs[f"req-{i}"][1:])


def test_prompt_logprobs_score_a_cached_prompt_and_each_sibling(tiny_model):
    """A prompt already in the prefix cache, and siblings that would share one computed
    prompt, still get an entry for every prompt token: a request that wants its prompt's
    logprobs computes its prompt (as in vLLM)."""
    rng = random.Random(4)
    prompt = [rng.randrange(2, 320) for _ in range(21)]
    core, _ = tiny_core(tiny_model)
    run_all(core, [prompt], greedy(max_tokens=2))  # its blocks are now cached
    wants = greedy(max_tokens=2, prompt_logprobs=1)
    core.add_request("a", prompt, wants, parent_id="p", index=0, siblings=2)
    core.add_request("b", prompt, wants, parent_id="p", index=1, fork_of="a", siblings=2)
    core.add_request("c", prompt, greedy(max_tokens=2))
    firsts: dict[tuple[str, int], RequestOutput] = {}
    while core.has_unfinished():
        for output in core.step():
            firsts.setdefault((output.request_id, output.index), output)
        core.scheduler.check_invariants()
    assert firsts["c", 0].num_cached_tokens > 0  # the cache did hold the prompt
    reference = full_logprobs(tiny_model, prompt)
    for index in (0, 1):
        entries = firsts["p", index].prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for pos in range(1, len(prompt)):
            assert entries[pos].logprob == pytest.approx(
                reference[pos - 1, prompt[pos]].item(), abs=1e-4
            )


def test_abort_mid_generation_frees_blocks_and_reports(tiny_model):
    core, _ = tiny_core(tiny_model)
    core.add_request("a", PROMPT, greedy(max_tokens=50))
    core.add_request("b", PROMPT, greedy(max_tokens=50))
    for _ in range(3):
        core.step()
    finals = core.abort_requests(["a", "missing"])
    assert len(finals) == 1 and finals[0].finish_reason == "abort" and finals[0].finished
    assert "a" not in core.scheduler.requests
    core.scheduler.check_invariants()
    held = len(core.scheduler.requests["b"].block_ids)
    assert core.scheduler.block_manager.num_used_blocks == held


def test_failed_step_fails_its_requests_and_the_engine_carries_on(tiny_model, monkeypatch):
    core, _ = tiny_core(tiny_model)
    core.add_request("doomed", PROMPT, greedy(max_tokens=5))
    sabotage_steps(core, monkeypatch, message="device on fire")
    outputs = core.step()
    assert len(outputs) == 1 and outputs[0].finish_reason == "error"
    assert isinstance(outputs[0].error, RequestFailedError)
    assert not core.has_unfinished()
    assert_all_blocks_free(core)
    monkeypatch.undo()
    after = run_all(core, [PROMPT], greedy(max_tokens=3))["req-0"]
    assert len(tokens_of(after)) == 3


@pytest.mark.parametrize(
    ("prompt", "params", "error"),
    [
        ([], SamplingParams(), InvalidRequestError),
        ([5, 100_000], SamplingParams(), InvalidRequestError),
        ([5, -1], SamplingParams(), InvalidRequestError),
        ([5], SamplingParams(logit_bias={10_000: 1.0}), InvalidRequestError),
        (list(range(2, 100)), SamplingParams(), PromptTooLongError),
    ],
)
def test_requests_that_cannot_run_are_refused(tiny_model, prompt, params, error):
    core, _ = tiny_core(tiny_model, max_model_len=64)
    with pytest.raises(error):
        core.add_request("bad", prompt, params)
    assert not core.has_unfinished()


def test_stop_strings_need_a_tokenizer(tiny_model):
    core, _ = tiny_core(tiny_model, with_tokenizer=False)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        core.add_request("x", PROMPT, SamplingParams(stop=("a",)))
    outputs = run_all(core, [PROMPT], greedy(max_tokens=3))["req-0"]
    assert len(tokens_of(outputs)) == 3 and text_of(outputs) == ""


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(min_p=2), "min_p"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(stop=("",)), "stop"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_sampling_params_are_validated(params, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**params)
    assert info.value.param == param


def test_block_size_defaults_to_the_devices():
    """Unset, a CPU cache holds 32 tokens a block (its attention kernels stream each block as
    one run of memory) and CUDA 16; a size that is set holds on either; the CLI leaves it unset."""
    assert block_size(CacheConfig(), torch.device("cpu")) == 32
    assert block_size(CacheConfig(), torch.device("cuda")) == 16
    assert block_size(CacheConfig(block_size=8), torch.device("cpu")) == 8
    assert block_size(CacheConfig(block_size=64), torch.device("cuda")) == 64
    with pytest.raises(ValueError, match="block_size must be positive"):
        CacheConfig(block_size=0)
    assert engine_config(build_parser().parse_args(["serve"])).cache.block_size is None
    args = build_parser().parse_args(["serve", "--block-size", "16"])
    assert engine_config(args).cache.block_size == 16


def test_default_cpu_blocks_serve_greedy_tokens_as_transformers(tiny_model):
    """Prompts across several 32-token blocks, and decoding past a block's end."""
    core, info = tiny_core(tiny_model, block_size=None, num_blocks=32)
    assert info.block_size == 32 and core.runner.kv_cache.block_size == 32
    prompts = [list(range(3, 3 + n)) for n in (5, 32, 33, 70)]
    results = run_all(core, prompts, greedy(max_tokens=40))
    for i, prompt in enumerate(prompts):
        assert tokens_of(results[f"req-{i}"]) == reference_greedy(tiny_model, prompt, 40), i
    assert_all_blocks_free(core)
