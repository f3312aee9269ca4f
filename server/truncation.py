"""`truncation: "auto"` of the Responses API: a conversation too long for the context loses its
oldest turns until it fits, as OpenAI drops items from the beginning of the conversation.

The system message (this turn's instructions) and the newest message always stay. A message
goes with the tool results that answered its calls (a `tool` message whose call is gone would
leave the template a result of nothing). The conversation fits when its prompt plus
`max_output_tokens` (where given) fits the context, else when the prompt leaves room for one
token.
"""

from __future__ import annotations

from typing import Any


def fits(prompt_tokens: int, max_output_tokens: int | None, max_model_len: int) -> bool:
    return prompt_tokens + max(max_output_tokens or 0, 1) <= max_model_len


def drop_oldest(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """`messages` without their oldest droppable turn, or None where nothing more can go."""
    start = 0
    while start < len(messages) and messages[start]["role"] == "system":
        start += 1
    if len(messages) - start <= 1:
        return None
    end = start + 1
    while end < len(messages) - 1 and messages[end]["role"] == "tool":
        end += 1
    return messages[:start] + messages[end:]
