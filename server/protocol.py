"""OpenAI request bodies, with the extra sampling fields vLLM accepts. Unknown fields are ignored,
as vLLM does."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import MAX_N
from server.middleware import MAX_REQUEST_ID, plain_request_id


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path of the first string in a parsed JSON body that holds a lone surrogate (JSON may
    carry `"\\ud800"`, which no UTF-8 tokenizer or response can hold), else None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else (enumerate(value) if isinstance(value, list) else ())
    )
    for key, item in items:
        found = lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class RequestBody(BaseModel):
    """A request body: text that is not valid Unicode is refused as it arrives."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = lone_surrogate_at(data)
        if where is not None:
            raise InvalidRequestError(
                f"'{where}' holds a lone surrogate, which is not valid Unicode text.", param=where
            )
        return data


def _whole_number(value: Any) -> Any:
    """JSON has one number type: 3.0 is the integer 3 (as JSON Schema counts it), while "3" and
    true stay refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer fields: whole numbers only, however JSON spells them (each constraint before the
# conversion, so that the schema shows it).
_WHOLE = BeforeValidator(_whole_number)
Int = Annotated[int, _WHOLE]
NonNegativeInt = Annotated[int, Field(ge=0), _WHOLE]
PositiveInt = Annotated[int, Field(ge=1), _WHOLE]
# Up to the engine's `--max-logprobs` (checked there, as vLLM does).
LogprobCount = Annotated[int, Field(ge=0), _WHOLE]
# vLLM's `truncate_prompt_tokens`: keep a prompt's last k tokens (-1: as many as fit).
TruncateTokens = Annotated[int, Field(ge=-1), _WHOLE]
Text = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[NonNegativeInt], Field(min_length=1)]
# A prompt and every piece of one is non-empty, as the schema says and the server checks.
Prompt = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | TokenIds
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class FormatModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class JsonSchemaFormat(FormatModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(FormatModel):
    """OpenAI's `response_format`, and vLLM's `structural_tag` type: a `format`, or
    `structures` and `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    at_least_one: bool | None = None


class StructuredOutputsFields(FormatModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    # How a JSON format is written (`server/json_style.py`); `disable_fallback` has nothing to
    # turn off (one backend compiles every format).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


def served_tier(asked: str | None) -> dict[str, str]:
    """The `service_tier` a reply names, where the request named one: flex, else default."""
    if asked is None:
        return {}
    return {"service_tier": "flex" if asked == "flex" else "default"}


# A value of `vllm_xargs`.
XArg = str | int | float


class SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: PositiveInt | None = None
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    n: Annotated[int, Field(ge=1, le=MAX_N), _WHOLE] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), lt=2**64), _WHOLE] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = (
        None
    )
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: Annotated[int, Field(ge=-1), _WHOLE] | None = None
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    allowed_token_ids: list[NonNegativeInt] | None = None
    bad_words: list[str] | None = None
    # Keep only the prompt's last k tokens (-1: as many as leave room for one new token).
    truncate_prompt_tokens: TruncateTokens | None = None
    return_tokens_as_token_ids: bool = False
    # vLLM's: the prompt's token ids and each choice's generated ones beside the text (streamed:
    # the prompt's in the first chunk, each chunk's new ones in it).
    return_token_ids: bool = False
    # vLLM's: only requests with the same salt share cached prefix blocks, so one tenant cannot
    # tell from response times what another sent.
    cache_salt: str | None = Field(default=None, min_length=1)
    # vLLM's: the response's id is `PREFIX-request_id` (the `X-Request-Id` header wins); plain,
    # as the header must be to be echoed, since it reaches the logs.
    request_id: str | None = Field(default=None, min_length=1)
    # vLLM's: the logprob of each prompt token and of its `prompt_logprobs` likeliest rivals.
    prompt_logprobs: LogprobCount | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the `n` best of a beam search instead of sampling (`server/beam_search.py`),
    # ranked by cumulative logprob over length to the power `length_penalty`.
    use_beam_search: bool = False
    length_penalty: float = Field(default=1.0, allow_inf_nan=False)
    priority: Int = 0
    timeout: float | None = Field(default=None, gt=0)
    # OpenAI's: "flex" runs the request in capacity no other request wants (as a batch line
    # runs), slower and cheaper; the others run as every request does.
    service_tier: ServiceTier | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    # vLLM's older names for the same formats, still sent by older clients.
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's: arguments for the server's logits processors (`--logits-processors`).
    vllm_xargs: dict[str, XArg | list[XArg]] | None = None

    @field_validator("request_id")
    @classmethod
    def _plain_request_id(cls, value: str | None) -> str | None:
        if value is not None and not plain_request_id(value.encode()):
            raise ValueError(
                f"must be at most {MAX_REQUEST_ID} letters, digits and '-_.:' (as X-Request-Id)"
            )
        return value

    @model_validator(mode="after")
    def _streaming_fields(self) -> SamplingFields:
        """As OpenAI and vLLM: stream_options that set anything belong to a streamed request,
        and prompt_logprobs to one that is not streamed."""
        options = self.stream_options
        if options is not None and options.model_fields_set and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true.", param="prompt_logprobs"
            )
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: every chunk carries the usage so far (with
        `include_usage`, as vLLM reads it)."""
        options = self.stream_options
        return self.include_usage and bool(options and options.continuous_usage_stats)

    @property
    def requested_max_tokens(self) -> int | None:
        """The most tokens the client asked for (None: as many as the context leaves)."""
        return self.max_tokens


# What `/v1/completions` generates when `max_tokens` is left out (OpenAI's and vLLM's default).
COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    # Required, unless the prompt comes as `prompt_embeds`.
    prompt: Prompt | None = None
    echo: bool = False
    logprobs: LogprobCount | None = None
    suffix: str | None = None
    # vLLM's: whether a text prompt gets the tokenizer's special tokens (a BOS).
    add_special_tokens: bool = True
    best_of: int | None = None
    # vLLM's: each prompt as its embedding rows, a base64 `torch.save` of a `[tokens, hidden]`
    # tensor (with --enable-prompt-embeds).
    prompt_embeds: str | list[str] | None = None

    @model_validator(mode="after")
    def _a_prompt(self) -> CompletionRequest:
        if self.prompt is None and self.prompt_embeds is None:
            raise InvalidRequestError("prompt is required.", param="prompt")
        if self.prompt is not None and self.prompt_embeds is not None:
            raise InvalidRequestError(
                "Give the prompt as prompt or as prompt_embeds, not both.", param="prompt_embeds"
            )
        if self.prompt_embeds is not None and not all(self.embedded_prompts or [""]):
            raise InvalidRequestError("prompt_embeds must not be empty.", param="prompt_embeds")
        return self

    @property
    def embedded_prompts(self) -> list[str]:
        """Each prompt's `prompt_embeds` (none where the prompts come as text or tokens)."""
        embeds = self.prompt_embeds
        return [embeds] if isinstance(embeds, str) else list(embeds or ())

    @property
    def requested_max_tokens(self) -> int | None:
        """16 where `max_tokens` is left out, as OpenAI's completions and vLLM's (an explicit
        null: as many as the context leaves)."""
        if "max_tokens" not in self.model_fields_set:
            return COMPLETION_MAX_TOKENS
        return self.max_tokens

    # Before the union's own checks, which would report an empty prompt as whichever member
    # failed last ("Input should be a valid string").
    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        return prompt_not_empty(value)


def prompt_not_empty(value: Any) -> Any:
    """A prompt (or embedding input) in any of its four forms, refused if it or a piece of it
    is empty."""
    if isinstance(value, str):
        pieces: list = [value]
    elif isinstance(value, list) and value and isinstance(value[0], list | str):
        pieces = list(value)
    elif isinstance(value, list):
        pieces = [value]
    else:
        return value
    if not pieces or any(isinstance(p, str | list) and len(p) == 0 for p in pieces):
        raise ValueError("the prompt must not be empty")
    return value


class PooledRequest(RequestBody):
    """The inputs of a request the pooling runner answers (embeddings, classifications), with
    vLLM's fields for them."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    input: Prompt
    user: str | None = None
    # vLLM's: keep the prompt's last k tokens, add a BOS and such.
    truncate_prompt_tokens: TruncateTokens | None = None
    add_special_tokens: bool = True
    priority: Int = 0
    timeout: float | None = Field(default=None, gt=0)

    @field_validator("input", mode="before")
    @classmethod
    def _input_not_empty(cls, value: Any) -> Any:
        return prompt_not_empty(value)


class EmbeddingRequest(PooledRequest):
    """OpenAI's embeddings request, with vLLM's extra fields."""

    encoding_format: Literal["float", "base64"] = "float"
    # Keep the first k numbers, normalized again (as OpenAI's text-embedding-3 models).
    dimensions: PositiveInt | None = None
    # vLLM's: L2-normalize the vector.
    normalize: bool = True


class ClassifyRequest(PooledRequest):
    """vLLM's classification request (`/classify`): inputs for a sequence classifier."""


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class PredictedContent(BaseModel):
    """OpenAI's Predicted Outputs: the reply as the client expects it (`prediction`)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # A `data:image/...;base64,` URL, or an http(s) URL the server fetches.
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(BaseModel):
    """An image in a message, read by an image-text model (OpenAI's `image_url` part)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made, as a client sends it back in the next turn."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant turn's reasoning, as this server returns it (or by DeepSeek's name).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        """As OpenAI: every message has content, except an assistant's that makes calls."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role != "user" and self.image_urls:
            raise ValueError(f"images go in user messages, not in a {self.role} message")
        return self

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's images, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class AllowedTool(BaseModel):
    """A function `allowed_tools` lets the reply call: `{"type": "function", "function":
    {"name": ...}}` as chat names it (the Responses API's `{"type": "function", "name": ...}`
    arrives in this shape)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    mode: Literal["auto", "required"]
    tools: list[AllowedTool] = Field(min_length=1)


class AllowedToolsChoice(BaseModel):
    """OpenAI's `allowed_tools`: the reply may call (`auto`) or must call (`required`) only
    these of the request's tools, while the template still shows them all."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: (
        Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None
    ) = None
    parallel_tool_calls: bool = True
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: LogprobCount | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: a reply that continues the last message (its role's) starts with that message.
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents for a template that grounds its answer in them (Command R's, Granite's),
    # each a mapping of strings such as {"title": ..., "text": ...}.
    documents: list[dict[str, str]] | None = None
    # vLLM's: at most this many reasoning tokens, after which the thought is closed for it.
    thinking_token_budget: NonNegativeInt | None = None
    # OpenAI's: how hard a reasoning model thinks, handed to the template as
    # `reasoning_effort` (gpt-oss's templates read it; others ignore it).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # vLLM's: the tokenizer's special tokens on top of what the template writes.
    add_special_tokens: bool = False
    # With a reasoning parser: whether the reply's reasoning is returned at all.
    include_reasoning: bool = True
    # vLLM's: the request's own chat template (with --trust-request-chat-template).
    chat_template: str | None = None
    # vLLM's per-request processor arguments: refused, the server sets them
    # (`--mm-processor-kwargs`), since one request's could make its images any size.
    mm_processor_kwargs: dict[str, Any] | None = None
    # OpenAI's Predicted Outputs: the expected reply, which the steps draft from.
    prediction: PredictedContent | None = None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The template's extra variables: `chat_template_kwargs`, and `reasoning_effort`
        unless they set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens`, OpenAI's newer name, before `max_tokens`."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """The field `requested_max_tokens` comes from."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class TokenizeCompletionRequest(RequestBody):
    """`/tokenize` of a plain prompt."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    # vLLM's: each token's string as the tokenizer writes it, beside its id.
    return_token_strs: bool = False


class TokenizeChatRequest(RequestBody):
    """`/tokenize` of messages, rendered through the chat template first."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    documents: list[dict[str, str]] | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False


# vLLM's two forms of a /tokenize body: a prompt, or messages.
TokenizeRequest = TokenizeChatRequest | TokenizeCompletionRequest


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[NonNegativeInt]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error the server returns, in OpenAI's shape."""

    error: ErrorDetail
