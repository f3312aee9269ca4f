"""Responses kept in memory (`store: true`, the Responses API's default): for `GET
/v1/responses/{id}`, and for a request that continues one (`previous_response_id`).

Each entry holds its own turn only (its input as chat messages, and its reply); a conversation
is rebuilt by walking back through `previous_response_id`. The newest `capacity` responses are
kept, within `max_bytes` of JSON in all (so large inputs cannot fill the memory); a
conversation whose older turns were dropped can no longer be continued. Like vLLM's store, it
lives with the process: a restart forgets it.

A background response (`background: true`) is held as running, with what its response object
says so far and the events of its stream, until it ends and is stored as any other (with its
events, so that a client may stream it from any point, as long as it is kept); cancelling it
stops its request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from server.errors import APIError
from server.streaming import compact_json

DEFAULT_CAPACITY = 1000
DEFAULT_MAX_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]
    # This turn as chat messages: its input, then its reply.
    messages: list[dict[str, Any]]
    previous_id: str | None
    # The request's input items as given, each with an id (`GET .../input_items`).
    input_items: list[dict[str, Any]]
    # The JSON size of all of it, what the store counts against `max_bytes`.
    size: int
    # A background response's stream, event by event (None for others).
    events: EventLog | None = None


class EventLog:
    """A background response's stream as it is written: every server-sent event, numbered by
    its place, which any number of readers follow from any point."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.done = False
        self._changed = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._changed.set()

    def close(self) -> None:
        self.done = True
        self._changed.set()

    @property
    def size(self) -> int:
        return sum(map(len, self.events))

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events numbered after `after`, then each as it comes, until the stream ends."""
        index = after + 1
        while True:
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.done:
                return
            self._changed.clear()
            await self._changed.wait()


@dataclass(frozen=True, slots=True)
class Running:
    """A background response under way: what its response object says now, its stream so far
    and its task."""

    snapshot: Callable[[], dict[str, Any]]
    events: EventLog
    task: asyncio.Task[None]


class ResponseStore:
    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._running: dict[str, Running] = {}

    def start(
        self,
        response_id: str,
        snapshot: Callable[[], dict[str, Any]],
        events: EventLog,
        task: asyncio.Task[None],
    ) -> None:
        """Hold a background response as running until its task ends (having stored it)."""
        self._running[response_id] = Running(snapshot, events, task)
        task.add_done_callback(lambda _: self._running.pop(response_id, None))

    def events(self, response_id: str) -> EventLog:
        """The stream of a background response, running or kept."""
        running = self._running.get(response_id)
        if running is not None:
            return running.events
        events = self._entry(response_id, "response_id").events
        if events is None:
            raise APIError(400, "Only a background response can be streamed again.", param="stream")
        return events

    async def cancel(self, response_id: str) -> dict[str, Any]:
        """Stop a running background response (its task stores it as cancelled) and return
        it; a response that has ended is returned as it ended."""
        running = self._running.get(response_id)
        if running is None:
            response = self.get(response_id)
            if not response.get("background"):
                raise APIError(
                    400, "Only a background response can be cancelled.", param="response_id"
                )
            return response
        await self.stop(response_id)
        return self.get(response_id)

    async def stop(self, response_id: str) -> None:
        """Cancel the response if it is a background one still running; its task stores it
        as cancelled before this returns."""
        running = self._running.get(response_id)
        if running is not None:
            running.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running.task
            self._running.pop(response_id, None)

    async def close(self) -> None:
        """Cancel what still runs (at shutdown)."""
        for response_id in list(self._running):
            await self.stop(response_id)

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        previous_id: str | None,
        input_items: list[dict[str, Any]] | None = None,
        events: EventLog | None = None,
    ) -> None:
        items = input_items or []
        size = sum(len(compact_json(part)) for part in (response, messages, items))
        size += events.size if events is not None else 0
        entry = StoredResponse(response, messages, previous_id, items, size, events)
        self._entries[response["id"]] = entry
        self.size += size
        while len(self._entries) > self.capacity or self.size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.size -= dropped.size

    def get(self, response_id: str) -> dict[str, Any]:
        running = self._running.get(response_id)
        if running is not None:
            return running.snapshot()
        return self._entry(response_id, "response_id").response

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """A page of the response's input items, as OpenAI lists them: newest first by default,
        from the item after `after`."""
        if response_id in self._running:
            raise APIError(
                400, f"The response '{response_id}' is still in progress.", param="response_id"
            )
        items = self._entry(response_id, "response_id").input_items
        ordered = list(reversed(items)) if order == "desc" else list(items)
        if after is not None:
            ids = [item["id"] for item in ordered]
            if after not in ids:
                raise APIError(404, f"No input item with id '{after}'.", param="after")
            ordered = ordered[ids.index(after) + 1 :]
        page = ordered[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(ordered) > limit,
        }

    def delete(self, response_id: str) -> None:
        self.size -= self._entry(response_id, "response_id").size
        del self._entries[response_id]

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation up to and including `response_id`'s reply."""
        if response_id in self._running:
            raise APIError(
                400,
                f"The response '{response_id}' is still in progress; continue it once it ends.",
                param="previous_response_id",
            )
        turns: list[list[dict[str, Any]]] = []
        current: str | None = response_id
        while current is not None:
            entry = self._entry(current, "previous_response_id")
            turns.append(entry.messages)
            current = entry.previous_id
        return [message for turn in reversed(turns) for message in turn]

    def _entry(self, response_id: str, param: str) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(
                404,
                f"No response with id '{response_id}' is stored (it was not stored, was "
                "deleted, or is older than those kept).",
                param=param,
                code="response_not_found",
            )
        return entry
