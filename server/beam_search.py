"""Beam search (vLLM's `use_beam_search`, `n` beams wide), run above the engine as vLLM runs it.

Each round sends every live beam (the prompt and its tokens so far) as a one-token request for
its `2 x n` likeliest next tokens; of all the continuations, the `n` with the highest
cumulative logprob go on, and one that ends in an end-of-sequence token (unless `ignore_eos`)
is set aside as finished. After `max_tokens` rounds, or once no live beam could still rank
among the best finished ones, the finished and live beams are ranked by their cumulative
logprob over their length (prompt included, a closing end-of-sequence token not) to the power
`length_penalty`, and the best `n` are the choices. Prefix caching keeps a round's cost to the
tokens a beam has added since its last full block.

Scores are the model's own logprobs: temperature and the other sampling settings do not apply,
and a request that sets what beam search cannot honour (stop strings, logprobs, an output
format, a logit bias) is refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.errors import InvalidRequestError
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from server.protocol import SamplingFields
from server.serving import EngineClient, RequestOptions, prompt_ids, submit_all

# Sampling fields beam search cannot honour, by the request field that sets each.
UNSUPPORTED = {
    "stop": lambda p: bool(p.stop),
    "stop_token_ids": lambda p: bool(p.stop_token_ids),
    "logprobs": lambda p: p.logprobs is not None,
    "prompt_logprobs": lambda p: p.prompt_logprobs is not None,
    "min_tokens": lambda p: p.min_tokens > 0,
    "logit_bias": lambda p: bool(p.logit_bias),
    "bad_words": lambda p: bool(p.bad_words),
    "allowed_token_ids": lambda p: p.allowed_token_ids is not None,
    "thinking_token_budget": lambda p: p.thought_budget is not None,
}


@dataclass(frozen=True, slots=True)
class BeamSearch:
    """One request's search: `width` beams, at most `max_tokens` new tokens each."""

    width: int
    max_tokens: int
    length_penalty: float
    ignore_eos: bool
    eos_token_ids: frozenset[int]
    include_eos: bool = False  # the closing token in the text (`include_stop_str_in_output`)
    skip_special_tokens: bool = True


@dataclass(slots=True)
class Beam:
    tokens: list[int] = field(default_factory=list)  # generated so far
    logprob: float = 0.0  # cumulative
    eos: int | None = None  # the end-of-sequence token that finished it


def submit(
    engine: EngineClient,
    prompts: list[list[int]],
    params: SamplingParams,
    body: SamplingFields,
    request_id: str,
    options: RequestOptions,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """The request's streams: its beam search's where it asks for one, else the engine's."""
    if not body.use_beam_search:
        return submit_all(engine, prompts, params, request_id, options)
    info = engine.info
    check_beam_search(params, body.n, info.max_logprobs)
    if info.logprobs_mode.endswith("logits"):
        raise InvalidRequestError(
            "use_beam_search ranks beams by their log probabilities, which this server does "
            f"not report (--logprobs-mode {info.logprobs_mode}).",
            param="use_beam_search",
        )

    def search(prompt: list[int]) -> BeamSearch:
        room = info.max_model_len - len(prompt)
        if room < 1:
            raise InvalidRequestError(
                f"This model's maximum context length is {info.max_model_len} tokens; the "
                f"prompt has {len(prompt)}, leaving no room for a new token.",
                param="prompt",
            )
        return BeamSearch(
            width=body.n,
            max_tokens=min(params.max_tokens or room, room),
            length_penalty=body.length_penalty,
            ignore_eos=params.ignore_eos,
            eos_token_ids=info.eos_token_ids,
            include_eos=params.include_stop_str_in_output,
            skip_special_tokens=params.skip_special_tokens,
        )

    searches = [search(prompt) for prompt in prompts]  # every prompt checked before any runs
    return search_streams(engine, prompts, searches, request_id, options)


def check_beam_search(params: SamplingParams, width: int, max_logprobs: int) -> None:
    """400 for a request beam search cannot serve as asked."""
    for name, sets in UNSUPPORTED.items():
        if sets(params):
            raise InvalidRequestError(f"use_beam_search does not take {name}.", param=name)
    if params.structured is not None:
        raise InvalidRequestError(
            "use_beam_search does not take an output format.", param=params.structured.param
        )
    if 2 * width > max_logprobs:
        raise InvalidRequestError(
            f"use_beam_search with n={width} ranks {2 * width} tokens a step; this server ranks "
            f"at most {max_logprobs} (--max-logprobs), so n may be at most {max_logprobs // 2}.",
            param="n",
        )


def search_streams(
    engine: EngineClient,
    prompts: list[list[int]],
    searches: list[BeamSearch],
    request_id: str,
    options: RequestOptions,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """For each prompt, a stream that runs its search and then yields its best beams, each
    as one whole output (`index` its rank), as the engine's streams yield sequences."""
    ids = prompt_ids(request_id, len(prompts))
    return [
        _finished_beams(engine, prompt, search, sub_id, options)
        for prompt, search, sub_id in zip(prompts, searches, ids, strict=True)
    ]


async def _finished_beams(
    engine: EngineClient,
    prompt: list[int],
    search: BeamSearch,
    request_id: str,
    options: RequestOptions,
) -> AsyncGenerator[RequestOutput, None]:
    beams = await run_search(engine, prompt, search, request_id, options)
    for rank, beam in enumerate(beams):
        yield _output(engine.tokenizer, request_id, rank, prompt, beam, search)


async def run_search(
    engine: EngineClient,
    prompt: list[int],
    search: BeamSearch,
    request_id: str,
    options: RequestOptions,
) -> list[Beam]:
    """The best `search.width` beams, best first."""

    def score(beam: Beam) -> float:
        return beam.logprob / (len(prompt) + len(beam.tokens)) ** search.length_penalty

    live, finished = [Beam()], []
    for round_ in range(search.max_tokens):
        ids = [f"{request_id}-{round_}-{i}" for i in range(len(live))]
        tops = await asyncio.gather(
            *(
                _next_tokens(engine, prompt + beam.tokens, 2 * search.width, sub_id, options)
                for beam, sub_id in zip(live, ids, strict=True)
            )
        )
        candidates = []
        for beam, top in zip(live, tops, strict=True):
            for token, logprob in top:
                if token in search.eos_token_ids and not search.ignore_eos:
                    finished.append(Beam(beam.tokens, beam.logprob + logprob, token))
                else:
                    candidates.append(Beam([*beam.tokens, token], beam.logprob + logprob))
        candidates.sort(key=lambda b: b.logprob, reverse=True)
        live = candidates[: search.width]
        if _settled(live, finished, search, len(prompt), score):
            break
    return sorted(finished + live, key=score, reverse=True)[: search.width]


def _settled(
    live: list[Beam],
    finished: list[Beam],
    search: BeamSearch,
    prompt_length: int,
    score: Callable[[Beam], float],
) -> bool:
    """Whether no live beam can still rank among the best `width` finished ones, so that more
    rounds could not change the answer: a beam's logprob only falls, so its best score to come
    is its logprob now over the length that favours it most (the longest it may reach when the
    penalty is positive, its own otherwise)."""
    if not live:
        return True
    if len(finished) < search.width:
        return False
    worst_kept = sorted(map(score, finished), reverse=True)[search.width - 1]
    now = prompt_length + len(live[0].tokens)
    length = prompt_length + search.max_tokens if search.length_penalty > 0 else now
    best_to_come = max(beam.logprob for beam in live) / length**search.length_penalty
    return best_to_come < worst_kept


async def _next_tokens(
    engine: EngineClient, tokens: list[int], count: int, request_id: str, options: RequestOptions
) -> tuple[tuple[int, float], ...]:
    """The `count` likeliest tokens after `tokens`, with their logprobs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=count, ignore_eos=True)
    last = None
    stream = engine.submit(tokens, params, request_id, options)
    try:
        async for output in stream:
            last = output
    finally:
        await stream.aclose()
    assert last is not None and last.logprobs, "a one-token request yields its token"
    return last.logprobs[0].top


def _output(
    tokenizer: Any,
    request_id: str,
    rank: int,
    prompt: list[int],
    beam: Beam,
    search: BeamSearch,
) -> RequestOutput:
    tokens = beam.tokens + ([beam.eos] if beam.eos is not None and search.include_eos else [])
    text = tokenizer.decode(tokens, skip_special_tokens=search.skip_special_tokens)
    return RequestOutput(
        request_id=request_id,
        index=rank,
        new_token_ids=tokens,
        text=text,
        finished=True,
        finish_reason="stop" if beam.eos is not None else "length",
        stop_reason=beam.eos,
        num_prompt_tokens=len(prompt),
        num_output_tokens=len(beam.tokens) + (beam.eos is not None),
    )
