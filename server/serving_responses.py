"""POST /v1/responses (OpenAI's Responses API), run as the chat completion its items spell.

The request becomes a chat request (`responses_protocol.as_chat`), which the chat handler
checks, templates and submits as it does its own; the chat renderer splits the reply
(reasoning, text, tool calls) and `OutputItems` makes typed output items of it. Streamed, each
event is a server-sent event named by its type, numbered in order, from `response.created` to
`response.completed` (or `response.incomplete`, or `response.failed`); there is no `[DONE]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.errors import InvalidRequestError, PromptTooLongError
from engine.core.outputs import RequestOutput
from server.errors import to_api_error
from server.protocol import ChatCompletionRequest, served_tier
from server.response_items import OutputItems, item_id
from server.response_store import EventLog, ResponseStore
from server.responses_protocol import (
    InputTokensRequest,
    ResponsesRequest,
    as_chat,
    chat_messages,
    input_messages,
    listed_items,
    responses_param,
)
from server.serving import (
    EngineClient,
    EventStream,
    bind_trace,
    now,
    request_options,
    require_text_model,
    submit_all,
)
from server.serving_chat import ChatHandler, ChatRenderer, PreparedChat
from server.streaming import CLIENT_GONE, merge, named_sse, unless_disconnected
from server.tools import check_tools
from server.tracing import RequestTrace, request_trace
from server.truncation import drop_oldest, fits

# How a reply that ended early says why (`incomplete_details.reason`).
INCOMPLETE = {"length": "max_output_tokens", "timeout": "timeout"}


class ResponsesHandler:
    def __init__(self, engine: EngineClient, chat: ChatHandler, store: ResponseStore) -> None:
        self.engine = engine
        self.chat = chat
        self.store = store

    async def __call__(self, body: ResponsesRequest, request: Request) -> Response:
        _check_background(body)
        previous = body.previous_response_id
        history = self.store.history(previous) if previous is not None else []
        response_id = item_id("resp")
        try:
            chat_body, prepared = await self._prepare(body, chat_messages(body, history))
            await self.engine.prepare(prepared.params)  # compiles a format
            options = request_options(chat_body, request, prepared.lora, prepared.images)
            streams = submit_all(
                self.engine, [prepared.prompt], prepared.params, response_id, options
            )
        except InvalidRequestError as exc:
            exc.param = responses_param(exc.param)
            raise
        bind_trace(request, response_id)
        renderer = self.chat.renderer(response_id, chat_body, prepared)
        tokenizer = require_text_model(self.engine)
        model = self.chat.model.name_for(prepared.lora)
        reply = Reply(response_id, model, body, renderer, tokenizer)
        merged = merge(streams)
        trace = request_trace(request)
        if body.background:
            events = EventLog()
            task = asyncio.create_task(self._in_background(body, reply, merged, events))
            self.store.start(response_id, reply.response, events, task)
            # Let the task start its stream, so that a cancel, however soon, finds it running
            # (a stream never started would not abort its request when closed).
            await asyncio.sleep(0)
            if trace is not None:  # the request's span is its HTTP exchange alone
                trace.end(200)
            if body.stream:  # a client that goes away stops reading, not the response
                return StreamingResponse(events.follow(), media_type="text/event-stream")
            return JSONResponse(reply.response())
        if not body.stream:
            result = await unless_disconnected(request, self._collect(reply, merged))
            if result is None:
                return Response(status_code=CLIENT_GONE)
            if trace is not None:
                trace.output(renderer)
            self._keep(body, reply, result)
            return JSONResponse(result)
        first = await unless_disconnected(request, anext(merged))
        if first is None:
            await merged.aclose()
            return Response(status_code=CLIENT_GONE)
        return EventStream(self._events(body, reply, first[1], merged, trace), merged, trace)

    async def _prepare(
        self, body: ResponsesRequest, messages: list[dict[str, Any]]
    ) -> tuple[ChatCompletionRequest, PreparedChat]:
        """The chat request of the conversation and what it runs; with `truncation: "auto"`,
        the oldest turns dropped until it fits the context."""
        max_model_len = self.chat.model.info.max_model_len
        while True:
            chat_body = as_chat(body, messages)
            shorter = drop_oldest(messages) if body.truncation == "auto" else None
            try:
                prepared = await self.chat.prepare(chat_body)
            except PromptTooLongError:
                if shorter is None:
                    raise
                messages = shorter
                continue
            if shorter is None or fits(len(prepared.prompt), body.max_output_tokens, max_model_len):
                return chat_body, prepared
            messages = shorter

    async def count_input_tokens(self, body: InputTokensRequest) -> dict[str, Any]:
        """The prompt tokens `/v1/responses` would take for this conversation, its earlier
        turns and its tools (with `truncation: "auto"`, once its oldest turns are dropped to
        fit; else however long)."""
        previous = body.previous_response_id
        history = self.store.history(previous) if previous is not None else []
        messages = chat_messages(body, history)
        if not messages:
            raise InvalidRequestError(
                "There is nothing to count: give input, instructions or previous_response_id.",
                param="input",
            )
        try:
            if body.truncation == "auto":
                _, prepared = await self._prepare(body, messages)
                prompt = prepared.prompt
            else:
                self.chat.model.resolve(body.model)
                chat_body = as_chat(body, messages)
                check_tools(chat_body)
                _, prompt, _ = await self.chat.templated(chat_body, fits=False)
        except InvalidRequestError as exc:
            exc.param = responses_param(exc.param)
            raise
        return {"object": "response.input_tokens", "input_tokens": len(prompt)}

    async def _in_background(
        self,
        body: ResponsesRequest,
        reply: Reply,
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
        events: EventLog,
    ) -> None:
        """Run a background response to its end, writing its stream's events, and store it:
        completed or incomplete, failed with its error, or cancelled."""
        try:
            try:
                _, first = await anext(merged)
            except Exception as exc:  # before any output: the deadline passed in the queue
                for event in self._failed(body, reply, EventNumbers(), exc, events):
                    events.append(event)
                return
            async for event in self._events(body, reply, first, merged, None, events):
                events.append(event)
        except asyncio.CancelledError:
            self._keep(body, reply, reply.response("cancelled"), events)
            raise
        finally:
            events.close()
            await merged.aclose()  # aborts what still runs

    @staticmethod
    async def _collect(
        reply: Reply, merged: AsyncGenerator[tuple[int, RequestOutput], None]
    ) -> dict[str, Any]:
        async for _, output in merged:
            reply.update(output)
        reply.finish()
        return reply.response()

    async def _events(
        self,
        body: ResponsesRequest,
        reply: Reply,
        output: RequestOutput,
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
        trace: RequestTrace | None,
        log: EventLog | None = None,
    ) -> AsyncGenerator[str, None]:
        """The response's stream; `log` is kept with the response (a background one's)."""
        stream = EventNumbers()
        completed = False
        try:
            yield stream.event("response.created", response=reply.response("in_progress"))
            yield stream.event("response.in_progress", response=reply.response("in_progress"))
            while True:
                for event in reply.update(output):
                    yield stream.sse(event)
                try:
                    _, output = await anext(merged)
                except StopAsyncIteration:
                    break
            for event in reply.finish():
                yield stream.sse(event)
            result = reply.response()
            if trace is not None:
                trace.output(reply.renderer)
            self._keep(body, reply, result, log)
            yield stream.event(f"response.{result['status']}", response=result)
            completed = True
        except Exception as exc:
            if trace is not None:
                trace.fail(exc)
            completed = True
            for ending in self._failed(body, reply, stream, exc, log):
                yield ending
        finally:
            await merged.aclose()
            if trace is not None:
                trace.end(None if completed else CLIENT_GONE)

    def _failed(
        self,
        body: ResponsesRequest,
        reply: Reply,
        stream: EventNumbers,
        exc: Exception,
        log: EventLog | None,
    ) -> list[str]:
        """The events that end a stream on `exc`, the response stored as failed."""
        error = to_api_error(exc)
        failed = reply.response("failed", {"code": error.code, "message": error.message})
        self._keep(body, reply, failed, log)
        return [
            stream.event("error", code=error.code, message=error.message, param=error.param),
            stream.event("response.failed", response=failed),
        ]

    def _keep(
        self,
        body: ResponsesRequest,
        reply: Reply,
        result: dict[str, Any],
        events: EventLog | None = None,
    ) -> None:
        """Store the response with its turn (`store: true`), for GET and continuations, with a
        background response's stream."""
        if body.store:
            turn = [*input_messages(body.input), reply.chat_message()]
            listed = listed_items(body.input)
            self.store.put(result, turn, body.previous_response_id, listed, events)


def _check_background(body: ResponsesRequest) -> None:
    """A background response is stored: GET reads it, or streams it again."""
    if body.background and not body.store:
        raise InvalidRequestError(
            "A background response must be stored: leave store true.", param="background"
        )


class EventNumbers:
    """Server-sent events named by their type, each with the next sequence number."""

    def __init__(self) -> None:
        self.next = 0

    def event(self, kind: str, **fields: Any) -> str:
        return self.sse({"type": kind, **fields})

    def sse(self, event: dict[str, Any]) -> str:
        event = {**event, "sequence_number": self.next}
        self.next += 1
        return named_sse(event)


class Reply:
    """One response being built: the chat renderer's deltas made into output items."""

    def __init__(
        self,
        response_id: str,
        model: str,
        body: ResponsesRequest,
        renderer: ChatRenderer,
        tokenizer: Any,
    ) -> None:
        self.response_id = response_id
        self.tokenizer = tokenizer
        self.model = model
        self.body = body
        self.renderer = renderer
        self.created_at = now()
        self.items = OutputItems()
        # Whether any output came yet (a background response is `queued` until it does), and
        # whether the reply has ended.
        self.started = False
        self.ended = False

    def update(self, output: RequestOutput) -> list[dict[str, Any]]:
        self.started = True
        events = []
        for fragment in self.renderer.update(0, output):
            logprobs = (fragment.get("logprobs") or {}).get("content")
            events += self.items.delta(fragment["delta"], logprobs)
        return events

    def finish(self) -> list[dict[str, Any]]:
        reason = self.renderer.choices[0].finish_reason or ""
        self.ended = True
        return self.items.finish(cut_short=reason in INCOMPLETE)

    def response(
        self, status: str | None = None, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The response object: with `status` given, as it stands; otherwise as the reply
        ended, or, until it has, as a background response's progress (`queued`, then
        `in_progress`)."""
        reason = self.renderer.choices[0].finish_reason
        incomplete = None
        if status is None and not self.ended:
            status = "in_progress" if self.started else "queued"
        if status is None:
            incomplete = INCOMPLETE.get(reason or "")
            status = "incomplete" if incomplete else "completed"
        body = self.body
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": body.background,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "model": self.model,
            "output": self.items.items if status not in ("queued", "in_progress") else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning,
            "store": body.store,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": body.text.model_dump(by_alias=True, exclude_none=True),
            "tool_choice": (
                body.tool_choice
                if isinstance(body.tool_choice, str)
                else body.tool_choice.model_dump()
            ),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools],
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "top_logprobs": body.top_logprobs,
            "truncation": body.truncation,
            **served_tier(body.service_tier),
            "usage": self.usage() if status not in ("queued", "in_progress") else None,
            "user": body.user,
            # vLLM's per-request metrics, where the server reports them, once it is done.
            **(self.renderer.metrics_field() if status not in ("queued", "in_progress") else {}),
        }

    def usage(self) -> dict[str, Any]:
        chat = self.renderer.usage()
        reasoning = self.items.reasoning
        reasoning_tokens = (
            len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return {
            "input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": min(reasoning_tokens, chat["completion_tokens"])
            },
            "total_tokens": chat["total_tokens"],
        }

    def chat_message(self) -> dict[str, Any]:
        """The reply as the assistant turn a continuation sends back to the template."""
        message: dict[str, Any] = {"role": "assistant", "content": self.items.text or None}
        calls = [
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            for item in self.items.items
            if item["type"] == "function_call"
        ]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        if self.items.reasoning:
            message["reasoning_content"] = self.items.reasoning
        return message
