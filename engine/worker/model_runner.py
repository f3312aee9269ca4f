"""Runs one step: flattened inputs through the model, logits of the needed positions, sampling.

Where every row samples greedily from its raw logits, the model chooses the tokens itself
(`CausalLM.greedy_tokens`), and over Conveyor's bf16 panels the logits are never written out."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.core.errors import WorkerFailedError
from engine.core.outputs import ModelRunnerOutput, TokenLogprob
from engine.core.request import Request
from engine.kernels.cpu import denormals
from engine.kv.kv_cache import KVCache
from engine.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from engine.lora.slots import LoRASlots
from engine.models import CausalLM
from engine.models.base import ImageRows
from engine.models.gemma import PagedGemmaForCausalLM
from engine.models.granite import PagedGraniteForCausalLM
from engine.models.llama import PagedLlamaForCausalLM
from engine.models.vision import ImageTextLM, takes_images
from engine.parallel.step import StateCopies, StepInputs
from engine.scheduling.scheduler import SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.image_features import step_image_features
from engine.worker.input_batch import InputBatch, build_input_batch
from engine.worker.piecewise_graphs import PiecewiseGraphs
from engine.worker.sampler import (
    PendingTokens,
    SampledTokens,
    Sampler,
    takes_argmax,
    token_logprobs,
)
from engine.worker.verify import (
    Verified,
    VerifyGroup,
    groups_of,
    kept_state_copies,
    verified_logprobs,
    verify_chosen,
    verify_sampled,
)

if TYPE_CHECKING:
    from engine.parallel.workers import WorkerPool


class ModelRunner:
    """Owns the model, the KV cache tensors and the sampler; knows nothing of queues. Under
    tensor parallelism it is rank 0's: each step goes to the `workers` before the model runs."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: KVCache,
        backend: AttentionBackend,
        sampler: Sampler,
        graphs: DecodeGraphs | None = None,
        workers: WorkerPool | None = None,
        piecewise: PiecewiseGraphs | None = None,
    ) -> None:
        self.model = model
        encoder = cast(ImageTextLM, model).image_encoder if takes_images(model) else None
        # Whether the model's image tokens see their whole run both ways (`ImageInputs`), and
        # where its images lie on their grids, the patches merged a token (`mrope.py`).
        self.images_both_ways = encoder is not None and encoder.both_ways
        self.grid_merge = encoder.grid_merge if encoder is not None else None
        self.workers = workers
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = sampler
        self.graphs = graphs
        self.piecewise = piecewise
        self.device = kv_cache.device
        # False: every step hands its logits to the sampler (benchmarks compare the two ways).
        self.greedy_in_model = True
        # The pooling runner: a prompt's last step returns its last hidden state, no token.
        self.pooling = False
        # A sequence classifier's pooled rows go through its head (the score head): one logit
        # per label instead of the hidden state.
        self.classifies = False
        # LoRA adapters' slots (`--enable-lora`); each step sets which rows run which.
        self.lora: LoRASlots | None = None
        # The last step's sampled tokens on the device, and each request's row in them.
        self._last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._last_rows: dict[str, int] = {}
        # The copies of states the last verifying step left, for the workers' next step.
        self._kept_states: list[tuple[int, int]] = []

    @property
    def takes_images(self) -> bool:
        """Whether the model reads images (an image-text model's prompts may carry some)."""
        return takes_images(self.model)

    @property
    def embeds_prompts(self) -> bool:
        """Whether a prompt may come as embedding rows in place of its tokens' (vLLM's
        `prompt_embeds`): on Conveyor's text decoder on one device, where the rows enter as
        transformers' `inputs_embeds` would (not Gemma's or Granite's, which scale those)."""
        model = self.model
        return (
            isinstance(model, PagedLlamaForCausalLM)
            and not isinstance(model, PagedGemmaForCausalLM | PagedGraniteForCausalLM)
            and not takes_images(model)
            and model.shard is None
        )

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its results."""
        return self.launch(scheduler_output).result()

    @torch.inference_mode()
    def launch(self, scheduler_output: SchedulerOutput) -> LaunchedStep:
        """Run one step as far as the device lets the host go on: on a GPU its kernels are
        queued and its sampled tokens stay there (the next step's inputs read them in place)
        until `LaunchedStep.result()`."""
        if self.device.type == "cpu":
            denormals.flush_on_this_thread()
        self.kv_cache.copy_blocks(scheduler_output.block_copies)
        state_copies = self._state_copies(scheduler_output)
        restore_states(self.kv_cache, state_copies)
        batch = build_input_batch(scheduler_output.scheduled, self.kv_cache.block_size)
        if self.lora is not None:
            self.lora.begin([r.lora for r in batch.requests], batch.query_lens)
        requests = _sampled_requests(batch)
        if self.pooling:
            return self._pool(batch, requests)
        prompt_rows = _prompt_logprob_rows(batch)
        prompt_indices = _prompt_logprob_indices(batch, prompt_rows)
        indices = np.concatenate([prompt_indices, batch.sample_token_indices])
        chooses = not prompt_rows and self._model_chooses(batch, requests)
        rows = [self._last_rows[request_id] for request_id in batch.placeholder_ids]
        if self.workers is not None:
            copies = scheduler_output.block_copies
            previous = len(self._last_tokens)
            kept, self._kept_states = self._kept_states, []
            shared = replace(state_copies, kept=kept)
            self.workers.send(StepInputs.of(batch, indices, copies, rows, previous, shared))
        output = ModelRunnerOutput()
        with self._across_ranks():
            input_ids = self._device_input_ids(batch, rows)
            images = self._image_features(batch)
            if chooses:
                inputs = self._model_inputs(batch, indices, input_ids)
                tokens = self.model.greedy_tokens(*inputs, image_features=images)
                self.kv_cache.end_calibration()
                save_states(self.kv_cache, state_copies)
                if batch.drafts:
                    self._verified_choices(requests, tokens.tolist(), batch.drafts, output)
                    return self._synchronous(batch, output)
                return self._launched(requests, SampledTokens(tokens, None), output)
            logits = self.forward(batch, indices, input_ids, images)
            self.kv_cache.end_calibration()
            save_states(self.kv_cache, state_copies)
        if prompt_rows:
            self._prompt_logprobs(batch, prompt_rows, logits[: len(prompt_indices)], output)
        if batch.drafts:
            sampled_logits = logits[len(prompt_indices) :]
            self._verified(sampled_logits, requests, batch.drafts, output)
            return self._synchronous(batch, output)
        sampled = None
        if requests:
            pending = PendingTokens(self._last_tokens, self._last_rows)
            sampled = self.sampler.sample(logits[len(prompt_indices) :], requests, pending)
        return self._launched(requests, sampled, output)

    def _state_copies(self, scheduler_output: SchedulerOutput) -> StateCopies:
        """The step's copies of a recurrent model's states: each request that resumes from a
        snapshot (a cached prefix) takes it into its slot before the forward; each that ends
        the step on the snapshots' grid leaves its states in the row reserved for them."""
        states = self.kv_cache.states
        if states is None or not states.num_snapshots:
            return StateCopies()
        scheduled = scheduler_output.scheduled
        restores = [(i.restore, i.request.state_slot) for i in scheduled]
        saves = [(i.request.state_slot, i.save[0] if i.save else None) for i in scheduled]
        return StateCopies(_pairs(restores), _pairs(saves))

    def _verified_choices(
        self,
        requests: list[Request],
        tokens: list[int],
        drafts: dict[str, list[int]],
        output: ModelRunnerOutput,
    ) -> None:
        """A step whose sampled rows (`requests`, a verifying request once a row) took their
        argmax tokens in the model: each verifying request keeps the drafts equal to them."""
        groups = groups_of(requests, drafts)
        for row in _plain_rows(len(requests), groups):
            output.sampled_token_ids[requests[row].request_id] = tokens[row]
        for group in groups:
            _take_verified(output, group, verify_chosen(tokens, group))

    def _verified(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: dict[str, list[int]],
        output: ModelRunnerOutput,
    ) -> None:
        """A step with verifying requests, its sampled rows' `logits` in hand: the other
        requests sample as ever, the verifying ones keep what `verify_sampled` keeps."""
        groups = groups_of(requests, drafts)
        plain = _plain_rows(len(requests), groups)
        if plain:
            chosen = [requests[row] for row in plain]
            rows = torch.tensor(plain, device=logits.device)
            LaunchedStep(chosen, self.sampler.sample(logits[rows], chosen), output).result()
        for group, verified in zip(
            groups, verify_sampled(self.sampler, logits, groups), strict=True
        ):
            _take_verified(output, group, verified)
            if group.request.sampling_params.logprobs is not None:
                mode = self.sampler.logprobs_mode
                *kept, last = verified_logprobs(logits, group, verified, mode)
                output.accepted_logprobs[group.request.request_id] = kept
                output.logprobs[group.request.request_id] = last

    def _synchronous(self, batch: InputBatch, output: ModelRunnerOutput) -> LaunchedStep:
        """A verifying step whose results are on the host already (a speculating engine does
        not overlap its steps: no later step reads this one's tokens on the device); a
        recurrent model's requests keep the states of their last kept rows."""
        states = self.kv_cache.states
        if states is not None:
            kept = kept_state_copies(batch, output.accepted_drafts)
            states.copy_slots(kept)
            if self.workers is not None:  # theirs before their next step
                self._kept_states += kept
        self._last_rows = {}
        return LaunchedStep([], None, output)

    def _pool(self, batch: InputBatch, requests: list[Request]) -> LaunchedStep:
        """The pooling runner's step: each finished prompt's last hidden state, on the host;
        its request takes a placeholder token and ends (`max_tokens` 1). It runs on one device
        and samples nothing, so none of a generating step's bookkeeping applies."""
        output = ModelRunnerOutput()
        model = cast(PagedLlamaForCausalLM, self.model)
        indices = batch.sample_token_indices
        inputs = self._model_inputs(batch, indices, self._device_input_ids(batch, []))
        hidden = model.pooled(*inputs)
        if self.classifies:
            hidden = model.lm_head(hidden)
        hidden = hidden.float().cpu()
        for row, request in enumerate(requests):
            output.embeddings[request.request_id] = hidden[row]
        tokens = torch.zeros(len(requests), dtype=torch.int64, device=self.device)
        return self._launched(requests, SampledTokens(tokens, None), output)

    def _launched(
        self, requests: list[Request], sampled: SampledTokens | None, output: ModelRunnerOutput
    ) -> LaunchedStep:
        """Remember where each request's token lies, for the next step's placeholders."""
        if sampled is not None:
            # A NO_TOKEN row's request fails when the step is received; a step launched before
            # that reads some token for it, never an index outside the vocabulary.
            self._last_tokens = sampled.token_ids.clamp(min=0)
            self._last_rows = {r.request_id: row for row, r in enumerate(requests)}
        return LaunchedStep(requests, sampled, output)

    def _device_input_ids(self, batch: InputBatch, rows: list[int] | None = None) -> torch.Tensor:
        """The step's input ids on the device, each placeholder taken from row `rows[i]` of the
        tokens the previous step sampled (a gather on the device: the host never waits for
        them). The other ranks get those tokens too, broadcast from this one."""
        if rows is None:
            rows = [self._last_rows[request_id] for request_id in batch.placeholder_ids]
        if rows and self.workers is not None:
            self.workers.group.broadcast(self._last_tokens)
        return placed_input_ids(batch, self._last_tokens, rows, self.device)

    @contextmanager
    def _across_ranks(self) -> Iterator[None]:
        """Under tensor parallelism, a forward pass that fails has left the other ranks in the
        middle of the step: the engine cannot go on (`WorkerFailedError`)."""
        if self.workers is None:
            yield
            return
        try:
            yield
        except Exception as exc:
            reason = self.workers.why_failed() or f"the step failed on rank 0: {exc}"
            raise WorkerFailedError(reason) from exc

    def forward(
        self,
        batch: InputBatch,
        logits_indices: np.ndarray,
        input_ids: torch.Tensor | None = None,
        images: ImageRows | None = None,
    ) -> torch.Tensor:
        """Logits `[len(logits_indices), vocab]` for the given flattened token positions;
        `input_ids` on the device, if already there. A step with `images` (features that
        replace some tokens' embeddings) runs eagerly."""
        if input_ids is None:
            input_ids = self._device_input_ids(batch)
        if images is not None:
            inputs = self._model_inputs(batch, logits_indices, input_ids)
            return self.model(*inputs, image_features=images)
        if self._replays_whole(batch, logits_indices):
            assert self.graphs is not None
            return self.graphs.run(batch, input_ids)
        inputs = self._model_inputs(batch, logits_indices, input_ids)
        if self._runs_in_pieces(batch):
            assert self.piecewise is not None
            _, _, metadata, keep = inputs
            return self.piecewise.run(batch, input_ids, metadata, keep)
        return self.model(*inputs)

    def _image_features(self, batch: InputBatch) -> ImageRows | None:
        """The features of the images whose placeholders the step computes (None for none)."""
        if not self.takes_images and all(r.images is None for r in batch.requests):
            return None
        encoder = cast(ImageTextLM, self.model).image_encoder if self.takes_images else None
        return step_image_features(batch, encoder, self.device)

    def _replays_whole(self, batch: InputBatch, logits_indices: np.ndarray) -> bool:
        """A decode graph runs the step. The step that calibrates the KV cache's scales runs
        eagerly, as do those the graphs do not take."""
        graphs = self.graphs
        if graphs is None or not self._graphs_run_it(batch):
            return False
        return graphs.supports(batch, logits_indices)

    def _runs_in_pieces(self, batch: InputBatch) -> bool:
        """Piecewise graphs run the step (again not the calibrating one)."""
        pieces = self.piecewise
        return pieces is not None and self._graphs_run_it(batch) and pieces.supports(batch)

    def _graphs_run_it(self, batch: InputBatch) -> bool:
        """The step is one graphs can replay: it neither calibrates the KV cache's scales nor
        runs a LoRA adapter (the graphs hold the base model's products), and its positions lie
        on one axis (the graphs copy those alone)."""
        adapted = self.lora is not None and self.lora.active
        return not self.kv_cache.calibrating and not adapted and batch.rope_positions is None

    def _model_inputs(
        self, batch: InputBatch, logits_indices: np.ndarray, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        return model_inputs(self.backend, self.kv_cache, batch, logits_indices, input_ids)

    def _model_chooses(self, batch: InputBatch, requests: list[Request]) -> bool:
        """Every sampled row (`requests`) takes the argmax of its raw logits, and no graphs
        would run the step (replayed graphs compute the logits anyway)."""
        indices = batch.sample_token_indices
        return (
            self.greedy_in_model
            and takes_argmax(requests)
            and self.sampler.keeps_argmax
            and not self._replays_whole(batch, indices)
            and not self._runs_in_pieces(batch)
        )

    def _prompt_logprobs(
        self, batch: InputBatch, rows: list[int], logits: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Entry i of a prompt's logprobs is its token i scored by the logits at position i - 1;
        entry 0 (nothing predicts the first token) is None."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets: list[int] = []
        counts: list[int | None] = []
        for row in rows:
            request = batch.requests[row]
            lo, hi = _prompt_entry_span(batch, row)
            targets.extend(request.prompt_token_ids[lo:hi])
            counts.extend([request.sampling_params.prompt_logprobs] * (hi - lo))
        target = torch.tensor(targets, device=logits.device, dtype=torch.long)
        entries = token_logprobs(logprobs, target, counts)
        offset = 0
        for row in rows:
            request = batch.requests[row]
            lo, hi = _prompt_entry_span(batch, row)
            first = request.num_prompt_logprobs_done == 0
            chunk: list[TokenLogprob | None] = [None] if first else []
            chunk.extend(entries[offset : offset + hi - lo])
            offset += hi - lo
            request.num_prompt_logprobs_done = max(hi, 1)
            output.prompt_logprobs[request.request_id] = chunk

    def has_lora(self, lora_id: int) -> bool:
        return self.lora is not None and lora_id in self.lora.adapters

    def read_lora(self, path: str) -> LoRAAdapter:
        """The adapter in folder `path`, checked against this model (`LoRAError` if it does not
        fit)."""
        if self.lora is None:
            raise LoRAError("LoRA adapters are served only with --enable-lora")
        return load_adapter(path, self.lora.layer_shapes, self.lora.rank)

    def add_lora(self, lora_id: int, adapter: LoRAAdapter) -> None:
        assert self.lora is not None
        self.lora.add(lora_id, adapter)

    def remove_lora(self, lora_id: int) -> None:
        if self.lora is not None:
            self.lora.remove(lora_id)

    def close(self) -> None:
        """Stop the other ranks, if any."""
        if self.workers is not None:
            self.workers.close()


class LaunchedStep:
    """A step whose tokens may still be computing, already on their way to the host;
    `result()` waits for them."""

    def __init__(
        self, requests: list[Request], sampled: SampledTokens | None, output: ModelRunnerOutput
    ) -> None:
        self.requests = requests
        self.output = output
        self._copy = sampled.start_copy(requests) if sampled is not None else None

    def result(self) -> ModelRunnerOutput:
        output = self.output
        if self._copy is None:
            return output
        chosen = self._copy.wait()
        for request, token, logprob in zip(
            self.requests, chosen.token_ids, chosen.logprobs, strict=True
        ):
            output.sampled_token_ids[request.request_id] = token
            if logprob is not None:
                output.logprobs[request.request_id] = logprob
        self._copy = None
        return output


def placed_input_ids(
    batch: InputBatch,
    previous: torch.Tensor,
    rows: Sequence[int] | np.ndarray,
    device: torch.device,
) -> torch.Tensor:
    """`batch.input_ids` on `device` with each placeholder set to `previous[rows[i]]`."""
    input_ids = torch.from_numpy(batch.input_ids).to(device, non_blocking=True)
    if len(rows):
        source = torch.as_tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        target = torch.from_numpy(batch.placeholders).to(device, non_blocking=True)
        input_ids[target] = previous[source].to(input_ids.dtype)
    return input_ids


def _pairs(pairs: list[tuple[int | None, int | None]]) -> list[tuple[int, int]]:
    return [(a, b) for a, b in pairs if a is not None and b is not None]


def restore_states(kv_cache: KVCache, copies: StateCopies) -> None:
    """The states a verifying step kept (`StateCopies.kept`) and a recurrent model's snapshots
    copied into the slots of the requests resuming from them, in that order."""
    if kv_cache.states is None:
        return
    if copies.kept:
        kv_cache.states.copy_slots(copies.kept)
    if copies.restores:
        kv_cache.states.restore(copies.restores)


def save_states(kv_cache: KVCache, copies: StateCopies) -> None:
    """A recurrent model's states copied into the snapshots reserved for them."""
    if copies.saves and kv_cache.states is not None:
        kv_cache.states.save(copies.saves)


def model_inputs(
    backend: AttentionBackend,
    kv_cache: KVCache,
    batch: InputBatch,
    logits_indices: np.ndarray,
    input_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The model's arguments for one step, on the cache's device (`input_ids` if already
    there)."""
    device = kv_cache.device
    metadata = backend.build_metadata(batch, kv_cache)
    if kv_cache.states is not None:
        kv_cache.states.begin(batch)
    if input_ids is None:
        input_ids = torch.from_numpy(batch.input_ids).to(device, non_blocking=True)
    on_axes = batch.positions if batch.rope_positions is None else batch.rope_positions
    positions = torch.from_numpy(on_axes).to(device, non_blocking=True)
    keep = torch.from_numpy(logits_indices).to(device, non_blocking=True)
    return input_ids, positions, metadata, keep


def _plain_rows(count: int, groups: list[VerifyGroup]) -> list[int]:
    """The sampled rows outside every verifying group."""
    taken = {row for group in groups for row in group.rows}
    return [row for row in range(count) if row not in taken]


def _take_verified(output: ModelRunnerOutput, group: VerifyGroup, verified: Verified) -> None:
    request_id = group.request.request_id
    output.sampled_token_ids[request_id] = verified.token
    output.accepted_drafts[request_id] = verified.accepted


def _sampled_requests(batch: InputBatch) -> list[Request]:
    """The requests that sample a token this step, in the order of the step's sampled rows."""
    return [batch.requests[row] for row in batch.sample_rows]


def _prompt_logprob_rows(batch: InputBatch) -> list[int]:
    """Rows with prompt logprob entries to produce in this chunk."""
    rows = []
    for row, request in enumerate(batch.requests):
        if request.sampling_params.prompt_logprobs is None:
            continue
        lo, hi = _prompt_entry_span(batch, row)
        if hi > lo or request.num_prompt_logprobs_done == 0:
            rows.append(row)
    return rows


def _prompt_entry_span(batch: InputBatch, row: int) -> tuple[int, int]:
    """Prompt logprob entries [lo, hi) this chunk's logits can score, skipping entries already
    produced before a preemption."""
    request = batch.requests[row]
    start = int(batch.context_lens[row])
    end = start + int(batch.query_lens[row])
    lo = max(request.num_prompt_logprobs_done, start + 1, 1)
    hi = min(end + 1, request.num_prompt_tokens)
    return lo, max(lo, hi)


def _prompt_logprob_indices(batch: InputBatch, rows: list[int]) -> np.ndarray:
    """Flattened token index of position i - 1 for each entry i."""
    pieces = [np.zeros(0, dtype=np.int64)]
    for row in rows:
        lo, hi = _prompt_entry_span(batch, row)
        base = int(batch.query_starts[row]) - int(batch.context_lens[row])
        pieces.append(np.arange(lo - 1, hi - 1, dtype=np.int64) + base)
    return np.concatenate(pieces)
