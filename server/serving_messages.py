"""POST /v1/messages (Anthropic's Messages API), run as the chat completion its turns spell, and
POST /v1/messages/count_tokens.

The request becomes a chat request (`messages_protocol.as_chat`), which the chat handler checks,
templates and submits as it does its own; the chat renderer splits the reply (reasoning, text,
tool calls) and `ContentBlocks` makes Anthropic's content blocks of it (`thinking`, `text`,
`tool_use`). Streamed, each event is a server-sent event named by its type, from
`message_start` to `message_stop`; there is no `[DONE]`. Errors take Anthropic's shape
(`server.errors`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.core.errors import InvalidRequestError
from engine.core.outputs import RequestOutput
from server import json_text
from server.errors import anthropic_error_body, to_api_error
from server.messages_protocol import CountTokensRequest, MessagesRequest, as_chat, messages_param
from server.serving import EngineClient, EventStream, bind_trace, request_options, submit_all
from server.serving_chat import ChatHandler, ChatRenderer
from server.streaming import CLIENT_GONE, merge, named_sse, unless_disconnected
from server.tools import check_tools
from server.tracing import RequestTrace, request_trace

# How chat's finish reasons read as Anthropic's stop reasons (a stop string: `stop_sequence`).
STOP_REASONS = {"length": "max_tokens", "timeout": "max_tokens", "tool_calls": "tool_use"}


class MessagesHandler:
    def __init__(self, engine: EngineClient, chat: ChatHandler) -> None:
        self.engine = engine
        self.chat = chat

    async def __call__(self, body: MessagesRequest, request: Request) -> Response:
        try:
            chat_body = as_chat(body)
            prepared = await self.chat.prepare(chat_body)
            await self.engine.prepare(prepared.params)  # compiles a format
            message_id = f"msg_{uuid.uuid4().hex}"
            options = request_options(chat_body, request, prepared.lora, prepared.images)
            streams = submit_all(
                self.engine, [prepared.prompt], prepared.params, message_id, options
            )
        except InvalidRequestError as exc:
            exc.param = messages_param(exc.param)
            raise
        bind_trace(request, message_id)
        renderer = self.chat.renderer(message_id, chat_body, prepared)
        reply = Reply(message_id, self.chat.model.name_for(prepared.lora), body, renderer)
        merged = merge(streams)
        trace = request_trace(request)
        if not body.stream:
            result = await unless_disconnected(request, _collect(reply, merged))
            if result is None:
                return Response(status_code=CLIENT_GONE)
            if trace is not None:
                trace.output(renderer)
            return JSONResponse(result)
        first = await unless_disconnected(request, anext(merged))
        if first is None:
            await merged.aclose()
            return Response(status_code=CLIENT_GONE)
        return EventStream(_events(reply, first[1], merged, trace), merged, trace)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The conversation's prompt tokens as this model's template renders it with its tools
        (what `/v1/messages` would take as `input_tokens`), however long."""
        try:
            self.chat.model.resolve(body.model)
            chat_body = as_chat(body)
            check_tools(chat_body)
        except InvalidRequestError as exc:
            exc.param = messages_param(exc.param)
            raise
        _, prompt, _ = await self.chat.templated(chat_body, fits=False)
        return {"input_tokens": len(prompt)}


async def _collect(
    reply: Reply, merged: AsyncGenerator[tuple[int, RequestOutput], None]
) -> dict[str, Any]:
    async for _, output in merged:
        reply.update(output)
    reply.blocks.finish()
    return reply.message()


async def _events(
    reply: Reply,
    output: RequestOutput,
    merged: AsyncGenerator[tuple[int, RequestOutput], None],
    trace: RequestTrace | None,
) -> AsyncGenerator[str, None]:
    completed = False
    try:
        yield named_sse({"type": "message_start", "message": reply.message(started=True)})
        yield named_sse({"type": "ping"})
        while True:
            for event in reply.update(output):
                yield named_sse(event)
            try:
                _, output = await anext(merged)
            except StopAsyncIteration:
                break
        for event in reply.blocks.finish():
            yield named_sse(event)
        result = reply.message()
        if trace is not None:
            trace.output(reply.renderer)
        stop = {key: result[key] for key in ("stop_reason", "stop_sequence")}
        yield named_sse({"type": "message_delta", "delta": stop, "usage": result["usage"]})
        yield named_sse({"type": "message_stop"})
        completed = True
    except Exception as exc:
        if trace is not None:
            trace.fail(exc)
        completed = True
        yield named_sse(anthropic_error_body(to_api_error(exc)))
    finally:
        await merged.aclose()
        if trace is not None:
            trace.end(None if completed else CLIENT_GONE)


class Reply:
    """One message being built: the chat renderer's deltas made into content blocks."""

    def __init__(
        self, message_id: str, model: str, body: MessagesRequest, renderer: ChatRenderer
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.body = body
        self.renderer = renderer
        self.blocks = ContentBlocks()

    def update(self, output: RequestOutput) -> list[dict[str, Any]]:
        events = []
        for fragment in self.renderer.update(0, output):
            events += self.blocks.delta(fragment["delta"])
        return events

    def message(self, started: bool = False) -> dict[str, Any]:
        """The message as it ended, or (`started`) as `message_start` announces it."""
        stop_reason, stop_sequence = (None, None) if started else self._stop()
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [] if started else self.blocks.content(),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(started),
        }

    def usage(self, started: bool = False) -> dict[str, Any]:
        chat = self.renderer.usage()
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": chat["prompt_tokens"] - cached,
            "output_tokens": 0 if started else chat["completion_tokens"],
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
        }

    def _stop(self) -> tuple[str, str | None]:
        choice = self.renderer.choices[0]
        reason = choice.finish_reason or "stop"
        if reason == "stop" and self.blocks.called:
            return "tool_use", None
        matched = choice.stop_reason
        if reason == "stop" and isinstance(matched, str):
            return "stop_sequence", matched
        return STOP_REASONS.get(reason, "end_turn"), None


class ContentBlocks:
    """The content blocks of one reply, built from chat deltas (reasoning, then content, then
    tool calls); each call returns the stream events it produced."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        # The block still growing, if any (its index in `blocks`).
        self._open: int | None = None
        # Chat's tool-call index -> the tool_use block it grows, and its arguments so far.
        self._calls: dict[int, int] = {}
        self._arguments: dict[int, str] = {}

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("reasoning"):
            events += self._grow("thinking", delta["reasoning"])
        if delta.get("content"):
            events += self._grow("text", delta["content"])
        for entry in delta.get("tool_calls") or ():
            events += self._call(entry)
        return events

    def finish(self) -> list[dict[str, Any]]:
        return self._close()

    def content(self) -> list[dict[str, Any]]:
        """The blocks as the whole message holds them: each call's input parsed (empty where
        its arguments were cut short)."""
        content = []
        for index, block in enumerate(self.blocks):
            if block["type"] == "tool_use":
                block = {**block, "input": _parsed(self._arguments.get(index, ""))}
            content.append(block)
        return content

    def _grow(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.blocks[self._open]["type"] != kind:
            block = {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "text":
                block = {"type": "text", "text": ""}
            events = self._close() + self._start(block)
        index = self._open
        assert index is not None
        self.blocks[index][kind] += text
        delta = {"type": f"{kind}_delta", kind: text}
        return [*events, {"type": "content_block_delta", "index": index, "delta": delta}]

    def _call(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call entry of a chat delta: a new call (it has an id), or more arguments."""
        function = entry.get("function") or {}
        arguments = function.get("arguments") or ""
        chat_index = entry.get("index", len(self._calls))
        events = []
        if "id" in entry:
            block = {"type": "tool_use", "id": entry["id"], "name": function.get("name", "")}
            events = self._close() + self._start({**block, "input": {}})
            assert self._open is not None
            self._calls[chat_index] = self._open
        growing = self._calls.get(chat_index)
        if growing is None or not arguments:
            return events
        self._arguments[growing] = self._arguments.get(growing, "") + arguments
        delta = {"type": "input_json_delta", "partial_json": arguments}
        return [*events, {"type": "content_block_delta", "index": growing, "delta": delta}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        index = len(self.blocks)
        self.blocks.append(block)
        self._open = index
        start = {"type": "content_block_start", "index": index, "content_block": dict(block)}
        return [start]

    def _close(self) -> list[dict[str, Any]]:
        index, self._open = self._open, None
        return [] if index is None else [{"type": "content_block_stop", "index": index}]


def _parsed(arguments: str) -> dict[str, Any]:
    try:
        value = json_text.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
