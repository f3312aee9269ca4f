"""POST /v1/completions."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.core.errors import InvalidRequestError
from engine.core.images import ImageInputs
from engine.core.outputs import RequestOutput
from engine.core.sampling_params import SamplingParams
from engine.lora.registry import LoRARequest
from server import beam_search
from server.fill_in_middle import check_suffix, fill_in_middle_prompts
from server.json_style import PLAIN, JsonStyle
from server.limits import RequestLimits, check_completion
from server.logprobs import CompletionLogprobs, prompt_logprobs
from server.prompt_embeds import embedded_prompts
from server.protocol import CompletionRequest, served_tier
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
    respond,
    sampling_params,
    submit_all,
    usage,
)
from server.tokenization import (
    TokenText,
    off_the_loop_if_large,
    prompt_size,
    split_prompts,
    tokenize_prompts,
)


@dataclass(slots=True)
class _Choice(ChoiceState):
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str | None = None
    logprobs: CompletionLogprobs | None = None
    offset: int = 0
    # vLLM's prompt_logprobs, once the prompt's entries have arrived (first output).
    prompt_logprobs: list | None = None


class CompletionRenderer(ChunkRenderer):
    """Accumulates engine deltas into OpenAI completion choices and chunks."""

    object_name = "text_completion"

    def __init__(
        self,
        request_id: str,
        model: str,
        body: CompletionRequest,
        prompts: list[list[int]],
        texts: list[str | None],
        tokenizer: Any,
    ) -> None:
        super().__init__(request_id, model, body.include_usage, body.continuous_usage)
        self.tier = served_tier(body.service_tier)
        self.body = body
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.token_text = (
            TokenText(tokenizer, body.return_tokens_as_token_ids) if tokenizer is not None else None
        )
        self.choices = {
            p * body.n + i: _Choice(
                p * body.n + i,
                prompt_ids=prompt,
                prompt_text=texts[p],
                token_ids=[] if body.return_token_ids else None,
            )
            for p, prompt in enumerate(prompts)
            for i in range(body.n)
        }

    def update(self, prompt_index: int, output: RequestOutput) -> list[dict[str, Any]]:
        """Fold a delta into its choice; return the choice's streaming fragment."""
        choice = self.choices[prompt_index * self.body.n + output.index]
        first = not choice.started
        text, logprobs = self._echo(choice, output) if first else ("", None)
        if first and self.body.prompt_logprobs is not None:
            choice.prompt_logprobs = self._prompt_logprobs(output)
        choice.started = True
        text += output.text
        if output.logprobs is not None:
            logprobs = logprobs or CompletionLogprobs()
            choice.offset = self._add_logprobs(
                logprobs, output.new_token_ids, output.logprobs, choice.offset
            )
        choice.record(output, text)
        self._merge_logprobs(choice, logprobs)
        fragment = {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs.to_dict() if logprobs is not None else None,
            **choice.ending(output.finished),
        }
        if self.body.return_token_ids:
            if first:
                fragment["prompt_token_ids"] = choice.prompt_ids
            fragment["token_ids"] = output.new_token_ids
        return [fragment]

    def _echo(
        self, choice: _Choice, output: RequestOutput
    ) -> tuple[str, CompletionLogprobs | None]:
        if not self.body.echo:
            return "", None
        # Echo gives back a text prompt as sent; token-id prompts are decoded.
        text = choice.prompt_text
        if text is None:
            text = self.tokenizer.decode(choice.prompt_ids) if self.tokenizer is not None else ""
        if output.prompt_logprobs is None:
            return text, None
        logprobs = CompletionLogprobs()
        # The engine computed as many rivals as either view asks for; echo shows `logprobs`.
        count = self.body.logprobs or 0
        entries = [e and replace(e, top=e.top[:count]) for e in output.prompt_logprobs]
        choice.offset = self._add_logprobs(logprobs, choice.prompt_ids, entries, 0)
        return text, logprobs

    def _prompt_logprobs(self, output: RequestOutput) -> list | None:
        if output.prompt_logprobs is None or self.body.prompt_logprobs is None:
            return None
        token_text = self.token_text or TokenText(None, as_ids=True)  # no tokenizer: ids
        return prompt_logprobs(output.prompt_logprobs, token_text, self.body.prompt_logprobs)

    def _add_logprobs(
        self, logprobs: CompletionLogprobs, token_ids: list[int], entries: list, offset: int
    ) -> int:
        if self.token_text is None:
            return offset
        return logprobs.add(token_ids, entries, self.token_text, offset)

    @staticmethod
    def _merge_logprobs(choice: _Choice, logprobs: CompletionLogprobs | None) -> None:
        if logprobs is None:
            return
        if choice.logprobs is None:
            choice.logprobs = CompletionLogprobs()
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(choice.logprobs, name).extend(getattr(logprobs, name))

    def usage(self) -> dict[str, Any]:
        completion = sum(c.num_output_tokens for c in self.choices.values())
        # The prompt is counted once per prompt, as its first sample saw it.
        cached = sum(
            self.choices[p * self.body.n].num_cached_tokens for p in range(len(self.prompts))
        )
        return usage(sum(len(p) for p in self.prompts), completion, cached)

    def response(self) -> dict[str, Any]:
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": c.logprobs.to_dict() if c.logprobs is not None else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **(
                    {"prompt_logprobs": c.prompt_logprobs}
                    if self.body.prompt_logprobs is not None
                    else {}
                ),
                **(
                    {"prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids}
                    if c.token_ids is not None
                    else {}
                ),
            }
            for c in sorted(self.choices.values(), key=lambda c: c.index)
        ]
        return self.chunk(choices, with_usage=True)


class CompletionHandler:
    def __init__(
        self,
        engine: EngineClient,
        model: ServedModel,
        limits: RequestLimits | None = None,
        prompt_embeds: bool = False,
        json_style: JsonStyle = PLAIN,
        per_request_metrics: bool = False,
    ) -> None:
        self.engine = engine
        self.model = model
        self.limits = limits or RequestLimits()
        # Prompts may come as embedding rows (`--enable-prompt-embeds`).
        self.prompt_embeds = prompt_embeds
        self.json_style = json_style
        # What a response's `metrics` holds (vLLM's per-request metrics).
        self.report = MetricsReport(per_request_metrics, model.info.spec_metrics)

    async def render(self, body: CompletionRequest) -> tuple[list[list[int]], SamplingParams, str]:
        """The request checked and made into what the engine runs: each prompt's token ids, the
        sampling parameters and the model it runs as (what `/v1/completions/render` answers)."""
        prompts, _, params, lora, _ = await self._prepare(body)
        return prompts, params, self.model.name_for(lora)

    async def _prepare(
        self, body: CompletionRequest
    ) -> tuple[
        list[list[int]],
        list[str | None],
        SamplingParams,
        LoRARequest | None,
        list[ImageInputs] | None,
    ]:
        """Each prompt's token ids and text (to echo), the sampling parameters, the adapter,
        and each prompt's embedding rows where the prompts came as `prompt_embeds`."""
        lora = self.model.resolve(body.model)
        check_completion(body, self.limits)
        _check_unsupported(body)
        params = self._params(body)
        if body.prompt_embeds is not None:
            embedded = embedded_prompts(body, self.model.info, self.prompt_embeds)
            ids = [prompt for prompt, _ in embedded]
            self._check_room(body, ids)
            return ids, [None] * len(ids), params, lora, [rows for _, rows in embedded]
        assert body.prompt is not None  # the request's validation asks for one or the other
        singles = split_prompts(body.prompt)
        max_model_len = self.model.info.max_model_len
        keep = prompt_truncation(body, max_model_len)
        prompts = await self._prompt_ids(body, singles, keep is not None)
        # A truncated prompt echoes as its kept tokens read back, not as the text sent.
        texts = [
            p if isinstance(p, str) and (keep is None or len(ids) <= keep) else None
            for p, ids in zip(singles, prompts, strict=True)
        ]
        prompts = [ids if keep is None else ids[-keep:] for ids in prompts]
        self._check_room(body, prompts)
        return prompts, texts, params, lora, None

    def _check_room(self, body: CompletionRequest, prompts: list[list[int]]) -> None:
        max_model_len = self.model.info.max_model_len
        for ids in prompts:
            check_output_room(
                len(ids), body.requested_max_tokens, max_model_len, "max_tokens", "prompt"
            )

    def _params(self, body: CompletionRequest) -> SamplingParams:
        echoed = body.logprobs if body.echo and body.logprobs is not None else None
        wanted = [n for n in (echoed, body.prompt_logprobs) if n is not None]
        return sampling_params(
            body,
            body.requested_max_tokens,
            body.logprobs,
            max(wanted) if wanted else None,
            self.model.info.sampling_defaults,
            self.json_style,
        )

    async def _prompt_ids(
        self, body: CompletionRequest, singles: list[str | list[int]], truncating: bool
    ) -> list[list[int]]:
        """Each prompt's token ids; with `suffix`, framed to fill in the middle."""
        tokenizer = self.engine.tokenizer
        if not body.suffix:
            max_model_len = self.model.info.max_model_len
            return await tokenize_prompts(
                tokenizer, singles, body.add_special_tokens, max_model_len, truncating, "prompt"
            )
        suffix = body.suffix
        check_suffix(bool(body.echo), truncating)
        return await off_the_loop_if_large(
            prompt_size(singles) + len(suffix),
            lambda: fill_in_middle_prompts(tokenizer, singles, suffix, body.add_special_tokens),
        )

    async def __call__(self, body: CompletionRequest, request: Request) -> Response:
        prompts, texts, params, lora, rows = await self._prepare(body)
        tokenizer = self.engine.tokenizer
        shown, request_id = request_ids("cmpl", request, body.request_id)
        bind_trace(request, request_id, shown)
        model = self.model.name_for(lora)
        renderer = CompletionRenderer(shown, model, body, prompts, texts, tokenizer)
        renderer.report = self.report
        await self.engine.prepare(params)
        options = request_options(body, request, lora)
        if rows is not None:
            streams = submit_all(self.engine, prompts, params, request_id, options, rows)
        else:
            streams = beam_search.submit(self.engine, prompts, params, body, request_id, options)
        return await respond(renderer, streams, bool(body.stream), request)


def _check_unsupported(body: CompletionRequest) -> None:
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of is not supported; use n.", param="best_of")
