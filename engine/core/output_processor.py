"""Turns sampled tokens into caller-facing deltas: text, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.core.outputs import ModelRunnerOutput, RequestOutput, TokenLogprob
from engine.core.request import FinishReason, Request


@dataclass(slots=True)
class _SequenceState:
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    matcher: StopStringMatcher
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    sent_first: bool = False


class OutputProcessor:
    """Per-sequence text state. A stop string found here is reported back so the scheduler can
    end the request in the same step."""

    def __init__(self, tokenizer: Any | None) -> None:
        self._tokenizer = tokenizer
        self._states: dict[str, _SequenceState] = {}

    def add(self, request: Request, parent_id: str, index: int) -> None:
        params = request.sampling_params
        detokenizer = None
        if self._tokenizer is not None:
            detokenizer = IncrementalDetokenizer(
                self._tokenizer, request.prompt_token_ids, params.skip_special_tokens
            )
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._states[request.request_id] = _SequenceState(parent_id, index, detokenizer, matcher)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def collect_prompt_logprobs(self, runner_output: ModelRunnerOutput) -> None:
        for request_id, chunk in runner_output.prompt_logprobs.items():
            state = self._states.get(request_id)
            if state is not None:
                state.prompt_logprobs.extend(chunk)

    def new_text(self, request: Request) -> tuple[str, str | None]:
        """Text delta for the request's newest tokens (those its last step appended), and the
        stop string they completed. Tokens after the one that completes a stop string (drafts
        a step kept past it) are taken off the request: they were never written."""
        state = self._states[request.request_id]
        if state.detokenizer is None:
            return "", None
        new = request.new_token_ids
        text, stop = "", None
        for count, token in enumerate(new, start=1):
            piece, stop = state.matcher.add(state.detokenizer.add([token]))
            text += piece
            if stop is not None:
                request.drop_last_outputs(len(new) - count)
                break
        if stop is None and request.is_finished:
            tail, stop = _flush(state)
            text += tail
        return text, stop

    def make_output(
        self, request: Request, text: str, logprobs: list[TokenLogprob] | None
    ) -> RequestOutput:
        state = self._states[request.request_id]
        output = RequestOutput(
            request_id=state.parent_id,
            index=state.index,
            new_token_ids=request.new_token_ids,
            text=text,
            finished=request.is_finished,
            finish_reason=_reason(request),
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_prediction_kept=request.num_prediction_kept,
            num_prediction_refused=request.num_prediction_refused,
        )
        if not state.sent_first and request.sampling_params.prompt_logprobs is not None:
            output.prompt_logprobs = state.prompt_logprobs
        state.sent_first = True
        if request.is_finished:
            del self._states[request.request_id]
        return output

    def final_output(self, request: Request, error: BaseException | None = None) -> RequestOutput:
        """The closing delta of a request ended from outside (abort, failure, deadline), with
        any text still held back."""
        state = self._states.pop(request.request_id)
        text = _flush(state)[0] if state.detokenizer is not None else ""
        return RequestOutput(
            request_id=state.parent_id,
            index=state.index,
            new_token_ids=[],
            text=text,
            finished=True,
            finish_reason=_reason(request),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_prediction_kept=request.num_prediction_kept,
            num_prediction_refused=request.num_prediction_refused,
            error=error,
        )


def _flush(state: _SequenceState) -> tuple[str, str | None]:
    """All text still held back at the end of a sequence, and a stop string it completes."""
    text = state.detokenizer.flush() if state.detokenizer is not None else ""
    tail, stop = state.matcher.add(text)
    return tail + state.matcher.flush(), stop


def _reason(request: Request) -> str | None:
    reason = request.finish_reason
    return str(reason) if isinstance(reason, FinishReason) else None
