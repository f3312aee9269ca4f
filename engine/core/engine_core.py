"""The engine core: one synchronous `step()` = schedule, run the model, update."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.core.bad_words import bad_word_ids, needs_history
from engine.core.errors import (
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestFailedError,
    RequestTimeoutError,
)
from engine.core.images import ImageInputs
from engine.core.mrope import grid_positions
from engine.core.output_processor import OutputProcessor
from engine.core.outputs import NO_TOKEN, ModelRunnerOutput, RequestOutput, TokenLogprob
from engine.core.profiling import StepProfiler
from engine.core.request import FinishReason, Request
from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams, ThoughtBudget
from engine.core.speculation import Drafter
from engine.core.stats import FinishedRequestStats, SpecTally, StepStats
from engine.core.thought_budget import ThoughtCounter
from engine.kv.events import EventSink
from engine.lora.registry import LoRARegistry, LoRARequest
from engine.scheduling.admission import Admission, fewest_new_tokens, promised_tokens
from engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from engine.structured.compiler import GrammarCompiler
from engine.structured.deferred import DeferredGrammar

if TYPE_CHECKING:  # the runner owns torch; the core itself stays torch-free
    from engine.weight_reload import WeightReloader
    from engine.worker.model_runner import LaunchedStep, ModelRunner
    from engine.worker.sleep_mode import SleepMode

logger = logging.getLogger(__name__)


class EngineCore:
    """Wires the scheduler to the model runner. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        tokenizer: Any | None,
        eos_token_ids: frozenset[int],
        vocab_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.tokenizer = tokenizer
        # An image-text model's processor, which the server runs its requests' images through.
        self.processor: Any = None
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        # The most log probabilities a request may ask for, per token (`--max-logprobs`).
        self.max_logprobs = MAX_LOGPROBS
        self.outputs = OutputProcessor(tokenizer)
        self.grammars = (
            GrammarCompiler(tokenizer, vocab_size, eos_token_ids) if tokenizer is not None else None
        )
        self._stats = StepStats(0, 0, 0.0)
        # Each queued sequence's request and its number of sequences, for its finished stats.
        self._groups: dict[str, tuple[str, int]] = {}
        # Overlapped (async) scheduling: the next step is scheduled and launched while the
        # last one still runs on the device.
        self.overlap = False
        self._in_flight: _InFlight | None = None
        self._last_end = 0.0
        # The LoRA adapters served (None: `--enable-lora` is off), and those removed whose
        # weights stay until no request runs them.
        self.loras: LoRARegistry | None = None
        self._retired: dict[int, LoRARequest] = {}
        # Drafts each running request's next tokens for its next step to verify: from its
        # prediction, and with `--speculative-config` by n-gram or a draft model.
        self.drafter = Drafter()
        # What each request reports of its verification steps (vLLM's
        # `--per-request-spec-decode-metrics`): "none", "summary" or "detailed".
        self.spec_metrics = "none"
        self._drafting_seconds = 0.0
        self._drafting_failures = 0
        # Where the prefix cache's events go (`--kv-events-config`); None: nowhere.
        self.kv_events: EventSink | None = None
        # Profiles of the steps on demand (`--profiler-config`); None: not offered.
        self.profiler: StepProfiler | None = None
        # Loads new weights in the served model's place; None: this engine cannot.
        self.reloader: WeightReloader | None = None
        # Gives the engine's memory back and takes it again; None where it cannot.
        self.sleeper: SleepMode | None = None

    # ---- requests --------------------------------------------------------------------------

    def validate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
        images: ImageInputs | None = None,
    ) -> None:
        """Raise a typed error for a request that can never run; touches no queue."""
        if images is not None:
            self._validate_images(len(prompt_token_ids), images)
        if lora is not None and not self.runner.has_lora(lora.lora_id):
            raise InvalidRequestError(
                f"The LoRA adapter `{lora.name}` is not loaded.", param="model"
            )
        if not prompt_token_ids:
            raise InvalidRequestError("The prompt is empty.", param="prompt")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.max_logprobs:
                raise InvalidRequestError(
                    f"Requested {name} of {asked}, which is greater than max allowed: "
                    f"{self.max_logprobs} (--max-logprobs).",
                    param=name,
                )
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidRequestError(
                f"Prompt token ids must be in [0, {self.vocab_size}).", param="prompt"
            )
        bias = params.logit_bias or {}
        if bias and max(bias) >= self.vocab_size:
            raise InvalidRequestError(
                f"logit_bias token ids must be below the vocabulary size {self.vocab_size}.",
                param="logit_bias",
            )
        allowed = params.allowed_token_ids
        if allowed and max(allowed) >= self.vocab_size:
            raise InvalidRequestError(
                f"allowed_token_ids must be below the vocabulary size {self.vocab_size}.",
                param="allowed_token_ids",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer.", param="stop")
        if params.bad_words and self.tokenizer is None:
            raise InvalidRequestError("bad_words need a tokenizer.", param="bad_words")
        if params.thought_budget is not None and self.tokenizer is None:
            raise InvalidRequestError(
                "thinking_token_budget needs a tokenizer.", param="thinking_token_budget"
            )
        if params.structured is not None and self.grammars is None:
            raise InvalidRequestError(
                "structured outputs need a tokenizer.", param=params.structured.param
            )
        self.scheduler.check_prompt(len(prompt_token_ids))

    def _validate_images(self, prompt_len: int, images: ImageInputs) -> None:
        """The model reads images; where an image's tokens see each other both ways, each
        image fits one step's token budget (it is computed in one step); where they lie on
        their grids, the prompt's positions on three axes."""
        if images.given:
            if not self.runner.embeds_prompts:
                raise InvalidRequestError(
                    "This model does not take prompt embeddings.", param="prompt_embeds"
                )
            return
        if not self.runner.takes_images:
            raise InvalidRequestError("This model does not take images.", param="messages")
        images.both_ways = self.runner.images_both_ways
        merge = self.runner.grid_merge
        if merge is not None and images.grid is None:
            grids = images.data.get("image_grid_thw")
            try:
                if grids is None:
                    raise ValueError("the processor gave no image grids")
                images.grid = grid_positions(prompt_len, images.runs(), grids.tolist(), merge)
            except ValueError as exc:
                raise InvalidRequestError(
                    f"The images do not fit their placeholders: {exc}", param="messages"
                ) from None
        budget = self.scheduler.config.max_num_batched_tokens
        if images.both_ways and images.longest_run() > budget:
            raise InvalidRequestError(
                f"An image takes {images.longest_run()} tokens, which this model computes in "
                f"one step, but a step holds at most {budget} (--max-num-batched-tokens).",
                param="messages",
            )

    def admit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        timeout: float | None = None,
        pending: int = 0,
        pending_tokens: int = 0,
    ) -> bool:
        """Decide on a new request before it queues: raise `QueueFullError` (reject) or
        `RequestTimeoutError` (its deadline cannot be met); return whether it is deferred."""
        num_prompt = len(prompt_token_ids)
        decision = self.scheduler.admission(
            promised_tokens(num_prompt, params, self.max_tokens), priority, pending, pending_tokens
        )
        if decision.outcome is Admission.REJECT:
            raise QueueFullError(
                f"The server is overloaded: {decision.reason}. Please retry later.",
                retry_after=decision.retry_after,
            )
        if timeout is not None:
            fewest = fewest_new_tokens(params, self.max_tokens - num_prompt)
            needed = self.scheduler.drain.time_to_finish(
                num_prompt, fewest, len(self.scheduler.running) + 1
            )
            if needed > timeout:
                raise RequestTimeoutError(
                    f"The request cannot finish within its timeout of {timeout:g} s (it needs "
                    f"about {needed:.1f} s at the current speed)."
                )
        return decision.outcome is Admission.DEFER

    def _thought_counter(self, budget: ThoughtBudget) -> ThoughtCounter:
        tokenizer = self.tokenizer
        assert tokenizer is not None  # a budget is refused without one
        return ThoughtCounter(
            budget.tokens,
            budget.starts,
            budget.end,
            tokenizer.encode(budget.end, add_special_tokens=False),
            budget.open_at_start,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        )

    def _decoder(self, params: SamplingParams) -> Callable[[list[int]], str]:
        """Token ids to text as the request's output shows it."""
        tokenizer, skip = self.tokenizer, params.skip_special_tokens
        assert tokenizer is not None  # formats are refused without one
        return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=skip)

    @property
    def max_tokens(self) -> int:
        return self.scheduler.max_sequence_tokens

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        parent_id: str | None = None,
        index: int = 0,
        arrival_time: float | None = None,
        fork_of: str | None = None,
        priority: int = 0,
        timeout: float | None = None,
        deferred: bool = False,
        siblings: int = 1,
        background: bool = False,
        lora: LoRARequest | None = None,
        images: ImageInputs | None = None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a sequence, one of `siblings` of request `parent_id`. `fork_of` names a sibling
        with the same prompt whose prompt blocks this one shares once computed; `timeout` counts
        from `arrival_time`; `lora` is the adapter it runs under (None: the base model);
        `images` are the prompt's images, for a model that reads them; only requests with the
        same `cache_salt` share cached prefix blocks."""
        self.validate(prompt_token_ids, params, lora, images)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=arrival,
            max_total_tokens=self.scheduler.max_sequence_tokens,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            deadline=None if timeout is None else arrival + timeout,
            deferred=deferred,
            background=background,
            lora=lora,
            images=images,
            cache_salt=cache_salt,
        )
        request.spec = self._spec_tally(params, siblings)
        if params.bad_words:
            request.bad_words = bad_word_ids(self.tokenizer, params.bad_words)
        if deferred:
            request.timings.events.append((arrival, "admission deferred"))
        if params.thought_budget is not None:
            request.thought = self._thought_counter(params.thought_budget)
        if params.structured is not None and self.grammars is not None:
            matcher = self.grammars.matcher(params.structured)
            if params.structured.after:
                request.deferred_grammar = DeferredGrammar(
                    matcher, params.structured.after, self._decoder(params)
                )
            else:
                request.grammar = matcher
        self.scheduler.add_request(request, fork_of)
        self.outputs.add(request, parent_id or request_id, index)
        self._groups[request_id] = (parent_id or request_id, siblings)
        return request

    def _spec_tally(self, params: SamplingParams, siblings: int) -> SpecTally | None:
        """Where verification steps are reported per request (`spec_metrics` "summary" or
        "detailed", vLLM's `--per-request-spec-decode-metrics`): a tally for a lone sequence
        that may draft (speculation is on, or it has a prediction)."""
        most = self.drafter.ceiling(params)
        if self.spec_metrics == "none" or siblings > 1 or most is None:
            return None
        return SpecTally(most, per_step=[] if self.spec_metrics == "detailed" else None)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        aborted = self.scheduler.abort_requests(request_ids)
        for request in aborted:
            self._record_finished(request)
        self._release([r.request_id for r in aborted])
        return [self.outputs.final_output(r) for r in aborted if r.request_id in self.outputs]

    def _release(self, request_ids: list[str]) -> None:
        """Forget what the drafter keeps of requests that ended."""
        self.drafter.release(request_ids)

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """End every request with an error (the loop hit something it cannot recover from)."""
        self._in_flight = None  # its requests fail here; nothing of it is wanted
        ids = list(self.scheduler.requests)
        return self._fail(ids, error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- LoRA adapters ---------------------------------------------------------------------

    def read_lora(self, name: str, path: str) -> tuple[LoRARequest, Any]:
        """Read and check an adapter's folder (any thread: it touches no queue or slot); raises
        `LoRAError` for one that cannot be served."""
        if self.loras is None:
            raise InvalidRequestError("LoRA adapters are served only with --enable-lora.")
        lora = self.loras.new_request(name, path)
        return lora, self.runner.read_lora(path)

    def add_lora(self, lora: LoRARequest, adapter: Any) -> None:
        """Serve an adapter `read_lora` read (between steps)."""
        assert self.loras is not None
        self.runner.add_lora(lora.lora_id, adapter)
        self.loras.add(lora)

    def retire_lora(self, lora: LoRARequest) -> None:
        """Forget an adapter removed from the registry once no request runs it."""
        self._retired[lora.lora_id] = lora
        self.drop_retired()

    def drop_retired(self) -> None:
        """Free the weights of removed adapters that no request runs any more."""
        if not self._retired:
            return
        requests = self.scheduler.requests.values()
        in_use = {r.lora.lora_id for r in requests if r.lora is not None}
        for lora_id in [i for i in self._retired if i not in in_use]:
            self.runner.remove_lora(lora_id)
            del self._retired[lora_id]

    def watch(self, on_failure: Callable[[EngineDeadError], None]) -> None:
        """Have `on_failure` called (from another thread) if a tensor-parallel worker dies."""
        if self.runner.workers is not None:
            self.runner.workers.watch(on_failure)

    def close(self) -> None:
        """Release what the runner holds outside this process (tensor-parallel workers) and
        stop publishing events."""
        self.runner.close()
        if self.kv_events is not None:
            self.kv_events.close()

    def publish_kv_events(self) -> None:
        """Send what the prefix cache stored and forgot since the last call, as one batch."""
        log = self.scheduler.block_manager.events
        if self.kv_events is not None and log is not None and log.events:
            self.kv_events.publish(log.take())

    # ---- stats -----------------------------------------------------------------------------

    def take_stats(self) -> StepStats:
        """What happened since the last call, with the queue and cache state as of now."""
        stats, self._stats = self._stats, StepStats(0, 0, 0.0)
        scheduler = self.scheduler
        stats.num_running, stats.num_waiting = scheduler.num_running, scheduler.num_waiting
        stats.kv_cache_usage = scheduler.block_manager.usage
        stats.prefix_cache_queries, scheduler.prefix_cache_queries = (
            scheduler.prefix_cache_queries,
            0,
        )
        stats.prefix_cache_hits, scheduler.prefix_cache_hits = scheduler.prefix_cache_hits, 0
        stats.num_rejections, scheduler.num_rejections = scheduler.num_rejections, 0
        stats.num_waiting_deferred = scheduler.num_deferred()
        residency = scheduler.block_manager.residency
        if residency is not None:
            stats.kv_evictions = residency.take()
        if self.loras is not None:
            stats.running_loras = _lora_names(scheduler.running)
            stats.waiting_loras = _lora_names(scheduler.waiting)
        if self.grammars is not None:
            stats.grammar_compile_seconds = self.grammars.take_compile_times()
        return stats

    def _record_tokens(self, advanced: list[Request], now: float) -> None:
        stats = self._stats
        for request in advanced:
            timings = request.timings
            if timings.first_token is None:
                timings.first_token = now
                stats.num_prompt_tokens += request.num_prompt_tokens
                stats.num_cached_prompt_tokens += request.num_cached_tokens
            elif timings.last_token is not None:
                stats.inter_token_latencies.append(now - timings.last_token)
            timings.last_token = now
            stats.num_generation_tokens += request.num_new_tokens

    def _record_drafts(self, scheduled: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Count the step's verified drafts (drafts, draft tokens, and those kept by position)
        and tell the drafter how many each request kept."""
        for item in scheduled.scheduled:
            if not item.drafts:
                continue
            request = item.request
            kept = len(runner_output.accepted_drafts.get(request.request_id, []))
            self._stats.drafts.record(len(item.drafts), kept)
            self.drafter.kept(request.request_id, kept)
            if request.sampling_params.prediction:
                request.num_prediction_kept += kept
                request.num_prediction_refused += len(item.drafts) - kept
            if request.spec is not None:
                request.spec.record(len(item.drafts), kept)

    def _draft(self, scheduled: SchedulerOutput, advanced: list[Request], seconds: float) -> None:
        """Tell the drafter what a decode step (one with no prompt chunk) gave in `seconds`
        and the drafting before it, then draft for the next one, timed for the step after."""
        items = scheduled.scheduled
        if self.drafter.config is not None and all(_measured(item) for item in items):
            tokens = sum(request.num_new_tokens for request in advanced)
            drafted = any(item.drafts for item in items)
            self.drafter.observe(len(items), drafted, tokens, seconds + self._drafting_seconds)
        began = time.monotonic()
        try:
            self.drafter.draft_step(advanced, self.scheduler.num_running)
        except Exception:  # a failing drafter costs the drafts, never the requests
            self._drafting_failed(advanced)
        self._drafting_seconds = time.monotonic() - began

    def _drafting_failed(self, requests: list[Request]) -> None:
        """Drafting raised: the requests decode the next step without drafts (the first
        failure is logged with its trace)."""
        for request in requests:
            request.draft_token_ids = []
        self._drafting_failures += 1
        if self._drafting_failures == 1:
            logger.exception("drafting failed; the requests decode without drafts")

    def _record_finished(self, request: Request) -> FinishedRequestStats:
        parent, siblings = self._groups.pop(request.request_id, ("", 1))
        stats = FinishedRequestStats.of(request, time.monotonic(), parent, siblings)
        self._stats.finished.append(stats)
        return stats

    # ---- the step --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; return the deltas of the step that completed. With
        `overlap`, the step just launched is left in flight and the previous one's results are
        taken while it runs, so a GPU never waits for the host between steps. What the step
        did to the prefix cache is published after it."""
        results = self._step()
        self.publish_kv_events()
        return results

    def _step(self) -> list[RequestOutput]:
        start = time.monotonic()
        results = self._expire(start)
        if self._in_flight is not None and not self._in_flight.overlappable:
            results += self._receive(self._take_in_flight())
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if self._in_flight is not None:
                results += self._receive(self._take_in_flight())
            return results
        self._stats.num_preemptions += len(scheduled.preempted)
        if not self.overlap:
            return results + self._run_now(scheduled, start)
        return results + self._run_overlapped(scheduled, start)

    def _run_overlapped(self, scheduled: SchedulerOutput, start: float) -> list[RequestOutput]:
        """Launch the step and leave it in flight; take the previous one's results meanwhile.
        A launch that fails takes the previous step's results first, then runs again in turn
        what did not finish with them."""
        try:
            launched = self.runner.launch(scheduled)
        except EngineDeadError:
            raise  # nothing to isolate: the engine cannot run another step
        except Exception as exc:
            logger.warning("a model step failed (%s); running it again without overlap", exc)
            results = self._receive(self._take_in_flight()) if self._in_flight else []
            live = _with(scheduled, [i for i in scheduled.scheduled if not i.request.is_finished])
            if not live.scheduled:
                return results
            if self._keeps_states:  # running it again whole would advance states twice
                return results + self._run_isolated(live, exc, start)
            return results + self._run_now(live, start)
        self.scheduler.advance(scheduled)
        previous, self._in_flight = self._in_flight, _InFlight(scheduled, launched, start)
        return self._receive(previous) if previous is not None else []

    def _run_now(self, scheduled: SchedulerOutput, start: float) -> list[RequestOutput]:
        """Run a step to completion and take its results. Should it fail, the requests that
        make it fail are found and failed, and the others' results kept."""
        try:
            runner_output = self.runner.execute(scheduled)
        except EngineDeadError:
            raise  # nothing to isolate: the engine cannot run another step
        except Exception as exc:
            return self._run_isolated(scheduled, exc, start)
        self.scheduler.advance(scheduled)
        return self._complete(scheduled, runner_output, start)

    def _run_isolated(
        self, scheduled: SchedulerOutput, exc: Exception, start: float
    ) -> list[RequestOutput]:
        """A step that raised `exc`: the requests that make it fail are found and failed, and
        the others' results kept; but where the model keeps recurrent states, a request that
        ran on from its state (not from its first token, whose state starts from zeros) may
        have had it advanced by a failed run, so it is recomputed from its tokens instead."""
        runner_output, scheduled, culprits = self._isolate(scheduled, exc)
        failed = self._fail_culprits(culprits)
        if self._keeps_states:
            scheduled = self._recompute_resumed(scheduled, runner_output)
        self.scheduler.advance(scheduled)
        return failed + self._complete(scheduled, runner_output, start)

    @property
    def _keeps_states(self) -> bool:
        """Whether the model's layers keep recurrent states per request."""
        return self.scheduler.block_manager.state_slots is not None

    def _recompute_resumed(
        self, scheduled: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> SchedulerOutput:
        """The step less the requests that ran on from their state (not from zeros, nor from
        a snapshot restored first), each sent back to wait, to be recomputed, with its results
        dropped."""
        resumed = [i for i in scheduled.scheduled if not _reruns_from_the_start(i)]
        for item in resumed:
            _drop_results(runner_output, item.request.request_id)
            self.scheduler.recompute(item.request)
        self._stats.num_preemptions += len(resumed)
        if resumed:
            logger.warning(
                "%d requests of the failed step are recomputed: their recurrent states may "
                "have advanced",
                len(resumed),
            )
        return _with(scheduled, [i for i in scheduled.scheduled if _reruns_from_the_start(i)])

    def _take_in_flight(self) -> _InFlight:
        in_flight, self._in_flight = self._in_flight, None
        assert in_flight is not None
        return in_flight

    def _receive(self, in_flight: _InFlight) -> list[RequestOutput]:
        """Wait for a step in flight and take its results. Should they fail to arrive, its
        requests fail (their next step, if launched, is discarded with them)."""
        try:
            runner_output = in_flight.launched.result()
        except EngineDeadError:
            raise
        except Exception as exc:
            logger.exception("the results of a model step could not be read")
            scheduled = in_flight.scheduled
            self.scheduler.discard(scheduled)
            ids = [item.request.request_id for item in scheduled.scheduled]
            return self._fail(ids, RequestFailedError(f"The model step failed: {exc}"))
        return self._complete(in_flight.scheduled, runner_output, in_flight.start)

    def _complete(
        self, scheduled: SchedulerOutput, runner_output: ModelRunnerOutput, start: float
    ) -> list[RequestOutput]:
        """Hand an advanced step's results to the scheduler and turn them into deltas."""
        self.outputs.collect_prompt_logprobs(runner_output)
        self._record_drafts(scheduled, runner_output)  # before the outputs, which count them
        failed = self._fail_ruled_out(scheduled, runner_output)
        advanced = self.scheduler.receive(scheduled, runner_output)
        end = time.monotonic()
        results = [self._output_for(r, _logprobs_of(r, runner_output)) for r in advanced]
        self._record_tokens(advanced, end)
        # Overlapped steps share the wall clock: each counts from the previous one's end.
        seconds = end - max(start, self._last_end)
        self._draft(scheduled, advanced, seconds)
        for request, result in zip(advanced, results, strict=True):
            result.embedding = runner_output.embeddings.get(request.request_id)
            if request.is_finished:
                result.stats = self._record_finished(request)
                result.spec = request.spec
        finished = [r for r in advanced if r.is_finished]
        self._release([r.request_id for r in finished])
        self._record_speed(scheduled, seconds, len(finished))
        self._last_end = end
        return failed + results

    def _fail_ruled_out(
        self, scheduled: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        """Fail, alone and as the client's error, each request whose own rules left its row
        no token (`NO_TOKEN`); the step's other requests take their tokens. One that kept
        drafts before that row takes them first, as steps of one token would have written
        them (the last one uncomputed), and meets the row again in its next step."""
        sampled = runner_output.sampled_token_ids
        results = []
        for item in scheduled.scheduled:
            request_id = item.request.request_id
            if sampled.get(request_id) != NO_TOKEN:
                continue
            kept = runner_output.accepted_drafts.pop(request_id, [])
            if kept:
                sampled[request_id], runner_output.accepted_drafts[request_id] = kept[-1], kept[:-1]
                logprobs = runner_output.accepted_logprobs.pop(request_id, [])
                if logprobs:
                    runner_output.logprobs[request_id] = logprobs[-1]
                    runner_output.accepted_logprobs[request_id] = logprobs[:-1]
                continue
            del sampled[request_id]
            results += self._fail([request_id], _ruled_out_error(item.request))
        return results

    def _expire(self, now: float) -> list[RequestOutput]:
        """Requests past their deadline: one that never produced a token fails with a timeout
        error; one already generating ends with what it has."""
        results = []
        for request in self.scheduler.expire_deadlines(now):
            self._record_finished(request)
            self._release([request.request_id])
            if request.request_id not in self.outputs:
                continue
            error = None
            if request.num_output_tokens == 0:
                error = RequestTimeoutError("The request timed out before it was served.")
            results.append(self.outputs.final_output(request, error))
        return results

    def _record_speed(self, scheduled: SchedulerOutput, seconds: float, finished: int) -> None:
        items = scheduled.scheduled
        prefill = sum(item.num_tokens for item in items if not item.decodes)
        decodes = sum(item.decodes for item in items)
        self.scheduler.drain.record_step(
            seconds,
            finished,
            scheduled.total_num_tokens,
            prefill,
            decodes,
            len(scheduled.scheduled),
        )

    def _output_for(self, request: Request, logprobs: list[TokenLogprob]) -> RequestOutput:
        """The request's delta for its newest tokens, with their `logprobs` (one per token the
        step gave, where it asked; a stop may have taken the later tokens back)."""
        text, stop = self.outputs.new_text(request)
        if stop is not None:
            if request.is_finished:
                request.finish(FinishReason.STOP, stop)
            else:
                self.scheduler.finish_request(request.request_id, FinishReason.STOP, stop)
        return self.outputs.make_output(request, text, logprobs[: request.num_new_tokens] or None)

    def _isolate(
        self, scheduled: SchedulerOutput, exc: Exception
    ) -> tuple[ModelRunnerOutput, SchedulerOutput, list[tuple[str, Exception]]]:
        """A step that raised, run again in halves (recursively) to find the requests that make
        it fail: what the others compute is kept, so only the culprits pay. Returns the merged
        output, the step less the culprits, and each culprit with its error."""
        items = scheduled.scheduled
        if len(items) == 1:
            logger.error(
                "the model step failed for request %s: %s",
                items[0].request.request_id,
                exc,
                exc_info=exc,
            )
            return ModelRunnerOutput(), _with(scheduled, []), [(items[0].request.request_id, exc)]
        logger.warning(
            "a model step of %d requests failed (%s); running it again in halves to "
            "find the requests that cause it",
            len(items),
            exc,
        )
        merged, kept, culprits = ModelRunnerOutput(), [], []
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            sub = _with(scheduled, part)
            try:
                output = self.runner.execute(sub)
            except EngineDeadError:
                raise
            except Exception as sub_exc:
                output, sub, found = self._isolate(sub, sub_exc)
                culprits += found
            _merge(merged, output)
            kept += sub.scheduled
        return merged, _with(scheduled, kept), culprits

    def _fail_culprits(self, culprits: list[tuple[str, Exception]]) -> list[RequestOutput]:
        results = []
        for request_id, exc in culprits:
            results += self._fail([request_id], RequestFailedError(f"The model step failed: {exc}"))
        return results

    def _fail(self, request_ids: list[str], error: BaseException) -> list[RequestOutput]:
        results = []
        for request_id in request_ids:
            request = self.scheduler.finish_request(request_id, FinishReason.ERROR)
            if request is not None and request_id in self.outputs:
                self._record_finished(request)
                results.append(self.outputs.final_output(request, error))
        self._release(request_ids)
        return results


@dataclass(slots=True)
class _InFlight:
    """A launched step whose results have not been taken yet."""

    scheduled: SchedulerOutput
    launched: LaunchedStep
    start: float

    @property
    def overlappable(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens reach the host:
        not if a request it samples has a grammar, which must advance on its newest token
        there to allow the next ones, or one still waiting to start (its newest token may be
        the one that starts it)."""
        items = self.scheduled.scheduled
        sampled = (item.request for item in items if item.completes_sequence)
        verifies = any(item.drafts for item in items)
        return not verifies and all(
            not r.follows_its_tokens and not needs_history(r.bad_words) for r in sampled
        )


def _measured(item: ScheduledRequest) -> bool:
    """A decode step's item that tells the gate what drafting by the config's method gives
    (not one whose drafts come from its prediction)."""
    return item.decodes and not item.request.sampling_params.prediction


def _with(scheduled: SchedulerOutput, items: list[ScheduledRequest]) -> SchedulerOutput:
    """The step with only these requests scheduled (its preemptions and block copies kept:
    copying a block again is harmless)."""
    return SchedulerOutput(items, scheduled.preempted, scheduled.block_copies)


def _logprobs_of(request: Request, output: ModelRunnerOutput) -> list[TokenLogprob]:
    """The logprobs of each token a step gave the request, in order ([] where it asked none)."""
    last = output.logprobs.get(request.request_id)
    if last is None:
        return []
    return [*output.accepted_logprobs.get(request.request_id, []), last]


def _reruns_from_the_start(item: ScheduledRequest) -> bool:
    """Whether a recurrent model's step item sets its states before it runs (zeroed at its
    request's first token, or restored from a snapshot), so running it again gives the same."""
    return item.start == 0 or item.restore is not None


def _drop_results(output: ModelRunnerOutput, request_id: str) -> None:
    """Forget what a step gave one request."""
    for results in (
        output.sampled_token_ids,
        output.accepted_drafts,
        output.accepted_logprobs,
        output.logprobs,
        output.prompt_logprobs,
        output.embeddings,
    ):
        results.pop(request_id, None)


def _merge(into: ModelRunnerOutput, part: ModelRunnerOutput) -> None:
    into.sampled_token_ids.update(part.sampled_token_ids)
    into.accepted_drafts.update(part.accepted_drafts)
    into.accepted_logprobs.update(part.accepted_logprobs)
    into.logprobs.update(part.logprobs)
    into.prompt_logprobs.update(part.prompt_logprobs)


def _lora_names(requests: Iterable[Request]) -> tuple[str, ...]:
    """The adapters `requests` run, each once, by name."""
    return tuple(sorted({r.lora.name for r in requests if r.lora is not None}))


def _ruled_out_error(request: Request) -> InvalidRequestError:
    """The error of a request whose rules leave no token to follow its output so far; its
    `param` is the first of them that is a request field (the format has several names)."""
    params = request.sampling_params
    rules = [
        (name, field)
        for name, field, holds in (
            ("the output format", None, request.grammar is not None),
            ("allowed_token_ids", "allowed_token_ids", bool(params.allowed_token_ids)),
            ("bad_words", "bad_words", bool(request.bad_words)),
            ("min_tokens", "min_tokens", request.num_output_tokens < params.min_tokens),
        )
        if holds
    ]
    return InvalidRequestError(
        f"No token may come next after {request.num_output_tokens} generated tokens: "
        f"{' and '.join(name for name, _ in rules)} rule out every token of the vocabulary.",
        param=next((field for _, field in rules if field is not None), None),
    )
