"""Speculation's drafts. vLLM's `ngram` method ("prompt lookup") drafts the next tokens of a
sequence from what followed the latest earlier match of its last few tokens, in its prompt or
its output so far; its `suffix` method from what most often followed them, there or in earlier
requests' outputs (`core/suffix_decoding.py`); its `draft_model` method has a smaller model
write them (`worker/draft_model.py`). A step then runs each draft as one more decode row of
the sequence and keeps the drafts its model agrees with, plus the token of the first row that
disagreed (or of the last row): several tokens for the price of a slightly wider decode step.

Only requests whose next token depends on nothing but the logits of its row and the tokens
before it (penalties, bad words, `min_tokens` and an output format read those, drafts
included) draft: a format that has not started yet, a thought budget still counting or images
make a request decode one token a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.draft_gate import DraftGate
from engine.core.prediction import Prediction
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.suffix_decoding import SuffixCache, SuffixSettings

# vLLM's default n-gram lengths where the config names neither.
DEFAULT_LOOKUP = 5

# The most drafts a step of one request verifies.
MOST_DRAFTS = 32

# vLLM's suffix decoding fields, by our names for them.
SUFFIX_FIELDS = {
    "suffix_decoding_max_tree_depth": "depth",
    "suffix_decoding_max_cached_requests": "max_cached_requests",
    "suffix_decoding_max_spec_factor": "factor",
    "suffix_decoding_min_token_prob": "min_prob",
}

# The fields each served method reads (besides `method` and `num_speculative_tokens`).
METHOD_FIELDS = {
    "ngram": {"prompt_lookup_min", "prompt_lookup_max"},
    "draft_model": {"model", "draft_tensor_parallel_size", "max_model_len"},
    "suffix": set(SUFFIX_FIELDS),
}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config`. `ngram`: draft up to `num_speculative_tokens` tokens
    from the longest match of the sequence's last `prompt_lookup_max` .. `prompt_lookup_min`
    tokens. `draft_model`: a smaller `model` of the same tokenizer drafts them, greedily, one
    after another (`worker/draft_model.py`), over sequences up to `draft_max_model_len`
    tokens (None: its own context). Either way no drafts while more than
    `disable_by_batch_size` requests run (where a step's rows already keep the device busy,
    more rows cost more than the tokens they keep); without it, drafts are made where steps
    of the same size have been faster with them (`draft_gate.py`). `suffix`: draft what most
    often followed the sequence's last tokens, by `suffix`'s settings."""

    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    method: str = "ngram"
    disable_by_batch_size: int | None = None
    model: str | None = None
    draft_max_model_len: int | None = None
    suffix: SuffixSettings = field(default_factory=SuffixSettings)

    def __post_init__(self) -> None:
        if self.method not in METHOD_FIELDS:
            raise ValueError(
                f"speculative method {self.method!r} is not served: 'ngram' (drafts from the "
                "sequence itself), 'suffix' (from it and earlier outputs) and 'draft_model' (a "
                "smaller model of the same tokenizer) are; EAGLE, Medusa, MLP speculators and "
                "MTP are not"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('the draft_model method needs the draft\'s "model" (a path or id)')
        if not 1 <= self.num_speculative_tokens <= MOST_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MOST_DRAFTS}]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must be 1 <= min <= max")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be at least 1")
        if self.draft_max_model_len is not None and self.draft_max_model_len < 2:
            raise ValueError("the draft's max_model_len must be at least 2")

    @property
    def uses_model(self) -> bool:
        """Whether a draft model makes the drafts (`draft_model`), not the sequence itself."""
        return self.method == "draft_model"

    def describe(self) -> str:
        """The start-up line's words for what drafts."""
        count = self.num_speculative_tokens
        if self.uses_model:
            return f"drafts of up to {count} tokens from the draft model {self.model}"
        if self.method == "suffix":
            suffix = self.suffix
            cached = "no" if suffix.max_cached_requests == 0 else str(suffix.max_cached_requests)
            if suffix.max_cached_requests < 0:
                cached = "all"
            return (
                f"suffix decoding drafts of up to {count} tokens (trees {suffix.depth} deep, "
                f"{cached} earlier outputs cached)"
            )
        return (
            f"n-gram drafts of up to {count} tokens from matches of the last "
            f"{self.prompt_lookup_min}-{self.prompt_lookup_max} tokens"
        )

    @classmethod
    def of(cls, fields: dict[str, Any]) -> SpeculativeConfig:
        """The config a `--speculative-config` JSON object gives. As in vLLM, a `model` with
        no `method` names the method: `ngram` or `[ngram]` n-gram drafts, an EAGLE head's
        name EAGLE (refused), any other a draft model; either lookup length alone sets both.
        `suffix` drafts up to its tree depth where `num_speculative_tokens` is not given."""
        method = _method_of(fields)
        if method not in METHOD_FIELDS:
            cls(1, method=method)  # refused by name
        known = {"method", "num_speculative_tokens", "disable_by_batch_size"}
        known |= METHOD_FIELDS[method] | ({"model"} if method == "ngram" else set())
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative config fields for {method}: {', '.join(unknown)}"
            )
        suffix = _suffix_settings(fields) if method == "suffix" else SuffixSettings()
        if method == "suffix" and fields.get("num_speculative_tokens") is None:
            fields = {**fields, "num_speculative_tokens": min(suffix.depth, MOST_DRAFTS)}
        if "num_speculative_tokens" not in fields:
            raise ValueError("the speculative config needs num_speculative_tokens")
        for name, value in fields.items():
            if name in ("method", "model", *SUFFIX_FIELDS) or (
                value is None and name != "num_speculative_tokens"
            ):
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"speculative config field {name} must be an integer")
        if fields.get("draft_tensor_parallel_size") not in (None, 1):
            raise ValueError("a draft model runs on one device: draft_tensor_parallel_size 1")
        lower = fields.get("prompt_lookup_min")
        upper = fields.get("prompt_lookup_max")
        lower = lower if lower is not None else upper if upper is not None else DEFAULT_LOOKUP
        upper = upper if upper is not None else lower
        model = fields.get("model") if method == "draft_model" else None
        if model is not None and not isinstance(model, str):
            raise ValueError("the speculative config's model must be a string")
        return cls(
            num_speculative_tokens=fields["num_speculative_tokens"],
            prompt_lookup_min=lower,
            prompt_lookup_max=upper,
            method=method,
            disable_by_batch_size=fields.get("disable_by_batch_size"),
            model=model,
            draft_max_model_len=fields.get("max_model_len"),
            suffix=suffix,
        )


def _suffix_settings(fields: dict[str, Any]) -> SuffixSettings:
    """The suffix method's settings from vLLM's `suffix_decoding_*` fields (defaults where
    absent or null), checked."""
    given = {}
    for name, ours in SUFFIX_FIELDS.items():
        value = fields.get(name)
        if value is None:
            continue
        whole = ours in ("depth", "max_cached_requests")
        if not isinstance(value, int if whole else int | float) or isinstance(value, bool):
            kind = "an integer" if whole else "a number"
            raise ValueError(f"speculative config field {name} must be {kind}")
        given[ours] = value
    settings = SuffixSettings(**given)
    if settings.depth < 1:
        raise ValueError("suffix_decoding_max_tree_depth must be at least 1")
    if settings.max_cached_requests < -1:
        raise ValueError("suffix_decoding_max_cached_requests must be -1 (no limit), 0 or more")
    if settings.factor < 0:
        raise ValueError("suffix_decoding_max_spec_factor must be at least 0")
    if not 0 <= settings.min_prob <= 1:
        raise ValueError("suffix_decoding_min_token_prob must be in [0, 1]")
    return settings


def _method_of(fields: dict[str, Any]) -> str:
    """The method a config names, or its `model` implies (vLLM's reading); `ngram` for
    neither."""
    method = fields.get("method")
    if method is not None:
        return str(method)
    model = fields.get("model")
    if model is None or model in ("ngram", "[ngram]"):
        return "ngram"
    name = str(model).lower()
    if "eagle3" in name:
        return "eagle3"
    if "eagle" in name:
        return "eagle"
    return "draft_model"


class NgramIndex:
    """Where each n-gram of a sequence (for n in [shortest, longest]) last ended, kept up to
    date as the sequence grows: a lookup costs `longest - shortest + 1` dictionary reads."""

    def __init__(self, shortest: int, longest: int) -> None:
        self.shortest = shortest
        self.longest = longest
        # n -> n-gram -> the position just past its latest occurrence.
        self._ends: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(shortest, longest + 1)
        }
        self._indexed = 0  # n-grams ending at or before this position are in `_ends`

    def draft(self, tokens: list[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the longest of
        `tokens`' suffixes that occurred before ([] where none did)."""
        self._catch_up(tokens)
        length = len(tokens)
        for n in range(min(self.longest, length - 1), self.shortest - 1, -1):
            end = self._ends[n].get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : end + count]
        return []

    def _catch_up(self, tokens: list[int]) -> None:
        """Index the n-grams that end before the sequence's last position (the suffix being
        looked up must find an earlier occurrence, not itself)."""
        last = len(tokens) - 1
        for end in range(self._indexed + 1, last + 1):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, last)


# The most tokens a request with a prediction drafts a step (OpenAI's Predicted Outputs).
PREDICTION_DRAFTS = 8
# The most tokens a request drafts in a step that tries drafts where steps without have been
# faster: a try costs little even where many requests run, and tells the gate as much.
TRY_DRAFTS = 2
# Under suffix decoding, where steps without drafts have been faster, the requests whose drafts
# are estimated each step (in turn), and the tokens of TRY_DRAFTS one must be expected to keep
# to have the gate try drafts.
EVIDENCE_CHECKS = 2
EVIDENCE = 1.0


class Drafter:
    """Drafts each running request's next tokens before a step is scheduled: from its
    prediction where it has one (OpenAI's Predicted Outputs, `core/prediction.py`), and, with
    a speculative `config`, the others' from the sequence itself (n-gram), or, in
    `ModelDrafter` (`worker/draft_model.py`), by a draft model."""

    def __init__(self, config: SpeculativeConfig | None = None) -> None:
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}
        self._predictions: dict[str, Prediction] = {}
        # The most tokens each request drafts next (`kept`); absent: num_speculative_tokens.
        self._lengths: dict[str, int] = {}
        # Without `disable_by_batch_size`, whether drafts pay is measured (`draft_gate.py`).
        self.gate = DraftGate()
        self._cap: int | None = None  # TRY_DRAFTS in a step that tries drafts
        self._turn = 0  # where the next evidence check starts among the requests
        self.suffix: SuffixCache | None = None
        if config is not None and config.method == "suffix":
            self.suffix = SuffixCache(config.suffix)

    def draft_step(self, requests: list[Request], running: int) -> None:
        """Draft for the requests a step just advanced, `running` requests in all: those with
        a prediction always; the others none while more run than `disable_by_batch_size`, or,
        without it, where the gate finds that steps of this size gain nothing by drafts."""
        others = []
        for request in requests:
            request.draft_token_ids = []
            if self.suffix is not None:  # every output counts, drafted or not
                self.suffix.observe(request.request_id, request.output_token_ids)
            if request.sampling_params.prediction:
                self.draft_prediction(request)
            else:
                others.append(request)
        if self.config is None or not others:
            return
        limit = self.config.disable_by_batch_size
        if running <= limit if limit is not None else self.gate.drafts(running):
            trying = limit is None and self.gate.tries_drafts(running)
        elif limit is None and self._evidence(others) and self.gate.try_drafts(running):
            trying = True
        else:
            return
        self._cap = TRY_DRAFTS if trying else None
        try:
            self.draft_all(others)
        finally:
            self._cap = None

    def _evidence(self, requests: list[Request]) -> bool:
        """Under suffix decoding, whether one of `EVIDENCE_CHECKS` of the requests (in turn
        from step to step) has a draft whose first `TRY_DRAFTS` tokens are expected to keep
        `EVIDENCE` tokens: replies that repeat earlier ones, worth a try of drafts."""
        if self.suffix is None or not requests:
            return False
        start = self._turn % len(requests)
        self._turn += EVIDENCE_CHECKS
        for offset in range(min(EVIDENCE_CHECKS, len(requests))):
            request = requests[(start + offset) % len(requests)]
            count = self.wanted(request, TRY_DRAFTS)
            if (
                count
                and self.suffix.best(request.request_id, request.all_token_ids, count).score
                >= EVIDENCE
            ):
                return True
        return False

    def observe(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `rows` requests, with drafts or without, gave `tokens` output
        tokens in `seconds` (its drafting included)."""
        self.gate.observe(rows, drafted, tokens, seconds)

    def draft_all(self, requests: list[Request]) -> None:
        """Set each request's `draft_token_ids` for its next step."""
        for request in requests:
            self.draft(request)

    def draft(self, request: Request) -> None:
        """Set `request.draft_token_ids` for its next step: none where it cannot speculate
        or may write at most one more token."""
        request.draft_token_ids = []
        count = self.wanted(request, self.most(request))
        if not count:
            return
        if self.suffix is not None:
            self.suffix.observe(request.request_id, request.output_token_ids)
            drafts = self.suffix.draft(request.request_id, request.all_token_ids, count)
            request.draft_token_ids = self.allowed(request, drafts)
            return
        index = self._indexes.get(request.request_id)
        if index is None:
            config = self.config
            assert config is not None
            index = NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max)
            self._indexes[request.request_id] = index
        request.draft_token_ids = self.allowed(request, index.draft(request.all_token_ids, count))

    def draft_prediction(self, request: Request) -> None:
        """Set `request.draft_token_ids` from its prediction, where the reply stands in it."""
        prediction = self._predictions.get(request.request_id)
        if prediction is None:
            prediction = Prediction(request.sampling_params.prediction)
            self._predictions[request.request_id] = prediction
        count = self.wanted(request, PREDICTION_DRAFTS)
        drafts = prediction.draft(request.output_token_ids, count) if count else []
        request.draft_token_ids = self.allowed(request, drafts)

    def most(self, request: Request) -> int:
        """The most tokens the request drafts next by the config's method: one more than its
        last step kept, up to `num_speculative_tokens` (suffix decoding: always up to that, its
        drafts end where their estimated chance runs out); `TRY_DRAFTS` in a step that tries
        drafts."""
        assert self.config is not None
        most = self.config.num_speculative_tokens
        if self.suffix is None:
            most = self._lengths.get(request.request_id, most)
        return most if self._cap is None else min(most, self._cap)

    def ceiling(self, params: SamplingParams) -> int | None:
        """The most drafts a step of a request with `params` may verify (None: it never
        drafts)."""
        if params.prediction:
            return PREDICTION_DRAFTS
        return self.config.num_speculative_tokens if self.config is not None else None

    @staticmethod
    def wanted(request: Request, most: int) -> int:
        """How many tokens, up to `most`, to draft for the request's next step: 0 where it
        cannot speculate or may write at most one more token."""
        room = request.max_output_tokens - request.num_output_tokens - 1
        if room <= 0 or request.is_finished or not speculates(request):
            return 0
        return min(most, room)

    @staticmethod
    def allowed(request: Request, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the request's format refuses."""
        if drafts and request.grammar is not None:
            return drafts[: request.grammar.validate_tokens(drafts)]
        return drafts

    def kept(self, request_id: str, kept: int) -> None:
        """A step kept `kept` of the request's drafts: it drafts one more than that next time
        (so a request whose text stops repeating spends one row a step on drafts, and one that
        repeats grows back); a prediction's drafts stay as long as its reply allows, and suffix
        decoding's as their estimated chance does."""
        if self.config is not None and self.suffix is None:
            self._lengths[request_id] = min(kept + 1, self.config.num_speculative_tokens)

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._indexes.pop(request_id, None)
            self._predictions.pop(request_id, None)
            self._lengths.pop(request_id, None)
            if self.suffix is not None:
                self.suffix.stop(request_id)


def speculates(request: Request) -> bool:
    """Whether the request's next tokens may be drafted: each depends only on its row's logits
    and the tokens before it (as `Sampler` processes them; its logprobs are its row's too), and
    its tokens are all on the host."""
    return (
        request.num_pending_tokens == 0
        and request.deferred_grammar is None
        and (request.thought is None or request.thought.done)
        and request.forced_token is None
        and request.images is None
    )
