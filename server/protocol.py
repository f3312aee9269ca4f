"""OpenAI request bodies, with the extra sampling fields vLLM accepts. Unknown fields are ignored,
as vLLM does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.errors import InvalidRequestError


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
    items = value.items() if isinstance(value, dict) else (
        enumerate(value) if isinstance(value, list) else ())
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
            raise InvalidRequestError(f"'{where}' holds a lone surrogate, which is not valid "
                                      f"Unicode text.", param=where)
        return data


Prompt = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    timeout: float | None = Field(default=None, gt=0)

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Prompt) -> Prompt:
        if isinstance(value, str):
            pieces: list = [value]
        elif value and isinstance(value[0], list | str):
            pieces = list(value)
        else:
            pieces = [value]
        if not pieces or any(len(piece) == 0 for piece in pieces):
            raise ValueError("the prompt must not be empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
