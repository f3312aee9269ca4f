"""OpenAI's Responses API request (`POST /v1/responses`), and the chat request it runs as.

A Responses request is a conversation of typed items: messages, the function calls an earlier
reply made and their outputs, earlier reasoning. Conveyor runs it as the chat completion those
items spell (`as_chat`): instructions as the system message, function calls as an assistant
turn's `tool_calls`, their outputs as `tool` messages, function tools and formats in chat's
shape, images (by URL, for an image-text model) as chat's image parts. Unknown fields are
ignored, as elsewhere; item and tool types this server cannot run (files, hosted tools) are
refused by name.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.core.errors import InvalidRequestError
from server.protocol import (
    ChatCompletionRequest,
    LogprobCount,
    NonNegativeInt,
    PositiveInt,
    RequestBody,
    ServiceTier,
)

_STRICT = ConfigDict(extra="ignore", strict=True)


class ContentPart(BaseModel):
    """Text in a message: `input_text` from the user side, `output_text` of an earlier reply."""

    model_config = _STRICT

    type: Literal["input_text", "output_text", "text"]
    text: str


class ImagePart(BaseModel):
    """An image in a user message, for an image-text model: a data or http(s) URL."""

    model_config = _STRICT

    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class MessageItem(BaseModel):
    model_config = _STRICT

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[ContentPart | ImagePart, Field(discriminator="type")]]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, ContentPart))

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The content as chat's: its text, or where it holds images, chat's parts in order."""
        if isinstance(self.content, str) or not any(
            isinstance(part, ImagePart) for part in self.content
        ):
            return self.text
        return [
            {"type": "image_url", "image_url": {"url": part.image_url}}
            if isinstance(part, ImagePart)
            else {"type": "text", "text": part.text}
            for part in self.content
        ]


class FunctionCallItem(BaseModel):
    """A call an earlier reply made, sent back with the conversation."""

    model_config = _STRICT

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = _STRICT

    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningText(BaseModel):
    model_config = _STRICT

    type: str
    text: str


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning: goes back to the template with the turn that follows."""

    model_config = _STRICT

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(discriminator="type"),
]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
LOGPROBS = "message.output_text.logprobs"
UNSUPPORTED = {
    "conversation": "continue a conversation with previous_response_id",
    "prompt": "send the prompt's text as instructions and input",
}


class FunctionTool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    name: str


class AllowedTools(BaseModel):
    """`{"type": "allowed_tools", "mode", "tools": [{"type": "function", "name"}]}`."""

    model_config = _STRICT

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunction] = Field(min_length=1)


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON that follows a schema."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = _STRICT

    format: TextFormat = TextFormat(type="text")


class ResponsesRequest(RequestBody):
    model_config = _STRICT

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | AllowedTools = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = TextConfig()
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # "message.output_text.logprobs" returns each output token's logprob (with `top_logprobs`
    # rivals); other inclusions name what this server does not make, and are ignored.
    include: list[str] | None = None
    top_logprobs: LogprobCount | None = None
    # vLLM's extra sampling fields, as on the chat route.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_tokens: NonNegativeInt = 0
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)
    service_tier: ServiceTier | None = None

    # What the request span reads (`server.tracing`), by the chat request's names.
    n: ClassVar[int] = 1

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS in (self.include or ()) or self.top_logprobs is not None

    @model_validator(mode="before")
    @classmethod
    def _no_server_state(cls, data: Any) -> Any:
        """Fields that point at state kept elsewhere (OpenAI's conversations and stored prompts)
        would be ignored as unknown: the reply would lose that context, so they are refused."""
        for name, instead in UNSUPPORTED.items():
            if isinstance(data, dict) and data.get(name) is not None:
                raise InvalidRequestError(
                    f"{name} is not supported by this server; {instead}.", param=name
                )
        return data

    @field_validator("input", mode="before")
    @classmethod
    def _typed_items(cls, value: Any) -> Any:
        """A message may leave out its type; a type this server cannot run is named."""
        if not isinstance(value, list):
            return value
        if not value:
            raise ValueError("input must not be empty")
        items = []
        for index, item in enumerate(value):
            if isinstance(item, dict) and "type" not in item and "role" in item:
                item = {**item, "type": "message"}
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and kind not in ITEM_TYPES:
                raise InvalidRequestError(
                    f"input items of type '{kind}' are not supported; this server takes "
                    f"{', '.join(ITEM_TYPES)}.",
                    param=f"input.{index}.type",
                )
            items.append(_text_parts_only(item, index))
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any) -> Any:
        for index, tool in enumerate(value if isinstance(value, list) else []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise InvalidRequestError(
                    f"tools of type '{kind}' are not supported; only function tools are.",
                    param=f"tools.{index}.type",
                )
        return value


class InputTokensRequest(ResponsesRequest):
    """What `POST /v1/responses/input_tokens` reads: a response request's conversation, its
    instructions and tools. `input` may be left out where earlier turns (by
    `previous_response_id`) or the instructions alone make the conversation."""

    # Wider than a response's own `input`, which is required.
    input: str | list[InputItem] | None = None  # type: ignore[assignment]


def _text_parts_only(item: Any, index: int) -> Any:
    """A message's parts must be text or images (by URL): files and audio are not read."""
    is_message = isinstance(item, dict) and item.get("type") == "message"
    content = item.get("content") if is_message else None
    for number, part in enumerate(content if isinstance(content, list) else []):
        kind = part.get("type") if isinstance(part, dict) else None
        if isinstance(kind, str) and kind not in READ_PARTS:
            raise InvalidRequestError(
                f"content parts of type '{kind}' are not supported; this server reads "
                f"{', '.join(READ_PARTS)}.",
                param=f"input.{index}.content.{number}.type",
            )
        if kind == "input_image" and not part.get("image_url"):
            raise InvalidRequestError(
                "an input_image needs an image_url (images by file_id are not read).",
                param=f"input.{index}.content.{number}.image_url",
            )
    return item


READ_PARTS = ("input_text", "output_text", "text", "input_image")


def as_chat(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion that runs `body` over the conversation `messages`
    (`chat_messages`)."""
    fields = {
        "model": body.model,
        "messages": messages,
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [_chat_tool(tool) for tool in body.tools] or None,
        "tool_choice": _chat_tool_choice(body),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _chat_format(body.text.format),
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs if body.wants_logprobs else None,
        "stream": body.stream,
        "user": body.user,
        "seed": body.seed,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "repetition_penalty": body.repetition_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "min_tokens": body.min_tokens,
        "priority": body.priority,
        "timeout": body.timeout,
        "service_tier": body.service_tier,
        "reasoning_effort": (body.reasoning or {}).get("effort"),
    }
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # a field checked only as chat checks it (top_k, ...)
        first = exc.errors()[0]
        param = responses_param(".".join(str(part) for part in first.get("loc", ())) or None)
        raise InvalidRequestError(
            f"Invalid value for '{param}': {first.get('msg', 'invalid')}.", param=param
        ) from None


def chat_messages(body: ResponsesRequest, history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation as chat messages: the instructions first (they apply to this turn
    only), then the earlier turns, then this request's input."""
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    turn = input_messages(body.input) if body.input is not None else []
    return messages + history + turn


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function calls join one assistant turn (the
    assistant text before them too), reasoning rides on the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    reasoning = ""
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning += item.text
            continue
        message: dict[str, Any]
        if isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            messages.append(message)
            continue
        if isinstance(item, FunctionCallItem):
            names[item.call_id] = item.name
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not reasoning:
                last.setdefault("tool_calls", []).append(call)
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            message = {"role": item.role, "content": item.chat_content()}
        if reasoning and message["role"] == "assistant":
            message["reasoning_content"], reasoning = reasoning, ""
        messages.append(message)
    return messages


ITEM_ID_PREFIXES = {
    "message": "msg",
    "function_call": "fc",
    "function_call_output": "fco",
    "reasoning": "rs",
}


def listed_items(items: str | list[Any]) -> list[dict[str, Any]]:
    """The input as OpenAI lists it back: typed items, each with an id (one made where the
    client gave none), a message's text as `input_text` parts."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    listed = []
    for item in items:
        entry = item.model_dump(by_alias=True, exclude_none=True)
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            entry["content"] = [{"type": "input_text", "text": item.content}]
        entry.setdefault("id", f"{ITEM_ID_PREFIXES[item.type]}_{uuid.uuid4().hex}")
        listed.append(entry)
    return listed


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    """The tool as chat takes it: strict unless it says otherwise, as the Responses API's
    functions are (chat's are not)."""
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    function.setdefault("strict", True)
    return {"type": "function", "function": function}


def _chat_tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if not body.tools and choice == "auto":  # the default, whether tools came or not
        return None
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, AllowedTools):
        tools = [{"type": "function", "function": {"name": tool.name}} for tool in choice.tools]
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": tools}}
    return choice


def _chat_format(text_format: TextFormat) -> dict[str, Any] | None:
    if text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return {"type": "json_object"}
    if text_format.schema_ is None:
        raise InvalidRequestError(
            "text.format of type json_schema needs a schema.", param="text.format.schema"
        )
    schema = {"name": text_format.name or "response", "schema": text_format.schema_}
    if text_format.strict is not None:
        schema["strict"] = text_format.strict
    return {"type": "json_schema", "json_schema": schema}


# Chat's names for the fields a Responses request spells otherwise (an error names the field
# the client sent).
_CHAT_PARAMS = (
    ("messages", "input"),
    ("prompt", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("tool_choice.function", "tool_choice"),
    ("reasoning_effort", "reasoning.effort"),
)


def responses_param(param: str | None) -> str | None:
    """The Responses request's name for a chat request's field (`messages.3` is in `input`)."""
    if param is None:
        return None
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith(chat + "."):
            return ours if chat == "messages" else ours + param[len(chat) :]
    if param.startswith("tools"):
        return param.replace(".function", "", 1)
    return param
