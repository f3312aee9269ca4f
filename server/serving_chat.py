"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams, ThoughtBudget
from engine.lora.registry import LoRARequest
from server import beam_search
from server.call_array import CallArrayReader
from server.call_readers import CallReader
from server.content_format import content_format
from server.harmony import FINAL, HarmonyReader, is_harmony, split_harmony
from server.harmony import PARSER as HARMONY
from server.harmony import REASONING_PARSER as HARMONY_REASONING
from server.images import image_urls, load_images, processed_prompt, processor_arguments
from server.limits import check_chat
from server.logprobs import chat_logprobs, prompt_logprobs
from server.protocol import ChatCompletionRequest, served_tier
from server.reasoning import (
    THINK,
    ThinkReader,
    ThoughtTags,
    opens_in_reasoning,
    split_reasoning,
    tags_for,
)
from server.rendering import ChoiceState, ChunkRenderer
from server.request_metrics import MetricsReport
from server.serving import (
    EngineClient,
    ServedModel,
    bind_trace,
    check_output_room,
    prompt_truncation,
    request_ids,
    request_options,
    require_text_model,
    respond,
    sampling_params,
    usage,
)
from server.settings import ServerSettings
from server.streaming import sse
from server.strict_tools import strict_calls_format
from server.structured import thought_first
from server.tokenization import (
    TokenText,
    call_arguments_among,
    chat_prompt,
    check_fits,
    message_text,
    messages_size,
    off_the_loop_if_large,
    prediction_tokens,
)
from server.tool_parsers import keeps_special_tokens, parse_calls, parser_for, reader_for
from server.tool_prompt import WRITTEN_TOOLS_PARSER, renders_tools
from server.tools import (
    ForcedCalls,
    check_tools,
    forced_calls,
    template_tools,
    tool_call,
    tool_schemas,
)


@dataclass(slots=True)
class _Choice(ChoiceState):
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    # The id of the named call being streamed (tool_choice naming a function).
    call_id: str | None = None
    # Reads calls out of the text as it streams (tool_choice "auto" with a parser).
    reader: CallReader | None = None
    num_calls: int = 0
    # Reads the calls of a required tool_choice as they stream.
    calls_reader: CallArrayReader = field(default_factory=CallArrayReader)
    # Splits reasoning from the answer as the text streams (`--reasoning-parser`).
    thinker: ThinkReader | None = None
    # Splits a Harmony reply (gpt-oss) into reasoning, content and calls as it streams.
    harmony: HarmonyReader | None = None


@dataclass(frozen=True, slots=True)
class PreparedChat:
    """A chat request as the engine runs it, and what reads its reply back."""

    prompt: list[int]
    params: SamplingParams
    forced: ForcedCalls | None
    # The tool-call parser of a `tool_choice: auto` request with tools (None otherwise;
    # `openai` for every request to a model that writes Harmony's messages).
    parser: str | None
    # None where no reasoning is split off, else whether the reply starts inside it.
    thinking: bool | None
    # The LoRA adapter the request's `model` names (None: the base model).
    lora: LoRARequest | None = None
    # The prompt's images (for an image-text model), placeholders expanded in `prompt`.
    images: ImageInputs | None = None


class ChatRenderer(ChunkRenderer):
    """Accumulates engine deltas into chat choices and `chat.completion.chunk` events."""

    object_name = "chat.completion.chunk"

    def __init__(
        self,
        request_id: str,
        model: str,
        body: ChatCompletionRequest,
        prompt: list[int],
        tokenizer: Any,
        forced: ForcedCalls | None = None,
        parser: str | None = None,
        thinking: bool | None = None,
        role: str = "assistant",
        thought: ThoughtTags = THINK,
    ) -> None:
        """`thinking`: None where the reply has no reasoning to split off, else whether it
        starts inside it (`server.reasoning`). `role`: the reply message's role."""
        super().__init__(request_id, model, body.include_usage, body.continuous_usage)
        self.tier = served_tier(body.service_tier)
        self.body = body
        self.role = role
        self.forced = forced
        self.parser = parser
        self.thinking = thinking
        self.thought = thought
        # vLLM's `echo`: the last message's text, where the reply continues it (its role's).
        last = body.messages[-1]
        self.echoed = message_text(last) if body.echo and last.role == role else ""
        self.prompt = prompt
        self.num_prompt_tokens = len(prompt)
        # Whether a streamed chunk carried the prompt's token ids yet (`return_token_ids`).
        self._prompt_ids_sent = False
        self.token_text = TokenText(tokenizer, body.return_tokens_as_token_ids)
        # vLLM's prompt_logprobs (the prompt is every choice's, so the first's are shown).
        self.prompt_logprobs: list | None = None
        self.choices = {
            i: _Choice(i, token_ids=[] if body.return_token_ids else None) for i in range(body.n)
        }
        for choice in self.choices.values():
            if parser == HARMONY:
                choice.harmony = HarmonyReader()
            elif parser is not None:
                choice.reader = reader_for(parser, tool_schemas(body))
            if thinking is not None:
                choice.thinker = ThinkReader(thinking, thought)

    def update(self, _source: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Fold a delta into its choice; return the streaming fragments it produces."""
        choice = self.choices[output.index]
        fragments = []
        wanted = self.body.prompt_logprobs
        if output.prompt_logprobs is not None and wanted is not None and not self.prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs(output.prompt_logprobs, self.token_text, wanted)
        if not choice.started:
            choice.started = True
            # A reply that is only calls has no content, as in the non-streamed message.
            content = None if self.forced is not None else ""
            fragments.append(self._fragment(choice, {"role": self.role, "content": content}))
            if self.echoed:
                fragments.append(self._fragment(choice, {"content": self.echoed}))
        logprobs = None
        if output.logprobs is not None and self.body.logprobs:
            logprobs = chat_logprobs(output.logprobs, self.token_text)
            choice.logprobs.extend(logprobs)
        choice.record(output, output.text)
        with_ids = choice.token_ids is not None and bool(output.new_token_ids)
        if output.text or logprobs or output.finished or with_ids:
            if choice.harmony is not None:
                reasoning, delta = self._harmony_delta(choice, output)
            else:
                reasoning, text = self._reasoning(choice, output)
                delta = self._delta(choice, text, output.finished)
            delta = self._first_call_only(delta)
            if reasoning:
                delta = {**self._reasoning_fields(reasoning), **delta}
            fragment = self._fragment(choice, delta, logprobs, output.finished)
            if choice.token_ids is not None:
                fragment["token_ids"] = output.new_token_ids
            fragments.append(fragment)
        return fragments

    def event(self, choices: list[dict[str, Any]]) -> str:
        """A chunk's event; the first carries the prompt's token ids where the request asked
        for them (`return_token_ids`), as vLLM's."""
        if self.body.return_token_ids and not self._prompt_ids_sent:
            self._prompt_ids_sent = True
            return sse({**self.chunk(choices), "prompt_token_ids": self.prompt})
        return super().event(choices)

    @staticmethod
    def _reasoning(choice: _Choice, output: RequestOutput) -> tuple[str, str]:
        """The delta's reasoning and the rest of its text."""
        if choice.thinker is None:
            return "", output.text
        reasoning, text = choice.thinker.feed(output.text)
        if output.finished:
            more, rest = choice.thinker.finish()
            reasoning, text = reasoning + more, text + rest
        return reasoning, text

    def _harmony_delta(self, choice: _Choice, output: RequestOutput) -> tuple[str, dict[str, Any]]:
        """A Harmony reply's delta: its reasoning, and its content and calls as they are written
        (or, for forced calls the model did not write as messages to functions, its answer's
        text as their arguments)."""
        assert choice.harmony is not None
        reasoning, content, entries = choice.harmony.feed(output.text)
        if output.finished:
            more, rest, last = choice.harmony.finish()
            reasoning, content, entries = reasoning + more, content + rest, entries + last
        if self.forced is not None and not entries and not choice.num_calls:
            return reasoning, self._delta(choice, content, output.finished)
        return reasoning, self._with_calls(choice, content, entries)

    def _reasoning_fields(self, reasoning: str) -> dict[str, str]:
        """`reasoning` (vLLM's and OpenAI's name) and `reasoning_content` (DeepSeek's, which
        some clients read), unless the request asked for none."""
        if not self.body.include_reasoning:
            return {}
        return {"reasoning": reasoning, "reasoning_content": reasoning}

    def _delta(self, choice: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """Text as content; forced calls as `tool_calls` entries, each call's id, type and name
        in its first, its arguments as they come in later ones."""
        if choice.reader is not None:
            return self._parsed_delta(choice, text, finished)
        if self.forced is None:
            return {"content": text} if text else {}
        if self.forced.kind == "required":
            entries = choice.calls_reader.feed(text)
            return {"tool_calls": entries} if entries else {}
        if not text:
            return {}
        entry: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
        if choice.call_id is None:
            first = tool_call(self.forced.names[0], text)
            choice.call_id = first["id"]
            entry = {"index": 0, **first}
        return {"tool_calls": [entry]}

    @staticmethod
    def _parsed_delta(choice: _Choice, text: str, finished: bool) -> dict[str, Any]:
        """Text outside calls as content (a possible tag held back), and the calls' entries:
        each call once it has begun, then its arguments as they are written."""
        assert choice.reader is not None
        content, entries = choice.reader.feed(text)
        if finished:
            rest, last = choice.reader.finish()
            content, entries = content + rest, entries + last
        return ChatRenderer._with_calls(choice, content, entries)

    @staticmethod
    def _with_calls(choice: _Choice, content: str, entries: list[dict[str, Any]]) -> dict[str, Any]:
        """A delta of `content` and calls' `delta.tool_calls` entries; counts the calls begun."""
        delta: dict[str, Any] = {"content": content} if content else {}
        if entries:
            delta["tool_calls"] = entries
            choice.num_calls += sum("id" in entry for entry in entries)
        return delta

    @staticmethod
    def _finish_reason(choice: _Choice, called: bool) -> str | None:
        """`tool_calls` for a choice that ended on its own having made calls."""
        if called and choice.finish_reason == "stop":
            return "tool_calls"
        return choice.finish_reason

    def _fragment(
        self,
        choice: _Choice,
        delta: dict[str, Any],
        logprobs: list | None = None,
        finished: bool = False,
    ) -> dict[str, Any]:
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": {"content": logprobs} if logprobs is not None else None,
            "finish_reason": (
                self._finish_reason(choice, self.forced is not None or choice.num_calls > 0)
                if finished
                else None
            ),
            "stop_reason": choice.stop_reason if finished else None,
        }

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage; with a prediction, how many of its tokens the reply kept and how
        many it refused after drafting them (`completion_tokens_details`)."""
        choices = self.choices.values()
        completion = sum(c.num_output_tokens for c in choices)
        found = usage(self.num_prompt_tokens, completion, self.choices[0].num_cached_tokens)
        if self.body.prediction is not None:
            found["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(c.num_prediction_kept for c in choices),
                "rejected_prediction_tokens": sum(c.num_prediction_refused for c in choices),
            }
        return found

    def _message(self, choice: _Choice) -> dict[str, Any]:
        if self.parser == HARMONY:
            return self._harmony_message(choice.text)
        if self.thinking is None:
            return self._answer(choice.text)
        reasoning, text = split_reasoning(choice.text, self.thinking, self.thought)
        message = self._answer(text or None)
        if reasoning is not None:
            message.update(self._reasoning_fields(reasoning))
        return message

    def _echoed(self, message: dict[str, Any]) -> dict[str, Any]:
        """The message with the echoed last message before its content (vLLM's `echo`)."""
        if not self.echoed:
            return message
        return {**message, "content": self.echoed + (message.get("content") or "")}

    def _harmony_message(self, text: str) -> dict[str, Any]:
        """The message of a whole Harmony reply."""
        reasoning, content, calls = split_harmony(text)
        if self.forced is not None and not calls:  # the answer's body holds the call
            message = {
                "role": self.role,
                "content": None,
                "tool_calls": self.forced.calls(content),
            }
        else:
            message = {"role": self.role, "content": content or None}
            if calls:
                message["tool_calls"] = calls
        if reasoning:
            message.update(self._reasoning_fields(reasoning))
        return message

    def _answer(self, text: str | None) -> dict[str, Any]:
        """The message of a reply whose text (past any reasoning) is `text`."""
        if self.parser is not None:
            content, calls = parse_calls(self.parser, text or "", tool_schemas(self.body))
            if not calls:  # the text as it streamed, blanks and all
                return {"role": self.role, "content": text}
            return {"role": self.role, "content": content, "tool_calls": calls}
        if self.forced is None:
            return {"role": self.role, "content": text}
        return {"role": self.role, "content": None, "tool_calls": self.forced.calls(text or "")}

    def _first_call_only(self, message: dict[str, Any]) -> dict[str, Any]:
        """A message, or a delta, with only its first call where the request allows no
        parallel calls (`parallel_tool_calls: false`), as vLLM's: a reply that runs free in its
        format may have written more."""
        calls = message.get("tool_calls")
        if self.body.parallel_tool_calls or not calls:
            return message
        if "index" in calls[0]:  # a delta's entries: those of the first call
            kept = [entry for entry in calls if entry["index"] == 0]
        else:
            kept = calls[:1]
        if kept:
            return {**message, "tool_calls": kept}
        return {key: value for key, value in message.items() if key != "tool_calls"}

    def response(self) -> dict[str, Any]:
        messages = {
            c.index: self._echoed(self._first_call_only(self._message(c)))
            for c in self.choices.values()
        }
        choices = [
            {
                "index": c.index,
                "message": messages[c.index],
                "logprobs": {"content": c.logprobs} if self.body.logprobs else None,
                "finish_reason": self._finish_reason(c, "tool_calls" in messages[c.index]),
                "stop_reason": c.stop_reason,
                **({"token_ids": c.token_ids} if c.token_ids is not None else {}),
            }
            for c in self.choices.values()
        ]
        return {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            **self.tier,
            "choices": choices,
            "usage": self.usage(),
            **self.metrics_field(),
            **(
                {"prompt_logprobs": self.prompt_logprobs}
                if self.body.prompt_logprobs is not None
                else {}
            ),
            **({"prompt_token_ids": self.prompt} if self.body.return_token_ids else {}),
        }


class ChatHandler:
    def __init__(
        self, engine: EngineClient, model: ServedModel, settings: ServerSettings | None = None
    ) -> None:
        settings = settings or ServerSettings()
        self.engine = engine
        self.model = model
        self.reasoning_parser = settings.reasoning_parser
        # The tags that parser reads a reply's reasoning between.
        self.thought = tags_for(settings.reasoning_parser)
        self.limits = settings.limits
        self.tool_call_parser = settings.tool_call_parser
        self.response_role = settings.response_role
        self.content_format = settings.chat_content_format
        self.default_template_kwargs = settings.default_chat_template_kwargs or {}
        self.trust_request_template = settings.trust_request_chat_template
        self.json_style = settings.json_style
        # What a response's `metrics` holds (vLLM's per-request metrics).
        self.report = MetricsReport(settings.per_request_metrics, model.info.spec_metrics)
        self.exclude_tools_when_none = settings.exclude_tools_when_tool_choice_none
        self.processor_kwargs = processor_arguments(
            getattr(engine, "processor", None), settings.mm_processor_kwargs
        )
        tokenizer = getattr(engine, "tokenizer", None)
        taken = call_arguments_among(tokenizer, self.default_template_kwargs) if tokenizer else []
        if taken:
            raise ValueError(
                f"--default-chat-template-kwargs cannot set {', '.join(taken)}: these are the "
                "chat template call's own arguments"
            )
        # Whether replies are Harmony's messages, read from the template on first use.
        self._harmony_replies: bool | None = None

    def _parser(self, tokenizer: Any, template: str | None) -> str | None:
        """The tool-call parser for `auto`: the format written tools teach for a template with no
        tool section, else `--tool-call-parser`, else the template's own (the request's
        `template`, else the model's)."""
        if not renders_tools(tokenizer, template):
            return WRITTEN_TOOLS_PARSER
        return parser_for(self.tool_call_parser, template or tokenizer.chat_template)

    def _offered_tools(
        self, body: ChatCompletionRequest, tokenizer: Any, template: str | None
    ) -> list[dict[str, Any]] | None:
        """The tools the prompt shows. Under `tool_choice` "none" a template that writes no
        tool section gets none (the tools Conveyor would write in its place tell the model
        how to call them), nor does a Harmony one (gpt-oss's replies are read as messages,
        calls included, whatever the choice)."""
        tools = template_tools(body, self.exclude_tools_when_none)
        if not tools or body.tool_choice != "none":
            return tools
        return None if self._harmony() or not renders_tools(tokenizer, template) else tools

    def _template(self, body: ChatCompletionRequest) -> str | None:
        """The request's own chat template, where the server trusts requests with one (vLLM's
        `--trust-request-chat-template`): a template runs code on the server."""
        if body.chat_template is not None and not self.trust_request_template:
            raise InvalidRequestError(
                "A chat template in the request is refused: this server does not run requests' "
                "own templates (--trust-request-chat-template).",
                param="chat_template",
            )
        return body.chat_template

    async def render(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams, str]:
        """The request checked and made into what the engine runs: the templated prompt's token
        ids, the sampling parameters and the model it runs as (what
        `/v1/chat/completions/render` answers)."""
        prepared = await self.prepare(body)
        return prepared.prompt, prepared.params, self.model.name_for(prepared.lora)

    async def prepare(self, body: ChatCompletionRequest) -> PreparedChat:
        """The request checked, templated and made into what the engine runs, with what reads
        the reply back (forced calls, the tool-call parser, where reasoning starts)."""
        lora = self.model.resolve(body.model)
        prompt, params, forced, thinking, images = await self._prepare(body)
        tokenizer = require_text_model(self.engine)
        reads_calls = body.tools and body.tool_choice != "none" and forced is None
        parser = self._parser(tokenizer, self._template(body)) if reads_calls else None
        if self._harmony():  # every reply is Harmony's messages
            parser = HARMONY
        # A reply not opened in its reasoning may open it itself before any call (with or
        # without a reasoning parser: Qwen3's `<think>` is a token free text cannot hold).
        may_think = None if thinking else self.thought
        strict = None if params.structured else strict_calls_format(body, parser, may_think)
        if strict is not None:
            after = self.thought.ends[0] if thinking else ""
            params = replace(params, structured=replace(strict, after=after))
        # A tag of the calls' or the reasoning's is a special token the text must keep.
        keeps = keeps_special_tokens(parser, tokenizer)
        if keeps or (thinking is not None and self.thought.special):
            params = replace(params, skip_special_tokens=False)
        return PreparedChat(prompt, params, forced, parser, thinking, lora, images)

    def renderer(
        self, request_id: str, body: ChatCompletionRequest, prepared: PreparedChat
    ) -> ChatRenderer:
        tokenizer = require_text_model(self.engine)
        renderer = ChatRenderer(
            request_id,
            self.model.name_for(prepared.lora),
            body,
            prepared.prompt,
            tokenizer,
            prepared.forced,
            prepared.parser,
            prepared.thinking,
            self.response_role if body.add_generation_prompt else body.messages[-1].role,
            self.thought,
        )
        renderer.report = self.report
        return renderer

    async def _prepare(
        self, body: ChatCompletionRequest
    ) -> tuple[list[int], SamplingParams, ForcedCalls | None, bool | None, ImageInputs | None]:
        check_chat(body, self.limits)
        check_tools(body)
        if body.mm_processor_kwargs:
            raise InvalidRequestError(
                "mm_processor_kwargs are the server's to set (--mm-processor-kwargs), not a "
                "request's.",
                param="mm_processor_kwargs",
            )
        keep = prompt_truncation(body, self.model.info.max_model_len)
        if keep is not None and image_urls(body.messages):
            raise InvalidRequestError(
                "truncate_prompt_tokens cannot cut a prompt that holds images.",
                param="truncate_prompt_tokens",
            )
        text, prompt, images = await self.templated(body, fits=keep is None)
        if keep is not None:
            prompt = prompt[-keep:]
        limit = self.model.info.max_model_len
        check_output_room(
            len(prompt), body.requested_max_tokens, limit, body.max_tokens_param, "messages"
        )
        params = sampling_params(
            body,
            body.requested_max_tokens,
            _top_logprobs(body, self.model.info.max_logprobs),
            body.prompt_logprobs,
            self.model.info.sampling_defaults,
            self.json_style,
        )
        forced = forced_calls(body)
        if forced is not None:
            if params.structured is not None:
                raise InvalidRequestError(
                    "A tool_choice that forces a call cannot be combined with another output "
                    f"format ({params.structured.param}).",
                    param="tool_choice",
                )
            params = replace(params, structured=self.json_style.applied(forced.format))
        harmony = self._harmony()
        thinking = None if harmony else self._thinking(text)
        if thinking is False and params.structured is not None:  # may think, then the format
            params = replace(params, structured=thought_first(params.structured, self.thought))
        if body.thinking_token_budget is not None:
            params = replace(params, thought_budget=self._budget(body, text, harmony))
        if body.prediction is not None:
            tokenizer = require_text_model(self.engine)
            predicted = await prediction_tokens(tokenizer, body.prediction.text, limit)
            params = replace(params, prediction=predicted)
        # The format holds for the final channel's body, or for the answer once the thought
        # has closed.
        after = FINAL if harmony else self.thought.ends[0] if thinking else None
        if after is not None and params.structured is not None:
            params = replace(params, structured=replace(params.structured, after=after))
        return prompt, params, forced, thinking, images

    async def templated(
        self, body: ChatCompletionRequest, fits: bool = True
    ) -> tuple[str, list[int], ImageInputs | None]:
        """The conversation through the model's template with the tools offered: its text, its
        token ids (for an image-text model, each image's placeholders expanded by the model's
        processor) and its images. With `fits`, text that cannot fit the context is refused
        before it is tokenized."""
        tokenizer = require_text_model(self.engine)
        template = self._template(body)
        size = messages_size(body.messages)
        if fits:
            check_fits(tokenizer, size, self.model.info.max_model_len, "messages")
        token = self.model.info.image_token_id
        text, prompt = await off_the_loop_if_large(
            size,
            lambda: chat_prompt(
                tokenizer,
                body.messages,
                body.add_generation_prompt,
                body.continue_final_message,
                self._offered_tools(body, tokenizer, template),
                {**self.default_template_kwargs, **(body.template_kwargs or {})} or None,
                body.add_special_tokens,
                images=token is not None,
                parts=content_format(self.content_format, template or tokenizer.chat_template)
                == "openai",
                template=template,
                documents=body.documents,
            ),
        )
        urls = image_urls(body.messages)
        if not urls:
            return text, prompt, None
        assert token is not None  # the template refused images otherwise
        loaded = await load_images(urls, self.limits)
        prompt, images = await asyncio.to_thread(
            processed_prompt,
            self.engine.processor,
            token,
            text,
            loaded,
            body.add_special_tokens,
            self.processor_kwargs,
        )
        return text, prompt, images

    def _harmony(self) -> bool:
        """Whether replies are Harmony's messages (gpt-oss): the parsers say so, or the chat
        template writes them."""
        if self._harmony_replies is None:
            template = getattr(require_text_model(self.engine), "chat_template", None)
            self._harmony_replies = (
                self.reasoning_parser == HARMONY_REASONING
                or self.tool_call_parser == HARMONY
                or is_harmony(template)
            )
        return self._harmony_replies

    def _budget(
        self, body: ChatCompletionRequest, prompt_text: str, harmony: bool
    ) -> ThoughtBudget:
        """The request's `thinking_token_budget` over the reasoning tags the server reads (the
        `--reasoning-parser`'s, `<think>` without one)."""
        if harmony:
            raise InvalidRequestError(
                "thinking_token_budget does not apply to Harmony replies (gpt-oss), whose "
                "reasoning is a channel, not a tagged thought.",
                param="thinking_token_budget",
            )
        assert body.thinking_token_budget is not None
        tags = self.thought
        opened = opens_in_reasoning(prompt_text, tags)
        return ThoughtBudget(body.thinking_token_budget, tags.starts, tags.ends[0], opened)

    def _thinking(self, prompt_text: str) -> bool | None:
        """Whether the reply starts in its reasoning (else it may open it itself); None where
        none is split off (no reasoning parser)."""
        if self.reasoning_parser is None:
            return None
        return opens_in_reasoning(prompt_text, self.thought)

    async def __call__(self, body: ChatCompletionRequest, request: Request) -> Response:
        prepared = await self.prepare(body)
        shown, request_id = request_ids("chatcmpl", request, body.request_id)
        bind_trace(request, request_id, shown)
        renderer = self.renderer(shown, body, prepared)
        await self.engine.prepare(prepared.params)
        options = request_options(body, request, prepared.lora, prepared.images)
        streams = beam_search.submit(
            self.engine, [prepared.prompt], prepared.params, body, request_id, options
        )
        return await respond(renderer, streams, bool(body.stream), request)


def _top_logprobs(body: ChatCompletionRequest, most: int) -> int | None:
    """The top log probabilities the request asks for, up to `most` (the engine checks the
    same; here the error names the chat request's own field)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs to be true.", param="top_logprobs")
    if (body.top_logprobs or 0) > most:
        raise InvalidRequestError(
            f"Requested top_logprobs of {body.top_logprobs}, which is greater than max "
            f"allowed: {most} (--max-logprobs).",
            param="top_logprobs",
        )
    return (body.top_logprobs or 0) if body.logprobs else None
