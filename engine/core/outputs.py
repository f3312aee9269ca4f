"""Plain result objects: from the model runner to the scheduler, and from the engine to callers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the core loads no torch; the runner hands it tensors
    import torch

    from engine.core.stats import FinishedRequestStats, SpecTally


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one chosen token and of the most likely alternatives at its position."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


# The token of a row whose request's own rules ruled out every token (a format and
# `allowed_token_ids` outside it, `min_tokens` where only EOS may follow, ...): the engine fails
# that request alone, as the client's error.
NO_TOKEN = -1


@dataclass(slots=True)
class ModelRunnerOutput:
    """What the model produced in one step.

    A token is sampled only for requests whose scheduled chunk reached their last known token.
    `prompt_logprobs` holds, per request, one entry for each prompt position computed this step
    (None for the first prompt token, which nothing predicts).
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Per request that verified drafts: the drafts its model agreed with, which come before its
    # sampled token (`core/speculation.py`).
    accepted_drafts: dict[str, list[int]] = field(default_factory=dict)
    # The logprobs of those kept drafts, where the request asked (its sampled token's are in
    # `logprobs`).
    accepted_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob | None]] = field(default_factory=dict)
    # Under the pooling runner: each finished prompt's last hidden state (fp32, on the host).
    embeddings: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class RequestOutput:
    """A delta of one sequence for the caller: what is new since the last output."""

    request_id: str
    index: int
    new_token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    # Drafts from the request's prediction its steps kept and refused, so far.
    num_prediction_kept: int = 0
    num_prediction_refused: int = 0
    # On the last delta of a sequence that finished in a step: its timings, and its
    # verification steps where the engine reports them per request.
    stats: FinishedRequestStats | None = None
    spec: SpecTally | None = None
    error: BaseException | None = None
    # The prompt's last hidden state (fp32 `[hidden]`), under the pooling runner.
    embedding: torch.Tensor | None = None

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same sequence into this one (a lagging consumer)."""
        self.new_token_ids.extend(later.new_token_ids)
        self.text += later.text
        if later.logprobs is not None:
            self.logprobs = [*(self.logprobs or []), *later.logprobs]
        if later.prompt_logprobs is not None:
            self.prompt_logprobs = [*(self.prompt_logprobs or []), *later.prompt_logprobs]
        self.finished = later.finished
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason
        self.num_output_tokens = later.num_output_tokens
        self.num_prediction_kept = later.num_prediction_kept
        self.num_prediction_refused = later.num_prediction_refused
        self.stats = later.stats or self.stats
        self.spec = later.spec or self.spec
        self.error = later.error
        if later.embedding is not None:
            self.embedding = later.embedding
