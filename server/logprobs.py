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
            label = token_text.label(token_id)
            self.tokens.append(label)
            self.text_offset.append(offset)
            offset += len(token_text(token_id))
            if entry is None:
                self.token_logprobs.append(None)
                self.top_logprobs.append(None)
                continue
            self.token_logprobs.append(entry.logprob)
            top = {token_text.label(tid): lp for tid, lp in entry.top}
            # The chosen token's own value wins where two tokens share a text.
            top[label] = entry.logprob
            self.top_logprobs.append(top)
        return offset

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


def prompt_logprobs(
    entries: list[TokenLogprob | None], token_text: TokenText, count: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: for each prompt token (None for the first, which nothing
    predicts) its own entry and those of its `count` likeliest rivals, keyed by token id, each
    `{"logprob", "rank", "decoded_token"}`."""
    shown: list[dict[str, dict[str, Any]] | None] = []
    for entry in entries:
        if entry is None:
            shown.append(None)
            continue
        ranked = [(entry.token_id, entry.logprob, entry.rank)]
        ranked += [(tid, lp, rank) for rank, (tid, lp) in enumerate(entry.top[:count], 1)]
        position: dict[str, dict[str, Any]] = {}
        for tid, lp, rank in ranked:
            position.setdefault(
                str(tid), {"logprob": lp, "rank": rank, "decoded_token": token_text.label(tid)}
            )
        shown.append(position)
    return shown


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> list[dict[str, Any]]:
    """The `logprobs.content` list of a chat choice."""
    content = []
    for entry in entries:
        content.append(
            {
                **_chat_entry(entry.token_id, entry.logprob, token_text),
                "top_logprobs": [_chat_entry(tid, lp, token_text) for tid, lp in entry.top],
            }
        )
    return content


def _chat_entry(token_id: int, logprob: float, token_text: TokenText) -> dict[str, Any]:
    label = token_text.label(token_id)
    return {"token": label, "logprob": logprob, "bytes": list(label.encode("utf-8"))}
