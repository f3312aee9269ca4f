"""Assembles an engine core from a config: model, KV cache sizing, scheduler, runner."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch

from engine.attention import AUTO as AUTO_BACKEND
from engine.attention import (
    AttentionBackend,
    InPlaceDecodeAttention,
    backend_class,
    get_backend,
    triton_paged,
)
from engine.attention.backend import LayerAttention
from engine.attention.hf import attention_features, describe
from engine.attention.torch_paged import TorchPagedAttention
from engine.core.config import (
    DEFAULT_BLOCK_SIZES,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_MAMBA_BLOCK_TOKENS,
    CacheConfig,
    EngineConfig,
    ServingInfo,
)
from engine.core.engine_core import EngineCore
from engine.core.errors import WorkerFailedError
from engine.core.profiling import StepProfiler
from engine.core.speculation import Drafter
from engine.kernels.cpu.linear import silence_fbgemm_deprecation
from engine.kv.block_manager import BlockManager
from engine.kv.event_publisher import ZmqEventPublisher
from engine.kv.events import EventLog
from engine.kv.kv_cache import KVCache, KVCacheSpec
from engine.kv.kv_scales import checkpoint_kv_scales
from engine.kv.residency import BlockResidency
from engine.kv.state_cache import StateCache, state_slot_bytes
from engine.kv.state_slots import StateSlots
from engine.kv.state_snapshots import StateSnapshots
from engine.loading.classifiers import is_classifier
from engine.loading.generation_config import sampling_defaults
from engine.loading.hub import fetched
from engine.loading.model_loader import (
    LoadedModel,
    checkpoint_config,
    load_model,
    resolve_device,
    resolve_dtype,
)
from engine.loading.overrides import overridden
from engine.loading.quantized_checkpoint import check_requested
from engine.lora.registry import LoRARegistry
from engine.lora.slots import LoRASlots
from engine.model_build import prepared_model
from engine.models import CausalLM, build_causal_lm
from engine.models.experts import SPARSE_ON_HOST
from engine.models.layer_kinds import (
    STATEFUL_FAMILIES,
    STATES_SPLIT,
    why_not_served,
    why_not_this_long,
)
from engine.models.llama import PagedLlamaForCausalLM
from engine.models.vision import ImageTextLM, is_image_text, takes_images
from engine.parallel.group import ParallelGroup
from engine.parallel.mixer_shares import MambaHeads
from engine.parallel.sharding import Shard, not_shardable, why_not_shardable
from engine.parallel.workers import WorkerPool, rank_device
from engine.scheduling.scheduler import Scheduler
from engine.weight_reload import WeightReloader
from engine.worker import host_memory, memory_profile, routes
from engine.worker.cuda_graphs import DecodeGraphs, capture_sizes
from engine.worker.draft_model import DraftLimits, ModelDrafter
from engine.worker.logits_processors import load_processors
from engine.worker.model_runner import ModelRunner
from engine.worker.piecewise_graphs import PiecewiseGraphs, bucket_sizes
from engine.worker.profiler import TorchRecorder
from engine.worker.sampler import Sampler
from engine.worker.sleep_mode import SleepMode

logger = logging.getLogger(__name__)


def create_engine_core(config: EngineConfig) -> tuple[EngineCore, LoadedModel, ServingInfo]:
    config = fetched(config)
    check_requested(config.model, config.quantization)
    config = overridden(config)
    device = resolve_device(config.device)
    # Opened before the model loads, so that a taken port is refused at once.
    publisher = _kv_event_publisher(config, device)
    try:
        core, loaded, info = _create_core(config, device)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    if publisher is not None:
        core.scheduler.block_manager.events = EventLog()
        core.kv_events = publisher
    return core, loaded, info


def _create_core(
    config: EngineConfig, device: torch.device
) -> tuple[EngineCore, LoadedModel, ServingInfo]:
    if config.tensor_parallel_size == 1:
        loaded, dtype = load_rank(config, device)
        core, info = core_from_model(loaded, config, device, dtype)
        return core, loaded, info
    _check_parallel(config, device)
    workers = WorkerPool.start(config, device)
    try:
        device = rank_device(device, 0)
        loaded, dtype = load_rank(config, device, workers.group)
        core, info = core_from_model(loaded, config, device, dtype, workers)
        workers.wait_ready()
    except BaseException as exc:
        failure = workers.failure(settle=1.0)
        workers.close()
        if failure and not isinstance(exc, ValueError):  # rank 0's own refusal says it best
            raise WorkerFailedError(failure) from exc
        raise
    return core, loaded, info


def _profiler(
    config: EngineConfig, device: torch.device, workers: WorkerPool | None
) -> StepProfiler | None:
    """Step profiles on demand (`--profiler-config`), of every rank."""
    if config.profiler is None or not config.profiler.enabled:
        return None
    settings = config.profiler
    tell = workers.tell_profilers if workers is not None else None
    logger.info("profiling on demand: traces go to %s", settings.folder)
    return StepProfiler(settings, lambda: TorchRecorder(settings, device, 0, tell))


def _check_parallel(config: EngineConfig, device: torch.device) -> None:
    """Refuse at once what tensor parallelism cannot run, before any worker starts."""
    size = config.tensor_parallel_size
    if config.model_impl == "transformers":
        raise ValueError("tensor parallelism runs on Conveyor's model implementation only")
    # A config of another family (no heads to count) is refused by the model's own check.
    checkpoint = checkpoint_config(config.model, config.trust_remote_code)
    if checkpoint is not None and is_image_text(checkpoint):
        raise ValueError("tensor parallelism serves text models only, not image-text ones")
    if checkpoint is not None and is_classifier(checkpoint):
        raise ValueError("a sequence classifier runs on one device (--runner pooling)")
    architectures = set(getattr(checkpoint, "architectures", None) or ())
    if architectures & (STATEFUL_FAMILIES.keys() - STATES_SPLIT):
        raise ValueError("tensor parallelism does not split recurrent layers' states yet")
    counted = all(hasattr(checkpoint, key) for key in ("num_attention_heads", "intermediate_size"))
    counted = counted or MambaHeads.of(checkpoint) is not None  # (Mamba's own models)
    reason = why_not_shardable(checkpoint, size) if counted else ""
    if reason:
        raise not_shardable(size, reason)
    if device.type == "cuda":
        first = device.index or 0
        if first + size > torch.cuda.device_count():
            raise ValueError(
                f"--tensor-parallel-size {size} from {device} needs CUDA devices "
                f"{first}..{first + size - 1}; {torch.cuda.device_count()} are visible"
            )


def load_rank(
    config: EngineConfig, device: torch.device, group: ParallelGroup | None = None
) -> tuple[LoadedModel, torch.dtype]:
    """Load the model (this rank's share of it, in a `group`) and the dtype it runs in."""
    use_device(device)
    silence_fbgemm_deprecation()
    dtype = resolve_dtype(config.dtype, device, config.model, config.trust_remote_code)
    torch.manual_seed(config.seed)
    rank = (group.rank, group.size) if group is not None else (0, 1)
    loaded = load_model(
        config.model,
        dtype,
        device,
        config.trust_remote_code,
        config.int8_activations,
        rank,
        random_weights=config.load_format == "dummy",
        tokenizer_name=config.tokenizer,
        served_name=config.model_name,
        slow_tokenizer=config.tokenizer_mode == "slow",
        keep_blocks=config.keep_blocks,
        kv_reserve=_budget_before_blocks(config, device) if device.type == "cpu" else 0,
    )
    return loaded, dtype


def use_device(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (the engine's step thread builds the
    core), so that graph capture, Triton launches and anything else that takes the current
    device use the one asked for (`--device cuda:N`)."""
    if device.type == "cuda":
        torch.cuda.set_device(
            device.index if device.index is not None else torch.cuda.current_device()
        )


@dataclass(frozen=True, slots=True)
class RankParts:
    """What every rank builds alike: the model it steps, its attention and its KV cache."""

    model: CausalLM
    backend: AttentionBackend
    kv_cache: KVCache
    cache_dtype: torch.dtype
    # Where an fp8 cache's scales come from ("" for other caches), and whether the first step
    # sets them (`KVCache.calibrating`, switched on once graphs are captured).
    kv_scales: str = ""
    calibrates: bool = False
    # How the layers' pieces between attention calls run (`--compile`): "" when eager.
    compiled: str = ""
    # The LoRA adapters' slots (`--enable-lora`).
    lora: LoRASlots | None = None
    # What the model's attention computes beyond plain causal attention, in words ("" none).
    attention_features: str = ""


def build_rank(
    loaded: LoadedModel,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard | None = None,
    draft_block_bytes: int = 0,
) -> RankParts:
    """The model, the attention backend and a KV cache sized for this rank (under tensor
    parallelism, for its share of the KV heads, with as many blocks as every rank can hold);
    where a draft model's cache takes `draft_block_bytes` a block beside it, the budget holds
    both."""
    limit = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
    unserved = why_not_served(loaded.model)  # before its config is read as attention's
    if unserved:
        raise ValueError(f"Conveyor cannot serve {type(loaded.model).__name__}: {unserved}")
    too_long = why_not_this_long(loaded.model, limit)
    if too_long:
        name = type(loaded.model).__name__
        raise ValueError(f"Conveyor cannot serve {name} over {limit} tokens: {too_long}")
    cache_dtype = kv_cache_dtype(config.cache.dtype, dtype, loaded.compute_dtype, device)
    spec = KVCacheSpec.from_hf_config(
        loaded.model.config.get_text_config(), cache_dtype, block_size(config.cache, device)
    )
    if shard is not None and not spec.values_are_keys:  # every rank keeps the whole latent
        spec = replace(spec, num_kv_heads=shard.shape.local_kv_heads)
    # The model is built (projections fused) before the cache is sized from what is left.
    model, compiled = prepared_model(loaded.model, config, device, shard)
    lora = lora_slots(config, model, device, dtype)
    features = attention_features(loaded.model, limit)
    backend = get_backend(_attention_backend(config, features, device), device, dtype)
    # Held before the KV cache is sized from what is left.
    states = _state_cache(config, model, device, loaded.compute_dtype, shard)
    num_blocks = _num_blocks(
        config, spec, device, model, backend, loaded.max_model_len, draft_block_bytes, states
    )
    if shard is not None:
        num_blocks = shard.group.min_int(num_blocks, device)
    kv_cache = KVCache(spec, num_blocks, device)
    kv_cache.group = shard.group if shard is not None else None
    kv_cache.states = states
    _log_cache(spec, num_blocks, kv_cache.num_bytes)
    if device.type == "cpu" and (shard is None or shard.group.rank == 0):
        # Every rank of a CPU group holds its cache in the same host's memory.
        ranks = 1 if shard is None else shard.group.size
        host_memory.warn_if_beyond(kv_cache.num_bytes, host_memory.available_bytes(), ranks)
    scales, calibrates = _kv_scales(kv_cache, backend, loaded.path, config.cache)
    return RankParts(
        model,
        backend,
        kv_cache,
        cache_dtype,
        scales,
        calibrates,
        compiled,
        lora,
        attention_features=describe(features),
    )


def _state_cache(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    shard: Shard | None,
) -> StateCache | None:
    """The per-request states of a model whose layers keep some (LFM2's convolutions), one
    slot for each request that may run at once; None for other models."""
    if not isinstance(model, PagedLlamaForCausalLM):
        return None
    specs = model.state_specs()
    if not specs:
        return None
    reason = _why_no_states(config, shard, model)
    if reason:
        raise ValueError(f"{type(model).__name__} keeps recurrent states, which {reason}")
    slot_bytes = state_slot_bytes(specs, dtype)
    slots = _state_slot_count(config, slot_bytes, device)
    # (one a request's slot: the slots drafts borrow keep none)
    snapshots = _snapshot_count(config, slot_bytes, min(slots, config.max_num_seqs), device)
    states = StateCache(specs, slots, dtype, device, snapshots)
    interval = mamba_block_size(config.cache, block_size(config.cache, device))
    logger.info(
        "recurrent states: %d tensors a slot, %d slots, %s, %.1f MiB",
        len(specs),
        states.num_slots,
        f"{snapshots} snapshots every {interval} tokens for prefix caching"
        if snapshots
        else "prefix caching is off",
        states.num_bytes / 2**20,
    )
    return states


def mamba_block_size(cache: CacheConfig, block_tokens: int) -> int:
    """Tokens between the snapshots of a request's recurrent states: as configured (a multiple
    of the block size), else the multiple of the block size nearest 256."""
    if cache.mamba_block_size is None:
        return max(1, round(DEFAULT_MAMBA_BLOCK_TOKENS / block_tokens)) * block_tokens
    if cache.mamba_block_size % block_tokens:
        raise ValueError(
            f"--mamba-block-size {cache.mamba_block_size} is not a multiple of the block size "
            f"{block_tokens}"
        )
    return cache.mamba_block_size


def _snapshot_count(config: EngineConfig, slot_bytes: int, slots: int, device: torch.device) -> int:
    """How many snapshots of a request's states prefix caching keeps: one for each slot, or
    as many as a quarter of the KV cache budget holds where that is fewer (taken from the blocks'
    share, which a hybrid model's few attention layers need less of); none without prefix
    caching, or for pooling (prompts only, never resumed)."""
    if not config.enable_prefix_caching or config.runner == "pooling":
        return 0
    if config.cache.num_blocks is not None:
        return slots
    return min(slots, _budget_before_blocks(config, device) // 4 // slot_bytes)


def _state_slot_count(config: EngineConfig, slot_bytes: int, device: torch.device) -> int:
    """A slot for each of `--max-num-seqs` requests, or as many as half the KV cache budget
    holds where that is fewer (the blocks keep the other half): then fewer requests run at once,
    as where the blocks run short. Under speculative decoding, as many again for each draft a
    step verifies (its rows' states), where the budget holds them; a step's drafts borrow the
    slots no request holds. `--num-gpu-blocks-override` leaves the budget to the user."""
    spec = config.speculative
    drafts = spec.num_speculative_tokens if spec is not None else 0
    if config.cache.num_blocks is not None:
        return config.max_num_seqs * (1 + drafts)
    budget = _budget_before_blocks(config, device)
    fit = budget // 2 // slot_bytes
    if fit < 1:
        raise ValueError(
            f"a request's recurrent states take {slot_bytes} bytes, more than half the KV cache "
            f"budget of {budget} bytes: raise --kv-cache-memory"
            + (" or --gpu-memory-utilization" if device.type == "cuda" else "")
        )
    if fit < config.max_num_seqs:
        logger.warning(
            "recurrent states: half the KV cache budget holds %d slots of %.1f MiB, fewer than "
            "--max-num-seqs %d, so at most %d requests run at once; raise --kv-cache-memory "
            "for more",
            fit,
            slot_bytes / 2**20,
            config.max_num_seqs,
            fit,
        )
    return min(fit, config.max_num_seqs * (1 + drafts))


def _budget_before_blocks(config: EngineConfig, device: torch.device) -> int:
    """The bytes the KV cache and the states share: `--kv-cache-memory`, the CPU's default, or
    on a GPU what utilization allows above what is allocated now (the weights; the profiling
    pass later measures the activations out of what the states leave)."""
    if config.cache.kv_cache_memory is not None:
        return config.cache.kv_cache_memory
    if device.type != "cuda":
        return DEFAULT_CPU_KV_CACHE_BYTES
    return memory_profile.allowed_above_allocated(device, config.cache.gpu_memory_utilization)


def _why_no_states(config: EngineConfig, shard: Shard | None, model: PagedLlamaForCausalLM) -> str:
    """Empty where the engine serves a recurrent model so configured, else what does not."""
    if shard is not None and not model.states_split():
        return "tensor parallelism does not split yet"
    if config.enable_lora and not model.states_adapted():
        return "LoRA adapters do not adapt yet"
    return ""


def _attention_backend(
    config: EngineConfig, needs: list[LayerAttention], device: torch.device
) -> str:
    """The backend the config names where it computes the model's attention features `needs`
    (a sliding window shorter than the context, soft-capped scores, sinks); else the torch
    backend, which computes them all, where the config leaves it `auto`; else a refusal naming
    them."""
    named = backend_class(config.attention_backend, device)
    if all(named.takes(features) for features in needs):
        return config.attention_backend
    if config.attention_backend != AUTO_BACKEND:
        raise ValueError(
            f"the {named.name} attention backend cannot compute this model's {describe(needs)}; "
            "use --attention-backend torch (or auto)"
        )
    logger.info("attention: torch, which computes the model's %s", describe(needs))
    return TorchPagedAttention.name


def lora_slots(
    config: EngineConfig, model: CausalLM, device: torch.device, dtype: torch.dtype
) -> LoRASlots | None:
    """With `--enable-lora`, the adapters' slots, attached to the model (before the KV cache is
    sized: on a GPU they take their share first). The adapters compute in fp32 on a CPU."""
    if not config.enable_lora:
        return None
    if not isinstance(model, PagedLlamaForCausalLM):
        raise ValueError("LoRA adapters run on Conveyor's model implementation only")
    lora_dtype = torch.float32 if device.type == "cpu" else dtype
    slots = LoRASlots(
        model.lora_shapes(), config.max_loras, config.max_lora_rank, device, lora_dtype
    )
    model.attach_lora(slots)
    return slots


def _serve_loras(core: EngineCore, config: EngineConfig) -> None:
    """The adapters `--lora-modules` names, loaded and served (a failure stops the start)."""
    if not config.enable_lora:
        return
    core.loras = LoRARegistry()
    for name, path in config.lora_modules:
        lora, adapter = core.read_lora(name, path)
        core.add_lora(lora, adapter)
    logger.info(
        "LoRA: %d slot(s) of rank %d; adapters: %s",
        config.max_loras,
        config.max_lora_rank,
        ", ".join(f"{name} ({path})" for name, path in config.lora_modules) or "none yet",
    )


def _kv_scales(
    kv_cache: KVCache, backend: AttentionBackend, path: str, cache: CacheConfig
) -> tuple[str, bool]:
    """Give an fp8 cache the checkpoint's scales where it has some; say where the scales come
    from, and whether the first step is to calibrate them."""
    calculate = cache.calculate_kv_scales
    if not kv_cache.scaled:
        if calculate:
            logger.warning("--calculate-kv-scales applies to fp8 KV caches only: ignored")
        return "", False
    found = None if calculate else checkpoint_kv_scales(path, kv_cache.spec.num_layers)
    if not backend.takes_kv_scales:
        if calculate or found is not None:
            logger.warning(
                "the %s attention backend stores fp8 K/V unscaled: KV scales ignored", backend.name
            )
        return "", False
    if calculate:
        return "calibrated on the first step", True
    if found is None:
        return "1.0", False
    kv_cache.scales.copy_(found)
    return "from the checkpoint", False


def core_from_model(
    loaded: LoadedModel,
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    workers: WorkerPool | None = None,
) -> tuple[EngineCore, ServingInfo]:
    """Build the core around an already loaded model (tests pass tiny in-memory models);
    `workers` are the other ranks under tensor parallelism."""
    shard = None
    if workers is not None:
        assert loaded.shard is not None  # loaded as rank 0's share
        shard = Shard(workers.group, loaded.shard)
    draft = _load_draft(config, device, dtype, loaded)
    draft_bytes = draft.cache.bytes_per_block if draft is not None else 0
    parts = build_rank(loaded, config, device, dtype, shard, draft_bytes)
    model, backend, kv_cache = parts.model, parts.backend, parts.kv_cache
    _check_runner(config, model, loaded.path, bool(loaded.labels))
    _check_image_step(config, model)
    num_blocks, block_tokens = kv_cache.num_blocks, kv_cache.block_size
    max_model_len = _max_model_len(config, loaded.max_model_len, num_blocks * block_tokens)
    # A prefix's K/V say nothing of a recurrent layer's state after it: such a model's prefix
    # caching resumes from snapshots of the states, where it keeps any.
    states = kv_cache.states
    caching = config.enable_prefix_caching and (states is None or states.num_snapshots > 0)
    blocks = BlockManager(num_blocks, block_tokens, caching)
    if states is not None:
        blocks.state_slots = StateSlots(states.num_slots)
        if caching:
            interval = mamba_block_size(config.cache, block_tokens)
            blocks.snapshots = StateSnapshots(states.num_snapshots, interval)
    if config.kv_cache_metrics_sample is not None:
        blocks.residency = BlockResidency(config.kv_cache_metrics_sample)
    scheduler = Scheduler(config.scheduler_config(max_model_len), blocks)
    vocab_size = _vocab_size(loaded, model)
    kernels = _sampling_kernels(device)
    sampler = Sampler(
        vocab_size,
        device,
        seed=config.seed,
        triton_kernels=kernels,
        logprobs_mode=config.logprobs_mode,
    )
    sampler.processors = load_processors(config.logits_processors, vocab_size, device)
    if sampler.processors:
        logger.info("logits processors: %s", ", ".join(config.logits_processors))
    overlap = config.overlaps(device.type)
    logger.info(
        "routes: %s",
        routes.describe(
            model,
            backend.name,
            dtype,
            loaded.compute_dtype,
            parts.cache_dtype,
            device,
            overlap,
            parts.kv_scales,
            sampler.route,
            parts.compiled,
            config.runner == "pooling",
            parts.attention_features,
        ),
    )
    graphs, piecewise = _graphs(config, model, backend, kv_cache, max_model_len)
    kv_cache.calibrating = parts.calibrates  # after capture: graphs never calibrate
    runner = ModelRunner(model, kv_cache, backend, sampler, graphs, workers, piecewise)
    runner.pooling = config.runner == "pooling"
    runner.classifies = bool(loaded.labels)
    runner.lora = parts.lora
    core = EngineCore(scheduler, runner, loaded.tokenizer, loaded.eos_token_ids, vocab_size)
    core.max_logprobs = vocab_size if config.max_logprobs < 0 else config.max_logprobs
    core.spec_metrics = config.spec_metrics
    core.overlap = overlap
    core.processor = loaded.processor
    core.profiler = _profiler(config, device, workers)
    if workers is None:
        core.reloader = WeightReloader(
            config,
            device,
            dtype,
            kv_cache.spec,
            lambda built: _graphs(config, built, backend, kv_cache, max_model_len),
            loaded.path if config.load_format != "dummy" else "",
        )
        core.sleeper = SleepMode(runner, core.reloader, config.enable_sleep_mode)
    spec = config.speculative
    if spec is not None:
        limits = DraftLimits(0, vocab_size, config.max_num_batched_tokens)
        core.drafter = Drafter(spec) if draft is None else draft.drafter(config, num_blocks, limits)
        logger.info("speculation: %s", spec.describe())
    _serve_loras(core, config)
    info = ServingInfo(
        model_name=loaded.name,
        max_model_len=max_model_len,
        dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(parts.cache_dtype).removeprefix("torch."),
        device=str(device),
        num_blocks=num_blocks,
        block_size=block_tokens,
        # What `--model` named (a GGUF file, a hub id), not the folder it was converted or
        # fetched into; the default model's folder.
        model_path=config.model_name or config.model or loaded.path,
        enable_prefix_caching=caching,
        request_timeout=config.request_timeout,
        stream_interval=config.stream_interval,
        tensor_parallel_size=config.tensor_parallel_size,
        data_parallel_rank=config.data_parallel_rank,
        async_scheduling=overlap,
        runner=config.runner,
        max_loras=config.max_loras if config.enable_lora else 0,
        sampling_defaults=_sampling_defaults(config, loaded),
        image_token_id=_image_token(model),
        labels=loaded.labels,
        max_logprobs=core.max_logprobs,
        eos_token_ids=loaded.eos_token_ids,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        logprobs_mode=config.logprobs_mode,
        spec_metrics=config.spec_metrics,
        kv_cache_metrics=config.kv_cache_metrics_sample is not None,
        hidden_size=int(getattr(loaded.model.config, "hidden_size", 0) or 0),
        embeds_prompts=runner.embeds_prompts,
        profiling=core.profiler is not None,
    )
    return core, info


@dataclass(frozen=True, slots=True)
class DraftParts:
    """A draft model (`--speculative-config`'s `draft_model`), loaded before the served
    model's KV cache is sized: its weights, attention, sampler and the shape of its cache."""

    loaded: LoadedModel
    model: CausalLM
    backend: AttentionBackend
    cache: KVCacheSpec
    sampler: Sampler

    def drafter(self, config: EngineConfig, num_blocks: int, limits: DraftLimits) -> Drafter:
        """The drafter over a cache of `num_blocks` blocks (as many as the served model's),
        drafting over sequences as long as its context, the config's limit and its cache
        allow; `limits` gives the rest. On a GPU its steps replay CUDA graphs of their own
        where they can be captured."""
        spec = config.speculative
        assert spec is not None
        kv_cache = KVCache(self.cache, num_blocks, self.sampler.device)
        blocks = BlockManager(num_blocks, self.cache.block_size, config.enable_prefix_caching)
        context = self.loaded.max_model_len
        if spec.draft_max_model_len is not None:
            context = min(context, spec.draft_max_model_len)
        limits = replace(limits, max_len=min(context, blocks.num_tokens_capacity))
        try:
            graphs, piecewise = _graphs(config, self.model, self.backend, kv_cache, limits.max_len)
        except Exception:  # the served model's graphs do not depend on these
            logger.exception("the draft model's steps run eagerly: their capture failed")
            graphs, piecewise = None, None
        runner = ModelRunner(
            self.model, kv_cache, self.backend, self.sampler, graphs, None, piecewise
        )
        return ModelDrafter(spec, runner, blocks, limits)


def _load_draft(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, served: LoadedModel
) -> DraftParts | None:
    """The draft model a `draft_model` config names, in the served model's dtype, on its
    device; refused where its tokenizer is not the served model's (drafts are token ids)."""
    spec = config.speculative
    if spec is None or not spec.uses_model:
        return None
    assert spec.model is not None
    loaded = load_model(spec.model, dtype, device, config.trust_remote_code)
    _check_draft_tokenizer(loaded, served)
    if spec.draft_max_model_len is not None and spec.draft_max_model_len > loaded.max_model_len:
        raise ValueError(
            f"the draft's max_model_len {spec.draft_max_model_len} is larger than its "
            f"context of {loaded.max_model_len} tokens"
        )
    model = build_causal_lm(loaded.model, config.model_impl, None)
    if isinstance(model, PagedLlamaForCausalLM) and model.state_specs():
        raise ValueError(
            "a draft model with recurrent layers is not served: draft with one whose layers "
            "all attend"
        )
    features = attention_features(loaded.model, loaded.max_model_len)
    backend = get_backend(_attention_backend(config, features, device), device, dtype)
    cache_dtype = kv_cache_dtype("auto", dtype, loaded.compute_dtype, device)
    text = loaded.model.config.get_text_config()
    cache = KVCacheSpec.from_hf_config(text, cache_dtype, block_size(config.cache, device))
    sampler = Sampler(_vocab_size(loaded, model), device, seed=config.seed)
    logger.info("draft model: %s, %d bytes of KV a token", spec.model, cache.bytes_per_token)
    return DraftParts(loaded, model, backend, cache, sampler)


def _check_draft_tokenizer(draft: LoadedModel, served: LoadedModel) -> None:
    if draft.tokenizer is None or served.tokenizer is None:
        return
    if draft.tokenizer.get_vocab() != served.tokenizer.get_vocab():
        raise ValueError(
            "the draft model's tokenizer is not the served model's: drafts are token ids, "
            "so both must share one vocabulary"
        )


def _kv_event_publisher(config: EngineConfig, device: torch.device) -> ZmqEventPublisher | None:
    """The publisher of the prefix cache's events (`--kv-events-config`), if asked for."""
    if config.kv_events is None or not config.kv_events.publishes:
        return None
    rank = config.data_parallel_rank
    medium = "GPU" if device.type == "cuda" else "CPU"
    publisher = ZmqEventPublisher(config.kv_events.for_rank(rank), medium, rank)
    replay = f", replays at {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
    topic = config.kv_events.topic
    logger.info("KV events: publishing on %s (topic %r)%s", publisher.endpoint, topic, replay)
    return publisher


def _check_image_step(config: EngineConfig, model: CausalLM) -> None:
    """A model whose images are computed in one step each (Gemma 3: their tokens see each
    other both ways) needs steps that hold one image."""
    if not takes_images(model):
        return
    encoder = cast(ImageTextLM, model).image_encoder
    tokens, budget = encoder.image_tokens, config.max_num_batched_tokens
    if encoder.both_ways and tokens is not None and budget < tokens:
        raise ValueError(
            f"--max-num-batched-tokens {budget} is below the {tokens} tokens of one image, "
            "which this model computes in one step (its image tokens attend to each other); "
            f"raise it to at least {tokens}"
        )


def _image_token(model: CausalLM) -> int | None:
    """An image-text model's image placeholder token (None for a text model)."""
    return cast(ImageTextLM, model).image_encoder.image_token_id if takes_images(model) else None


def _sampling_defaults(config: EngineConfig, loaded: LoadedModel) -> dict[str, float]:
    """The model's recommended sampling defaults (logged, as vLLM logs them)."""
    defaults = sampling_defaults(
        config.generation_config, loaded.model, config.override_generation_config
    )
    if defaults:
        logger.info("default sampling parameters from the generation config: %s", defaults)
    return defaults


def _check_runner(
    config: EngineConfig, model: CausalLM, path: str = "", classifier: bool = False
) -> None:
    """The pooling runner reads Conveyor's decoder's last hidden states, for a model pooled by
    its last token (as its sentence-transformers config says, where it has one); that it runs
    on one device the config checks itself. A sequence classifier runs under it only."""
    if classifier and config.runner != "pooling":
        raise ValueError(
            "the model is a sequence classifier: serve it with --runner pooling (/classify)"
        )
    if config.runner != "pooling":
        return
    mode = pooling_mode(path)
    if mode not in (None, "lasttoken"):
        raise ValueError(
            f"the model pools its embeddings by {mode} (1_Pooling/config.json); "
            "--runner pooling pools the last token"
        )
    if not isinstance(model, PagedLlamaForCausalLM) or takes_images(model):
        raise ValueError(
            "--runner pooling needs Conveyor's model implementation (--model-impl) of a text model"
        )


def _vocab_size(loaded: LoadedModel, model: CausalLM) -> int:
    """The logits' width: the whole vocabulary also where each rank holds a share of the head;
    a classifier's (whose head has a logit per label) is its embedding's."""
    if loaded.labels:
        return int(loaded.model.get_input_embeddings().weight.shape[0])
    if isinstance(model, PagedLlamaForCausalLM):
        return model.vocab_size
    head = loaded.model.get_output_embeddings()
    # Every linear layer type knows its width; packed ones would unpack their weight to say.
    return getattr(head, "out_features", None) or head.weight.shape[0]


def _sampling_kernels(device: torch.device) -> bool:
    """On a GPU the sampler takes its Triton kernels: top-p rows drawn with nothing asked of the
    host (an async step then never waits), seeded rows' noise in one launch. On a CPU the host
    is where the work runs anyway."""
    if device.type != "cuda" or not triton_paged.available():
        return False
    from engine.kernels.triton import sampling

    return sampling.usable(str(device))


# K/V element types the CPU's attention widens to fp32 as it reads them.
NARROW_CPU_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e5m2)


# fp8 K/V a GPU's attention (the Triton kernels, or torch's casts) widens as it reads them.
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def cache_dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a `--kv-cache-dtype` name other than `auto`."""
    return FP8_CACHE_DTYPES.get(name) or getattr(torch, name)


def kv_cache_dtype(
    name: str, model_dtype: torch.dtype, compute_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """What the KV cache holds. `auto` is the model's dtype, as in vLLM: a bf16 model keeps bf16
    K/V even where a CPU without native bf16 computes it in fp32. The cache holds the compute
    dtype, or, on the CPU under fp32 compute, bf16, fp16 or fp8 e5m2 (as vLLM's `fp8_e5m2`: the
    top byte of an fp16, no scale), rounded as K/V are stored and widened exactly as attention
    reads them; on CUDA, fp8 (`fp8` and `fp8_e4m3` are e4m3, as vLLM's) under any compute
    dtype, K/V saturated to the format's range as they are stored."""
    dtype = model_dtype if name == "auto" else cache_dtype_named(name)
    if dtype == compute_dtype:
        return dtype
    if device.type == "cuda" and dtype in FP8_CACHE_DTYPES.values():
        if dtype == torch.float8_e4m3fn and _capability(device) < (8, 9):
            raise ValueError(
                "an fp8 e4m3 KV cache needs a GPU of compute capability 8.9 or newer "
                "(Ada, Hopper); use --kv-cache-dtype fp8_e5m2"
            )
        return dtype
    narrow = dtype in NARROW_CPU_CACHE_DTYPES
    if device.type == "cpu" and compute_dtype == torch.float32 and narrow:
        return dtype
    compute = str(compute_dtype).removeprefix("torch.")
    raise ValueError(
        f"a {str(dtype).removeprefix('torch.')} KV cache under {compute} compute "
        f"on {device.type} is not supported; use --kv-cache-dtype auto or {compute}"
    )


def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _graphs(
    config: EngineConfig,
    model: CausalLM,
    backend: AttentionBackend,
    kv_cache: KVCache,
    max_model_len: int,
) -> tuple[DecodeGraphs | None, PiecewiseGraphs | None]:
    """CUDA graphs where every piece of the step can be captured (Conveyor's own model, an
    attention backend that decodes in place, rotary tables fixed at load): decode steps whole,
    other steps of up to 512 tokens piece by piece around attention, in one memory pool."""
    if kv_cache.device.type != "cuda" or not _captures(config):
        return None, None
    reason = _why_not_capturable(model, backend)
    if reason:
        logger.info("steps run eagerly: %s", reason)
        return None, None
    assert isinstance(backend, InPlaceDecodeAttention)  # _why_not_capturable checked its kind
    assert isinstance(model, PagedLlamaForCausalLM)
    sizes = _graph_sizes(config)
    graphs = DecodeGraphs(model, backend, kv_cache, config.max_num_seqs, max_model_len, sizes)
    pool = graphs.capture()
    if not config.mixed_step_graphs:
        logger.info("steps with prompt chunks run eagerly (decode graphs only)")
        return graphs, None
    piecewise = PiecewiseGraphs(model, config.max_num_batched_tokens)
    try:
        piecewise.capture(pool)
    except Exception:  # the decode graphs do not depend on these
        logger.exception("steps with prompt chunks run eagerly: their capture failed")
        return graphs, None
    return graphs, piecewise


def pooling_mode(path: str) -> str | None:
    """The pooling a sentence-transformers model folder names (`1_Pooling/config.json`:
    `lasttoken`, `mean`, `cls`, ...), or None where it names none."""
    config = Path(path) / "1_Pooling" / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    flags = json.loads(config.read_text())
    modes = [
        key.removeprefix("pooling_mode_")
        for key, on in flags.items()
        if key.startswith("pooling_mode_") and on is True
    ]
    modes = [mode.removesuffix("_token").removesuffix("_tokens") for mode in modes]
    return "+".join(sorted(modes)) or None


def _graph_sizes(config: EngineConfig) -> list[int]:
    return capture_sizes(config.max_num_seqs, config.cuda_graph_sizes, config.max_cuda_graph_size)


def _captures(config: EngineConfig) -> bool:
    """Steps may replay CUDA graphs: not under `--enforce-eager`, nor for pooling (prompts
    only, whose graphs would compute the LM head)."""
    return not config.enforce_eager and config.runner != "pooling"


def _why_not_capturable(model: CausalLM, backend: AttentionBackend) -> str:
    if not isinstance(backend, InPlaceDecodeAttention):
        return f"the {backend.name} attention backend gathers K/V into batch-sized copies"
    if not isinstance(model, PagedLlamaForCausalLM):
        return "the Hugging Face model implementation is not captured"
    if model.shard is not None:
        return "steps across tensor-parallel ranks are not captured"
    if model.sparse:
        return SPARSE_ON_HOST
    if model.state_specs():
        return "recurrent layers' state indices are built afresh each step"
    if not model.splits_at_attention:
        return "layers that are not cut at an attention call are not captured"
    if any(layer.attention is not None for layer in model.layers):
        return "sliding-window layers are not captured"
    rope_type = getattr(model.rotary_emb, "rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return f"{rope_type} rotary embeddings change with the sequence length"
    return ""


def block_size(cache: CacheConfig, device: torch.device) -> int:
    """Tokens per KV block: as configured, else the device's default."""
    if cache.block_size is not None:
        return cache.block_size
    return DEFAULT_BLOCK_SIZES.get(device.type, DEFAULT_BLOCK_SIZES["cuda"])


def _num_blocks(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    model: CausalLM,
    backend: AttentionBackend,
    model_len: int,
    draft_block_bytes: int = 0,
    states: StateCache | None = None,
) -> int:
    cache = config.cache
    if cache.num_blocks is not None:
        return cache.num_blocks
    if spec.bytes_per_block == 0:  # no layer keeps K/V: blocks only count tokens
        return 2 * config.max_num_seqs * -(-model_len // spec.block_size)
    if cache.kv_cache_memory is not None:
        budget = _less_states(cache.kv_cache_memory, states)
    elif device.type == "cuda":  # measured with the states held already
        budget = _cuda_kv_budget(config, spec, device, model, backend, model_len, states)
    else:
        budget = _less_states(DEFAULT_CPU_KV_CACHE_BYTES, states)
    # A draft model's cache has as many blocks: each block of the budget pays for both.
    share = budget * spec.bytes_per_block // (spec.bytes_per_block + draft_block_bytes)
    num_blocks = spec.num_blocks_for(share)
    if num_blocks < 1:
        raise ValueError(
            f"the KV cache budget of {budget} bytes holds no block of {spec.bytes_per_block} bytes"
        )
    return num_blocks


def _less_states(budget: int, states: StateCache | None) -> int:
    """A fixed KV budget less what a recurrent model's states take of it (they share it, as the
    blocks and the states both grow with the requests held; the slots take at most half of it,
    the snapshots at most a quarter, `_state_slot_count`, `_snapshot_count`)."""
    return budget if states is None else budget - states.num_bytes


def _cuda_kv_budget(
    config: EngineConfig,
    spec: KVCacheSpec,
    device: torch.device,
    model: CausalLM,
    backend: AttentionBackend,
    model_len: int,
    states: StateCache | None = None,
) -> int:
    """Bytes left for the KV cache once a profiling pass has measured the rest (logged); a
    recurrent model's `states` are held already, among the weights."""
    context = min(config.max_model_len or model_len, model_len)
    running = config.max_num_seqs if states is None else states.num_slots
    lengths = memory_profile.prefill_lengths(config.max_num_batched_tokens, context, running)
    prefill = memory_profile.profile_forward(model, backend, spec, device, lengths, states)
    graph_sizes = (
        [] if not _captures(config) or _why_not_capturable(model, backend) else _graph_sizes(config)
    )
    decode, graph_count = None, 0
    if graph_sizes:
        # The graphs' pool holds the larger of a decode step's and a piecewise bucket's peaks:
        # both are about that many rows through the same ops.
        buckets = bucket_sizes(config.max_num_batched_tokens) if config.mixed_step_graphs else []
        rows = max([graph_sizes[-1], *buckets])
        decode = memory_profile.profile_forward(model, backend, spec, device, [1] * rows)
        graph_count = len(graph_sizes) + len(buckets)
    breakdown = memory_profile.measure(
        device, config.cache.gpu_memory_utilization, prefill, decode, graph_count
    )
    logger.info("%s", breakdown.describe())
    return breakdown.kv_cache


def _max_model_len(config: EngineConfig, model_len: int, cache_tokens: int) -> int:
    if config.max_model_len is not None:
        if config.max_model_len > model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} is larger than the model's "
                f"context length of {model_len} tokens"
            )
        if config.max_model_len > cache_tokens:
            raise ValueError(
                f"max_model_len {config.max_model_len} is larger than the {cache_tokens} "
                f"tokens the KV cache can hold; raise the cache size or lower max_model_len"
            )
        return config.max_model_len
    if model_len > cache_tokens:
        logger.warning(
            "the KV cache holds %d tokens, fewer than the model's context of %d; "
            "serving up to %d tokens",
            cache_tokens,
            model_len,
            cache_tokens,
        )
    return min(model_len, cache_tokens)


def _log_cache(spec: KVCacheSpec, num_blocks: int, num_bytes: int) -> None:
    logger.info(
        "KV cache: %d blocks of %d tokens, %s, %d bytes per token, %.1f MiB, up to %d tokens",
        num_blocks,
        spec.block_size,
        str(spec.dtype).removeprefix("torch."),
        spec.bytes_per_token,
        num_bytes / 2**20,
        num_blocks * spec.block_size,
    )
