"""What the user asked for, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.core.errors import InvalidRequestError

# The most log probabilities a request may ask for per token, unless `--max-logprobs` says
# otherwise (OpenAI's limit for chat, and vLLM's default).
MAX_LOGPROBS = 20
MAX_N = 128
# Temperatures below this sample greedily, as in vLLM: dividing logits by less overflows.
GREEDY_TEMPERATURE = 1e-5


# The output formats a request may ask for (`StructuredOutputs.kind`).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredOutputs:
    """One format the output must follow, enforced token by token.

    `spec` is the JSON Schema as JSON text (`json`), the regular expression (`regex`), the
    choices as a JSON list of strings (`choice`), the grammar's text (`grammar`: Lark, or
    GBNF with `::=`), or a structural tag as JSON text (`structural_tag`: see
    `engine.structured.structural_tag`); empty for `json_object`. `param` names the request
    field it came from, for errors. With `after`, the format holds only once the output has
    written that text (a thinking model's `</think>`): what comes before runs free.
    """

    kind: str
    spec: str = ""
    param: str = "structured_outputs"
    after: str = ""

    def __post_init__(self) -> None:
        _check(
            self.kind in STRUCTURED_KINDS,
            self.param,
            f"unknown structured output kind {self.kind!r}; one of {', '.join(STRUCTURED_KINDS)}",
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)


@dataclass(frozen=True, slots=True)
class ThoughtBudget:
    """At most `tokens` reasoning tokens (vLLM's `thinking_token_budget`): the thought opens
    with one of `starts` (or is open from the first token, `open_at_start`) and is closed with
    `end`, forced once the budget is spent (`core/thought_budget.py`)."""

    tokens: int
    starts: tuple[str, ...]
    end: str
    open_at_start: bool = False

    def __post_init__(self) -> None:
        _check(
            self.tokens >= 0,
            "thinking_token_budget",
            f"thinking_token_budget must be non-negative, got {self.tokens}.",
        )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping settings of one request.

    `temperature == 0` (or below 1e-5) means greedy. `top_k` of 0 or -1 disables top-k.
    `max_tokens=None` lets the request run to the end of the context. `logprobs` is the number of
    alternatives returned next to each sampled token (0: only the sampled token's own logprob);
    `prompt_logprobs` likewise for the prompt tokens.
    """

    n: int = 1
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's `allowed_token_ids`); None allows all.
    allowed_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured: StructuredOutputs | None = None
    # Words the output may not write (vLLM's `bad_words`; `core/bad_words.py`).
    bad_words: tuple[str, ...] = ()
    # A cap on a thinking model's reasoning tokens.
    thought_budget: ThoughtBudget | None = None
    # The reply as the client expects it, in tokens (OpenAI's Predicted Outputs): steps draft
    # from it (`core/prediction.py`); () for none.
    prediction: tuple[int, ...] = ()
    # Arguments for the deployment's logits processors (vLLM's `vllm_xargs`;
    # `worker/logits_processors.py`).
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._validate_counts()
        self._validate_distribution()
        self._validate_penalties()
        self._validate_stops()

    def _validate_counts(self) -> None:
        _check(1 <= self.n <= MAX_N, "n", f"n must be between 1 and {MAX_N}, got {self.n}.")
        if self.max_tokens is not None:
            _check(
                self.max_tokens >= 1,
                "max_tokens",
                f"max_tokens must be at least 1, got {self.max_tokens}.",
            )
        _check(
            self.min_tokens >= 0,
            "min_tokens",
            f"min_tokens must be non-negative, got {self.min_tokens}.",
        )
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens}).",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                # The most an engine returns is its own (`EngineCore.max_logprobs`).
                _check(value >= 0, name, f"{name} must be non-negative, got {value}.")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "seed is out of range.")

    def _validate_distribution(self) -> None:
        _check(
            _finite(self.temperature) and self.temperature >= 0,
            "temperature",
            f"temperature must be a non-negative number, got {self.temperature}.",
        )
        _check(
            _finite(self.top_p) and 0 < self.top_p <= 1,
            "top_p",
            f"top_p must be in (0, 1], got {self.top_p}.",
        )
        _check(
            self.top_k >= -1,
            "top_k",
            f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k}.",
        )
        _check(
            _finite(self.min_p) and 0 <= self.min_p <= 1,
            "min_p",
            f"min_p must be in [0, 1], got {self.min_p}.",
        )

    def _validate_penalties(self) -> None:
        _check(
            _finite(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            f"repetition_penalty must be positive, got {self.repetition_penalty}.",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(
                _finite(value) and -2 <= value <= 2,
                name,
                f"{name} must be in [-2, 2], got {value}.",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", f"logit_bias has a negative token id {token_id}.")
            _check(
                _finite(bias) and -100 <= bias <= 100,
                "logit_bias",
                f"logit_bias values must be in [-100, 100], got {bias}.",
            )
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0,
                "allowed_token_ids",
                "allowed_token_ids must hold at least one token id, none negative.",
            )

    def _validate_stops(self) -> None:
        _check(all(self.stop), "stop", "stop strings must not be empty.")
        _check(
            all(word.strip() for word in self.bad_words),
            "bad_words",
            "bad_words must not be empty or only spaces.",
        )
        _check(
            all(t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "stop_token_ids must be non-negative.",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def uses_top_k(self) -> bool:
        return self.top_k > 0


def _finite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))
