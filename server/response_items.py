"""A reply as the Responses API's output items and the events that stream them.

The chat renderer splits a reply as it streams (reasoning, text, tool calls: `ChatRenderer`);
`OutputItems` turns each of its deltas into typed items (`reasoning`, `message`,
`function_call`) and the events that open, grow and close them, so a streamed reply and a
whole one are built the same way and end with the same items.
"""

from __future__ import annotations

import copy
import uuid
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """The output items of one reply, built delta by delta; each call returns the events it
    produced (without sequence numbers, which the stream adds)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        # The item still growing, if any (its index in `items`).
        self._open: int | None = None
        # Chat's tool-call index -> the function_call item it grows.
        self._calls: dict[int, int] = {}
        # Logprobs of tokens that added no text yet (a character's first bytes): they go with
        # the text that follows.
        self._pending: list[dict[str, Any]] = []

    def delta(
        self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Fold one chat delta (reasoning, then content, then tool calls) into the items; its
        tokens' `logprobs`, if asked for, go with its text."""
        events: list[dict[str, Any]] = []
        self._pending.extend(logprobs or ())
        if delta.get("reasoning"):
            self._pending.clear()  # a thought's tokens have no logprobs here
            events += self._grow("reasoning", delta["reasoning"])
        if delta.get("content"):
            pending, self._pending = self._pending, []
            events += self._grow("message", delta["content"], pending)
        for entry in delta.get("tool_calls") or ():
            events += self._call(entry)
        return events

    def finish(self, cut_short: bool = False) -> list[dict[str, Any]]:
        """Close what is open (`incomplete` where the reply was `cut_short`); a reply with no
        item at all gets an empty message."""
        events = []
        if self._pending and self._open is not None and self.items[self._open]["type"] == "message":
            events += self._grow("message", "", self._pending)
        self._pending = []
        events += self._close("incomplete" if cut_short else "completed")
        if not self.items:
            events += self._start("message")
            events += self._close()
        return events

    @property
    def reasoning(self) -> str:
        return "".join(_part_text(item) for item in self.items if item["type"] == "reasoning")

    @property
    def text(self) -> str:
        return "".join(_part_text(item) for item in self.items if item["type"] == "message")

    def _grow(
        self, kind: str, text: str, logprobs: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self.items[self._open]["type"] != kind:
            events = self._close() + self._start(kind)
        index = self._open
        assert index is not None
        item = self.items[index]
        part = item["content"][0]
        part["text"] += text
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        event = {
            "type": name,
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            event["logprobs"] = logprobs or []
            part["logprobs"].extend(event["logprobs"])
        return [*events, event]

    def _start(self, kind: str) -> list[dict[str, Any]]:
        """Open a message or reasoning item with one empty text part."""
        item: dict[str, Any]
        if kind == "message":
            item = {
                "id": item_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        index = len(self.items)
        events = [_item_event("response.output_item.added", index, item)]
        item["content"].append(part)
        self.items.append(item)
        self._open = index
        events.append(_part_event("response.content_part.added", index, item, part))
        return events

    def _call(self, entry: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call entry of a chat delta: a new call (it has an id), or more arguments."""
        function = entry.get("function") or {}
        arguments = function.get("arguments") or ""
        chat_index = entry.get("index", len(self._calls))
        events = []
        if "id" in entry:
            events = self._close()
            item = {
                "id": item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": entry["id"],
                "name": function.get("name", ""),
                "arguments": "",
            }
            index = len(self.items)
            events.append(_item_event("response.output_item.added", index, item))
            self.items.append(item)
            self._open = self._calls[chat_index] = index
        growing = self._calls.get(chat_index)
        if growing is None or not arguments:
            return events
        item = self.items[growing]
        item["arguments"] += arguments
        events.append(
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": growing,
                "delta": arguments,
            }
        )
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        index = self._open
        if index is None:
            return []
        self._open = None
        item = self.items[index]
        events = []
        if item["type"] == "function_call":
            events.append(
                {
                    "type": "response.function_call_arguments.done",
                    "item_id": item["id"],
                    "output_index": index,
                    "arguments": item["arguments"],
                }
            )
        else:
            part = item["content"][0]
            done = "response.output_text.done"
            if item["type"] == "reasoning":
                done = "response.reasoning_text.done"
            event = {
                "type": done,
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "text": part["text"],
            }
            if item["type"] == "message":
                event["logprobs"] = part["logprobs"]
            events.append(event)
            events.append(_part_event("response.content_part.done", index, item, part))
        if "status" in item:
            item["status"] = status
        events.append(_item_event("response.output_item.done", index, item))
        return events


def _part_text(item: dict[str, Any]) -> str:
    return "".join(part["text"] for part in item["content"])


def _item_event(kind: str, index: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "output_index": index, "item": copy.deepcopy(item)}


def _part_event(
    kind: str, index: int, item: dict[str, Any], part: dict[str, Any]
) -> dict[str, Any]:
    return {
        "type": kind,
        "item_id": item["id"],
        "output_index": index,
        "content_index": 0,
        "part": copy.deepcopy(part),
    }
