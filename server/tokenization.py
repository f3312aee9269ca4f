"""Prompts to token ids, chat messages through the model's template, token ids to strings."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from functools import lru_cache
from typing import Any, TypeVar, cast

from engine.core.errors import InvalidRequestError, PromptTooLongError
from server import json_text
from server.protocol import ChatMessage, Prompt, TextPart
from server.tool_prompt import renders_tools, with_tools_written

T = TypeVar("T")


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def split_prompts(prompt: Prompt) -> list[str | list[int]]:
    """The four prompt forms of /v1/completions as a list of single prompts."""
    if isinstance(prompt, str) or all(isinstance(item, int) for item in prompt):
        return [cast(str | list[int], prompt)]
    return list(cast(list[str] | list[list[int]], prompt))


def require_tokenizer(tokenizer: Any, param: str | None = None) -> Any:
    """The tokenizer, or a clear 400 for text sent to a server that has none."""
    if tokenizer is None:
        raise InvalidRequestError("This server has no tokenizer; send token ids.", param=param)
    return tokenizer


# Requests with more text than this are tokenized (and chat templates rendered) on a worker
# thread, so that one large body does not hold up every other request and /health.
OFF_LOOP_CHARS = 16_384


async def off_the_loop_if_large(size: int, work: Callable[[], T]) -> T:
    """`work()` here for small inputs (a thread hop costs more than they do), on a worker thread
    for large ones."""
    if size <= OFF_LOOP_CHARS:
        return work()
    return await asyncio.to_thread(work)


@lru_cache(maxsize=8)
def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for: the longest entry of the vocabulary
    (byte-level vocabularies spell each byte as one character, so this bounds characters)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1) or 1


def fewest_tokens(tokenizer: Any, chars: int) -> int:
    """The fewest tokens `chars` characters of text can take: no token spells more than
    `longest_token_chars`."""
    return -(-chars // longest_token_chars(tokenizer))


def check_fits(tokenizer: Any, chars: int, max_model_len: int, param: str) -> None:
    """Refuse, before tokenizing it, text too long for the context whatever its tokens: no token
    spells more than `longest_token_chars`, so it has at least chars / that many. (Tokenizing
    30 MB of text takes tens of seconds.)"""
    fewest = fewest_tokens(tokenizer, chars)
    if fewest >= max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has at least {fewest} tokens ({chars} characters), leaving no room for a "
            f"completion. Please reduce the length of the prompt.",
            param=param,
        )


async def prediction_tokens(tokenizer: Any, text: str, max_model_len: int) -> tuple[int, ...]:
    """A chat request's `prediction` (OpenAI's Predicted Outputs) as tokens: refused where it
    could not fit the context (a reply cannot be that long), tokenized off the loop when
    large."""
    fewest = fewest_tokens(tokenizer, len(text))
    if fewest >= max_model_len:
        raise InvalidRequestError(
            f"The prediction has at least {fewest} tokens ({len(text)} characters), more than "
            f"this model's context of {max_model_len} tokens.",
            param="prediction",
        )
    tokens = await off_the_loop_if_large(len(text), lambda: encode_text(tokenizer, text, False))
    return tuple(tokens)


def prompt_size(prompts: list[str | list[int]]) -> int:
    return sum(len(p) for p in prompts)


def messages_size(messages: list[ChatMessage]) -> int:
    return sum(len(message_text(m)) for m in messages)


def prompt_token_ids(
    tokenizer: Any, prompts: list[str | list[int]], add_special_tokens: bool = True
) -> list[list[int]]:
    """Token ids of each single prompt (text with the tokenizer's special tokens, such as a
    BOS, unless `add_special_tokens` is false); text needs the tokenizer."""
    if any(isinstance(p, str) for p in prompts):
        require_tokenizer(tokenizer, param="prompt")
    return [
        encode_text(tokenizer, p, add_special_tokens) if isinstance(p, str) else list(p)
        for p in prompts
    ]


async def tokenize_prompts(
    tokenizer: Any,
    prompts: list[str | list[int]],
    add_special_tokens: bool,
    max_model_len: int,
    truncating: bool,
    param: str,
) -> list[list[int]]:
    """`prompt_token_ids` of single prompts (completions' prompts, embeddings' inputs), each
    text first refused if it cannot fit the context (unless the request keeps only its last
    tokens, `truncating`), tokenized off the loop when large."""
    for prompt in prompts:
        if isinstance(prompt, str) and tokenizer is not None and not truncating:
            check_fits(tokenizer, len(prompt), max_model_len, param)
    return await off_the_loop_if_large(
        prompt_size(prompts), lambda: prompt_token_ids(tokenizer, prompts, add_special_tokens)
    )


def message_text(message: ChatMessage) -> str:
    """The message's text, its parts joined (images left out)."""
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    return "".join(part.text for part in message.content if isinstance(part, TextPart))


def message_content(
    message: ChatMessage, images: bool, parts: bool = False
) -> str | list[dict[str, Any]]:
    """The content as the template reads it: text for a text model (its text parts as sent,
    for a template that takes `parts`); for an image-text model the parts as its processor's
    templates take them (`{"type": "image"}` where each image goes; `as_parts` makes the text
    of the others parts too, once tools are written). An image sent to a text model is
    refused."""
    if not message.image_urls:
        if parts and isinstance(message.content, list):
            texts = [part.text for part in message.content if isinstance(part, TextPart)]
            return [{"type": "text", "text": text} for text in texts]
        return message_text(message)
    if not images:
        raise InvalidRequestError(
            "This model does not take images: image_url parts need an image-text model.",
            param="messages",
        )
    assert isinstance(message.content, list)
    return [
        {"type": "text", "text": part.text} if isinstance(part, TextPart) else {"type": "image"}
        for part in message.content
    ]


def chat_prompt(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    add_special_tokens: bool = False,
    images: bool = False,
    parts: bool = False,
    template: str | None = None,
    documents: list[dict[str, str]] | None = None,
) -> tuple[str, list[int]]:
    """Render messages (and the tools offered, `tools=`) with the model's chat template; return
    the text and its token ids. For a template with no tool section the conversation carries
    the tools and earlier calls itself (`server.tool_prompt`). `template_kwargs` are more
    variables for the template (`chat_template_kwargs`, e.g. Qwen3's `enable_thinking`). The
    template writes the special tokens it wants; `add_special_tokens` adds the tokenizer's own
    (such as a BOS) as well. For an image-text model (`images`), and for a template that takes
    OpenAI's list of parts (`parts`, `server.content_format`), the content goes as parts.
    `template` is a request's own chat template, used instead of the model's; `documents` are
    what a retrieval-grounded template (Command R's, Granite's) writes as sources."""
    if template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "This model has no chat template, so /v1/chat/completions cannot be used; "
            "use /v1/completions with a plain prompt instead.",
            param="messages",
        )
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true.",
            param="continue_final_message",
        )
    check_template_kwargs(tokenizer, template_kwargs)
    conversation = [template_message(m, images, parts) for m in messages]
    if not renders_tools(tokenizer, template):
        conversation, tools = with_tools_written(conversation, tools), None
    if images or parts:
        conversation = [as_parts(message) for message in conversation]
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tools=tools,
            documents=documents,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # template errors (e.g. roles it refuses) are the client's
        raise InvalidRequestError(f"The chat template failed: {exc}", param="messages") from exc
    return text, encode_text(tokenizer, text, add_special_tokens)


def as_parts(message: dict[str, Any]) -> dict[str, Any]:
    """A templated message with text content as one text part, as image-text models'
    templates read every message."""
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    return message


def check_template_kwargs(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> None:
    """Template variables may not stand in for `apply_chat_template`'s own arguments (the
    messages, the tools, whether to tokenize, the template itself): those come from the
    request's fields or not at all."""
    taken = call_arguments_among(tokenizer, template_kwargs)
    if taken:
        raise InvalidRequestError(
            f"chat_template_kwargs cannot set {', '.join(taken)}: "
            "these are the chat template call's own arguments.",
            param="chat_template_kwargs",
        )


def call_arguments_among(tokenizer: Any, template_kwargs: dict[str, Any] | None) -> list[str]:
    """The names among `template_kwargs` that are `apply_chat_template`'s own arguments."""
    return sorted(set(template_kwargs or ()) & apply_template_arguments(tokenizer.__class__))


@lru_cache(maxsize=8)
def apply_template_arguments(tokenizer_class: Any) -> frozenset[str]:
    parameters = inspect.signature(tokenizer_class.apply_chat_template).parameters.values()
    return frozenset(p.name for p in parameters if p.kind is not p.VAR_KEYWORD) - {"self"}


def template_message(
    message: ChatMessage, images: bool = False, parts: bool = False
) -> dict[str, Any]:
    """A message as chat templates take it: the calls an assistant made, with their arguments
    as objects where they parse (templates write them back as JSON), and the call a tool
    message answers."""
    content = message_content(message, images, parts)
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning or message.reasoning_content
    if reasoning:  # by the names thinking models' templates read (gpt-oss's: `thinking`)
        rendered["reasoning_content"] = rendered["thinking"] = reasoning
    return rendered


def _arguments(text: str) -> Any:
    try:
        return json_text.loads(text)
    except ValueError:
        return text


class TokenText:
    """Text of single tokens for logprobs, cached per token id. `label` names a token in a
    logprobs entry: its text, or with `as_ids` (vLLM's `return_tokens_as_token_ids`)
    `token_id:N`, which stays exact where a token's text is not valid UTF-8 alone."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self._decode = lru_cache(maxsize=65536)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False)
        )
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        return self._decode(token_id)

    def label(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self._decode(token_id)


def tokenizer_info(tokenizer: Any) -> dict[str, Any]:
    """What the tokenizer was made from, as its `tokenizer_config.json` holds it (vLLM's
    `/tokenizer_info`): its class, special tokens, added tokens and the chat template served,
    each value as JSON writes it."""
    info = {name: _json_safe(value) for name, value in tokenizer.init_kwargs.items()}
    info.setdefault("tokenizer_class", type(tokenizer).__name__)
    template = getattr(tokenizer, "chat_template", None)
    if template is not None:
        info["chat_template"] = template
    return info


def _json_safe(value: Any) -> Any:
    """A tokenizer setting as JSON holds it: added tokens as their fields, anything else that
    JSON has no form for as its text."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(key): _json_safe(item) for key, item in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_json_safe(item) for item in value]
    if not isinstance(value, type) and isinstance(getattr(value, "content", None), str):
        fields = value.__getstate__()  # an AddedToken: its content and flags
        if isinstance(fields, dict):
            return _json_safe(fields)
    return str(value)
