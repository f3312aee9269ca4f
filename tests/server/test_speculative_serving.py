"""A server started with `--speculative-config` (n-gram drafts, suffix decoding or a draft
model's) answers greedy requests exactly as one without: texts, token ids, usage and finish
reasons, streamed or not, with `n`, logprobs and stops."""

from __future__ import annotations

from typing import Any

from engine.core.request import Request
from engine.core.speculation import Drafter, SpeculativeConfig, speculates
from tests.helpers import chat_tokenizer
from tests.server_utils import app_client, shared_tiny_model, sse_events

LOOP = [40, 41, 42, 43] * 5
BODIES: list[dict[str, Any]] = [
    {"prompt": LOOP, "max_tokens": 24},
    {"prompt": LOOP[3:], "max_tokens": 20, "n": 2, "return_token_ids": True},
    {"prompt": "Hello world Hello world Hello", "max_tokens": 16, "logprobs": 2},
    {"prompt": LOOP, "max_tokens": 24, "stream": True, "return_token_ids": True},
    {"prompt": "Hello world Hello world Hello", "max_tokens": 16, "stop": ["o w"]},
]


async def _answers(client) -> list[Any]:
    answers = []
    for body in BODIES:
        body = {"temperature": 0, "ignore_eos": True, **body}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        if body.get("stream"):
            events = sse_events(response.text)[:-1]
            text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
            ids = [
                t for e in events if e["choices"] for t in e["choices"][0].get("token_ids") or []
            ]
            answers.append((text, ids))
            continue
        reply = response.json()
        for choice in reply["choices"]:
            choice.pop("index", None)
        # What an earlier pass left cached, which also moves the last bits of logprobs.
        reply["usage"].pop("prompt_tokens_details", None)
        answers.append((reply["choices"], reply["usage"]))
    return answers


# How far a log probability verified among drafts may lie from the same one decoded alone: the
# rows run through other kernels (a verifying step's several rows at once), whose sums round
# apart in the last bits on some instruction sets.
LOGPROB_TOLERANCE = 1e-3


def _same(given: Any, expected: Any) -> bool:
    """Equal, but for floats (log probabilities) within `LOGPROB_TOLERANCE`."""
    if isinstance(expected, float) and isinstance(given, float):
        return abs(given - expected) <= LOGPROB_TOLERANCE
    if isinstance(expected, dict) and isinstance(given, dict):
        return given.keys() == expected.keys() and all(
            _same(given[k], expected[k]) for k in expected
        )
    if isinstance(expected, list | tuple) and isinstance(given, list | tuple):
        return len(given) == len(expected) and all(map(_same, given, expected))
    return bool(given == expected)


async def _same_answers(client, plain: list[Any]) -> None:
    answers = await _answers(client)
    assert _same(answers, plain), (answers, plain)


class KnownDrafter(Drafter):
    """Drafts each prompt's known greedy continuation, every third draft token wrong."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(SpeculativeConfig(4, 1, 1))
        self.continuations = continuations
        self.made = 0

    def draft(self, request: Request) -> None:
        request.draft_token_ids = []
        if not speculates(request):
            return
        truth = self.continuations[tuple(request.prompt_token_ids)]
        done = request.num_output_tokens
        drafts = truth[done : min(done + 4, request.max_output_tokens - 1)]
        for position in range(len(drafts)):
            self.made += 1
            if self.made % 3 == 0:
                drafts[position] += 1
        request.draft_token_ids = drafts


async def _continuations(client) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's first 30 greedy tokens, with its token ids."""
    found = {}
    for prompt in {str(body["prompt"]): body["prompt"] for body in BODIES}.values():
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        reply = await client.post("/v1/completions", json={**body, "return_token_ids": True})
        choice = reply.json()["choices"][0]
        found[tuple(choice["prompt_token_ids"])] = choice["token_ids"]
    return found


async def test_greedy_answers_are_those_of_a_server_without_speculation():
    async with app_client() as (client, _):
        plain = await _answers(client)
        continuations = await _continuations(client)
    async with app_client(speculative=SpeculativeConfig(4, 1, 3)) as (client, engine):
        await _same_answers(client, plain)  # n-gram drafts
        engine.core.drafter = KnownDrafter(continuations)
        seen = []
        engine.stat_loggers.append(seen.append)
        await _same_answers(client, plain)
    kept = sum(s.drafts.num_accepted_tokens for s in seen)
    assert 0 < kept < sum(s.drafts.num_draft_tokens for s in seen)


def _metric(text: str, name: str) -> float:
    """A counter's value in /metrics' text (its one series)."""
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, lines
    return float(lines[0].rsplit(" ", 1)[1])


async def test_a_draft_model_s_server_answers_as_one_without_and_counts_its_drafts(tmp_path):
    """The draft is the served model saved to a folder: every draft is kept."""
    shared_tiny_model().save_pretrained(tmp_path)
    chat_tokenizer().save_pretrained(tmp_path)
    async with app_client() as (client, _):
        plain = await _answers(client)
    fields = {"model": str(tmp_path), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    async with app_client(speculative=SpeculativeConfig.of(fields)) as (client, _):
        await _same_answers(client, plain)
        metrics = (await client.get("/metrics")).text
    drafted = _metric(metrics, "vllm:spec_decode_num_draft_tokens_total")
    assert drafted > 0
    assert _metric(metrics, "vllm:spec_decode_num_accepted_tokens_total") == drafted


async def test_a_suffix_decoding_server_answers_as_one_without_and_drafts_repeats_from_before():
    async with app_client() as (client, _):
        plain = await _answers(client)
    fields = {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": 8}
    async with app_client(speculative=SpeculativeConfig.of(fields)) as (client, _):
        await _same_answers(client, plain)
        first = (await client.get("/metrics")).text
        await _same_answers(client, plain)
        again = (await client.get("/metrics")).text
    kept = "vllm:spec_decode_num_accepted_tokens_total"
    drafted = "vllm:spec_decode_num_draft_tokens_total"
    # The same requests again draft from the replies before: most of their tokens are kept
    # drafts (the replies hold 24 + 2 x 20 + 16 + 24 + at most 16 tokens).
    assert _metric(again, kept) - _metric(first, kept) >= 60
    share = (_metric(again, kept) - _metric(first, kept)) / (
        _metric(again, drafted) - _metric(first, drafted)
    )
    assert share > 0.7
