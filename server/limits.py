"""Limits on the sizes of a request's lists, checked before any tokenizing or engine work: a
client cannot make the server scan 10,000 stop strings or queue 30,000 prompts in one body.
Each is a `conveyor serve` flag; a request past one gets a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import InvalidRequestError
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.tokenization import split_prompts


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_stop_strings: int = 64
    max_stop_string_chars: int = 1024
    max_prompts: int = 1024
    max_logit_bias: int = 1024
    max_messages: int = 2048
    # Images in one chat request (vLLM's `--limit-mm-per-prompt '{"image": N}'`).
    max_images: int = 16
    # Hosts image URLs may name (vLLM's `--allowed-media-domains`); None: any.
    allowed_media_domains: frozenset[str] | None = None
    # The folder `file://` image URLs may read from (vLLM's `--allowed-local-media-path`);
    # None: no file URLs.
    allowed_local_media_path: Path | None = None


def check_sampling(body: SamplingFields, limits: RequestLimits) -> None:
    stops = body.stop_strings
    _at_most(len(stops), limits.max_stop_strings, "stop", "stop strings")
    longest = max((len(s) for s in stops), default=0)
    _at_most(longest, limits.max_stop_string_chars, "stop", "characters in a stop string")
    _at_most(
        len(body.stop_token_ids or ()), limits.max_stop_strings, "stop_token_ids", "stop token ids"
    )
    _at_most(len(body.logit_bias or {}), limits.max_logit_bias, "logit_bias", "logit_bias entries")
    words = body.bad_words or ()
    _at_most(len(words), limits.max_stop_strings, "bad_words", "bad words")
    longest_word = max((len(w) for w in words), default=0)
    _at_most(longest_word, limits.max_stop_string_chars, "bad_words", "characters in a bad word")


def check_completion(body: CompletionRequest, limits: RequestLimits) -> None:
    check_sampling(body, limits)
    count = len(split_prompts(body.prompt)) if body.prompt is not None else 0
    _at_most(count + len(body.embedded_prompts), limits.max_prompts, "prompt", "prompts")


def check_chat(body: ChatCompletionRequest, limits: RequestLimits) -> None:
    check_sampling(body, limits)
    _at_most(len(body.messages), limits.max_messages, "messages", "messages")


def _at_most(count: int, limit: int, param: str, what: str) -> None:
    if count > limit:
        raise InvalidRequestError(
            f"At most {limit} {what} are allowed in a request, got {count}.", param=param
        )
