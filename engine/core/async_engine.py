"""The asyncio face of the engine: `generate()` streams deltas, one background task steps.

Each step runs in a worker thread so the event loop keeps serving health checks and new requests
while torch works. Requests and aborts are queued and applied between steps, so only one thread
ever touches the scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from engine.core.config import EngineConfig, ServingInfo
from engine.core.engine_core import EngineCore
from engine.core.errors import EngineDeadError, InvalidRequestError, RequestFailedError
from engine.core.images import ImageInputs
from engine.core.outputs import RequestOutput
from engine.core.pausing import Pause, PauseInterruptedError, check_mode
from engine.core.profiling import (
    ProfilerStateError,
    StepProfiler,
    save_in_background,
    save_logged,
)
from engine.core.sampling_params import SamplingParams
from engine.core.stats import RequestParamsStats, StepStats
from engine.lora.registry import LoRARegistry, LoRARequest
from engine.scheduling.admission import promised_tokens

logger = logging.getLogger(__name__)

# What the server adds to the id a client sees: a suffix of its own where the client chose the
# id, and the prompt's index in a many-prompt request.
_ENGINE_SUFFIX = r"(?:-[0-9a-f]{8})?(?:-[0-9]+)?"


class RequestCollector:
    """Deltas of one request (all its `n` sequences) waiting for the consumer.

    A consumer that lags gets the pending deltas of a sequence merged into one. With an
    `interval` above 1 (vLLM's `--stream-interval`) the consumer is woken once a sequence has
    gathered that many tokens, has ended, or has its first delta pending: fewer, larger deltas.
    """

    def __init__(self, n: int, interval: int = 1) -> None:
        self.n = n
        self.interval = interval
        self.finished_indices: set[int] = set()
        self._pending: dict[int, RequestOutput] = {}
        # Sequences whose first delta the consumer has had.
        self._started: set[int] = set()
        # The consumer's wait, when it is waiting (a bare future: cheaper than an Event).
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput) -> None:
        if output.index in self.finished_indices:
            return
        pending = self._pending.get(output.index)
        if pending is None:
            self._pending[output.index] = output
        else:
            pending.merge(output)
        if output.finished:
            self.finished_indices.add(output.index)
        waiter = self._waiter
        if waiter is not None and not waiter.done() and self._ready():
            waiter.set_result(None)

    async def get(self) -> list[RequestOutput]:
        while not self._ready():
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        outputs = list(self._pending.values())
        self._pending.clear()
        self._started.update(output.index for output in outputs)
        return outputs

    def _ready(self) -> bool:
        """Whether the pending deltas are due to the consumer."""
        if self.interval == 1:
            return bool(self._pending)
        return any(
            output.finished
            or output.index not in self._started
            or len(output.new_token_ids) >= self.interval
            for output in self._pending.values()
        )


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How a request is treated under load: `priority` (lower runs first under the priority
    policy) and `timeout` in seconds (None: the server's default, if any)."""

    priority: int = 0
    timeout: float | None = None
    # Background work (batch lines): runs only when no other request runs or waits.
    background: bool = False
    # The LoRA adapter to run under (the `model` a request names); None: the base model.
    lora: LoRARequest | None = None
    # The prompt's images, for a model that reads them.
    images: ImageInputs | None = None
    # Only requests with the same salt share cached prefix blocks (vLLM's `cache_salt`).
    cache_salt: str | None = None


@dataclass(slots=True)
class _PendingAdd:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    options: RequestOptions
    timeout: float | None
    deferred: bool
    promised_tokens: int


class AsyncEngine:
    """Owns the engine loop task. Create, `await start()`, use, `await shutdown()`."""

    def __init__(
        self, core: EngineCore, info: ServingInfo, executor: ThreadPoolExecutor | None = None
    ) -> None:
        self.core = core
        self.info = info
        self._executor = executor or _step_executor()
        self._grammar_executor = ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="conveyor-grammar"
        )
        self._collectors: dict[str, RequestCollector] = {}
        self._children: dict[str, list[str]] = {}
        self._adds: list[_PendingAdd] = []
        # The promised tokens of `_adds`, kept as they come: summing them per request made a
        # body of many prompts quadratic in its count.
        self._pending_tokens = 0
        self._aborts: list[str] = []
        # While paused: the pause, and the requests that came meanwhile (queued at the resume).
        self._pause: Pause | None = None
        self._held: list[_PendingAdd] = []
        self._cache_resets: list[asyncio.Future[int]] = []
        # Checkpoint folders to serve next, each with its caller's wait (`reload_weights`).
        self._reloads: list[tuple[str, asyncio.Future[None]]] = []
        # What the trainer calls the weights being served (None: those it started with).
        self.weight_version: str | None = None
        # Whether the pause in force is the one a sleep made (the wake-up then resumes), and
        # whether a sleep is under way (a resume meanwhile waits for the wake-up too).
        self._sleep_paused = False
        self._falling_asleep = False
        # Adapters read and waiting to be served, and adapters removed, between two steps.
        self._lora_adds: list[tuple[LoRARequest, Any, asyncio.Future[LoRARequest]]] = []
        self._lora_removals: list[LoRARequest] = []
        self._new_requests: list[RequestParamsStats] = []
        self.stat_loggers: list[Callable[[StepStats], None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.last_error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and size the cache (blocking; call before serving)."""
        from engine.factory import create_engine_core

        # Load on the thread that will run the steps: torch's CPU kernels run measurably
        # slower when two threads each keep an OpenMP team.
        executor = _step_executor()
        core, _, info = executor.submit(create_engine_core, config).result()
        return cls(core, info, executor)

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def processor(self) -> Any:
        """An image-text model's processor (None for a text model)."""
        return self.core.processor

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="conveyor-engine-loop")
        loop = asyncio.get_running_loop()

        def on_failure(error: EngineDeadError) -> None:  # on the thread watching the workers
            loop.call_soon_threadsafe(self._stop_dead, error)

        self.core.watch(on_failure)

    async def shutdown(self) -> None:
        """Stop the loop; requests still in flight are aborted."""
        self._stopping = True
        if self._task is not None:
            self._wake_loop()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        waiting: list[asyncio.Future[Any]] = [*self._cache_resets]
        waiting += [done for _, done in self._reloads]
        self._reloads = []
        waiting += [done for _, _, done in self._lora_adds]
        for done in waiting:
            if not done.done():
                done.set_exception(EngineDeadError("The engine is not running."))
        self._cache_resets, self._lora_adds = [], []
        self._abort_all_now()
        self._fail_unqueued(EngineDeadError("The engine is not running."))
        await self._save_running_profile()
        self._executor.shutdown(wait=True)
        self._grammar_executor.shutdown(wait=False, cancel_futures=True)
        self.core.close()

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done() and not self._stopping

    @property
    def num_unfinished(self) -> int:
        return len(self._collectors)

    # ---- requests --------------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        options: RequestOptions = RequestOptions(),
    ) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request now and return the stream of its deltas.

        Raises at once a typed error for a request that can never run or is turned away
        (`QueueFullError`, `RequestTimeoutError`). The stream yields deltas of every sequence
        until all `params.n` have finished, and raises `RequestFailedError` (after the deltas
        that came before) if a step fails, or `RequestTimeoutError` if the deadline passes
        before a sequence produced anything. Closing it early aborts the request and frees its
        blocks.
        """
        request_id = request_id or uuid.uuid4().hex
        collector = self._submit(request_id, prompt_token_ids, params, options)
        return self._stream(request_id, collector)

    async def prepare(self, params: SamplingParams) -> None:
        """Compile the output format `params` asks for, if any, on a thread of its own (not the
        event loop, not the step's), so that a large schema never stalls other requests and
        queuing the request only copies the compiled grammar. Raises `InvalidRequestError` for
        a format that does not compile."""
        if params.structured is None:
            return
        grammars = self.core.grammars
        if grammars is None:
            return  # the core refuses the request: it has no tokenizer
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._grammar_executor, grammars.compile, params.structured)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        options: RequestOptions = RequestOptions(),
    ) -> AsyncIterator[RequestOutput]:
        """`submit` and iterate in one: errors surface at the first iteration."""
        stream = self.submit(prompt_token_ids, params, request_id, options)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    async def _stream(
        self, request_id: str, collector: RequestCollector
    ) -> AsyncGenerator[RequestOutput, None]:
        finished = 0
        try:
            while finished < collector.n:
                for output in await collector.get():
                    if output.error is not None:
                        raise output.error
                    finished += output.finished
                    yield output
        finally:
            if finished < collector.n:
                self.abort(request_id)
            self._collectors.pop(request_id, None)

    def _submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        options: RequestOptions,
    ) -> RequestCollector:
        if not self.is_running:
            reason = f": {self.last_error}" if self.last_error is not None else "."
            raise EngineDeadError(f"The engine is not running{reason}")
        if request_id in self._collectors:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.core.validate(prompt_token_ids, params, options.lora, options.images)
        timeout = options.timeout if options.timeout is not None else self.info.request_timeout
        try:
            deferred = self.core.admit(
                prompt_token_ids,
                params,
                options.priority,
                timeout,
                len(self._adds) + len(self._held),
                self._pending_tokens,
            )
        except Exception:
            self._wake_loop()  # so the rejection reaches the metrics promptly
            raise
        collector = RequestCollector(params.n, self.info.stream_interval)
        self._collectors[request_id] = collector
        promised = promised_tokens(len(prompt_token_ids), params, self.core.max_tokens)
        (self._adds if self._pause is None else self._held).append(
            _PendingAdd(
                request_id,
                list(prompt_token_ids),
                params,
                time.monotonic(),
                options,
                timeout,
                deferred,
                promised,
            )
        )
        self._pending_tokens += promised
        kind = params.structured.kind if params.structured is not None else None
        self._new_requests.append(
            RequestParamsStats(params.n, promised - len(prompt_token_ids), kind)
        )
        self._wake_loop()
        return collector

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with `error` (their streams raise it after what they
        already had); their sequences are aborted within a step."""
        for request_id in list(self._collectors):
            self._fail_collector(request_id, error)
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (all its sequences); its blocks return within a step."""
        self._aborts.append(request_id)
        self._wake_loop()

    def abort_requests(self, request_ids: list[str] | None = None) -> list[str]:
        """Abort every request in flight, or those `request_ids` name: an engine id, or the
        id a client sees (a reply's `id`: the engine's lacks the suffix a client's own id
        gets, and one id per prompt of a many-prompt request). Return the engine ids."""
        chosen = list(self._collectors)
        if request_ids is not None:
            named = [f"(?:{re.escape(given)}){_ENGINE_SUFFIX}" for given in request_ids]
            pattern = re.compile("|".join(named)) if named else None
            chosen = [rid for rid in chosen if pattern is not None and pattern.fullmatch(rid)]
        for request_id in chosen:
            self.abort(request_id)
        return chosen

    # ---- pausing -----------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._pause is not None

    async def pause(self, mode: str = "abort", clear_cache: bool = True) -> None:
        """Stop generating between two steps until `resume()` (see `engine.core.pausing`);
        return once the pause has taken effect."""
        check_mode(mode)
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        if self._pause is None:
            self._pause = Pause()
            logger.info("pausing generation (mode %s)", mode)
        done = self._pause.ask(mode, clear_cache)
        if mode == "abort":
            held = {add.request_id for add in self._held}
            for request_id in list(self._collectors):
                if request_id not in held:
                    self.abort(request_id)
        self._wake_loop()
        await done

    async def resume(self) -> None:
        """Go on generating: frozen requests continue and the held ones queue. Asleep, the
        engine goes on at the wake-up."""
        if self.is_sleeping:
            self._sleep_paused = True
            return
        self._resume_now()

    def _resume_now(self) -> None:
        pause, self._pause = self._pause, None
        if pause is None:
            return
        pause.fail(PauseInterruptedError())
        self._adds += self._held
        self._held = []
        logger.info("generation resumed")
        self._wake_loop()

    def _rest(self, pause: Pause) -> None:
        """The engine rests in `pause`: forget the prefix cache if asked and nothing holds
        it, then let the callers waiting for the pause return."""
        if pause.wants_clear and not self.core.has_unfinished():
            self.core.scheduler.block_manager.reset_cache()
            self.core.publish_kv_events()
        pause.settle()

    # ---- new weights -------------------------------------------------------------------------

    async def reload_weights(self, path: str, version: str | None = None) -> None:
        """Serve the weights in the checkpoint folder `path` from the next step on, and call
        them `version` (see `engine/weight_reload.py`); no step runs while they load."""
        reloader = self.core.reloader
        reason = reloader.refusal() if reloader is not None else "this engine cannot"
        if reason is not None:
            raise InvalidRequestError(f"Cannot load new weights: {reason}.", param="model_path")
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reloads.append((path, done))
        self._wake_loop()
        await done
        if version is not None:
            self.weight_version = version

    async def _apply_reloads(self) -> None:
        """Between two steps: each queued checkpoint loads and takes the model's place on the
        step thread, then the prefix cache computed with the old weights is forgotten."""
        loop = asyncio.get_running_loop()
        reloads, self._reloads = self._reloads, []
        for path, done in reloads:
            try:
                await loop.run_in_executor(self._executor, self._swap_weights, path)
            except Exception as exc:
                if not done.done():
                    done.set_exception(exc)
                continue
            self.core.scheduler.block_manager.reset_cache()
            self.core.publish_kv_events()
            self._resume_if_awake()
            if not done.done():
                done.set_result(None)

    def _swap_weights(self, path: str) -> None:
        """On the step thread: the checkpoint at `path` loads and takes the model's place."""
        reloader, sleeper = self.core.reloader, self.core.sleeper
        assert reloader is not None and sleeper is not None  # made together, or neither
        model = reloader.load(path, sleeper.shape())
        reloader.install(self.core.runner, model, path)
        sleeper.weights_loaded()

    # ---- sleep mode ------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        sleeper = self.core.sleeper
        return self._falling_asleep or (sleeper is not None and bool(sleeper.asleep))

    @property
    def sleep_level(self) -> int:
        """0 awake, else the deepest level the engine sleeps at."""
        sleeper = self.core.sleeper
        return sleeper.level if sleeper is not None and sleeper.asleep else 0

    async def sleep(self, level: int = 1) -> None:
        """Give the engine's memory back (see `engine/worker/sleep_mode.py`): requests in
        flight are aborted, and requests that arrive wait for the wake-up."""
        sleeper = self.core.sleeper
        reason = sleeper.refusal(level) if sleeper is not None else "this engine cannot sleep"
        if reason is not None:
            raise InvalidRequestError(f"Cannot sleep: {reason}.", param="level")
        assert sleeper is not None
        if self._pause is None:
            self._sleep_paused = True
        self._falling_asleep = True
        try:
            await self.pause("abort")
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, sleeper.sleep, level)
        finally:
            self._falling_asleep = False

    async def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Take back what sleep gave up (`tags`: `weights`, `kv_cache`; None: both); once
        both are back, generation goes on unless a pause of its own holds it."""
        sleeper = self.core.sleeper
        if sleeper is None or not sleeper.asleep:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, sleeper.wake, tags)
        self._resume_if_awake()

    def _resume_if_awake(self) -> None:
        if self._sleep_paused and not self.is_sleeping:
            self._sleep_paused = False
            self._resume_now()

    # ---- the loop --------------------------------------------------------------------------

    async def reset_prefix_cache(self) -> int:
        """Forget the cached prefix blocks no request holds, between two steps; return how
        many were forgotten."""
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._cache_resets.append(done)
        self._wake_loop()
        return await done

    # ---- LoRA adapters ---------------------------------------------------------------------

    @property
    def loras(self) -> LoRARegistry | None:
        """The adapters served by name (None without `--enable-lora`)."""
        return self.core.loras

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Read the adapter in folder `path` off the loop and serve it as `name` from the next
        step on. Raises `InvalidRequestError` where adapters are not served, the name is
        taken or the folder holds no adapter this model can run."""
        if not self.is_running:
            raise EngineDeadError("The engine is not running.")
        self._check_new_lora(name)
        loop = asyncio.get_running_loop()
        try:
            lora, adapter = await loop.run_in_executor(
                self._grammar_executor, self.core.read_lora, name, path
            )
        except ValueError as exc:  # `LoRAError`: the folder's adapter cannot be served
            raise InvalidRequestError(str(exc), param="lora_path") from None
        done: asyncio.Future[LoRARequest] = loop.create_future()
        self._lora_adds.append((lora, adapter, done))
        self._wake_loop()
        return await done

    def remove_lora(self, name: str) -> LoRARequest | None:
        """Stop serving adapter `name` (None if there is none): new requests cannot name it,
        those that did run to their end, then its weights are freed."""
        registry = self.core.loras
        lora = registry.remove(name) if registry is not None else None
        if lora is not None:
            self._lora_removals.append(lora)
            self._wake_loop()
        return lora

    def _check_new_lora(self, name: str) -> None:
        registry = self.core.loras
        if registry is None:
            raise InvalidRequestError("LoRA adapters are served only with --enable-lora.")
        loading = any(lora.name == name for lora, _, _ in self._lora_adds)
        if name in registry or loading:
            raise InvalidRequestError(
                f"The LoRA adapter `{name}` has already been loaded.", param="lora_name"
            )

    def _apply_lora_changes(self) -> None:
        adds, self._lora_adds = self._lora_adds, []
        for lora, adapter, done in adds:
            if done.done():
                continue
            try:
                self._check_new_lora(lora.name)  # another load of the name may have won
            except InvalidRequestError as exc:
                done.set_exception(exc)
                continue
            self.core.add_lora(lora, adapter)
            done.set_result(lora)
        removals, self._lora_removals = self._lora_removals, []
        for lora in removals:
            self.core.retire_lora(lora)
        self.core.drop_retired()

    # ---- profiling -------------------------------------------------------------------------

    async def start_profile(self) -> None:
        """Start a profile of the steps (after the configured delay); a `ProfilerStateError`
        while one runs."""
        profiler = self._profiler()
        await asyncio.get_running_loop().run_in_executor(self._executor, profiler.start)

    async def stop_profile(self) -> list[str]:
        """Stop the profile and save it: the files written (none where it stopped before it
        began); a `ProfilerStateError` while none runs."""
        profiler = self._profiler()
        loop = asyncio.get_running_loop()
        recording = await loop.run_in_executor(self._executor, profiler.stop)
        return [] if recording is None else await asyncio.to_thread(recording.save)

    async def _save_running_profile(self) -> None:
        """At shutdown: a profile still recording is stopped and saved, not lost."""
        profiler = self.core.profiler
        if profiler is None or not profiler.active:
            return
        recording = await asyncio.get_running_loop().run_in_executor(self._executor, profiler.stop)
        if recording is not None:
            await asyncio.to_thread(save_logged, recording)

    def _profiler(self) -> StepProfiler:
        if self.core.profiler is None:
            raise ProfilerStateError("Profiling is off; start the server with --profiler-config.")
        return self.core.profiler

    def _wake_loop(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while not self._stopping:
            self._apply_pending()
            self._report_stats()
            if self._reloads:
                await self._apply_reloads()
                continue
            pause = self._pause
            if pause is not None and pause.rests(not self.core.has_unfinished()):
                self._rest(pause)
                self._wake.clear()
                if not self._aborts and not self._stopping:
                    await self._wake.wait()
                continue
            if not self.core.has_unfinished():
                self._wake.clear()
                if not self._adds and not self._aborts and not self._stopping:
                    await self._wake.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._executor, self._step)
            except EngineDeadError as exc:  # no further step can run (a worker died)
                self._stop_dead(exc)
                return
            except Exception as exc:  # a bug outside the model step: fail what is in flight
                logger.exception("engine step crashed")
                self.last_error = exc
                outputs = self.core.fail_all(RequestFailedError(f"The engine failed: {exc}"))
            # No yield here: the next step starts first, and the handlers stream these outputs
            # while it runs instead of holding it up.
            self._dispatch(outputs)
            self._report_stats()

    def _step(self) -> list[RequestOutput]:
        """One engine step, on the step thread; then a profile counts it."""
        outputs = self.core.step()
        profiler = self.core.profiler
        if profiler is not None and profiler.active:
            recording = profiler.tick()
            if recording is not None:  # it ran its `max_iterations` steps
                save_in_background(recording)
        return outputs

    def _stop_dead(self, error: EngineDeadError) -> None:
        """The engine cannot step again: every request in flight fails with `error`, health
        turns unavailable and new requests are refused."""
        if self.last_error is None:
            logger.error("the engine stopped: %s", error)
        self.last_error = error
        self._stopping = True
        self.fail_all(error)
        if self._pause is not None:
            self._pause.fail(error)
        self._wake_loop()

    def _report_stats(self) -> None:
        if not self.stat_loggers:
            return
        stats = self.core.take_stats()
        stats.new_requests, self._new_requests = self._new_requests, []
        for log in self.stat_loggers:
            try:
                log(stats)
            except Exception:
                logger.exception("a stats logger failed")

    def _apply_pending(self) -> None:
        aborts, self._aborts = self._aborts, []
        adds, self._adds = self._adds, []
        aborted = set(aborts)
        if self._held and aborted:
            self._held = [add for add in self._held if add.request_id not in aborted]
        self._pending_tokens = sum(add.promised_tokens for add in self._held)
        for add in adds:
            if add.request_id not in aborted:
                self._add_to_core(add)
        for request_id in aborts:
            self._abort_now(request_id)
        resets, self._cache_resets = self._cache_resets, []
        for done in resets:
            if not done.done():
                done.set_result(self.core.scheduler.block_manager.reset_cache())
        if resets:
            self.core.publish_kv_events()
        self._apply_lora_changes()

    def _add_to_core(self, add: _PendingAdd) -> None:
        n = add.params.n
        children = [add.request_id] if n == 1 else [f"{add.request_id}-{i}" for i in range(n)]
        self._children[add.request_id] = children
        try:
            for index, child in enumerate(children):
                self.core.add_request(
                    child,
                    add.prompt_token_ids,
                    _child_params(add.params, index),
                    parent_id=add.request_id,
                    index=index,
                    arrival_time=add.arrival_time,
                    fork_of=children[0] if index else None,
                    priority=add.options.priority,
                    background=add.options.background,
                    lora=add.options.lora,
                    images=add.options.images,
                    cache_salt=add.options.cache_salt,
                    timeout=add.timeout,
                    deferred=add.deferred,
                    siblings=n,
                )
        except Exception as exc:
            self._dispatch(self.core.abort_requests(children))
            self._fail_collector(add.request_id, exc)

    def _abort_now(self, request_id: str) -> None:
        children = self._children.pop(request_id, [])
        self._dispatch(self.core.abort_requests(children))
        collector = self._collectors.get(request_id)
        if collector is not None and not children:
            self._fail_collector(request_id, None)

    def _abort_all_now(self) -> None:
        for request_id in list(self._children):
            self._abort_now(request_id)

    def _fail_unqueued(self, error: EngineDeadError) -> None:
        """At shutdown: the requests not yet queued in the core (held by a pause, or
        submitted after the last step) end with `error`, as do callers waiting for a pause."""
        for add in self._adds + self._held:
            self._fail_collector(add.request_id, error)
        self._adds, self._held = [], []
        if self._pause is not None:
            self._pause.fail(error)

    def _fail_collector(self, request_id: str, error: BaseException | None) -> None:
        collector = self._collectors.get(request_id)
        if collector is None:
            return
        for index in set(range(collector.n)) - collector.finished_indices:
            collector.put(
                RequestOutput(
                    request_id,
                    index,
                    [],
                    "",
                    finished=True,
                    finish_reason="abort" if error is None else "error",
                    error=error,
                )
            )

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            if output.finished and output.request_id in self._children:
                self._forget_child(output)
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)
                if len(collector.finished_indices) == collector.n:
                    # The stream keeps its own reference; an unread stream must not leak.
                    del self._collectors[output.request_id]

    def _forget_child(self, output: RequestOutput) -> None:
        children = self._children[output.request_id]
        child = output.request_id if len(children) == 1 else f"{output.request_id}-{output.index}"
        if child in children:
            children.remove(child)
        if not children:
            del self._children[output.request_id]


def _step_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="conveyor-step")


def _child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index` of an `n > 1` request: one sequence, its own seed stream. Seeds count
    modulo 2^64, as generators take them, so the last seed's siblings wrap to 0, 1, ..."""
    if params.n == 1:
        return params
    seed = None if params.seed is None else (params.seed + index) % 2**64
    return replace(params, n=1, seed=seed)
