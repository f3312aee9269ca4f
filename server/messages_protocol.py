"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), and the
chat request it runs as.

A Messages request is a conversation of user and assistant turns whose content is text or typed
blocks: the assistant's `tool_use` calls and `thinking`, the user's `tool_result`s. Conveyor
runs it as the chat completion they spell (`as_chat`): `system` as the system message, each
`tool_use` as an assistant turn's `tool_calls` entry, each `tool_result` as a `tool` message,
`thinking` as the turn's reasoning, `image` blocks as chat's image parts (for an image-text
model), tools and `tool_choice` in chat's shape. Unknown fields are ignored, as elsewhere; blocks
this server cannot read (documents) and server-side tools are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.core.errors import InvalidRequestError
from server.protocol import ChatCompletionRequest, NonNegativeInt, PositiveInt, RequestBody

_STRICT = ConfigDict(extra="ignore", strict=True)


class TextBlock(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


class Base64Source(BaseModel):
    model_config = _STRICT

    type: Literal["base64"]
    media_type: str
    data: str


class URLSource(BaseModel):
    model_config = _STRICT

    type: Literal["url"]
    url: str


class ImageBlock(BaseModel):
    """An image in a user turn, inline or by URL."""

    model_config = _STRICT

    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    def chat_part(self) -> dict[str, Any]:
        """The image as chat's `image_url` part."""
        source = self.source
        url = (
            source.url
            if isinstance(source, URLSource)
            else f"data:{source.media_type};base64,{source.data}"
        )
        return {"type": "image_url", "image_url": {"url": url}}


class ToolUseBlock(BaseModel):
    """A call an earlier reply made, sent back with the conversation."""

    model_config = _STRICT

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _STRICT

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(block.text for block in self.content)


class ThinkingBlock(BaseModel):
    """An earlier reply's thinking: goes back to the template with its turn."""

    model_config = _STRICT

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(BaseModel):
    model_config = _STRICT

    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]
BLOCK_TYPES = ("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking")


class Message(BaseModel):
    model_config = _STRICT

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, value: Any) -> Any:
        """A block this server cannot read is named (documents)."""
        for block in value if isinstance(value, list) else []:
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind not in BLOCK_TYPES:
                raise ValueError(
                    f"content blocks of type '{kind}' are not supported; this server reads "
                    f"{', '.join(BLOCK_TYPES)}"
                )
        return value


class Tool(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    strict: bool | None = None


class ToolChoice(BaseModel):
    model_config = _STRICT

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    model_config = _STRICT

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(BaseModel):
    model_config = _STRICT

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`format`: JSON that follows a schema (structured outputs); `effort`: how hard a reasoning
    model thinks, handed to the template as `reasoning_effort`."""

    model_config = _STRICT

    format: OutputFormat | None = None
    effort: str | None = None


class Metadata(BaseModel):
    model_config = _STRICT

    user_id: str | None = None


class CountTokensRequest(RequestBody):
    """What `/v1/messages/count_tokens` reads: the conversation, its system prompt and tools."""

    model_config = _STRICT

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        """Server tools (web search, code execution, ...) run on Anthropic's side."""
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in (None, "custom"):
                raise InvalidRequestError(
                    f"tools of type '{kind}' are not supported; only client tools (a name, "
                    "a description and an input_schema) are.",
                    param=f"tools.{index}.type",
                )
        return value


class MessagesRequest(CountTokensRequest):
    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = None
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # vLLM's extra sampling fields, as on the chat route.
    seed: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)

    # What the request span reads (`server.tracing`), by the chat request's names.
    n: ClassVar[int] = 1

    @property
    def requested_max_tokens(self) -> int:
        return self.max_tokens


def as_chat(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion that runs `body` (a count only renders it)."""
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body),
        "tools": [_chat_tool(tool) for tool in body.tools] or None,
        "tool_choice": _chat_tool_choice(body),
        "max_tokens": 1,
        "chat_template_kwargs": _template_kwargs(body),
    }
    if body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if body.messages[-1].role == "assistant":  # a prefill: the reply continues it
        fields |= {"add_generation_prompt": False, "continue_final_message": True}
    if isinstance(body, MessagesRequest):
        metadata = body.metadata
        fields |= {
            "max_tokens": body.max_tokens,
            "stop": body.stop_sequences,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
            "user": metadata.user_id if metadata is not None else None,
            "seed": body.seed,
            "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty,
            "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty,
            "min_tokens": body.min_tokens,
            "ignore_eos": body.ignore_eos,
            "stop_token_ids": body.stop_token_ids,
            "priority": body.priority,
            "timeout": body.timeout,
            "response_format": _chat_format(body.output_config),
            "reasoning_effort": _effort(body.output_config),
            "thinking_token_budget": _budget(body.thinking),
        }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # a field checked only as chat checks it (top_k, ...)
        first = exc.errors()[0]
        param = messages_param(".".join(str(part) for part in first.get("loc", ())) or None)
        raise InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param
        ) from None


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat messages: the system prompt first; a user turn's tool results
    as `tool` messages before its text; an assistant turn's calls as its `tool_calls` and its
    thinking as its reasoning."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system
        text = system if isinstance(system, str) else "".join(b.text for b in system)
        messages.append({"role": "system", "content": text})
    names: dict[str, str] = {}
    for message in body.messages:
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            messages.append(_assistant_turn(message.content, names))
        else:
            messages += _user_turn(message.content, names)
    return messages


def _assistant_turn(blocks: list[Any], names: dict[str, str]) -> dict[str, Any]:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    turn: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [block for block in blocks if isinstance(block, ToolUseBlock)]
    if calls:
        names.update((call.id, call.name) for call in calls)
        turn["content"] = text or None
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.input)},
            }
            for call in calls
        ]
    thinking = "".join(block.thinking for block in blocks if isinstance(block, ThinkingBlock))
    if thinking:
        turn["reasoning_content"] = thinking
    return turn


def _user_turn(blocks: list[Any], names: dict[str, str]) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            result: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": block.text,
            }
            if block.tool_use_id in names:
                result["name"] = names[block.tool_use_id]
            turns.append(result)
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    if any(isinstance(block, ImageBlock) for block in blocks):
        turns.append({"role": "user", "content": _parts(blocks)})
    elif text or not turns:
        turns.append({"role": "user", "content": text})
    return turns


def _parts(blocks: list[Any]) -> list[dict[str, Any]]:
    """A user turn's text and images, in order, as chat's content parts."""
    return [
        block.chat_part() if isinstance(block, ImageBlock) else {"type": "text", "text": block.text}
        for block in blocks
        if isinstance(block, (ImageBlock, TextBlock))
    ]


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": function}


def _template_kwargs(body: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` as the template variables thinking models read (Qwen3's `enable_thinking`,
    Granite's and DeepSeek's `thinking`): on where it is `enabled`, off where `disabled`, the
    template's own default where `adaptive` or absent. `chat_template_kwargs` override them."""
    kwargs: dict[str, Any] = {}
    if body.thinking is not None and body.thinking.type != "adaptive":
        on = body.thinking.type == "enabled"
        kwargs = {"enable_thinking": on, "thinking": on}
    if isinstance(body, MessagesRequest):
        kwargs |= body.chat_template_kwargs or {}
    return kwargs or None


def _budget(thinking: Thinking | None) -> int | None:
    """`thinking.budget_tokens` of enabled thinking, as chat's `thinking_token_budget`."""
    if thinking is None or thinking.type != "enabled":
        return None
    return thinking.budget_tokens


def _effort(config: OutputConfig | None) -> str | None:
    """`output_config.effort` as chat's `reasoning_effort` (Anthropic's `max` is its
    `xhigh`)."""
    if config is None or config.effort is None:
        return None
    return "xhigh" if config.effort == "max" else config.effort


def _chat_format(config: OutputConfig | None) -> dict[str, Any] | None:
    if config is None or config.format is None:
        return None
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": config.format.schema_},
    }


def _chat_tool_choice(body: CountTokensRequest) -> Any:
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name is None:
            raise InvalidRequestError(
                "tool_choice of type tool needs the tool's name.", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice.name}}
    if not body.tools and choice.type == "auto":
        return None
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# Chat's names for the fields a Messages request spells otherwise (an error names the field
# the client sent).
_CHAT_PARAMS = (
    ("stop", "stop_sequences"),
    ("tool_choice.function", "tool_choice"),
    ("max_completion_tokens", "max_tokens"),
    ("response_format.json_schema.schema", "output_config.format.schema"),
    ("response_format", "output_config.format"),
    ("reasoning_effort", "output_config.effort"),
)


def messages_param(param: str | None) -> str | None:
    """The Messages request's name for a chat request's field."""
    if param is None:
        return None
    if param.startswith("messages."):  # chat's messages are numbered otherwise
        return "messages"
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith(chat + "."):
            return ours + param[len(chat) :]
    if param.startswith("tools"):
        return param.replace(".function", "", 1).replace(".parameters", ".input_schema", 1)
    return param


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Every error the Messages routes return, in Anthropic's shape."""

    type: Literal["error"]
    error: AnthropicErrorDetail
