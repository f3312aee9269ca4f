"""Batched sampling: logits processing, greedy and random choice, logprobs.

Every row's choice is tensor work over the whole batch: penalties, `min_tokens`, logit bias and
grammars each touch all their rows in one operation, with no per-row device work or host sync.
Rows with top-p and no top-k are drawn on a GPU by a Triton kernel that needs nothing from the
host; elsewhere `top_k_top_p` finds what each row keeps without sorting the vocabulary.
A random row's token is where a uniform draw falls in the running sum of its probabilities
(on a CPU in Conveyor's nucleus kernel, which finds the row's top-k and top-p itself); on a
GPU it wins the exponential race instead (noise for every token: cheap there, about ten times
the work of the running sum on a CPU). A
request with a seed draws each token from a uniform (or noise) keyed by its seed and the
token's position in its output, so its tokens depend neither on what else shares the batch nor
on how many tokens a step gives it (speculation's drafts verified or not).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from engine.core.bad_words import banned_tokens
from engine.core.outputs import NO_TOKEN, TokenLogprob
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.kernels.cpu import ops as cpu_ops
from engine.worker.logits_processors import LogitsProcessor, apply_processors, keeps_argmax
from engine.worker.top_k_top_p import row_top_ks, top_k_top_p
from engine.worker.transfer import HostCopy, to_device

# A token processing ruled out has a logprob of -inf, which JSON cannot carry: reported as this,
# as vLLM reports it.
LOWEST_LOGPROB = -9999.0


def position_key(seed: int, position: int) -> int:
    """A 64-bit generator seed for the token at `position` of a request seeded `seed`
    (splitmix64 of the two, so neighbouring seeds and positions draw unrelated noise)."""
    mask = 2**64 - 1
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass(slots=True)
class SampledTokens:
    """A step's choices still on the device: `token_ids[i]` is row i's token, and `logprobs`
    the rows' scores as `--logprobs-mode` reports them, when some row asked for logprobs."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None

    def to_host(self, requests: list[Request]) -> SamplerOutput:
        """Wait for the choices and bring them over, with each row's logprobs if it asked."""
        return self.start_copy(requests).wait()

    def start_copy(self, requests: list[Request]) -> SampledCopy:
        """Start bringing the choices (and the logprobs the rows asked for) to the host; on a
        GPU the copy is queued right behind the sampling, so waiting for it does not wait for
        a step launched after."""
        wanted = [r.sampling_params.logprobs for r in requests]
        tensors = [self.token_ids]
        if self.logprobs is not None:
            tensors += logprob_tensors(self.logprobs, self.token_ids, wanted)
        return SampledCopy(HostCopy(tensors), wanted if self.logprobs is not None else None)


@dataclass(slots=True)
class SampledCopy:
    copy: HostCopy
    wanted: list[int | None] | None  # each row's logprobs count, when any row asked

    def wait(self) -> SamplerOutput:
        token_ids, *rest = self.copy.wait()
        ids = token_ids.tolist()
        if self.wanted is None:
            return SamplerOutput(ids, [None] * len(ids))
        return SamplerOutput(ids, logprob_entries(ids, rest, self.wanted))


class Sampler:
    def __init__(
        self,
        vocab_size: int,
        device: torch.device,
        seed: int = 0,
        triton_kernels: bool = False,
        logprobs_mode: str = "raw_logprobs",
        race: bool | None = None,
    ) -> None:
        """`triton_kernels` (`engine.kernels.triton.sampling`): rows with top-p and no top-k
        draw in a kernel that needs nothing from the host, rather than in a `topk` search that
        asks the host whether their nucleus reaches past it; seeded rows' noise comes from one
        launch for them all, rather than from a generator per row, one call each.
        `logprobs_mode`: what logprobs report (`engine.core.config.LOGPROBS_MODES`).
        `race`: random rows run the exponential race (noise for every token) rather than the
        running sum; by default on a GPU, and always with the Triton kernels, whose top-p
        kernel races."""
        self.vocab_size = vocab_size
        self.device = device
        self.triton_kernels = triton_kernels
        self.logprobs_mode = logprobs_mode
        self.race = device.type != "cpu" if race is None else race
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        # The deployment's own (`--logits-processors`), before Conveyor's rules.
        self.processors: list[LogitsProcessor] = []

    @property
    def keeps_argmax(self) -> bool:
        """Whether the deployment's processors leave every row's argmax where it was (a
        greedy row may then be chosen inside the model)."""
        return keeps_argmax(self.processors)

    @property
    def route(self) -> str:
        if self.triton_kernels:
            return "Triton kernels (top-p pivoting, seeded noise in one launch)"
        if self._races:
            draws = "the exponential race"
        elif self.device.type == "cpu" and cpu_ops.has("elementwise"):
            draws = "a running sum in Conveyor's nucleus kernel"
        else:
            draws = "a running sum"
        return f"torch (top-p by topk or histogram, draws by {draws}, a generator per seeded row)"

    @property
    def _races(self) -> bool:
        return self.triton_kernels or self.race

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        return self.sample(logits, requests).to_host(requests)

    def sample(
        self, logits: torch.Tensor, requests: list[Request], pending: PendingTokens | None = None
    ) -> SampledTokens:
        """Choose each row's token, leaving the result on the device. `pending` holds the
        tokens a step still in flight sampled for some of these requests (async scheduling):
        penalties count them there, without waiting for them."""
        logits = logits.float()
        wanted = any(r.sampling_params.logprobs is not None for r in requests)
        raw = self.logprobs_mode.startswith("raw")
        scores = raw_scores(logits, self.logprobs_mode) if wanted and raw else None
        logits = self._process(logits, requests, pending)
        if wanted and not raw:
            processed = sampled_scores(logits, [r.sampling_params for r in requests])
            logits_only = self.logprobs_mode == "processed_logits"
            scores = processed if logits_only else torch.log_softmax(processed, dim=-1)
        positions = [r.num_sampled_tokens for r in requests]
        choice = self._choose(logits, requests, positions)
        return SampledTokens(_none_where_ruled_out(choice, logits, requests), scores)

    def choose(
        self, logits: torch.Tensor, requests: list[Request], positions: list[int]
    ) -> torch.Tensor:
        """Each row's token as `sample` chooses it for the token at `positions[row]` of its
        request's output, from what `requests[row]` holds as it stands: its tokens (penalties,
        bad words, `min_tokens`) and its matcher's state. Speculation verifies drafts by it: a
        draft is kept where it is the token a step would have drawn there."""
        logits = self._process(logits.float(), requests)
        return _none_where_ruled_out(self._choose(logits, requests, positions), logits, requests)

    # ---- logits processing -----------------------------------------------------------------

    def _process(
        self, logits: torch.Tensor, requests: list[Request], pending: PendingTokens | None = None
    ) -> torch.Tensor:
        if self.processors:
            logits = apply_processors(self.processors, logits, requests)
        _apply_grammars(logits, requests)
        _apply_allowed_tokens(logits, requests)
        _apply_bad_words(logits, requests)
        _apply_logit_bias(logits, requests)
        _apply_repetition_penalty(logits, requests, pending)
        _apply_frequency_presence(logits, requests, pending)
        _apply_min_tokens(logits, requests)
        _apply_forced(logits, requests)
        return logits

    # ---- choice ----------------------------------------------------------------------------

    def _choose(
        self, logits: torch.Tensor, requests: list[Request], positions: list[int]
    ) -> torch.Tensor:
        """Each row's token; `positions[row]` is where it lies in its request's output (a
        seeded request's noise is keyed by it)."""
        greedy = [r.sampling_params.greedy for r in requests]
        if all(greedy):
            return row_argmax(logits)
        params = [r.sampling_params for r in requests]
        scaled = _scaled(logits, params)
        if self._races:
            nucleus = self._nucleus_rows(params)
            # The nucleus rows are drawn by the kernel instead: their whole vocabulary is kept.
            _, probs = _kept(scaled, params, [*nucleus, *_greedy_rows(params)])
            noise = self._exponential_noise(probs, requests, positions)
            choice = row_argmax(probs.div_(noise))
            if nucleus:
                rows = to_device(nucleus, logits.device, torch.int64)
                nucleus_params = [params[row] for row in nucleus]
                choice[rows] = _nucleus_choice(scaled, noise, nucleus_params, rows)
        else:
            choice = _running_sum_choice(scaled, params, self._uniforms(requests, positions))
        if any(greedy):
            mask = to_device(greedy, logits.device)
            choice = torch.where(mask, row_argmax(logits), choice)
        return choice

    def _nucleus_rows(self, params: list[SamplingParams]) -> list[int]:
        """The rows the nucleus kernel draws: top-p without top-k, not greedy."""
        if not self.triton_kernels:
            return []
        return [
            row
            for row, p in enumerate(params)
            if p.top_p < 1.0 and not p.uses_top_k and not p.greedy
        ]

    def _uniforms(self, requests: list[Request], positions: list[int]) -> torch.Tensor:
        """One U[0, 1) draw per row; a seeded row's keyed by its seed and `positions[row]`."""
        values = torch.rand(len(requests), generator=self._generator, device=self.device)
        for row, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is not None:
                generator = self._keyed(seed, positions[row])
                values[row] = torch.rand(1, generator=generator, device=self.device)[0]
        return values

    def _keyed(self, seed: int, position: int) -> torch.Generator:
        """The generator of a request seeded `seed`, for its token at `position`."""
        generator = torch.Generator(device=self.device)
        generator.manual_seed(position_key(seed, position))
        return generator

    def _exponential_noise(
        self, probs: torch.Tensor, requests: list[Request], positions: list[int]
    ) -> torch.Tensor:
        """Exp(1) noise: argmax(p / noise) is a sample from p (the exponential race). A seeded
        row's noise is keyed by its seed and `positions[row]`."""
        noise = torch.empty_like(probs)
        unseeded = [row for row, r in enumerate(requests) if r.sampling_params.seed is None]
        if len(unseeded) == len(requests):
            return noise.exponential_(generator=self._generator)
        if unseeded:
            rows = to_device(unseeded, probs.device)
            noise[rows] = torch.empty_like(noise[rows]).exponential_(generator=self._generator)
        seeded = [row for row, r in enumerate(requests) if r.sampling_params.seed is not None]
        seeds = [cast(int, requests[row].sampling_params.seed) for row in seeded]
        at = [positions[row] for row in seeded]
        if self.triton_kernels:
            from engine.kernels.triton.sampling import seeded_noise

            seeded_noise(noise, to_device(seeded, noise.device, torch.int64), seeds, at)
            return noise
        for row, seed, position in zip(seeded, seeds, at, strict=True):
            noise[row].exponential_(generator=self._keyed(seed, position))
        return noise


def _greedy_rows(params: list[SamplingParams]) -> list[int]:
    return [row for row, p in enumerate(params) if p.greedy]


def _scaled(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Each sampled row divided by its temperature (a greedy row as it is)."""
    temps = to_device([1.0 if p.greedy else p.temperature for p in params], logits.device)
    return logits / temps[:, None]


def _running_sum_choice(
    scaled: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """Each random row's token by the running sum of its kept tokens' probabilities: in the
    CPU's nucleus kernel where it runs (a row's top-k and top-p found without a sort), else
    over the whole vocabulary with what top-k, top-p and min-p rule out at 0 (`inverse_cdf`). A
    greedy row gets 0, a placeholder its argmax replaces."""
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    draw = _nucleus_kernel_choice if _cpu_kernels_take(scaled) else _whole_vocabulary_choice
    if len(drawn) == len(params):
        return draw(scaled, params, uniforms)
    choice = torch.zeros(len(params), dtype=torch.int64, device=scaled.device)
    if drawn:
        index = to_device(drawn, scaled.device, torch.int64)
        choice[index] = draw(scaled[index], [params[row] for row in drawn], uniforms[index])
    return choice


def _cpu_kernels_take(values: torch.Tensor) -> bool:
    """Whether Conveyor's CPU elementwise kernels (argmax, token mask, nucleus draw) take
    `values`: fp32 on the CPU, where they built."""
    return (
        values.device.type == "cpu" and values.dtype == torch.float32 and cpu_ops.has("elementwise")
    )


def _nucleus_kernel_choice(
    scaled: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    return cpu_ops.nucleus_draw(
        scaled.contiguous(),
        torch.tensor(row_top_ks(params, scaled.shape[1]), dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        torch.tensor([p.min_p for p in params], dtype=torch.float32),
        uniforms.float().contiguous(),
    )


def _whole_vocabulary_choice(
    scaled: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    _, probs = _kept(scaled, params, [])
    return inverse_cdf(probs, uniforms)


def _kept(
    scaled: torch.Tensor, params: list[SamplingParams], whole: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature-scaled logits with the tokens each row's top-k, top-p and min-p rule out at
    -inf, and each row's probabilities with those tokens at 0 (not renormalized after min-p:
    sampling draws the same either way); the rows in `whole` keep every token."""
    apart = set(whole)
    limited = [(p.uses_top_k or p.top_p < 1.0) and row not in apart for row, p in enumerate(params)]
    if any(limited):
        kept = [p if limit else KEEP_ALL for p, limit in zip(params, limited, strict=True)]
        scaled = top_k_top_p(scaled, kept)
    probs = torch.softmax(scaled, dim=-1)
    min_p = [0.0 if row in apart else p.min_p for row, p in enumerate(params)]
    if any(min_p):
        floor = probs.max(dim=-1, keepdim=True).values * to_device(min_p, scaled.device)[:, None]
        below = probs < floor
        scaled = scaled.masked_fill(below, float("-inf"))
        probs = probs.masked_fill(below, 0.0)
    return scaled, probs


def raw_scores(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The model's own scores as a raw `--logprobs-mode` reports them: their log-softmax, or a
    copy of the logits (processing then changes the logits in place)."""
    return logits.clone() if mode == "raw_logits" else torch.log_softmax(logits, dim=-1)


def sampled_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The processed logits as sampling draws from them: each sampled row divided by its
    temperature, and the tokens its top-k, top-p and min-p rule out at -inf (a greedy row as
    the processing left it)."""
    scores, _ = _kept(_scaled(logits, params), params, _greedy_rows(params))
    return scores


def _nucleus_choice(
    scaled: torch.Tensor, noise: torch.Tensor, params: list[SamplingParams], rows: torch.Tensor
) -> torch.Tensor:
    from engine.kernels.triton.sampling import nucleus_sample

    device = scaled.device
    top_p = to_device([p.top_p for p in params], device)
    return nucleus_sample(scaled, noise, rows, top_p, to_device([p.min_p for p in params], device))


def takes_argmax(requests: list[Request]) -> bool:
    """Every request's next token is the argmax of its raw logits, as the sampler would choose
    it: greedy, no logprobs, and nothing that changes the logits first (a logit bias,
    penalties, a `min_tokens` ban still in force). The model may then choose the tokens itself
    without handing the logits over."""
    return all(_argmax_of_raw_logits(request) for request in requests)


def _argmax_of_raw_logits(request: Request) -> bool:
    params = request.sampling_params
    return (
        params.greedy
        and request.grammar is None
        and request.forced_token is None
        and params.logprobs is None
        and not params.logit_bias
        and params.allowed_token_ids is None
        and not request.bad_words
        and not params.needs_penalties
        and request.num_sampled_tokens >= params.min_tokens
    )


def _ruling_rows(requests: list[Request]) -> list[int]:
    """The rows whose requests' rules can rule out every token: a format, `allowed_token_ids`,
    bad words or a `min_tokens` ban in force."""
    return [
        row
        for row, request in enumerate(requests)
        if request.grammar is not None
        or request.sampling_params.allowed_token_ids
        or request.bad_words
        or request.num_sampled_tokens < request.sampling_params.min_tokens
    ]


def _none_where_ruled_out(
    choice: torch.Tensor, logits: torch.Tensor, requests: list[Request]
) -> torch.Tensor:
    """`choice` with NO_TOKEN where a request's rules left its row no token: the chosen
    token's logit is -inf, as only a row with nothing allowed chooses such a token. On the
    device, without waiting."""
    rows = _ruling_rows(requests)
    if not rows:
        return choice
    index = to_device(rows, logits.device, torch.int64)
    chosen = choice[index]
    empty = torch.isneginf(logits[index, chosen.clamp(min=0)])
    choice[index] = torch.where(empty, torch.full_like(chosen, NO_TOKEN), chosen)
    return choice


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's token drawn from its `weights` (`[rows, vocab]`, not necessarily summing to
    1): the first token whose running sum of weights passes `uniforms[row]` of the row's total.
    A token of no weight is never drawn (its running sum equals its predecessor's); a row of no
    weight at all gets its last token, which the caller reads as ruled out. On the device,
    without waiting."""
    cdf = weights.cumsum(dim=-1)  # summed in double on the CPU, stored as the weights are
    total = cdf[:, -1:]
    # Strictly below the total, so that some token's running sum passes it.
    point = torch.minimum(
        uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total))
    )
    token = torch.searchsorted(cdf, point.to(cdf.dtype), right=True).squeeze(1)
    return token.clamp_(max=weights.shape[-1] - 1)


def row_argmax(values: torch.Tensor) -> torch.Tensor:
    """`values.argmax(dim=-1)` for `[rows, vocab]`: Conveyor's CPU kernel for fp32 on the CPU
    (it compares eight lanes at a time where torch compares one element), else torch's."""
    if _cpu_kernels_take(values) and values.is_contiguous():
        return cpu_ops.argmax_rows(values)
    return values.argmax(dim=-1)


def token_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_counts: list[int | None]
) -> list[TokenLogprob | None]:
    """Logprob and rank of `token_ids[i]` in row i, with the row's `top_counts[i]` best
    alternatives; rows whose count is None get None. One host transfer for the batch."""
    tensors = logprob_tensors(logprobs, token_ids, top_counts)
    return logprob_entries(token_ids.tolist(), [t.cpu() for t in tensors], top_counts)


def logprob_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_counts: list[int | None]
) -> list[torch.Tensor]:
    """On the device: each row's chosen logprob and its rank, then, when some row wants
    alternatives, the values and ids of the most any row wants."""
    chosen = logprobs.gather(1, token_ids.clamp(min=0)[:, None])[:, 0]  # NO_TOKEN: any
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1
    top_k = max((k for k in top_counts if k), default=0)
    if not top_k:
        return [chosen, ranks]
    top_values, top_ids = logprobs.topk(top_k, dim=-1)
    return [chosen, ranks, top_values, top_ids]


def logprob_entries(
    token_ids: list[int], tensors: list[torch.Tensor], top_counts: list[int | None]
) -> list[TokenLogprob | None]:
    """`logprob_tensors`' results, on the host, as each row's entry."""
    chosen, ranks, *top = (t.tolist() for t in tensors)
    values, top_ids = top if top else ([], [])
    result: list[TokenLogprob | None] = []
    for row, count in enumerate(top_counts):
        if count is None:
            result.append(None)
            continue
        best: tuple[tuple[int, float], ...] = ()
        if count:
            shown = (max(value, LOWEST_LOGPROB) for value in values[row][:count])
            best = tuple(zip(top_ids[row][:count], shown, strict=False))
        chosen_value = max(chosen[row], LOWEST_LOGPROB)
        result.append(TokenLogprob(token_ids[row], chosen_value, ranks[row], best))
    return result


def _apply_forced(logits: torch.Tensor, requests: list[Request]) -> None:
    """A row whose next token is forced (a spent thought budget's closing tag) can sample only
    that token, whatever else ruled on it."""
    for row, request in enumerate(requests):
        token = request.forced_token
        if token is not None:
            logits[row].fill_(float("-inf"))
            logits[row, token] = 0.0


def _apply_grammars(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rule out every token a request's format does not allow next: each constrained row's
    matcher fills its row of one bitmask for the step (a bit per token), applied to all those
    rows at once (in one C++ pass over fp32 logits on the CPU)."""
    rows = [row for row, request in enumerate(requests) if request.grammar is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    bits = np.zeros((len(rows), (vocab + 31) // 32), dtype=np.int32)
    for k, row in enumerate(rows):
        requests[row].grammar.unsafe_compute_mask_ptr(bits[k].ctypes.data, bits[k].nbytes)
    if _cpu_kernels_take(logits) and logits.is_contiguous():
        cpu_ops.apply_token_bitmask(logits, torch.from_numpy(bits), torch.tensor(rows))
        return
    allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    index = to_device(rows, logits.device)
    banned = torch.from_numpy(allowed == 0).to(logits.device)
    logits[index] = logits[index].masked_fill(banned, float("-inf"))


def _apply_allowed_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rule out every token outside a row's `allowed_token_ids`: every such row at once."""
    rows = [r for r, request in enumerate(requests) if request.sampling_params.allowed_token_ids]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [requests[row] for row in rows]
    lists = [list(r.sampling_params.allowed_token_ids or ()) for r in chosen]
    which, tokens = _token_rows(chosen, lists, vocab, device, pending=None)
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    allowed[which, tokens] = True
    index = to_device(rows, device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def _apply_bad_words(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rule out each row's tokens that would complete one of its bad words (`bad_words`), all
    rows in one indexed write. A word spanning tokens needs the row's newest token on the host:
    a step sampling such a row is waited for before the next is scheduled."""
    rows = [r for r, request in enumerate(requests) if request.bad_words]
    if not rows:
        return
    chosen = [requests[r] for r in rows]
    lists = [banned_tokens(r.bad_words, r.output_token_ids) for r in chosen]
    which, tokens = _token_rows(chosen, lists, logits.shape[-1], logits.device, None)
    index = to_device(rows, logits.device, torch.int64)
    logits[index[which], tokens] = float("-inf")


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for row, request in enumerate(requests):
        for token_id, bias in (request.sampling_params.logit_bias or {}).items():
            rows.append(row)
            cols.append(token_id)
            values.append(bias)
    if rows:
        device = logits.device
        index = (to_device(rows, device), to_device(cols, device))
        logits.index_put_(index, to_device(values, device), accumulate=True)


@dataclass(frozen=True, slots=True)
class PendingTokens:
    """What the step in flight sampled, on the device: request `r`'s token is
    `tokens[rows[r]]`. It is not in the request's token lists yet."""

    tokens: torch.Tensor
    rows: dict[str, int]


def _token_rows(
    requests: list[Request],
    token_lists: list[list[int]],
    vocab: int,
    device: torch.device,
    pending: PendingTokens | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (row, token) pairs of several rows' token lists as two index tensors, built in one
    host pass and one transfer (tokens past the logits' width are dropped); then each row's
    pending token, taken on the device, if its request (`requests[row]`) has one."""
    lengths = np.fromiter((len(tokens) for tokens in token_lists), np.int64, len(token_lists))
    tokens = np.fromiter(itertools.chain.from_iterable(token_lists), np.int64, int(lengths.sum()))
    rows = np.repeat(np.arange(len(token_lists)), lengths)
    keep = tokens < vocab
    which = torch.from_numpy(rows[keep]).to(device, non_blocking=True)
    ids = torch.from_numpy(tokens[keep]).to(device, non_blocking=True)
    waiting = [row for row, r in enumerate(requests) if r.num_pending_tokens]
    if not waiting or pending is None:
        return which, ids
    source = to_device([pending.rows[requests[row].request_id] for row in waiting], device)
    return (
        torch.cat([which, to_device(waiting, device, torch.int64)]),
        torch.cat([ids, pending.tokens[source]]),
    )


def _apply_repetition_penalty(
    logits: torch.Tensor, requests: list[Request], pending: PendingTokens | None = None
) -> None:
    """Divide positive and multiply negative logits of every token seen (prompt or output) by
    the row's penalty: every such row at once."""
    rows = [row for row, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [requests[row] for row in rows]
    which, tokens = _token_rows(chosen, [r.all_token_ids for r in chosen], vocab, device, pending)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    seen[which, tokens] = True
    penalty = to_device([requests[row].sampling_params.repetition_penalty for row in rows], device)
    penalty = penalty[:, None]
    index = to_device(rows, device)
    values = logits[index]
    penalised = torch.where(values > 0, values / penalty, values * penalty)
    logits[index] = torch.where(seen, penalised, values)


def _apply_frequency_presence(
    logits: torch.Tensor, requests: list[Request], pending: PendingTokens | None = None
) -> None:
    """OpenAI's penalties: minus `frequency` times a token's count in the output, minus
    `presence` if it occurs at all; every such row at once."""
    rows = [
        row
        for row, r in enumerate(requests)
        if r.num_sampled_tokens
        and (r.sampling_params.presence_penalty or r.sampling_params.frequency_penalty)
    ]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    chosen = [requests[row] for row in rows]
    which, tokens = _token_rows(
        chosen, [r.output_token_ids for r in chosen], vocab, device, pending
    )
    counts = torch.zeros(len(rows), vocab, device=device)
    counts.index_put_((which, tokens), torch.ones_like(tokens, dtype=counts.dtype), True)
    params = [requests[row].sampling_params for row in rows]
    frequency = to_device([p.frequency_penalty for p in params], device)[:, None]
    presence = to_device([p.presence_penalty for p in params], device)[:, None]
    index = to_device(rows, device)
    logits[index] = logits[index] - frequency * counts - presence * (counts > 0).float()


def _apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rule out EOS and the stop token ids of rows still short of `min_tokens`, in one write."""
    rows: list[int] = []
    cols: list[int] = []
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.sampling_params
        if request.num_sampled_tokens >= params.min_tokens:
            continue
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= request.eos_token_ids
        banned = [t for t in stops if t < vocab]
        rows += [row] * len(banned)
        cols += banned
    if rows:
        device = logits.device
        index = (to_device(rows, device), to_device(cols, device))
        logits[index] = float("-inf")


# Parameters that keep every token (for rows whose top-p is applied elsewhere).
KEEP_ALL = SamplingParams()
