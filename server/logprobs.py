"""Logprobs in the two shapes OpenAI uses: legacy completions and chat."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import TokenLogprob
from server.tokenization import TokenText


@dataclass(slots=True)
class CompletionLogprobs:
    """`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` of /v1/completions."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(
        self,
        token_ids: list[int],
        entries: list[TokenLogprob | None],
        token_text: TokenText,
        offset: int,
    ) -> int:
        """Append tokens whose text starts at `offset`; return the offset after them."""
        for token_id, entry in zip(token_ids, entries, strict=True):
            text = token_text(token_id)
            self.tokens.append(text)
            self.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(entry.logprob)
            top = {token_text(tid): lp for tid, lp in entry.top}
            # The chosen token's own value wins where two tokens share a text.
            top[text] = entry.logprob
            self.top_logprobs.append(top)
        return offset

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> list[dict[str, Any]]:
    """The `logprobs.content` list of a chat choice."""
    content = []
    for entry in entries:
        text = token_text(entry.token_id)
        content.append(
            {
                "token": text,
                "logprob": entry.logprob,
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": token_text(tid),
                        "logprob": lp,
                        "bytes": list(token_text(tid).encode("utf-8")),
                    }
                    for tid, lp in entry.top
                ],
            }
        )
    return content
