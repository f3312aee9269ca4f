"""What completions and chat share: model checks, sampling settings, submitting prompts."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.async_engine import RequestOptions
from engine.core.config import ServingInfo
from engine.core.errors import InvalidRequestError, PromptTooLongError, RequestTimeoutError
from engine.core.images import ImageInputs
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.core.stats import StepStats
from engine.lora.registry import LoRARegistry, LoRARequest
from server.errors import APIError
from server.json_style import PLAIN, JsonStyle
from server.protocol import SamplingFields
from server.streaming import CLIENT_GONE, DONE, merge, sse, sse_error, unless_disconnected
from server.structured import structured_outputs
from server.tokenization import require_tokenizer
from server.tracing import RequestTrace, request_trace


class EngineClient(Protocol):
    """What the server needs from an engine; `engine.core.async_engine.AsyncEngine` provides it."""

    info: ServingInfo
    stat_loggers: list[Callable[[StepStats], None]]

    @property
    def tokenizer(self) -> Any: ...

    @property
    def processor(self) -> Any: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def num_unfinished(self) -> int: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        options: RequestOptions = ...,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def abort_requests(self, request_ids: list[str] | None = None) -> list[str]: ...

    @property
    def is_paused(self) -> bool: ...

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None: ...

    async def resume(self) -> None: ...

    weight_version: str | None

    @property
    def is_sleeping(self) -> bool: ...

    @property
    def sleep_level(self) -> int: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: tuple[str, ...] | None = None) -> None: ...

    async def reload_weights(self, path: str, version: str | None = None) -> None: ...

    async def prepare(self, params: SamplingParams) -> None: ...

    async def reset_prefix_cache(self) -> int: ...

    async def start_profile(self) -> None: ...

    async def stop_profile(self) -> list[str]: ...

    @property
    def loras(self) -> LoRARegistry | None: ...

    async def add_lora(self, name: str, path: str) -> LoRARequest: ...

    def remove_lora(self, name: str) -> LoRARequest | None: ...


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The base model by its served name, and the LoRA adapters served over it (`loras`, as
    the engine keeps them: loaded and removed while serving)."""

    name: str
    info: ServingInfo
    loras: LoRARegistry | None = None
    # More names a request may give for the base model.
    aliases: tuple[str, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        """Every name the base model answers to, the one replies give first."""
        return (self.name, *self.aliases)

    def check(self, requested: str | None) -> None:
        self.resolve(requested)

    def resolve(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no name)."""
        if requested is None or requested in self.names:
            return None
        lora = self.loras.get(requested) if self.loras is not None else None
        if lora is None:
            raise APIError(
                404,
                f"The model `{requested}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return lora

    def name_for(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter's, where the request ran one."""
        return self.name if lora is None else lora.name


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(prefix: str, request: Request, given: str | None) -> tuple[str, str]:
    """The id a response shows and the engine's id for the request. As vLLM: the response's id
    is `PREFIX-` and the client's `X-Request-Id` (a plain token, as `RequestIdMiddleware`
    echoes it), else the body's `request_id`, else a fresh one; a client's id may come twice,
    so the engine's then has a suffix of its own."""
    header = request.headers.get("x-request-id")
    echoed = getattr(request.state, "request_id", None)
    base = header if header is not None and header == echoed else given
    if base is None:
        fresh = new_id(prefix)
        return fresh, fresh
    shown = f"{prefix}-{base}"
    return shown, f"{shown}-{uuid.uuid4().hex[:8]}"


def now() -> int:
    return int(time.time())


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    if not raw:
        return None
    try:
        return {int(token): float(bias) for token, bias in raw.items()}
    except ValueError:
        raise InvalidRequestError(
            "logit_bias keys must be token ids.", param="logit_bias"
        ) from None


def sampling_params(
    request: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    defaults: Mapping[str, float] | None = None,
    json_style: JsonStyle = PLAIN,
) -> SamplingParams:
    """For fields left out, the model's `defaults` (its generation config's, as vLLM applies
    them), else OpenAI's (temperature 1, top_p 1, no penalties, up to the context's end); an
    output format's JSON written in the server's `json_style`."""
    model = defaults or {}

    def pick(value: float | None, name: str, default: float) -> float:
        return model.get(name, default) if value is None else value

    return SamplingParams(
        n=request.n,
        max_tokens=max_tokens if max_tokens is not None else _whole(model.get("max_tokens")),
        min_tokens=request.min_tokens,
        temperature=pick(request.temperature, "temperature", 1.0),
        top_p=pick(request.top_p, "top_p", 1.0),
        top_k=int(pick(request.top_k, "top_k", 0)),
        min_p=pick(request.min_p, "min_p", 0.0),
        repetition_penalty=pick(request.repetition_penalty, "repetition_penalty", 1.0),
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        logit_bias=logit_bias(request.logit_bias),
        seed=request.seed,
        stop=request.stop_strings,
        stop_token_ids=tuple(request.stop_token_ids or ()),
        allowed_token_ids=(  # each id once, however often the list repeats it
            None
            if request.allowed_token_ids is None
            else tuple(dict.fromkeys(request.allowed_token_ids))
        ),
        bad_words=tuple(request.bad_words or ()),
        ignore_eos=request.ignore_eos,
        include_stop_str_in_output=request.include_stop_str_in_output,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=request.skip_special_tokens,
        structured=structured_outputs(request, json_style),
        extra_args=request.vllm_xargs,
    )


def _whole(value: float | None) -> int | None:
    return None if value is None else int(value)


def prompt_truncation(request: SamplingFields, max_model_len: int) -> int | None:
    """How many of each prompt's last tokens `truncate_prompt_tokens` keeps (None: all); -1
    keeps as many as leave room for the output asked for (at least one token of each)."""
    if request.truncate_prompt_tokens == -1:
        return max(max_model_len - max(request.requested_max_tokens or 1, 1), 1)
    return kept_tokens(request.truncate_prompt_tokens, max_model_len)


def kept_tokens(keep: int | None, max_model_len: int) -> int | None:
    """How many of a prompt's last tokens a `truncate_prompt_tokens` of `keep` keeps."""
    if keep is None:
        return None
    if keep == -1:
        return max_model_len - 1
    if not 1 <= keep <= max_model_len:
        raise InvalidRequestError(
            f"truncate_prompt_tokens must be -1 or between 1 and the model's context "
            f"({max_model_len}), got {keep}.",
            param="truncate_prompt_tokens",
        )
    return keep


def check_output_room(
    prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str, where: str
) -> None:
    """Refuse a request whose prompt and asked-for output (`max_tokens` as the client gave it)
    do not fit the context together, as OpenAI and vLLM do, rather than cut its output short.
    A prompt that leaves no room at all is the prompt check's to report."""
    if max_tokens is None or prompt_tokens >= max_model_len:
        return
    if prompt_tokens + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, "
            f"{max_tokens} in the completion). Please reduce the length of the {where} or "
            f"completion.",
            param=param,
        )


# Sent by the batch runner: the request is a batch line, run only in capacity live ones leave.
BACKGROUND_HEADER = "x-conveyor-background"


# The sampling parameters a render route hands back, by vLLM's names.
RENDERED_FIELDS = (
    "n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "stop_token_ids", "ignore_eos", "include_stop_str_in_output", "logprobs", "prompt_logprobs",
    "skip_special_tokens",
)  # fmt: skip


def sampling_fields(params: SamplingParams) -> dict[str, Any]:
    """The plain fields of `params` as JSON (logit bias keyed by token id, as text)."""
    fields: dict[str, Any] = {name: getattr(params, name) for name in RENDERED_FIELDS}
    fields["stop"], fields["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    if params.bad_words:
        fields["bad_words"] = list(params.bad_words)
    if params.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    if params.allowed_token_ids is not None:
        fields["allowed_token_ids"] = list(params.allowed_token_ids)
    return fields


def request_options(
    body: SamplingFields,
    request: Request | None = None,
    lora: LoRARequest | None = None,
    images: ImageInputs | None = None,
) -> RequestOptions:
    asked = request is not None and request.headers.get(BACKGROUND_HEADER) == "1"
    background = asked or body.service_tier == "flex"
    return RequestOptions(
        priority=body.priority,
        timeout=body.timeout,
        background=background,
        lora=lora,
        images=images,
        cache_salt=body.cache_salt,
    )


def bind_trace(request: Request, request_id: str, response_id: str | None = None) -> None:
    """Give the request's span (if it is traced) the engine's id for it and its response's."""
    trace = request_trace(request)
    if trace is not None:
        trace.bind(request_id, response_id)


def prompt_ids(request_id: str, count: int) -> list[str]:
    """The engine's id for each prompt of a request: the request's own for one prompt."""
    return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]


def submit_all(
    engine: EngineClient,
    prompts: list[list[int]],
    params: SamplingParams,
    request_id: str,
    options: RequestOptions,
    rows: list[ImageInputs] | None = None,
) -> list[AsyncGenerator[RequestOutput, None]]:
    """Queue every prompt, or none: a refusal aborts the ones already queued. `rows`: each
    prompt's own embedding rows, for prompts given as embeddings."""
    streams: list[AsyncGenerator[RequestOutput, None]] = []
    ids = prompt_ids(request_id, len(prompts))
    try:
        for index, (prompt, sub_id) in enumerate(zip(prompts, ids, strict=True)):
            own = options if rows is None else replace(options, images=rows[index])
            streams.append(engine.submit(prompt, params, sub_id, own))
    except BaseException:
        for sub_id in ids[: len(streams)]:
            engine.abort(sub_id)
        raise
    return streams


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def require_text_model(engine: EngineClient) -> Any:
    return require_tokenizer(engine.tokenizer)


class Renderer(Protocol):
    """Turns engine deltas into one endpoint's JSON: streaming fragments and the final body."""

    include_usage: bool

    def update(self, source: int, output: RequestOutput) -> list[dict[str, Any]]: ...

    def usage(self) -> dict[str, Any]: ...

    def finish_reasons(self) -> list[str]: ...

    def texts(self) -> list[str]: ...

    def chunk(self, choices: list[dict[str, Any]], with_usage: bool = False) -> dict[str, Any]: ...

    def event(self, choices: list[dict[str, Any]]) -> str: ...

    def response(self) -> dict[str, Any]: ...


Streams = list[AsyncGenerator[RequestOutput, None]]


async def respond(renderer: Renderer, streams: Streams, stream: bool, request: Request) -> Response:
    """Stream server-sent events, or wait for the whole answer, unless the client leaves.

    A stream starts only with the first delta, so an error before it (the deadline passed in
    the queue, say) still gets its own HTTP status."""
    merged = merge(streams)
    trace = request_trace(request)
    if not stream:
        result = await unless_disconnected(request, _collect(renderer, merged))
        if result is None:
            return Response(status_code=CLIENT_GONE)
        if trace is not None:
            trace.output(renderer)
        return JSONResponse(result)
    first = await unless_disconnected(request, anext(merged))
    if first is None:
        await merged.aclose()
        return Response(status_code=CLIENT_GONE)
    events = _events(renderer, first, merged, trace)
    return EventStream(events, merged, trace)


class EventStream(StreamingResponse):
    """Server-sent events whose request ends with the response, whatever happens to it. The
    events' own cleanup runs only once they have started; a client gone before the first write
    leaves them unstarted, and their request would run on unread until the garbage collector
    came by (at once, or not while a traceback held them)."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        merged: AsyncGenerator[tuple[int, RequestOutput], None],
        trace: RequestTrace | None,
    ) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events, self._merged, self._trace = events, merged, trace

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            await self._merged.aclose()  # aborts what is still running
            if self._trace is not None:
                self._trace.end(CLIENT_GONE)  # unless the events ended it already


async def _collect(
    renderer: Renderer, merged: AsyncIterator[tuple[int, RequestOutput]]
) -> dict[str, Any]:
    async for source, output in merged:
        renderer.update(source, output)
    return renderer.response()


async def _events(
    renderer: Renderer,
    first: tuple[int, RequestOutput],
    merged: AsyncGenerator[tuple[int, RequestOutput], None],
    trace: RequestTrace | None = None,
) -> AsyncGenerator[str, None]:
    timed_out = completed = False
    try:
        source, output = first
        while True:
            timed_out = timed_out or output.finish_reason == "timeout"
            for fragment in renderer.update(source, output):
                yield renderer.event([fragment])
            try:
                source, output = await anext(merged)
            except StopAsyncIteration:
                break
        if renderer.include_usage:
            yield sse(renderer.chunk([], with_usage=True))
        if timed_out:
            yield sse_error(
                RequestTimeoutError("The request's deadline passed; the answer above is cut short.")
            )
        if trace is not None:
            trace.output(renderer)
        completed = True
    except Exception as exc:
        if trace is not None:
            trace.fail(exc)
        completed = True
        yield sse_error(exc)
    finally:
        await merged.aclose()
        if trace is not None:  # a client gone mid-stream closes this generator early
            trace.end(None if completed else CLIENT_GONE)
    yield DONE
