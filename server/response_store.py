"""Responses kept in memory (`store: true`, the Responses API's default): for `GET
/v1/responses/{id}`, and for a request that continues one (`previous_response_id`).

Each entry holds its own turn only (its input as chat messages, and its reply); a conversation
is rebuilt by walking back through `previous_response_id`. The newest `capacity` responses are
kept, within `max_bytes` of JSON in all (so large inputs cannot fill the memory); a
conversation whose older turns were dropped can no longer be continued. Like vLLM's store, it
lives with the process: a restart forgets it.
"""

from __future__ import annotations

from collections import OrderedDict
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


class ResponseStore:
    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES
    ) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.size = 0
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
        previous_id: str | None,
        input_items: list[dict[str, Any]] | None = None,
    ) -> None:
        items = input_items or []
        size = sum(len(compact_json(part)) for part in (response, messages, items))
        entry = StoredResponse(response, messages, previous_id, items, size)
        self._entries[response["id"]] = entry
        self.size += size
        while len(self._entries) > self.capacity or self.size > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.size -= dropped.size

    def get(self, response_id: str) -> dict[str, Any]:
        return self._entry(response_id, "response_id").response

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> dict[str, Any]:
        """A page of the response's input items, as OpenAI lists them: newest first by default,
        from the item after `after`."""
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
