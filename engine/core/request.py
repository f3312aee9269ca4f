"""One sequence being generated: its tokens, progress, blocks and fate."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from engine.core.images import ImageInputs
from engine.core.sampling_params import SamplingParams
from engine.lora.registry import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    """Why a request ended; the values are OpenAI's and vLLM's finish reasons."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(slots=True)
class RequestTimings:
    """Monotonic timestamps of a request's life (arrival lives on the request)."""

    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    # What the scheduler did with it besides running it: (time, "admission deferred" |
    # "preempted" | "paused" | "resumed").
    events: list[tuple[float, str]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Request:
    """A single sequence inside the engine.

    `num_computed_tokens` counts the tokens whose K/V are in the cache (or are being written by
    the step in flight); a preempted request drops to zero and recomputes its prompt and outputs.
    `num_pending_tokens` counts tokens sampled by a step still in flight (overlapped scheduling):
    they count in `num_tokens` but are not in `all_token_ids` until the step's results arrive.
    `max_total_tokens` is the hard length of the sequence (the context limit or the whole cache,
    whichever is smaller) and `max_output_tokens` the user's limit clamped to it.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    max_total_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # The slot of a recurrent model's state cache this request holds beside its blocks
    # (`kv/state_slots.py`); None in other models, or while it holds no blocks.
    state_slot: int | None = None
    # The snapshot row of the states after its cached prefix, which its first step copies into
    # its slot (`kv/state_snapshots.py`); None once taken, or where it resumes from none.
    restore_snapshot: int | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_prompt_logprobs_done: int = 0
    num_cached_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    num_published_blocks: int = 0
    priority: int = 0
    deadline: float | None = None
    deferred: bool = False
    # A background request (a batch line) runs only in capacity no other request wants.
    background: bool = False
    timings: RequestTimings = field(default_factory=RequestTimings)
    # The token sequences of `sampling_params.bad_words` (`core/bad_words.py`).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # The matcher of `sampling_params.structured`: which tokens may come next (llguidance's
    # `LLMatcher`, advanced with each sampled token); None for free text.
    grammar: Any = None
    # A format that starts later (`StructuredOutputs.after`): a `DeferredGrammar` until then.
    deferred_grammar: Any = None
    # The reasoning tokens counted against `sampling_params.thought_budget` (a
    # `ThoughtCounter`); None without a budget.
    thought: Any = None
    # The LoRA adapter the request runs under; None: the base model.
    lora: LoRARequest | None = None
    # The prompt's images (an image-text model's); None for a text prompt.
    images: ImageInputs | None = None
    # A tenant's salt of the prefix cache's hashes (vLLM's `cache_salt`): only requests with the
    # same salt share cached blocks.
    cache_salt: str | None = None
    # Tokens drafted for the next step to verify (`core/speculation.py`); [] for none.
    draft_token_ids: list[int] = field(default_factory=list)
    # The output tokens the last step that gave this request any appended (more than one where
    # it accepted drafts).
    num_new_tokens: int = 0
    # Drafts from `sampling_params.prediction` its steps kept and refused (Predicted Outputs).
    num_prediction_kept: int = 0
    num_prediction_refused: int = 0
    # Its verification steps, where the engine reports them per request (a `SpecTally`).
    spec: Any = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_sampled_tokens(self) -> int:
        """Output tokens sampled so far, counting those of a step still in flight."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def new_token_ids(self) -> list[int]:
        """The output tokens the last step that gave this request any appended."""
        return self.output_token_ids[len(self.output_token_ids) - self.num_new_tokens :]

    @property
    def max_output_tokens(self) -> int:
        room = self.max_total_tokens - self.num_prompt_tokens
        limit = self.sampling_params.max_tokens
        return room if limit is None else min(limit, room)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def forced_token(self) -> int | None:
        """The token the next step must sample (a spent thought budget's closing tag)."""
        return None if self.thought is None else self.thought.forced_token

    @property
    def follows_its_tokens(self) -> bool:
        """Whether the next token depends on the newest one (a format, a thought budget still
        counting), or the next step's drafts do (a prediction), so that a step's tokens must
        reach the host before the next is scheduled."""
        counting = self.thought is not None and not self.thought.done
        formats = self.grammar is not None or self.deferred_grammar is not None
        return formats or counting or bool(self.sampling_params.prediction)

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.thought is not None:
            self.thought.append(self.output_token_ids)
        if self.grammar is not None:
            self.grammar.consume_token(token_id)
        elif self.deferred_grammar is not None and self.deferred_grammar.opens(
            self.output_token_ids
        ):
            self.grammar, self.deferred_grammar = self.deferred_grammar.matcher, None

    def drop_last_outputs(self, count: int) -> None:
        """Take back the newest `count` output tokens of the last step (drafts kept past a
        stop string; its format, if any, takes them back too)."""
        if count <= 0:
            return
        del self.output_token_ids[-count:]
        del self.all_token_ids[-count:]
        self.num_new_tokens -= count
        if self.grammar is not None:
            self.grammar.rollback(count)

    def finish(self, reason: FinishReason, stop_reason: int | str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_token_stop(self) -> bool:
        """Finish the request if its newest token ends it; return whether it did."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.finish(FinishReason.STOP, last)
                return True
            if not params.ignore_eos and last in self.eos_token_ids:
                self.finish(FinishReason.STOP)
                return True
        if self.grammar is not None and self.grammar.is_stopped():
            # The format is complete (nothing but EOS may follow): stop here, as at EOS.
            self.finish(FinishReason.STOP)
            return True
        if self.num_output_tokens >= self.max_output_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        return False
