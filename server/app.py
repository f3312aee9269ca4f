"""The FastAPI application factory: `build_app(engine, settings)`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.convertors import Convertor, register_url_convertor

from engine.core.errors import EngineDeadError, InvalidRequestError
from engine.core.paths import cache_dir
from engine.core.sampling_params import SamplingParams
from server.batches.files import FileStore
from server.batches.jobs import BatchStore
from server.batches.metrics import BatchMetrics
from server.batches.routes import batches_router, files_router
from server.batches.runner import BatchRunner
from server.batches.state import Lazy
from server.errors import APIError, install_error_handlers
from server.fleet_api import fleet_router
from server.generation_control import generation_control_router
from server.images import check_processor_kwargs
from server.invocations import INVOCATION_BODY, invocation_body, validated
from server.messages_protocol import CountTokensRequest, MessagesRequest
from server.metrics import EngineMetrics, HTTPMetrics, HTTPMetricsMiddleware, build_registry
from server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    RequestIdMiddleware,
    UnexpectedErrorMiddleware,
)
from server.openapi import (
    EMBEDDING,
    GENERATION,
    MESSAGES,
    anthropic_errors,
    document_errors_as_sent,
    errors,
)
from server.profiling_api import profiling_router
from server.protocol import (
    ChatCompletionRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    StreamOptions,
    TokenizeChatRequest,
    TokenizeRequest,
)
from server.response_store import ResponseStore
from server.responses_protocol import InputTokensRequest, ResponsesRequest
from server.score_protocol import RerankRequest, ScoreRequest
from server.serving import (
    EngineClient,
    ServedModel,
    new_id,
    prompt_ids,
    require_text_model,
    sampling_fields,
)
from server.serving_chat import ChatHandler
from server.serving_classify import ClassifyHandler
from server.serving_completions import CompletionHandler
from server.serving_embeddings import EmbeddingHandler
from server.serving_lora import lora_router
from server.serving_messages import MessagesHandler
from server.serving_responses import ResponsesHandler
from server.serving_score import ScoreHandler
from server.settings import ServerSettings
from server.sleep_api import sleep_router
from server.stats_log import StatsLog
from server.tokenization import encode_text, tokenizer_info
from server.tracing import Tracing, output_logging
from server.user_middleware import add_user_middleware
from server.version import conveyor_version
from server.weight_updates import weight_updates_router


class ResponseIdConvertor(Convertor[str]):
    """A stored response's id in a path: any segment but `input_tokens`, which is a route of
    its own (`POST /v1/responses/input_tokens`), not a response to get or delete."""

    regex = "(?!input_tokens$)[^/]+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("response_id", ResponseIdConvertor())

UPLOAD_ENVELOPE_BYTES = 1 << 20


def build_app(
    engine: EngineClient,
    settings: ServerSettings | None = None,
    registry: CollectorRegistry | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """An app serving `engine`, with its metrics on `registry` (a fresh one by default) and its
    request spans through `tracing` (by default, as `settings` say). The lifespan starts the
    engine loop and shuts it down."""
    settings = settings or ServerSettings()
    served = ServedModel(
        settings.served_model_name or engine.info.model_name,
        engine.info,
        engine.loras,
        settings.served_model_aliases,
    )
    _check_adapter_names(served)
    if settings.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = settings.chat_template
    check_processor_kwargs(engine.processor, settings.mm_processor_kwargs)
    if settings.enable_prompt_embeds and not engine.info.embeds_prompts:
        raise ValueError(
            "--enable-prompt-embeds: this model cannot take prompts as embeddings (Conveyor's "
            "text decoder on one device takes them; not Gemma's or Granite's, which scale them)"
        )
    registry = registry if registry is not None else build_registry()
    metrics = EngineMetrics(registry, served.name, engine.info, lambda: engine.sleep_level)
    engine.stat_loggers.append(metrics.record)
    tracing = tracing or Tracing.from_endpoint(
        settings.otlp_traces_endpoint, settings.log_requests, output_logging(settings)
    )
    if tracing.enabled:
        engine.stat_loggers.append(tracing.record)

    state_dir = settings.state_dir or cache_dir() / "state"
    files, jobs = Lazy(state_dir, FileStore), Lazy(state_dir, BatchStore)
    stored = ResponseStore()

    stats_log = StatsLog()
    if settings.log_stats_interval is not None:
        engine.stat_loggers.append(stats_log.record)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        runner.start()
        interval = settings.log_stats_interval
        lines = None if interval is None else asyncio.create_task(stats_log.run(interval))
        yield
        if lines is not None:
            lines.cancel()
        app.state.draining = True
        await runner.stop()
        await stored.close()  # background responses still running
        await engine.shutdown()
        tracing.shutdown()
        files.close()
        jobs.close()

    shown = settings.api_docs  # else no /openapi.json, /docs or /redoc
    app = FastAPI(
        title="Conveyor",
        version=conveyor_version(),
        lifespan=lifespan,
        openapi_url="/openapi.json" if shown else None,
        docs_url="/docs" if shown else None,
        redoc_url="/redoc" if shown else None,
    )
    app.state.engine = engine
    app.state.model = served
    app.state.settings = settings
    app.state.draining = False
    install_error_handlers(app)
    document_errors_as_sent(app)
    app.include_router(_openai_router(engine, served, settings, tracing, stored))
    app.include_router(_ops_router(engine, registry))
    app.include_router(fleet_router(engine, served))
    if settings.runtime_lora_updating:
        app.include_router(lora_router(engine, served))
    if settings.server_dev_mode:
        app.include_router(generation_control_router(engine))
        app.include_router(weight_updates_router(engine))
        app.include_router(sleep_router(engine))
    if engine.info.profiling:
        app.include_router(profiling_router(engine))
    runner = BatchRunner(app, files, jobs, settings.api_key)
    app.state.batches = runner
    BatchMetrics(registry, jobs, runner)
    app.include_router(files_router(files, settings.max_file_bytes))
    app.include_router(batches_router(files, jobs, runner))
    # Innermost: an unexpected error's 500 still passes the metrics and gets a request id.
    app.add_middleware(UnexpectedErrorMiddleware)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.allowed_origins),
            allow_methods=list(settings.cors.methods),
            allow_headers=list(settings.cors.headers),
            allow_credentials=settings.cors.credentials,
        )
    # Uploads stream to disk under their own limit (plus room for the multipart envelope).
    uploads = {"/v1/files": settings.max_file_bytes + UPLOAD_ENVELOPE_BYTES}
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes, streamed=uploads)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    # A deployment's own, outside the key check (it may check keys itself), inside the request
    # id and the HTTP metrics (what it answers is counted and carries an id).
    add_user_middleware(app, settings.middleware)
    app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(registry))
    app.add_middleware(RequestIdMiddleware)
    return app


def _check_adapter_names(served: ServedModel) -> None:
    """A LoRA adapter may not take a name of the base model's: requests naming it would never
    reach it."""
    adapters = served.loras.adapters if served.loras is not None else {}
    taken = sorted(set(served.names) & set(adapters))
    if taken:
        raise ValueError(f"the LoRA adapter {taken[0]!r} has the served model's name")


async def _accepting(request: Request) -> None:
    if request.app.state.draining:
        raise EngineDeadError("The server is shutting down.")


async def _generating(request: Request) -> None:
    """The generation routes need the generate runner."""
    if request.app.state.model.info.runner == "pooling":
        raise InvalidRequestError(
            "This server runs the model for embeddings (--runner pooling); use /v1/embeddings."
        )


GENERATING = [Depends(_accepting), Depends(_generating)]


def _server_defaults(
    body: CompletionRequest | ChatCompletionRequest, settings: ServerSettings
) -> None:
    """What the server gives every completion and chat request (vLLM's flags): a streamed
    request's usage last, logprobs naming tokens by their ids."""
    if settings.force_include_usage and body.stream:
        options = body.stream_options or StreamOptions()
        body.stream_options = options.model_copy(update={"include_usage": True})
    if settings.return_tokens_as_token_ids:
        body.return_tokens_as_token_ids = True


def _openai_router(
    engine: EngineClient,
    served: ServedModel,
    settings: ServerSettings,
    tracing: Tracing,
    stored: ResponseStore,
) -> APIRouter:
    router = APIRouter(responses=errors(401) if settings.api_key else None)
    completions = CompletionHandler(
        engine,
        served,
        settings.limits,
        settings.enable_prompt_embeds,
        settings.json_style,
        settings.per_request_metrics,
    )
    chat = ChatHandler(engine, served, settings)
    embeddings = EmbeddingHandler(engine, served, settings.limits)
    scores = ScoreHandler(embeddings)
    classify = ClassifyHandler(embeddings)
    responses = ResponsesHandler(engine, chat, stored)
    messages = MessagesHandler(engine, chat)

    @router.post("/v1/completions", dependencies=GENERATING, responses=GENERATION)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        _server_defaults(body, settings)
        return await tracing.traced("text_completion", served.name, body, request, completions)

    @router.post("/v1/chat/completions", dependencies=GENERATING, responses=GENERATION)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        _server_defaults(body, settings)
        return await tracing.traced("chat", served.name, body, request, chat)

    @router.post("/v1/responses", dependencies=GENERATING, responses=GENERATION)
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await tracing.traced("chat", served.name, body, request, responses)

    @router.post("/v1/responses/input_tokens", dependencies=GENERATING, responses=errors(400, 404))
    async def count_response_tokens(body: InputTokensRequest) -> dict[str, Any]:
        return await responses.count_input_tokens(body)

    @router.post("/v1/messages", dependencies=GENERATING, responses=MESSAGES)
    async def create_message(body: MessagesRequest, request: Request) -> Response:
        return await tracing.traced("chat", served.name, body, request, messages)

    @router.post(
        "/v1/messages/count_tokens", dependencies=GENERATING, responses=anthropic_errors(400, 404)
    )
    async def count_message_tokens(body: CountTokensRequest) -> dict[str, int]:
        return await messages.count_tokens(body)

    @router.post("/v1/embeddings", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    async def create_embedding(body: EmbeddingRequest, request: Request) -> Response:
        return await embeddings(body, request)

    # vLLM's score and rerank routes (and the older paths it also serves), for embedding models.
    @router.post("/v1/score", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    @router.post("/score", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    async def create_score(body: ScoreRequest, request: Request) -> Response:
        return await scores.score(body, request)

    @router.post("/v1/rerank", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    @router.post("/rerank", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    @router.post("/v2/rerank", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    async def create_rerank(body: RerankRequest, request: Request) -> Response:
        return await scores.rerank(body, request)

    # vLLM's classification route (SGLang serves it under /v1 too), for sequence classifiers.
    @router.post("/classify", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    @router.post("/v1/classify", dependencies=[Depends(_accepting)], responses=EMBEDDING)
    async def create_classification(body: ClassifyRequest, request: Request) -> Response:
        return await classify(body, request)

    # SageMaker's route, as vLLM serves it: one endpoint whose body says which API it is for.
    @router.post(
        "/invocations",
        dependencies=[Depends(_accepting)],
        responses=GENERATION,
        openapi_extra=INVOCATION_BODY,
    )
    async def invoke(request: Request) -> Response:
        body = await invocation_body(request)
        if "messages" in body:
            await _generating(request)
            return await create_chat_completion(validated(ChatCompletionRequest, body), request)
        if "prompt" in body or "prompt_embeds" in body:
            await _generating(request)
            return await create_completion(validated(CompletionRequest, body), request)
        if "input" in body and served.info.labels:
            return await create_classification(validated(ClassifyRequest, body), request)
        if "input" in body:
            return await create_embedding(validated(EmbeddingRequest, body), request)
        raise InvalidRequestError(
            "An invocation is a chat request (messages), a completion request (prompt or "
            "prompt_embeds) or an embedding request (input)."
        )

    @router.get(
        "/v1/responses/{response_id:response_id}", responses=errors(400, 404), response_model=None
    )
    async def get_response(
        response_id: str,
        stream: bool = False,
        starting_after: Annotated[int, Query(ge=-1)] = -1,
    ) -> dict[str, Any] | StreamingResponse:
        """The response; with `stream`, a background response's events after the one numbered
        `starting_after`, then each as it comes."""
        if stream:
            events = stored.events(response_id).follow(starting_after)
            return StreamingResponse(events, media_type="text/event-stream")
        return stored.get(response_id)

    @router.get("/v1/responses/{response_id}/input_items", responses=errors(400, 404))
    async def list_input_items(
        response_id: str,
        limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
        after: str | None = None,
    ) -> dict[str, Any]:
        return stored.input_items(response_id, limit, order, after)

    @router.post("/v1/responses/{response_id}/cancel", responses=errors(400, 404))
    async def cancel_response(response_id: str) -> dict[str, Any]:
        return await stored.cancel(response_id)

    @router.delete("/v1/responses/{response_id:response_id}", responses=errors(404))
    async def delete_response(response_id: str) -> dict[str, Any]:
        await stored.stop(response_id)  # a running background response is cancelled first
        stored.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    # vLLM's render routes: what the engine would run for a request, without running it. A
    # router that routes on prompt tokens (vllm-router's cache-aware policy, the inference
    # extension's precise prefix scorer) asks these first and /tokenize only on a 404.
    @router.post("/v1/completions/render", responses=errors(400, 404))
    async def render_completion(body: CompletionRequest) -> list[dict[str, Any]]:
        prompts, params, model = await completions.render(body)
        ids = prompt_ids(new_id("cmpl"), len(prompts))
        return [generate_request(i, p, params, model) for i, p in zip(ids, prompts, strict=True)]

    @router.post("/v1/chat/completions/render", responses=errors(400, 404))
    async def render_chat(body: ChatCompletionRequest) -> dict[str, Any]:
        prompt, params, model = await chat.render(body)
        return generate_request(new_id("chatcmpl"), prompt, params, model)

    def generate_request(
        request_id: str, tokens: list[int], params: SamplingParams, model: str
    ) -> dict:
        """What the engine would run, under `model` (the base model's name or an adapter's)."""
        return {
            "request_id": request_id,
            "token_ids": tokens,
            "sampling_params": sampling_fields(params),
            "model": model,
            "stream": False,
        }

    def model_cards() -> list[dict[str, Any]]:
        """The base model under each of its names, then each LoRA adapter served over it (its
        `parent`)."""
        root = served.info.model_path or served.name
        bases = [(name, root, None) for name in served.names]
        adapters = served.loras.adapters.values() if served.loras is not None else ()
        cards = [*bases, *((lora.name, lora.path, served.name) for lora in adapters)]
        return [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "conveyor",
                "root": root,
                "parent": parent,
                "max_model_len": served.info.max_model_len,
            }
            for name, root, parent in cards
        ]

    @router.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": model_cards()}

    # OpenAI's retrieve (`client.models.retrieve`); a hub id's slash stays in the path.
    @router.get("/v1/models/{model_id:path}", responses=errors(404))
    async def retrieve_model(model_id: str) -> dict[str, Any]:
        served.check(model_id)
        return next(card for card in model_cards() if card["id"] == model_id)

    @router.post("/tokenize", responses=errors(400, 404))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        served.check(body.model)
        tokenizer = require_text_model(engine)
        if isinstance(body, TokenizeChatRequest):
            conversation = ChatCompletionRequest(
                messages=body.messages,
                add_generation_prompt=body.add_generation_prompt,
                chat_template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
                documents=body.documents,
                add_special_tokens=body.add_special_tokens,
            )
            _, tokens, _ = await chat.templated(conversation, fits=False)
        else:
            tokens = encode_text(tokenizer, body.prompt, body.add_special_tokens)
        strings = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": served.info.max_model_len,
            "tokens": tokens,
            "token_strs": strings,
        }

    @router.post("/detokenize", responses=errors(400, 404))
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        served.check(body.model)
        tokenizer = require_text_model(engine)
        vocab = len(tokenizer)
        if any(token < 0 or token >= vocab for token in body.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    if settings.tokenizer_info_endpoint:

        @router.get("/tokenizer_info", responses=errors(400))
        async def get_tokenizer_info() -> dict[str, Any]:
            return tokenizer_info(require_text_model(engine))

    return router


def _ops_router(engine: EngineClient, registry: CollectorRegistry) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @router.get(
        "/health",
        responses={
            503: {"description": "The engine is not running, or the server is shutting down"}
        },
    )
    async def health(request: Request) -> Response:
        if engine.is_running and not request.app.state.draining:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    # SageMaker's health check, as vLLM serves it.
    @router.get("/ping", responses={503: {"description": "As /health"}})
    @router.post("/ping", responses={503: {"description": "As /health"}})
    async def ping(request: Request) -> Response:
        return await health(request)

    @router.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": conveyor_version()}

    return router
