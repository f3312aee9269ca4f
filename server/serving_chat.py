"""POST /v1/chat/completions."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from server.logprobs import chat_logprobs
from server.protocol import ChatCompletionRequest
from server.serving import (
    EngineClient,
    ServedModel,
    new_id,
    now,
    request_options,
    require_text_model,
    respond,
    sampling_params,
    submit_all,
    usage,
)
from server.tokenization import TokenText, chat_prompt


@dataclass(slots=True)
class _Choice:
    index: int
    pieces: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    started: bool = False


class ChatRenderer:
    """Accumulates engine deltas into chat choices and `chat.completion.chunk` events."""

    def __init__(self, request_id: str, model: str, body: ChatCompletionRequest,
                 num_prompt_tokens: int, tokenizer: Any) -> None:
        self.request_id = request_id
        self.model = model
        self.body = body
        self.num_prompt_tokens = num_prompt_tokens
        self.include_usage = body.include_usage
        self.created = now()
        self.token_text = TokenText(tokenizer)
        self.choices = {i: _Choice(i) for i in range(body.n)}

    def update(self, _source: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Fold a delta into its choice; return the streaming fragments it produces."""
        choice = self.choices[output.index]
        fragments = []
        if not choice.started:
            choice.started = True
            fragments.append(self._fragment(choice, {"role": "assistant", "content": ""}))
        logprobs = None
        if output.logprobs is not None and self.body.logprobs:
            logprobs = chat_logprobs(output.logprobs, self.token_text)
            choice.logprobs.extend(logprobs)
        choice.pieces.append(output.text)
        choice.num_output_tokens = output.num_output_tokens
        choice.num_cached_tokens = max(choice.num_cached_tokens, output.num_cached_tokens)
        if output.finished:
            choice.finish_reason, choice.stop_reason = output.finish_reason, output.stop_reason
        if output.text or logprobs or output.finished:
            delta = {"content": output.text} if output.text else {}
            fragments.append(self._fragment(choice, delta, logprobs, output.finished))
        return fragments

    @staticmethod
    def _fragment(choice: _Choice, delta: dict[str, Any], logprobs: list | None = None,
                  finished: bool = False) -> dict[str, Any]:
        return {"index": choice.index, "delta": delta,
                "logprobs": {"content": logprobs} if logprobs is not None else None,
                "finish_reason": choice.finish_reason if finished else None,
                "stop_reason": choice.stop_reason if finished else None}

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_output_tokens for c in self.choices.values())
        return usage(self.num_prompt_tokens, completion, self.choices[0].num_cached_tokens)

    def chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.request_id, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.model,
                                "choices": choices}
        if with_usage:
            body["usage"] = self.usage()
        return body

    def response(self) -> dict[str, Any]:
        choices = [{
            "index": c.index,
            "message": {"role": "assistant", "content": "".join(c.pieces)},
            "logprobs": {"content": c.logprobs} if self.body.logprobs else None,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        } for c in self.choices.values()]
        return {"id": self.request_id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self.usage()}


class ChatHandler:
    def __init__(self, engine: EngineClient, model: ServedModel) -> None:
        self.engine = engine
        self.model = model

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.model.check(body.model)
        tokenizer = require_text_model(self.engine)
        _, prompt = chat_prompt(tokenizer, body.messages, body.add_generation_prompt,
                                body.continue_final_message)
        params = sampling_params(body, _max_tokens(body), _top_logprobs(body))
        request_id = new_id("chatcmpl")
        renderer = ChatRenderer(request_id, self.model.name, body, len(prompt), tokenizer)
        streams = submit_all(self.engine, [prompt], params, request_id,
                             request_options(body))
        return await respond(renderer, streams, bool(body.stream), request)


def _max_tokens(body: ChatCompletionRequest) -> int | None:
    if body.max_completion_tokens is not None:
        return body.max_completion_tokens
    return body.max_tokens


def _top_logprobs(body: ChatCompletionRequest) -> int | None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs to be true.",
                                  param="top_logprobs")
    return (body.top_logprobs or 0) if body.logprobs else None
