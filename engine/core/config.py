"""Engine settings: frozen, validated, no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.core.profiling import ProfilerConfig
from engine.core.sampling_params import MAX_LOGPROBS
from engine.core.speculation import SpeculativeConfig
from engine.kv.events import KVEventsConfig

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3
# A hub repository's files not fetched unless asked: Meta's copies of the weights in `original/`.
DEFAULT_IGNORE_PATTERNS = ("original/*",)
# Tokens per KV block unless asked otherwise. The CPU's attention kernels read each block as one
# run of memory, and longer runs stream faster: decode attention over 64 sequences of 136-250
# tokens took 7-21% less time in blocks of 32 than of 16 (vLLM's CPU backend also prefers
# multiples of 32). CUDA keeps vLLM's 16.
DEFAULT_BLOCK_SIZES = {"cpu": 32, "cuda": 16}
# Tokens between the copies of a request's recurrent states kept for prefix caching, unless asked
# otherwise: each copy is a whole request's states (megabytes), so far fewer than one a block.
DEFAULT_MAMBA_BLOCK_TOKENS = 256
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits the scheduler packs each step into.

    With chunked prefill off, a prompt is only admitted whole, so the token budget must hold the
    longest sequence or a recomputed request could never run again. `static_batching` (for
    comparison benchmarks only) admits a new batch only once the previous one has completely
    finished, as padded batch generation does.

    `policy` is `fcfs` or `priority` (lower `priority` values first, then arrival); a request
    that has waited longer than `max_priority_wait` seconds counts as the highest priority.
    Under `priority`, `reserved_seqs` sequence slots are kept for requests of priority 0 or
    more urgent: low-priority ones (priority > 0) occupy at most `max_num_seqs - reserved_seqs`
    slots, so an urgent request finds a free slot instead of waiting for one to finish.

    `max_loras` (with LoRA adapters served) bounds the adapters among the running requests:
    every step then fits the model's adapter slots.
    """

    max_model_len: int
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # vLLM's `long_prefill_token_threshold`: the most prompt tokens one request computes in a
    # step (0: as many as the budget leaves), so a long prompt's chunks leave room in each step
    # for other requests' prompts.
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int | None = None
    static_batching: bool = False
    policy: str = "fcfs"
    max_priority_wait: float | None = None
    max_queued_tokens: int | None = None
    admission_soft_limit: float = 0.9
    reserved_seqs: int = 0
    max_loras: int | None = None
    # Image feature rows one step may encode (None: `max_num_batched_tokens`, as vLLM's
    # `max_num_encoder_input_tokens`); a step always encodes one request's images at least.
    max_num_encoder_input_tokens: int | None = None

    @property
    def encoder_rows(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}"
            )
        if not 0 < self.admission_soft_limit <= 1:
            raise ValueError("admission_soft_limit must be in (0, 1]")
        if not 0 <= self.reserved_seqs < self.max_num_seqs:
            raise ValueError(
                f"reserved_seqs must be in [0, max_num_seqs), got {self.reserved_seqs}"
            )
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 or more")
        if self.long_prefill_token_threshold and not self.enable_chunked_prefill:
            raise ValueError("long_prefill_token_threshold needs chunked prefill")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be at least max_model_len "
                f"({self.max_model_len})"
            )


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """How the paged KV cache is sized and what it holds.

    `block_size` is tokens per block, None for the device's default (`DEFAULT_BLOCK_SIZES`).
    `num_blocks` overrides both memory budgets. `kv_cache_memory` bytes (on each device) are
    used where given; otherwise 4 GiB on CPU, and on CUDA the fraction `gpu_memory_utilization`
    of the device memory, less what the weights and a profiling step took. `dtype` is the K/V
    element type: `auto` is the model's dtype. An fp8 cache takes its per-layer scales from the
    checkpoint, or with `calculate_kv_scales` from the first step served
    (`engine/kv/kv_scales.py`). A model whose layers keep recurrent states keeps a copy of a
    request's states every `mamba_block_size` tokens for prefix caching (None: the multiple of
    `block_size` nearest `DEFAULT_MAMBA_BLOCK_TOKENS`; `engine/kv/state_snapshots.py`).
    """

    block_size: int | None = None
    mamba_block_size: int | None = None
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    calculate_kv_scales: bool = False

    def __post_init__(self) -> None:
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.mamba_block_size is not None and self.mamba_block_size < 1:
            raise ValueError(f"mamba_block_size must be positive, got {self.mamba_block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"unknown KV cache dtype {self.dtype!r}; choose one of {', '.join(KV_CACHE_DTYPES)}"
            )


# `generate` samples tokens; `pooling` (vLLM's `--runner pooling`) returns each prompt's last
# hidden state instead, for embeddings.
RUNNERS = ("generate", "pooling")

# `auto` reads the checkpoint's weights; `dummy` (as vLLM's) gives the model random weights of
# the checkpoint's shape, read from its config alone: for measuring speed and memory.
LOAD_FORMATS = ("auto", "dummy")
# What logprobs report (vLLM's `--logprobs-mode`): the log-softmax of the model's logits or the
# logits themselves, raw or as processed for sampling (after bias, penalties, temperature,
# top-k, top-p and min-p; tokens those rule out at -inf, reported as -9999).
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# What each request reports of its verification steps (vLLM's --per-request-spec-decode-metrics).
SPEC_METRICS = ("none", "summary", "detailed")
# vLLM's `--quantization` names of the methods of the checkpoints Conveyor serves.
QUANTIZATION_METHODS = (
    "awq",
    "awq_marlin",
    "gptq",
    "gptq_marlin",
    "marlin",
    "compressed-tensors",
    "compressed_tensors",
    "fp8",
    "gguf",
)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything needed to build an engine. `model` is a folder, a hub id or a GGUF file; None
    means the default model. `tokenizer` (a folder or hub id) replaces the model's tokenizer.
    `max_model_len=None` takes the model's own context length."""

    model: str | None = None
    tokenizer: str | None = None
    # vLLM's `--tokenizer-mode`: auto (or hf) takes the fast tokenizer, slow the Python one.
    tokenizer_mode: str = "auto"
    # A hub model's revision, its tokenizer's, the cache folder and token it is fetched with
    # (`loading/hub.py`); the name replies give the model (default: `model` as given).
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    hf_token: str | None = None
    # Files of a hub repository not fetched (vLLM's `--ignore-patterns`).
    ignore_patterns: tuple[str, ...] = DEFAULT_IGNORE_PATTERNS
    model_name: str | None = None
    # Fields of the model's config replaced (`--hf-overrides`, `loading/overrides.py`).
    hf_overrides: dict[str, Any] | None = None
    # vLLM's `--quantization`: checked against the checkpoint's own method.
    quantization: str | None = None
    # The most log probabilities a request may ask for per token; -1: the whole vocabulary.
    max_logprobs: int = MAX_LOGPROBS
    dtype: str = "auto"
    device: str = "auto"
    int8_activations: bool = False
    # A bf16 (or fp16) model on a CPU keeps a quantized checkpoint's blocks (`--keep-blocks`);
    # None: only where its widened weights would not fit in the memory left.
    keep_blocks: bool | None = None
    max_model_len: int | None = None
    cache: CacheConfig = CacheConfig()
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_waiting_requests: int | None = None
    static_batching: bool = False
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    max_priority_wait: float | None = None
    max_queued_tokens: int | None = None
    admission_soft_limit: float = 0.9
    priority_reserved_seqs: int | None = None
    request_timeout: float | None = None
    # vLLM's `--stream-interval`: a sequence's tokens reach its consumer once this many have
    # gathered (its first token and its end at once).
    stream_interval: int = 1
    attention_backend: str = "auto"
    model_impl: str = "auto"
    enforce_eager: bool = False
    # The decode batch sizes replayed from CUDA graphs (vLLM's `cudagraph_capture_sizes`; ()
    # for Conveyor's own choice), the largest of that choice, and whether steps with prompt
    # chunks replay graphs too (piecewise around attention) or run eagerly.
    cuda_graph_sizes: tuple[int, ...] = ()
    max_cuda_graph_size: int | None = None
    mixed_step_graphs: bool = True
    # Compile what each layer of Conveyor's decoder does between attention calls with
    # torch.compile (`worker/compilation.py`).
    compile: bool = False
    seed: int = 0
    trust_remote_code: bool = False
    load_format: str = "auto"
    # Ranks (processes, one device each) the model's weights are split across.
    tensor_parallel_size: int = 1
    # This server's rank among data-parallel replicas behind a router (vLLM's
    # `--data-parallel-rank`): its metrics' `engine` label and its KV events' ports and batches.
    data_parallel_rank: int = 0
    # Schedule and launch each step while the previous one still runs on the device; None:
    # on CUDA devices only (on a CPU the host computes the step itself).
    async_scheduling: bool | None = None
    runner: str = "generate"
    # Image feature rows one step may encode (None: `max_num_batched_tokens`).
    max_num_encoder_input_tokens: int | None = None
    # LoRA adapters (`engine/lora/`): served at all, how many one step may run, the highest
    # rank, and those loaded at start-up as (name, folder).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: tuple[tuple[str, str], ...] = ()
    # Where requests' sampling defaults come from (`loading/generation_config.py`): `auto`
    # (the model's generation_config.json), `vllm` (OpenAI's alone) or a folder; and fields set
    # on top of them.
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # Speculation (`core/speculation.py`): n-gram drafts or a draft model's; None: one token
    # a step.
    speculative: SpeculativeConfig | None = None
    # The prefix cache's events for routers (`kv/events.py`); None: not published.
    kv_events: KVEventsConfig | None = None
    # The deployment's logits processors, by import path (`worker/logits_processors.py`).
    logits_processors: tuple[str, ...] = ()
    # The share of KV blocks whose time in the prefix cache is measured (`kv/residency.py`,
    # vLLM's `--kv-cache-metrics-sample`); None: none.
    kv_cache_metrics_sample: float | None = None
    # Step profiles on demand (`core/profiling.py`); None: not offered.
    profiler: ProfilerConfig | None = None
    logprobs_mode: str = "raw_logprobs"
    # What each request reports of its verification steps (`SPEC_METRICS`).
    spec_metrics: str = "none"
    # The engine may give its memory back between rollouts (`worker/sleep_mode.py`).
    enable_sleep_mode: bool = False

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        sample = self.kv_cache_metrics_sample
        if sample is not None and not 0 < sample <= 1:
            raise ValueError(f"kv_cache_metrics_sample must be in (0, 1], got {sample}")
        if self.runner not in RUNNERS:
            raise ValueError(f"unknown runner {self.runner!r}; choose one of {', '.join(RUNNERS)}")
        if self.spec_metrics not in SPEC_METRICS:
            raise ValueError(
                f"unknown per-request spec decode metrics {self.spec_metrics!r}; choose one of "
                f"{', '.join(SPEC_METRICS)}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"unknown logprobs mode {self.logprobs_mode!r}; choose one of "
                f"{', '.join(LOGPROBS_MODES)}"
            )
        if self.speculative is not None and self.logprobs_mode.startswith("processed"):
            raise ValueError(
                f"--logprobs-mode {self.logprobs_mode} and speculative decoding do not run "
                "together: drafted rows report raw logprobs or logits"
            )
        if self.speculative is not None and self.runner == "pooling":
            raise ValueError("speculative decoding drafts generated tokens: not --runner pooling")
        if self.logits_processors and self.async_scheduling:
            raise ValueError(
                "--logits-processors read each row's tokens so far, which a step scheduled ahead "
                "does not have yet: drop --async-scheduling"
            )
        if self.speculative is not None and self.async_scheduling:
            raise ValueError(
                "speculative decoding and --async-scheduling do not run together: drafts are "
                "made from each step's tokens before the next step is scheduled"
            )
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError("--enable-sleep-mode runs on one device: --tensor-parallel-size 1")
        spec = self.speculative
        if spec is not None and spec.uses_model and self.tensor_parallel_size > 1:
            raise ValueError("a draft model drafts on one device: --tensor-parallel-size 1")
        if self.runner == "pooling" and self.tensor_parallel_size > 1:
            # Refused before any worker starts or weight loads.
            raise ValueError("--runner pooling runs on one device (--tensor-parallel-size 1)")
        publishes = self.kv_events is not None and self.kv_events.publishes
        if publishes and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-events-config publishes what the prefix cache stores: it needs "
                "prefix caching (drop --no-enable-prefix-caching)"
            )
        self._check_lora()
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.data_parallel_rank < 0:
            raise ValueError(f"data_parallel_rank must be 0 or more, got {self.data_parallel_rank}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(
                f"unknown load format {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}"
            )

    def _check_lora(self) -> None:
        """What LoRA adapters run with is refused before anything loads."""
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if not self.enable_lora:
            return
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run on one device (--tensor-parallel-size 1)")
        if self.runner == "pooling":
            raise ValueError("LoRA adapters run with the generating runner, not --runner pooling")
        if self.model_impl == "transformers":
            raise ValueError("LoRA adapters run on Conveyor's model implementation only")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names each adapter once")

    def overlaps(self, device_type: str) -> bool:
        """Whether steps are scheduled asynchronously on this kind of device (never for
        pooling: a prompt's step is its last; nor with speculation or logits processors: drafts
        and processors read each step's tokens on the host before the next step is scheduled)."""
        if self.runner == "pooling" or self.speculative is not None or self.logits_processors:
            return False
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device_type == "cuda"

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_waiting_requests=self.max_waiting_requests,
            static_batching=self.static_batching,
            policy=self.scheduling_policy,
            max_priority_wait=self.max_priority_wait,
            max_queued_tokens=self.max_queued_tokens,
            admission_soft_limit=self.admission_soft_limit,
            reserved_seqs=self._reserved_seqs(),
            max_loras=self.max_loras if self.enable_lora else None,
            max_num_encoder_input_tokens=self.max_num_encoder_input_tokens,
        )

    def _reserved_seqs(self) -> int:
        """By default the priority policy keeps an eighth of the slots for urgent requests."""
        if self.scheduling_policy != "priority":
            return 0
        if self.priority_reserved_seqs is not None:
            return self.priority_reserved_seqs
        return self.max_num_seqs // 8


@dataclass(frozen=True, slots=True)
class ServingInfo:
    """What the serving layer needs to know about a loaded engine."""

    model_name: str
    max_model_len: int
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    model_path: str = ""
    enable_prefix_caching: bool = False
    request_timeout: float | None = None
    stream_interval: int = 1
    kv_cache_dtype: str = ""
    tensor_parallel_size: int = 1
    data_parallel_rank: int = 0
    async_scheduling: bool = False
    runner: str = "generate"
    # With LoRA adapters served: how many one step may run (0: none served).
    max_loras: int = 0
    # An image-text model's image placeholder token (None: the model reads no images).
    image_token_id: int | None = None
    # A sequence classifier's labels in logit order (`/classify`); () for other models.
    labels: tuple[str, ...] = ()
    # The most log probabilities a request may ask for per token (`--max-logprobs`).
    max_logprobs: int = MAX_LOGPROBS
    # The tokens that end a sequence (the model's end-of-sequence tokens).
    eos_token_ids: frozenset[int] = frozenset()
    # The most tokens n-gram speculation drafts for a step (0: no speculation).
    num_speculative_tokens: int = 0
    # What logprobs report (`--logprobs-mode`).
    logprobs_mode: str = "raw_logprobs"
    # What each request reports of its verification steps (`--per-request-spec-decode-metrics`).
    spec_metrics: str = "none"
    # The model's width, and whether a prompt may come as embedding rows of it.
    hidden_size: int = 0
    embeds_prompts: bool = False
    # Whether the steps may be profiled on demand (`--profiler-config`).
    profiling: bool = False
    # Whether the prefix cache's blocks report their residency (`--kv-cache-metrics`).
    kv_cache_metrics: bool = False
    # What a request that leaves a sampling field out gets, by the request's field name, where
    # the model's generation config says (`loading/generation_config.py`).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
