"""Continuous batching: which requests run how many tokens in the next step.

There is no prefill or decode phase. Each step has a token budget; a running request asks for
`num_tokens - num_computed_tokens` tokens (one when decoding, the rest of its prompt when a
prefill was chunked), and waiting requests are admitted while budget, sequence slots and blocks
last. When blocks run out, the running request the policy ranks last (under fcfs the most
recently admitted) is preempted: it gives back its blocks and returns to the waiting queue to be
recomputed later. Under the priority policy a waiting request also preempts running requests of
lower priority when it cannot otherwise get blocks or a sequence slot.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.core.config import SchedulerConfig
from engine.core.errors import PromptTooLongError
from engine.core.outputs import ModelRunnerOutput
from engine.core.request import FinishReason, Request, RequestStatus
from engine.kv.block_manager import BlockManager
from engine.scheduling.adapters import adapter_gate
from engine.scheduling.admission import (
    AdmissionLimits,
    Decision,
    DrainRate,
    QueueState,
    decide,
    fewest_new_tokens,
)
from engine.scheduling.encoder_budget import EncoderBudget
from engine.scheduling.policy import SchedulingPolicy


@dataclass(slots=True)
class ScheduledRequest:
    """`num_tokens` of `request` to run from its `start` (its computed tokens when scheduled);
    `completes_sequence` when they reach its last token, so the step samples a new one. Both
    are fixed when scheduled: the request moves on before an overlapped step's results arrive.
    A decoding request may also run `drafts`, tokens drafted to follow its last one
    (`core/speculation.py`): `num_tokens` counts them, and the step verifies them. A recurrent
    model's request may first take its states from the snapshot row `restore` (a cached prefix
    it resumes from), and leave them after the step in the row `save` (reserved, with its
    generation: `kv/state_snapshots.py`); where it verifies drafts, each row after its first
    keeps its states in one of the step's borrowed `draft_slots`."""

    request: Request
    num_tokens: int
    drafts: list[int] = field(default_factory=list)
    draft_slots: list[int] = field(default_factory=list)
    restore: int | None = None
    save: tuple[int, int] | None = None
    start: int = field(init=False)
    completes_sequence: bool = field(init=False)

    def __post_init__(self) -> None:
        self.start = self.request.num_computed_tokens
        self.completes_sequence = self.start + self.num_tokens >= self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def decodes(self) -> bool:
        """A decode step's item: one token, or one and the drafts after it."""
        return self.num_tokens == 1 or bool(self.drafts)


@dataclass(slots=True)
class SchedulerOutput:
    """What to run this step: requests in batch order with their token counts."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Waiting and running queues over one block manager. Imports no torch."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.clock = clock
        self.policy = SchedulingPolicy(config.policy, config.max_priority_wait)
        self.admission_limits = AdmissionLimits(
            config.max_waiting_requests, config.max_queued_tokens, config.admission_soft_limit
        )
        self.drain = DrainRate()
        self.num_rejections = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._batch_closed = False
        self._others = False  # whether any request but background ones wants capacity
        self._forks: dict[str, list[Request]] = {}
        # The state slots the last step borrowed for its drafts' rows (`_with_drafts`).
        self._lent: list[int] = []

    # ---- admission -------------------------------------------------------------------------

    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence that can ever be held: context limit or whole cache."""
        return min(self.config.max_model_len, self.block_manager.num_tokens_capacity)

    def check_prompt(self, num_prompt_tokens: int) -> None:
        """Refuse a prompt that could never run (it needs room for at least one new token)."""
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise PromptTooLongError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"has {num_prompt_tokens} tokens, leaving no room for a completion. Please "
                f"reduce the length of the prompt.",
                param="prompt",
            )
        capacity = self.block_manager.num_tokens_capacity
        if num_prompt_tokens >= capacity:
            raise PromptTooLongError(
                f"The prompt has {num_prompt_tokens} tokens but the KV cache holds only "
                f"{capacity} tokens in all. Please reduce the length of the prompt.",
                param="prompt",
            )

    def admission(
        self, promised_tokens: int, priority: int, pending: int = 0, pending_tokens: int = 0
    ) -> Decision:
        """Admit, defer or reject a new request promising `promised_tokens` (prompt plus its
        most output); `pending` requests are on their way into the queue. Under the priority
        policy only waiting requests of the same or higher priority count against the queue
        limits, so low-priority traffic is turned away first."""
        ahead = [r for r in self.waiting if not self.policy.uses_priority or r.priority <= priority]
        queued = sum(r.num_prompt_tokens + r.max_output_tokens for r in ahead)
        state = QueueState(len(ahead) + pending, queued + pending_tokens, self.block_manager.usage)
        decision = decide(self.admission_limits, state, promised_tokens, priority > 0, self.drain)
        if decision.outcome.value == "reject":
            self.num_rejections += 1
        return decision

    def num_deferred(self) -> int:
        """Waiting requests held back by the soft limit rather than by capacity."""
        if self.block_manager.usage < self.config.admission_soft_limit:
            return 0
        return sum(r.deferred for r in self.waiting)

    def add_request(self, request: Request, fork_of: str | None = None) -> None:
        """Queue a request. With `fork_of` (a waiting request with the same prompt), it waits
        until that one has computed the prompt, then shares its blocks instead of recomputing
        them, unless it wants its prompt's logprobs."""
        self.check_prompt(request.num_prompt_tokens)
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        request.max_total_tokens = min(request.max_total_tokens, self.max_sequence_tokens)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        leader = self.requests.get(fork_of) if fork_of is not None else None
        if (
            leader is not None
            and leader.num_output_tokens == 0
            and (leader.prompt_token_ids == request.prompt_token_ids)
            and request.sampling_params.prompt_logprobs is None  # those compute their prompt
        ):
            self._forks.setdefault(leader.request_id, []).append(request)
        else:
            self.waiting.append(request)

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self._take_back_lent()
        output = SchedulerOutput()
        now = self.clock()
        self.policy.order_running(self.running, now)
        self._yield_background()
        if self.policy.uses_priority:
            self._preempt_for_priority(output, now)
        encoder = EncoderBudget(self.config.encoder_rows, self.config.enable_chunked_prefill)
        budget, grew_out = self._schedule_running(
            output, self.config.max_num_batched_tokens, encoder
        )
        if not grew_out:
            self._schedule_waiting(output, budget, now, encoder)
        output.block_copies = self.block_manager.take_copies()
        if self.block_manager.snapshots is not None:
            for item in output.scheduled:
                if not item.drafts:  # (where drafts end is known only once they are verified)
                    item.save = self.block_manager.snapshot_row(item.request, item.end)
        return output

    def _schedule_running(
        self, output: SchedulerOutput, budget: int, encoder: EncoderBudget
    ) -> tuple[int, bool]:
        """Schedule running requests; also say whether one had to be preempted to grow. A
        prompt's next chunk stops before images the step's encoder budget cannot take, or
        whose run of tokens it cannot compute whole where they attend both ways."""
        index = 0
        preempted = len(output.preempted)
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if request.num_pending_tokens and _reached_length(request):
                index += 1  # its step in flight sampled its last token: nothing more to run
                continue
            num_tokens = self._chunk(request, budget, encoder)
            if num_tokens == 0:  # its images wait for a step with room for them
                index += 1
                continue
            item = self._with_drafts(request, num_tokens, budget)
            if item is None:
                if not self._allocate_or_preempt(request, num_tokens, output):
                    break
                item = ScheduledRequest(request, num_tokens)
            output.scheduled.append(item)
            budget -= item.num_tokens
            index += 1
        return budget, len(output.preempted) > preempted

    def _with_drafts(
        self, request: Request, num_tokens: int, budget: int
    ) -> ScheduledRequest | None:
        """A decoding request's step with its drafts, as many as the budget, its length and
        free blocks allow (drafts never preempt anyone); None where it runs none."""
        drafts = request.draft_token_ids
        if not drafts or num_tokens != 1 or request.num_tokens - request.num_computed_tokens != 1:
            return None
        limit = min(budget - 1, request.max_total_tokens - request.num_tokens - 1)
        slots = self.block_manager.state_slots
        if slots is not None:  # each row after the first borrows a slot for its states
            limit = min(limit, slots.num_free - len(self.waiting))  # none a waiting one needs
        drafts = drafts[: max(0, limit)]
        target = request.num_computed_tokens + 1 + len(drafts)
        if not drafts or not self.block_manager.allocate(request, target):
            return None
        lent = slots.lend(len(drafts)) if slots is not None else []
        self._lent += lent
        return ScheduledRequest(request, 1 + len(drafts), list(drafts), lent)

    def _take_back_lent(self) -> None:
        """Free the state slots the last step borrowed: it has run (a step that verifies drafts
        runs to its end when launched, and is never overlapped), its kept rows' states copied
        into their requests' slots."""
        slots = self.block_manager.state_slots
        if slots is not None and self._lent:
            slots.take_back(self._lent)
        self._lent = []

    def _chunk(self, request: Request, budget: int, encoder: EncoderBudget) -> int:
        """The tokens `request` computes this step: what it has left, within the budget and
        `long_prefill_token_threshold`, stopping before images the step cannot take (where the
        threshold would leave a run of image tokens that attend both ways unstarted, the step
        runs as much as the budget allows, so the run is never put off for good); a recurrent
        model's prompt stops at the snapshots' grid (`_to_snapshot`)."""
        left = self._to_snapshot(
            request, min(request.num_tokens - request.num_computed_tokens, budget)
        )
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < left:
            capped = _image_cut(request, threshold, encoder)
            if capped:
                return capped
        return _image_cut(request, left, encoder)

    def _to_snapshot(self, request: Request, num_tokens: int) -> int:
        """`num_tokens` of a recurrent model's prompt chunk, cut to end at the last point of the
        snapshots' grid before its last token where it would run past it, so that its states
        there are kept and a later prompt with the same start resumes from them (not where
        prompts run whole: chunked prefill off)."""
        snapshots = self.block_manager.snapshots
        if (
            snapshots is None
            or request.images is not None
            or not self.config.enable_chunked_prefill
        ):
            return num_tokens
        start = request.num_computed_tokens
        last = (request.num_tokens - 1) // snapshots.interval * snapshots.interval
        return last - start if start < last < start + num_tokens else num_tokens

    def _yield_background(self) -> None:
        """Background requests run only in capacity no other request wants: while another
        runs, or waits able to start, running background requests pause (keeping their blocks
        unless those are needed) and waiting ones stay waiting."""
        self._others = any(not r.background for r in self.running) or any(
            not r.background and self._eligible(r) for r in self.waiting
        )
        if not self._others:
            return
        for request in [r for r in self.running if r.background]:
            self.running.remove(request)
            self._pause(request)

    def _eligible(self, request: Request) -> bool:
        """Deferred requests wait until the cache drops below the soft limit; background ones
        while others want the capacity; a preempted one until its step in flight has given its
        token (it recomputes every token it has)."""
        if request.num_pending_tokens or (request.background and self._others):
            return False
        if request.deferred and self.block_manager.usage < self.config.admission_soft_limit:
            request.deferred = False
        return not request.deferred

    def _admissible(self) -> Callable[[Request], bool]:
        """Eligible requests, less low-priority ones once they fill their share of the slots
        (the rest are reserved for urgent requests), and less those whose LoRA adapter would be
        one too many (`adapters.py`)."""
        eligible = self._slot_share()
        max_loras = self.config.max_loras
        if max_loras is None:
            return eligible
        fits = adapter_gate(self.running, lambda: self._ranked(eligible), max_loras)
        return lambda r: eligible(r) and fits(r)

    def _ranked(self, eligible: Callable[[Request], bool]) -> Iterable[Request]:
        """The eligible waiting requests in the order the policy would start them."""
        ranked = (r for r in self.waiting if eligible(r))
        if not self.policy.uses_priority:
            return ranked
        now = self.clock()
        return sorted(ranked, key=lambda r: self.policy.key(r, now))

    def _slot_share(self) -> Callable[[Request], bool]:
        """Eligible requests, less low-priority ones once they fill their share of the slots."""
        reserved = self.config.reserved_seqs if self.policy.uses_priority else 0
        if not reserved:
            return self._eligible
        lows = sum(r.priority > 0 for r in self.running)
        low_slots_full = lows >= self.config.max_num_seqs - reserved
        return lambda r: self._eligible(r) and not (low_slots_full and r.priority > 0)

    def _preempt_for_priority(self, output: SchedulerOutput, now: float) -> None:
        """Make room for waiting requests that outrank running ones: sequence slots first, then
        blocks for the best one's first chunk."""
        admissible = self._admissible()
        self._preempt_for_slots(output, now, admissible)
        candidate = self.policy.pick(self.waiting, now, admissible)
        if candidate is not None and len(self.running) < self.config.max_num_seqs:
            self._preempt_for_blocks(output, now, candidate)

    def _preempt_for_slots(
        self, output: SchedulerOutput, now: float, admissible: Callable[[Request], bool]
    ) -> None:
        """With every slot taken, each waiting request of a better priority class than the
        last running one takes that one's slot, while their prompts fit in this step's token
        budget. The displaced request is paused, not recomputed. Requests of the same class
        never displace each other, so nothing thrashes."""
        slots = self.config.max_num_seqs - len(self.running)
        budget = self.config.max_num_batched_tokens - len(self.running)
        queue = sorted(filter(admissible, self.waiting), key=lambda r: self.policy.key(r, now))
        for index, candidate in enumerate(queue):
            need = candidate.num_tokens - candidate.num_computed_tokens
            if need > budget and index > 0:  # the first one may start with a chunk
                return
            budget -= need
            if slots > 0:
                slots -= 1
                continue
            victim = self._slot_victim(candidate, now)
            if victim is None:
                return
            self.running.remove(victim)
            self._pause(victim)
            output.preempted.append(victim)
            budget += 1

    def _slot_victim(self, candidate: Request, now: float) -> Request | None:
        """The running request to pause for `candidate`: one of the lowest priority class, if
        `candidate` outranks it; of those, one that will miss its deadline anyway, else the one
        with the most time to spare, else the latest to arrive."""
        if not self.running or not self.policy.outranks(candidate, self.running[-1], now):
            return None
        lowest = self.policy.key(self.running[-1], now)[0]
        peers = [r for r in self.running if self.policy.key(r, now)[0] == lowest]
        step = self.drain.step_seconds(len(self.running))

        def spare(ranked: tuple[int, Request]) -> tuple[bool, float, int]:
            rank, request = ranked
            if request.deadline is None:
                return False, math.inf, rank
            fewest = fewest_new_tokens(request.sampling_params, request.max_output_tokens)
            slack = request.deadline - now - max(0, fewest - request.num_output_tokens) * step
            return slack < 0, slack, rank

        return max(enumerate(peers), key=spare)[1]

    def _preempt_for_blocks(self, output: SchedulerOutput, now: float, candidate: Request) -> None:
        """While `candidate` cannot get blocks for its first chunk (once the running ones have
        grown by this step's tokens), free the blocks of lower-ranked waiting requests, then
        preempt lower-ranked running ones."""
        key = self.policy.key(candidate, now)
        manager = self.block_manager
        first_chunk = min(candidate.num_tokens, self.config.max_num_batched_tokens)
        need = manager.blocks_for(first_chunk) - len(candidate.block_ids)
        while True:
            growth = sum(
                max(0, manager.blocks_for(r.num_tokens) - len(r.block_ids)) for r in self.running
            )
            if manager.num_free_blocks >= need + growth:
                return
            if self._release_held(now, spare=candidate, below=key):
                continue
            if not self.running or self.policy.key(self.running[-1], now) <= key:
                return
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)

    def _allocate_or_preempt(
        self, request: Request, num_tokens: int, output: SchedulerOutput
    ) -> bool:
        """Find blocks for the request, taking them from waiting requests that hold some, then
        preempting from the back; False if it was preempted."""
        target = request.num_computed_tokens + num_tokens
        while not self.block_manager.allocate(request, target):
            if self._release_held(self.clock(), spare=request):
                continue
            victim = self.running.pop()
            self._preempt(victim)
            output.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _schedule_waiting(
        self, output: SchedulerOutput, budget: int, now: float, encoder: EncoderBudget
    ) -> None:
        if self.config.static_batching:
            if not self.running:
                self._batch_closed = False
            if self._batch_closed:
                return
        self._admit(output, budget, now, encoder)
        if self.config.static_batching and (
            not self.waiting or len(self.running) >= self.config.max_num_seqs
        ):
            self._batch_closed = True

    def _admit(
        self, output: SchedulerOutput, budget: int, now: float, encoder: EncoderBudget
    ) -> None:
        """Start waiting requests in policy order while budget, slots and blocks last (and the
        step's encoder budget, for a first chunk that reaches images)."""
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.policy.pick(self.waiting, now, self._admissible())
            if request is None:
                break
            fresh = not request.block_ids  # forked requests arrive holding their prompt
            if fresh:
                self.block_manager.claim_cached_prefix(request)
            whole = request.num_tokens - request.num_computed_tokens <= budget
            if whole or self.config.enable_chunked_prefill:
                num_tokens = self._chunk(request, budget, encoder)
            else:
                num_tokens = 0
            if num_tokens == 0 or not self._allocate_waiting(request, num_tokens, now):
                if fresh:  # stays waiting: hold nothing
                    self._release(request)
                break
            if fresh:
                self._count_prefix_lookup(request)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            if request.timings.first_scheduled is None:
                request.timings.first_scheduled = now
            else:
                request.timings.events.append((now, "resumed"))
            self.running.append(request)
            restore, request.restore_snapshot = request.restore_snapshot, None
            output.scheduled.append(ScheduledRequest(request, num_tokens, restore=restore))
            budget -= num_tokens

    def _allocate_waiting(self, request: Request, num_tokens: int, now: float) -> bool:
        """Blocks for a waiting request's next chunk, freeing those other waiting requests hold
        when the cache is full. A request that holds blocks and still cannot grow gives them up
        (it starts from scratch later), so held blocks can never wedge the queue."""
        manager = self.block_manager
        while not manager.allocate(request, request.num_computed_tokens + num_tokens):
            if not self._release_held(now, spare=request):
                self._release(request)
                return False
        return True

    def _release_held(
        self, now: float, spare: Request, below: tuple[float, float] | None = None
    ) -> bool:
        """Free the blocks of the lowest-ranked waiting request holding any (a paused or forked
        one; it will be recomputed), other than `spare` and ranked after `below`; False if
        there is none."""
        held = [
            r
            for r in self.waiting
            if r.block_ids and r is not spare and (below is None or self.policy.key(r, now) > below)
        ]
        if not held:
            return False
        if self.policy.uses_priority:
            self._release(max(held, key=lambda r: self.policy.key(r, now)))
        else:
            self._release(held[-1])
        return True

    def _release(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0

    def _count_prefix_lookup(self, request: Request) -> None:
        if not self.block_manager.enable_caching:
            return
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += request.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens

    def _preempt(self, request: Request) -> None:
        """Back to the waiting queue without its blocks: it will be recomputed."""
        self._release(request)
        self._pause(request, "preempted")

    def recompute(self, request: Request) -> None:
        """Send a running request back to wait without its blocks, to be recomputed from its
        tokens (one whose recurrent state a failed step may have advanced)."""
        if request in self.running:
            self.running.remove(request)
        self._preempt(request)

    def _pause(self, request: Request, event: str = "paused") -> None:
        """Back to the waiting queue keeping its blocks: it resumes where it stopped, unless
        the blocks are needed first."""
        request.timings.events.append((time.monotonic(), event))
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- results ---------------------------------------------------------------------------

    def update_from_output(
        self, output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """`advance` then `receive`: the step ran to completion before the next is scheduled."""
        self.advance(output)
        return self.receive(output, runner_output)

    def advance(self, output: SchedulerOutput) -> None:
        """Move the scheduled requests past the step's tokens once it is launched: the next
        step may be scheduled before its results arrive, each sampled token pending until
        then (overlapped scheduling)."""
        for item in output.scheduled:
            item.request.num_computed_tokens += item.num_tokens
            item.request.num_pending_tokens += item.completes_sequence

    def discard(self, output: SchedulerOutput) -> None:
        """Give up an advanced step's results (they could not be read, or have arrived): its
        sampled tokens are no longer pending."""
        for item in output.scheduled:
            item.request.num_pending_tokens -= item.completes_sequence
        self._take_back_lent()

    def receive(self, output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[Request]:
        """Take an advanced step's sampled tokens; return the requests that received one.

        A request ended while the step was in flight (a stop, an abort) gets nothing. Requests
        that finish here free their blocks at once, so the next step can admit others.
        """
        self.discard(output)
        advanced: list[Request] = []
        for item in output.scheduled:
            request = item.request
            if self.requests.get(request.request_id) is not request:
                continue
            if item.drafts:
                if self._receive_verified(item, runner_output):
                    advanced.append(request)
                continue
            self.block_manager.cache_full_blocks(request, item.end)
            if item.save is not None:
                self.block_manager.commit_snapshot(request, item.end, item.save)
            token = runner_output.sampled_token_ids.get(request.request_id)
            if token is None:
                continue
            request.append_output(token)
            request.num_new_tokens = 1
            advanced.append(request)
            # A leader preempted while its step was in flight has no prompt blocks to share;
            # a recurrent model's state past the prompt is the leader's own, not to be shared.
            shares = self.block_manager.state_slots is None and request.num_computed_tokens > 0
            self._release_forks(request, share=shares)
            if request.check_token_stop():
                self._remove(request)
        return advanced

    def _receive_verified(self, item: ScheduledRequest, runner_output: ModelRunnerOutput) -> bool:
        """Take a step that verified drafts: the drafts the model agreed with, then its own
        token, each checked for a stop; False where the step gave it nothing. The K/V of the
        drafts it refused are dropped (their slots are written again by the next step)."""
        request = item.request
        accepted = runner_output.accepted_drafts.get(request.request_id, [])
        token = runner_output.sampled_token_ids.get(request.request_id)
        request.num_computed_tokens = item.start + (0 if token is None else 1 + len(accepted))
        if token is None:
            return False
        request.num_new_tokens = 0
        for new in [*accepted, token]:
            request.append_output(new)
            request.num_new_tokens += 1
            if request.check_token_stop():
                break
        self.block_manager.cache_full_blocks(request, request.num_computed_tokens)
        if request.is_finished:
            self._remove(request)
        return True

    def _release_forks(self, leader: Request, share: bool) -> None:
        """Queue the requests waiting on `leader`'s prompt: sharing its blocks (they compute
        only the last prompt token, into a private copy of its block) or from scratch."""
        siblings = self._forks.pop(leader.request_id, [])
        for sibling in reversed(siblings):
            if share:
                self.block_manager.fork(leader, sibling)
                sibling.num_computed_tokens = sibling.num_prompt_tokens - 1
            self.waiting.appendleft(sibling)

    def finish_request(
        self, request_id: str, reason: FinishReason, stop_reason: int | str | None = None
    ) -> Request | None:
        """End a request from outside (abort, stop string, error); its blocks return at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if not request.is_finished:
            request.finish(reason, stop_reason)
        self._remove(request)
        return request

    def expire_deadlines(self, now: float) -> list[Request]:
        """End every request whose deadline has passed, waiting or running, and every
        request not started yet that could no longer finish in time even if it started now
        (its compute would be wasted on an answer nobody wants)."""
        expired = [
            r
            for r in self.requests.values()
            if r.deadline is not None and (now >= r.deadline or self._hopeless(r, now))
        ]
        for request in expired:
            request.finish(FinishReason.TIMEOUT)
            self._remove(request)
        return expired

    def _hopeless(self, request: Request, now: float) -> bool:
        if request.num_output_tokens or request.status is not RequestStatus.WAITING:
            return False
        fewest = fewest_new_tokens(request.sampling_params, request.max_output_tokens)
        needed = self.drain.time_to_finish(request.num_prompt_tokens, fewest, len(self.running) + 1)
        return now + needed > (request.deadline or now)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        aborted = (self.finish_request(rid, FinishReason.ABORT) for rid in request_ids)
        return [request for request in aborted if request is not None]

    def _remove(self, request: Request) -> None:
        if request.request_id not in self.requests:
            return
        del self.requests[request.request_id]
        if request in self.running:
            self.running.remove(request)
        else:
            self._discard_waiting(request)
        self._release_forks(request, share=False)
        self.block_manager.free(request)

    def _discard_waiting(self, request: Request) -> None:
        with contextlib.suppress(ValueError):
            self.waiting.remove(request)
        for siblings in self._forks.values():
            if request in siblings:
                siblings.remove(request)

    # ---- introspection ---------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def check_invariants(self) -> None:
        """Raise AssertionError if queues and blocks disagree."""
        manager = self.block_manager
        manager.check_invariants()
        holders: dict[int, int] = {}
        for request in self.requests.values():
            for block in request.block_ids:
                holders[block] = holders.get(block, 0) + 1
        assert len(holders) == manager.num_used_blocks, "blocks held != blocks used"
        assert all(manager.ref_count(b) == n for b, n in holders.items()), "bad ref count"
        for request in self.waiting:
            # A paused or forked request waits holding the blocks of its computed tokens.
            computed = request.num_computed_tokens
            assert request.block_ids or computed == 0, "waiting KV"
            assert manager.blocks_for(computed) <= len(request.block_ids), "waiting KV"
        assert len(self.running) <= self.config.max_num_seqs
        pending = {r.request_id for siblings in self._forks.values() for r in siblings}
        assert (
            set(self.requests)
            == {r.request_id for r in self.running} | {r.request_id for r in self.waiting} | pending
        )


def _reached_length(request: Request) -> bool:
    return request.num_sampled_tokens >= request.max_output_tokens


def _image_cut(request: Request, num_tokens: int, encoder: EncoderBudget) -> int:
    """How many of `num_tokens` the request's next chunk runs, given its images: it never ends
    inside a run of image tokens that attend both ways, nor reaches images the step's encoder
    budget cannot take (either way it stops before them, which may leave none)."""
    images = request.images
    if images is not None:
        num_tokens = images.whole_runs(request.num_computed_tokens, num_tokens)
    return encoder.cut(request, num_tokens) if num_tokens else 0
