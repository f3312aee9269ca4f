"""`conveyor serve`: load the model, then open the port."""

from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import re
import ssl
import sys
from pathlib import Path

from engine.core.config import (
    DEFAULT_IGNORE_PATTERNS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    QUANTIZATION_METHODS,
    SPEC_METRICS,
    CacheConfig,
    EngineConfig,
)
from engine.core.profiling import ProfilerConfig
from engine.core.sampling_params import MAX_LOGPROBS
from engine.core.speculation import SpeculativeConfig
from engine.kv.events import KVEventsConfig
from engine.loading.gguf_file import is_gguf_file
from server.config_file import CONFIG_OPTION, with_config_file
from server.content_format import CONTENT_FORMATS
from server.flag_values import (
    DTYPES,
    at_least,
    context_length,
    count,
    dtype,
    json_object,
    number,
)
from server.json_style import JsonStyle
from server.limits import RequestLimits
from server.log_format import FORMATS, PLAIN
from server.reasoning import PARSERS as REASONING_PARSERS
from server.settings import (
    DEFAULT_HEAD_TIMEOUT,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_HEAD_BYTES,
    DEFAULT_MAX_HEAD_COUNT,
    CorsOptions,
    ServerSettings,
    TlsFiles,
)
from server.stats_log import INTERVAL as STATS_INTERVAL
from server.tool_parsers import PARSERS
from server.version import conveyor_version
from server.vllm_only_flags import add_vllm_only_flags, data_parallel_rank, graph_choice

logger = logging.getLogger("conveyor")

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes."""
    match = _SIZE.match(text)
    if match is None:
        try:
            return int(float(text))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a size: {text!r}") from None
    number, unit, binary = match.groups()
    base = 1024 if binary or unit == "" else 1000
    power = " kmgt".index(unit.lower() or " ")
    return int(float(number) * base**power)


def load_chat_template(text: str) -> str:
    """A Jinja file's text, or `text` itself where it is a template (it holds `{{` or `{%`),
    its escapes (`\\n`) read as vLLM reads a one-line template."""
    path = Path(text)
    if path.is_file():
        return path.read_text()
    if "{{" in text or "{%" in text:
        return codecs.decode(text, "unicode_escape")
    raise argparse.ArgumentTypeError(f"no chat template file at {text!r}")


def tokenizer_mode(text: str) -> str:
    """vLLM's `--tokenizer-mode`: `hf` is `auto`; `mistral` and `custom` are refused."""
    mode = text.lower()
    if mode in ("auto", "hf"):
        return "auto"
    if mode == "slow":
        return mode
    raise argparse.ArgumentTypeError(
        f"tokenizer mode {text!r} is not served: Conveyor reads Hugging Face tokenizer files "
        "(auto, hf or slow)"
    )


def _sample_rate(text: str) -> float:
    value = number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a share in (0, 1], not {value}")
    return value


def existing_folder(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder: {text}")
    return path


def parse_media_limits(text: str) -> int:
    """vLLM's `--limit-mm-per-prompt`, `'{"image": N}'`: the most images in one request."""
    value = json_object(text)
    count = value.get("image")
    if set(value) - {"image"} or not isinstance(count, int) or count < 0:
        raise argparse.ArgumentTypeError(
            f"not a media limit: {text!r} (Conveyor reads images only: '{{\"image\": N}}')"
        )
    return count


def parse_lora_module(text: str) -> tuple[str, str]:
    """`name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` (a `base_model_name` in it
    is the served model anyway)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            name, path = spec["name"], spec["path"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(
                f'not a LoRA module: {text!r} (JSON needs "name" and "path")'
            ) from None
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise argparse.ArgumentTypeError(f"not a LoRA module: {text!r} (name=path)")
    return name, path


def _add_lora_args(parser: argparse.ArgumentParser) -> None:
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters over the model: a request runs one by naming it as its model",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        type=parse_lora_module,
        default=[],
        metavar="NAME=PATH",
        help="adapters to serve from the start, each a PEFT adapter folder: name=path or "
        '\'{"name": ..., "path": ...}\'',
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="adapters one step may run (a slot each; more wait their turn)",
    )
    lora.add_argument(
        "--max-lora-rank", type=int, default=16, help="the highest adapter rank served"
    )


def _add_engine_args(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--model",
        default=None,
        help="local Hugging Face folder, hub id or GGUF file (default: the embedded "
        "SmolLM2-135M-Instruct)",
    )
    engine.add_argument(
        "--tokenizer",
        default=None,
        help="folder or hub id of the tokenizer (and chat template) to use instead of the "
        "model's own",
    )
    engine.add_argument(
        "--tokenizer-mode",
        type=tokenizer_mode,
        default="auto",
        help="auto (or hf): the fast tokenizer; slow: the Python one (vLLM's flag; its mistral "
        "mode is refused: Conveyor reads Hugging Face tokenizer files)",
    )
    engine.add_argument(
        "--revision", default=None, help="a hub model's branch, tag or commit (default: main)"
    )
    engine.add_argument(
        "--tokenizer-revision",
        default=None,
        help="the tokenizer's branch, tag or commit (default: the model's)",
    )
    engine.add_argument(
        "--download-dir",
        default=None,
        help="the Hugging Face cache folder to fetch a hub model into (default: $HF_HOME's)",
    )
    engine.add_argument(
        "--hf-token",
        default=None,
        help="the token to fetch a gated or private hub model with (default: $HF_TOKEN, or "
        "the login's)",
    )
    _add_ignore_patterns(engine)
    engine.add_argument(
        "--hf-overrides",
        type=json_object,
        default=None,
        help="a JSON object of fields of the model's config to replace, e.g. a longer context "
        'by YaRN: \'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32768}}\'',
    )
    engine.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help="the most log probabilities a request may ask for per token (logprobs, "
        "top_logprobs, prompt_logprobs); -1: the whole vocabulary",
    )
    engine.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=QUANTIZATION_METHODS,
        help="the checkpoint's quantization method, checked against it (by default read from "
        "the checkpoint; models are not quantized as they load)",
    )
    engine.add_argument(
        "--dtype",
        type=dtype,
        default="auto",
        metavar="{" + ",".join(DTYPES) + "}",
        help="the model's compute dtype (half: float16, float: float32, as vLLM)",
    )
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    engine.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model's weights across this many processes, one device each "
        "(CUDA devices from --device on, NCCL; on a CPU, gloo, for testing)",
    )
    engine.add_argument(
        "--int8-activations",
        action="store_true",
        help="on a CPU in float32, multiply GGUF Q4_1 blocks against "
        "activations rounded to 8-bit blocks, as llama.cpp does: faster, "
        "but no longer the exact fp32 product",
    )
    engine.add_argument(
        "--keep-blocks",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="on a CPU in bf16 (or fp16), keep a GGUF file's or quantized checkpoint's blocks "
        "instead of dequantizing them into 16-bit panels: a third of the weights' memory, "
        "faster for one stream, slower for many (fp32 keeps them always). Default: kept only "
        "where the widened weights and the KV cache would not fit in the memory left",
    )
    engine.add_argument(
        "--max-model-len",
        type=context_length,
        default=None,
        help="context limit, e.g. 32768, 32k or 32K (default, or auto: the model's, where the "
        "KV cache holds it)",
    )
    engine.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: 32 on a CPU, 16 on CUDA)",
    )
    engine.add_argument(
        "--mamba-block-size",
        type=int,
        default=None,
        help="tokens between the copies of a request's recurrent states that prefix caching "
        "resumes from, a multiple of --block-size (LFM2, Qwen3.5, Granite 4, Bamba, "
        "Nemotron-H, Falcon-H1, Jamba, Mamba; "
        "default: the multiple of --block-size nearest 256)",
    )
    engine.add_argument(
        "--num-blocks",
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV blocks (overrides the memory budgets; vLLM's --num-gpu-blocks-override)",
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=None,
        help="KV cache bytes, e.g. 4GiB (default on CPU 4GiB; on CUDA what "
        "--gpu-memory-utilization leaves)",
    )
    engine.add_argument(
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=count,
        help="vLLM's name of --kv-cache-memory, read as vLLM reads it: 4G is 4 GiB, 4g 4e9 bytes",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory for weights, activations and KV cache",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPES),
        help="K/V element type (auto: the model's dtype; on CPU, bfloat16, "
        "float16 or fp8_e5m2 under float32 compute; on CUDA, fp8 (e4m3), fp8_e4m3 or fp8_e5m2)",
    )
    engine.add_argument(
        "--calculate-kv-scales",
        action="store_true",
        help="an fp8 KV cache on CUDA takes each layer's scales from the first step's K/V "
        "(default: the checkpoint's scales, else 1.0)",
    )
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--max-num-batched-tokens", type=count, default=2048)
    engine.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    engine.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="the most prompt tokens one request computes in a step, so a long prompt leaves "
        "room in each step for other prompts (vLLM's flag; 0: as many as the budget leaves)",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of shared prompt prefixes",
    )
    engine.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help="publish what the prefix cache stores and evicts over ZeroMQ for KV-aware routers, "
        "as vLLM's JSON config: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "kv"}\' '
        "(also replay_endpoint, buffer_steps, hwm, max_queue_size; needs the kv-events extra)",
    )
    engine.add_argument(
        "--kv-cache-metrics",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="measure how long the prefix cache keeps a sample of its blocks: vLLM's "
        "vllm:kv_block_lifetime_seconds, vllm:kv_block_idle_before_evict_seconds and "
        "vllm:kv_block_reuse_gap_seconds histograms",
    )
    engine.add_argument(
        "--kv-cache-metrics-sample",
        type=_sample_rate,
        default=0.01,
        metavar="SHARE",
        help="with --kv-cache-metrics, the share of blocks measured, in (0, 1] (default 0.01)",
    )
    engine.add_argument(
        "--profiler-config",
        type=_profiler_config,
        default=None,
        help="serve POST /start_profile and /stop_profile, which record the engine's steps with "
        "torch's profiler, as vLLM's JSON config: "
        '\'{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}\' (also '
        "delay_iterations, max_iterations and the torch_profiler_* options)",
    )
    engine.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="refuse new requests with 503 beyond this many waiting",
    )
    engine.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="refuse new requests with 503 beyond this many promised tokens "
        "(queued prompts plus their max_tokens)",
    )
    engine.add_argument(
        "--admission-soft-limit",
        type=float,
        default=0.9,
        help="KV cache usage past which low-priority requests are deferred",
    )
    engine.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    engine.add_argument(
        "--priority-reserved-seqs",
        type=int,
        default=None,
        help="sequence slots kept for requests of priority <= 0 under the "
        "priority policy (default: an eighth of --max-num-seqs)",
    )
    engine.add_argument(
        "--max-priority-wait",
        type=float,
        default=None,
        help="seconds after which a waiting request counts as top priority",
    )
    engine.add_argument(
        "--stream-interval",
        type=at_least(1),
        default=1,
        help="tokens a streamed sequence gathers before they are sent (its first token and "
        "its end at once); more sends fewer, larger chunks (vLLM's flag)",
    )
    engine.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="default deadline of a request in seconds (request field timeout)",
    )
    engine.add_argument(
        "--attention-backend",
        default="auto",
        choices=["auto", "cpu", "triton", "torch"],
        help="cpu: Conveyor's C++ paged-attention kernel (built on first use); "
        "triton: Conveyor's Triton kernels, on CUDA; torch: pure torch, "
        "any device; auto: triton on a GPU, cpu on a CPU where the kernel "
        "builds, else torch",
    )
    engine.add_argument(
        "--model-impl",
        default="auto",
        choices=["auto", "conveyor", "transformers"],
        help="Conveyor's own decoder (Llama, Mistral, Qwen2, Qwen3) or the "
        "Hugging Face model; auto takes Conveyor's where it applies",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly instead of replaying CUDA graphs",
    )
    engine.add_argument(
        "--runner",
        choices=["generate", "pooling"],
        default="generate",
        help="generate: sample tokens; pooling: serve /v1/embeddings (each input's last hidden "
        "state, L2-normalized) instead of the generation routes",
    )
    engine.add_argument(
        "--compile",
        action="store_true",
        help="compile what each layer does between attention calls with torch.compile "
        "(inductor) at start-up; CUDA graphs then replay the compiled code",
    )
    engine.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="let the engine give its memory back between rollouts: /sleep frees the KV "
        "cache (level 1; on a GPU the weights move to host memory) or the weights too "
        "(level 2), /wake_up takes it again (with --server-dev-mode)",
    )
    engine.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and launch each step while the previous one still runs on the device, "
        "so a GPU never waits for the host (default: on for CUDA, off on a CPU)",
    )
    engine.add_argument(
        "--logits-processors",
        nargs="+",
        action="extend",
        default=[],
        metavar="CLASS",
        help="logits processors of your own, as package.module.Class (vLLM's flag): built with "
        "the vocabulary's size and the device, each sees every sampled row's logits, and the "
        "request's vllm_xargs, before Conveyor's rules (engine/worker/logits_processors.py)",
    )
    engine.add_argument(
        "--logprobs-mode",
        choices=list(LOGPROBS_MODES),
        default="raw_logprobs",
        help="what logprobs report (vLLM's flag): the log-softmax of the model's logits or the "
        "logits, raw, or processed as sampling draws from them (after logit bias, penalties, "
        "temperature, top-k, top-p and min-p; tokens they rule out at -9999)",
    )
    engine.add_argument(
        "--per-request-spec-decode-metrics",
        choices=list(SPEC_METRICS),
        default="none",
        help="with speculative decoding or a prediction, a lone sequence's response carries "
        "its verification steps as `metrics.speculative_decoding` (vLLM's): summary counts, "
        "detailed adds each step's",
    )
    engine.add_argument(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        help="speculative decoding as vLLM's JSON config: n-gram drafts "
        '(\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'; '
        "either lookup length alone sets both, default 5), suffix decoding's "
        '(\'{"method": "suffix"}\', from the request and earlier outputs; vLLM\'s '
        "suffix_decoding_* fields) or a draft model's "
        '(\'{"model": "Qwen/Qwen3-0.6B", "num_speculative_tokens": 4}\', a smaller model '
        "of the same tokenizer); turns --async-scheduling off",
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--trust-remote-code", action="store_true")
    engine.add_argument(
        "--load-format",
        default="auto",
        choices=list(LOAD_FORMATS),
        help="auto: read the checkpoint's weights; dummy: random weights of the model's shape "
        "(only its config and tokenizer are read), for measuring speed and memory",
    )
    engine.add_argument(
        "--generation-config",
        default="auto",
        help="where requests' sampling defaults come from: auto (the model's "
        "generation_config.json: temperature, top_p, top_k, min_p, repetition_penalty, "
        "max_new_tokens, where it sets them), vllm (OpenAI's defaults alone) or a folder",
    )
    engine.add_argument(
        "--override-generation-config",
        type=json_object,
        default={},
        metavar="JSON",
        help="generation config fields set on top, e.g. '{\"temperature\": 0.5}'",
    )
    _add_lora_args(parser)


def _add_server_args(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the names clients send as model (the first is the one replies give)",
    )
    server.add_argument(
        "--api-key",
        default=os.environ.get("CONVEYOR_API_KEY"),
        help="require this Bearer token on /v1 (or set CONVEYOR_API_KEY)",
    )
    server.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=os.environ.get("CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, which read any folder "
        "a client names (or set CONVEYOR_ALLOW_RUNTIME_LORA_UPDATING=1)",
    )
    server.add_argument(
        "--server-dev-mode",
        action="store_true",
        default=os.environ.get("CONVEYOR_SERVER_DEV_MODE", "").lower() in ("1", "true"),
        help="serve the routes an RL trainer drives generation with: /pause, /resume, "
        "/is_paused, /abort_requests and /update_weights_from_disk (SGLang's "
        "/pause_generation, /continue_generation and /abort_request too; a client then names "
        "folders the server reads; or set CONVEYOR_SERVER_DEV_MODE=1)",
    )
    server.add_argument(
        "--allowed-origins",
        type=_name_list,
        default=(),
        help="CORS origins, comma-separated or as vLLM's JSON list: '*', 'https://a.example' "
        "or '[\"https://a.example\"]' (default: CORS off)",
    )
    server.add_argument(
        "--allowed-methods",
        type=_name_list,
        default=("*",),
        help="with CORS, the methods browsers may send (vLLM's flag; default all)",
    )
    server.add_argument(
        "--allowed-headers",
        type=_name_list,
        default=("*",),
        help="with CORS, the headers browsers may send (vLLM's flag; default all)",
    )
    server.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with CORS, browsers may send cookies and credentials (vLLM's flag)",
    )
    server.add_argument(
        "--middleware",
        action="append",
        default=[],
        metavar="IMPORT_PATH",
        help="a deployment's own ASGI middleware, as package.module.name (vLLM's flag; "
        "repeatable): a class is added as ASGI middleware, an async function "
        "(request, call_next) wraps every HTTP request",
    )
    server.add_argument(
        "--uds",
        default=None,
        metavar="PATH",
        help="listen on this Unix domain socket instead of --host and --port (vLLM's flag)",
    )
    server.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_BODY_BYTES)
    server.add_argument(
        "--max-header-bytes",
        "--h11-max-incomplete-event-size",
        type=parse_bytes,
        default=DEFAULT_MAX_HEAD_BYTES,
        help="bytes of a request's line and headers (more gets a 431; vLLM's h11 name too)",
    )
    server.add_argument(
        "--max-header-count",
        "--h11-max-header-count",
        type=at_least(1),
        default=DEFAULT_MAX_HEAD_COUNT,
        help="header lines a request may carry (more gets a 431; vLLM's h11 name too)",
    )
    server.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEAD_TIMEOUT,
        help="seconds a connection has to send a request's line and headers (then 408, closed)",
    )
    defaults = RequestLimits()
    server.add_argument(
        "--max-stop-strings",
        type=int,
        default=defaults.max_stop_strings,
        help="stop strings (and stop token ids) a request may give",
    )
    server.add_argument(
        "--max-stop-string-chars",
        type=int,
        default=defaults.max_stop_string_chars,
        help="characters in one stop string",
    )
    server.add_argument(
        "--max-prompts",
        type=int,
        default=defaults.max_prompts,
        help="prompts in one /v1/completions request",
    )
    server.add_argument(
        "--max-logit-bias",
        type=int,
        default=defaults.max_logit_bias,
        help="logit_bias entries in one request",
    )
    server.add_argument(
        "--max-messages",
        type=int,
        default=defaults.max_messages,
        help="messages in one /v1/chat/completions request",
    )
    server.add_argument(
        "--limit-mm-per-prompt",
        type=parse_media_limits,
        default=defaults.max_images,
        metavar="JSON",
        help=f"images in one request, as '{{\"image\": N}}' (default {defaults.max_images})",
    )
    server.add_argument(
        "--enable-prompt-embeds",
        action="store_true",
        help="/v1/completions takes prompts as embedding rows (`prompt_embeds`: base64 of a "
        "torch.save'd [tokens, hidden] tensor), as vLLM's flag",
    )
    server.add_argument(
        "--enable-tokenizer-info-endpoint",
        action="store_true",
        help="serve GET /tokenizer_info: the tokenizer's config (class, special and added "
        "tokens, chat template), as vLLM's",
    )
    server.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="run a chat template a request brings (`chat_template`) instead of the model's; "
        "without it such a request gets a 400 (a template runs code on the server)",
    )
    server.add_argument(
        "--mm-processor-kwargs",
        type=json_object,
        default={},
        metavar="JSON",
        help="more arguments of every call of an image-text model's processor, as a JSON "
        "object (vLLM's flag), e.g. '{\"max_pixels\": 1003520}' for Qwen2-VL's largest image",
    )
    server.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=None,
        metavar="HOST",
        help="hosts image URLs may be fetched from (default: any)",
    )
    server.add_argument(
        "--allowed-local-media-path",
        type=existing_folder,
        default=None,
        metavar="DIR",
        help="let image URLs be file:// paths under this folder (vLLM's flag; only for "
        "trusted clients: they read the server's files there)",
    )
    _add_reply_parsers(server)
    server.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where uploaded files (/v1/files) are kept (default: state under the cache folder)",
    )
    server.add_argument(
        "--max-file-bytes",
        type=parse_bytes,
        default=DEFAULT_MAX_FILE_BYTES,
        help="the largest file /v1/files accepts",
    )
    server.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send a span per request over OTLP/HTTP to this URL, e.g. "
        "http://localhost:4318/v1/traces (needs the otel extra; default: "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing)",
    )
    server.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds running requests get to finish on SIGTERM",
    )
    server.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    server.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="every streamed completion and chat request gets its usage last, as if it asked "
        "with stream_options.include_usage",
    )
    server.add_argument(
        "--enable-per-request-metrics",
        action="store_true",
        help="a lone sequence's response carries its timings as vLLM's `metrics` object "
        "(queue time, time to first token, generation time, mean inter-token latency, tokens "
        "per second); streamed, in the usage chunk",
    )
    server.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="logprobs name every token as token_id:N, as if each request asked",
    )
    server.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no uvicorn line per HTTP request",
    )
    server.add_argument(
        "--disable-access-log-for-endpoints",
        type=_name_list,
        default=(),
        metavar="PATHS",
        help="no uvicorn line for requests to these paths, comma-separated (vLLM's flag): "
        "/health,/metrics,/ping for probes and scrapes",
    )
    server.add_argument(
        "--disable-fastapi-docs",
        action="store_true",
        help="serve no API description (/openapi.json) and no pages at /docs and /redoc",
    )
    server.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no stats line (throughput, requests, KV cache use) every 10 s while serving",
    )
    server.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["debug", "info", "warning", "error", "critical", "trace"],
        help="the level of uvicorn's own log lines (default: --log-level)",
    )
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key")
    server.add_argument("--ssl-certfile", default=None, help="and this certificate chain")
    server.add_argument(
        "--ssl-ca-certs", default=None, help="certificates of the authority clients' must be of"
    )
    server.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=ssl.CERT_NONE,
        choices=[ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED],
        help="whether clients must show a certificate: 0 no, 1 optional, 2 required "
        "(Python's ssl.CERT_* values, as vLLM takes them)",
    )
    server.add_argument(
        "--enable-ssl-refresh",
        action="store_true",
        help="with HTTPS, re-read the key, certificate and --ssl-ca-certs when their files "
        "change, so a rotated certificate serves without a restart (vLLM's flag)",
    )
    server.add_argument(
        "--ssl-ciphers",
        default=None,
        help="with HTTPS, the TLS 1.2 ciphers offered, in OpenSSL's syntax (vLLM's flag; "
        "default: Python's)",
    )
    server.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves the app under, for the links it writes",
    )
    server.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="a log line for every finished request (on by default with --log-format json)",
    )
    server.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="no log line per request, whatever the log format",
    )
    server.add_argument(
        "--enable-log-outputs",
        action="store_true",
        help="each request's log line holds each choice's text (needs request log lines)",
    )
    server.add_argument(
        "--max-log-len",
        type=at_least(0),
        default=None,
        help="the characters of each text a log line holds (default: all)",
    )
    server.add_argument(
        "--log-format",
        default="plain",
        choices=FORMATS,
        help="json: one JSON object per line, and a line for every finished request",
    )
    server.add_argument(
        "--log-config-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a JSON logging configuration (Python's dictConfig) for Conveyor's and uvicorn's "
        "loggers, applied over --log-format and --log-level (vLLM's flag)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    graphs = graph_choice(args)
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        tokenizer_mode=args.tokenizer_mode,
        quantization=args.quantization,
        max_logprobs=args.max_logprobs,
        revision=args.revision,
        tokenizer_revision=args.tokenizer_revision,
        download_dir=args.download_dir,
        hf_token=args.hf_token,
        ignore_patterns=tuple(args.ignore_patterns),
        hf_overrides=args.hf_overrides,
        dtype=args.dtype,
        device=args.device,
        int8_activations=args.int8_activations,
        keep_blocks=args.keep_blocks,
        max_model_len=args.max_model_len,
        cache=CacheConfig(
            block_size=args.block_size,
            mamba_block_size=args.mamba_block_size,
            num_blocks=args.num_blocks,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            dtype=args.kv_cache_dtype,
            calculate_kv_scales=args.calculate_kv_scales,
        ),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_prefix_caching=args.enable_prefix_caching,
        max_waiting_requests=args.max_waiting_requests,
        max_queued_tokens=args.max_queued_tokens,
        admission_soft_limit=args.admission_soft_limit,
        scheduling_policy=args.scheduling_policy,
        max_priority_wait=args.max_priority_wait,
        priority_reserved_seqs=args.priority_reserved_seqs,
        request_timeout=args.request_timeout,
        stream_interval=args.stream_interval,
        attention_backend=args.attention_backend,
        model_impl=args.model_impl,
        enforce_eager=args.enforce_eager or graphs.eager,
        cuda_graph_sizes=graphs.sizes,
        max_cuda_graph_size=graphs.largest,
        mixed_step_graphs=graphs.mixed,
        compile=args.compile,
        enable_sleep_mode=args.enable_sleep_mode,
        runner=args.runner,
        seed=args.seed,
        trust_remote_code=args.trust_remote_code,
        load_format=args.load_format,
        tensor_parallel_size=args.tensor_parallel_size,
        data_parallel_rank=data_parallel_rank(args),
        async_scheduling=args.async_scheduling,
        speculative=args.speculative_config,
        kv_events=args.kv_events_config,
        kv_cache_metrics_sample=args.kv_cache_metrics_sample if args.kv_cache_metrics else None,
        profiler=args.profiler_config,
        logprobs_mode=args.logprobs_mode,
        logits_processors=tuple(args.logits_processors),
        spec_metrics=args.per_request_spec_decode_metrics,
        enable_lora=args.enable_lora,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=tuple(args.lora_modules),
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
    )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        served_model_aliases=tuple(args.served_model_name or ())[1:],
        chat_template=args.chat_template,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        cors=CorsOptions(args.allowed_methods, args.allowed_headers, args.allow_credentials),
        middleware=tuple(args.middleware),
        tls=_tls_files(args),
        root_path=args.root_path,
        log_stats_interval=None if args.disable_log_stats else STATS_INTERVAL,
        access_log=not args.disable_uvicorn_access_log,
        quiet_paths=tuple(args.disable_access_log_for_endpoints),
        api_docs=not args.disable_fastapi_docs,
        force_include_usage=args.enable_force_include_usage,
        per_request_metrics=args.enable_per_request_metrics,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_body_bytes=args.max_request_bytes,
        max_head_bytes=args.max_header_bytes,
        max_head_count=args.max_header_count,
        head_timeout=args.header_timeout,
        shutdown_timeout=args.shutdown_timeout,
        chat_content_format=args.chat_template_content_format,
        default_chat_template_kwargs=args.default_chat_template_kwargs,
        response_role=args.response_role,
        tool_call_parser=tool_call_parser(args),
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
        reasoning_parser=reasoning_parser(args),
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        log_requests=_log_requests(args),
        log_outputs=_log_outputs(args),
        max_log_len=args.max_log_len,
        state_dir=args.state_dir,
        max_file_bytes=args.max_file_bytes,
        runtime_lora_updating=args.allow_runtime_lora_updating,
        server_dev_mode=args.server_dev_mode,
        mm_processor_kwargs=args.mm_processor_kwargs,
        trust_request_chat_template=args.trust_request_chat_template,
        tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
        enable_prompt_embeds=args.enable_prompt_embeds,
        json_style=_json_style(args),
        limits=RequestLimits(
            args.max_stop_strings,
            args.max_stop_string_chars,
            args.max_prompts,
            args.max_logit_bias,
            args.max_messages,
            args.limit_mm_per_prompt,
            frozenset(d.lower() for d in args.allowed_media_domains)
            if args.allowed_media_domains
            else None,
            args.allowed_local_media_path,
        ),
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    """`--speculative-config`: vLLM's JSON object, its n-gram, suffix and draft-model fields."""
    try:
        return SpeculativeConfig.of(json_object(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _name_list(text: str) -> tuple[str, ...]:
    """Names given comma-separated, or as a JSON list of strings (vLLM's form)."""
    if text.lstrip().startswith("["):
        try:
            names = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise argparse.ArgumentTypeError("must be a JSON list of strings")
        return tuple(n.strip() for n in names if n.strip())
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _kv_events_config(text: str) -> KVEventsConfig:
    """`--kv-events-config`: vLLM's JSON object."""
    try:
        return KVEventsConfig.of(json_object(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _profiler_config(text: str) -> ProfilerConfig:
    """`--profiler-config`: vLLM's JSON object."""
    try:
        return ProfilerConfig.of(json_object(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """HTTPS's files, or None for plain HTTP; a key without a certificate (or the other way
    round) is refused."""
    if args.ssl_keyfile is None and args.ssl_certfile is None:
        if args.ssl_ca_certs is not None:
            raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
        return None
    if args.ssl_keyfile is None or args.ssl_certfile is None:
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    # Read now, so that a wrong file stops the start before the model loads.
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        if args.ssl_ca_certs is not None:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot read the TLS files: {exc}") from exc
    if args.ssl_ciphers is not None:
        try:
            context.set_ciphers(args.ssl_ciphers)
        except ssl.SSLError as exc:
            raise ValueError(f"--ssl-ciphers {args.ssl_ciphers!r}: {exc}") from exc
    return TlsFiles(
        args.ssl_keyfile,
        args.ssl_certfile,
        args.ssl_ca_certs,
        args.ssl_cert_reqs,
        args.ssl_ciphers,
        args.enable_ssl_refresh,
    )


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """`--tool-call-parser`: one of Conveyor's parsers or of `--tool-parser-plugin`'s file."""
    from server.tool_plugins import PLUGINS

    return PLUGINS.chosen(args.tool_parser_plugin, args.tool_call_parser)


def reasoning_parser(args: argparse.Namespace) -> str | None:
    """`--reasoning-parser`: one of Conveyor's parsers or of `--reasoning-parser-plugin`'s
    file."""
    from server.reasoning_plugins import PLUGINS

    return PLUGINS.chosen(args.reasoning_parser_plugin, args.reasoning_parser)


def _json_style(args: argparse.Namespace) -> JsonStyle:
    """How enforced JSON is written: `--structured-outputs-config`'s options, its backend
    where it names one, else `--guided-decoding-backend`'s."""
    return JsonStyle.of(
        {"backend": args.guided_decoding_backend, **(args.structured_outputs_config or {})}
    )


def _log_requests(args: argparse.Namespace) -> bool:
    return (args.log_format == "json" or args.enable_log_requests) and not args.disable_log_requests


def _log_outputs(args: argparse.Namespace) -> bool:
    if args.enable_log_outputs and not _log_requests(args):
        raise ValueError(
            "--enable-log-outputs writes outputs into request log lines, which are off: add "
            "--enable-log-requests (or --log-format json)"
        )
    return bool(args.enable_log_outputs)


def serve(args: argparse.Namespace) -> int:
    from engine.core.async_engine import AsyncEngine
    from server.app import build_app
    from server.http_protocol import uvicorn_config
    from server.lifecycle import DrainingServer, freeze_heap, thaw_heap
    from server.log_format import apply_config_file, configure_logging
    from server.tracing import Tracing, output_logging

    uvicorn_level = args.uvicorn_log_level or args.log_level
    log_config = configure_logging(args.log_level, args.log_format, uvicorn_level)
    try:
        if args.log_config_file is not None:
            log_config = apply_config_file(args.log_config_file)
        settings = server_settings(args)
        tracing = Tracing.from_endpoint(
            settings.otlp_traces_endpoint, settings.log_requests, output_logging(settings)
        )
        engine = AsyncEngine.from_config(engine_config(args))
        app = build_app(engine, settings, tracing=tracing)
    except (ValueError, OSError) as exc:
        logger.error("cannot start: %s", exc)
        return 2
    info = engine.info
    logger.info(
        "serving %s as '%s' (%s on %s, %d %s KV blocks of %d tokens, context %d) at %s://%s:%d",
        info.model_path or info.model_name,
        app.state.model.name,
        info.dtype,
        info.device,
        info.num_blocks,
        info.kv_cache_dtype,
        info.block_size,
        info.max_model_len,
        "https" if settings.tls else "http",
        args.host if args.uds is None else "unix:" + args.uds,
        args.port,
    )
    config = uvicorn_config(
        app, args.host, args.port, uvicorn_level, settings, log_config, uds=args.uds
    )
    logger.debug("%d objects of the loaded model frozen out of garbage collection", freeze_heap())
    try:
        tls = settings.tls
        refreshed = tls if tls is not None and tls.refresh else None
        DrainingServer(config, app, settings.shutdown_timeout, refreshed).run()
    finally:
        thaw_heap()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description="Conveyor inference server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="serve a model over an OpenAI-compatible API")
    serve_parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model, as --model (vLLM's `vllm serve MODEL`)",
    )
    _add_config_option(serve_parser)
    _add_engine_args(serve_parser)
    _add_server_args(serve_parser)
    add_vllm_only_flags(serve_parser)
    serve_parser.set_defaults(func=serve)
    download_parser = commands.add_parser(
        "download", help="fetch a model into the cache ahead of serving (an offline image)"
    )
    download_parser.add_argument(
        "--model",
        default=None,
        help="hub id, or a GGUF file to convert (default: the embedded SmolLM2-135M-Instruct)",
    )
    download_parser.add_argument("--revision", default=None, help="the branch, tag or commit")
    download_parser.add_argument("--download-dir", default=None, help="the cache folder")
    download_parser.add_argument("--hf-token", default=None, help="for gated models")
    _add_ignore_patterns(download_parser)
    download_parser.set_defaults(func=download)
    _add_batch_commands(commands)
    _add_bench_commands(commands)
    _add_client_commands(commands)
    _add_collect_env(commands)
    parser.add_argument("--version", action="version", version=conveyor_version())
    return parser


def _add_collect_env(commands: argparse._SubParsersAction) -> None:
    from server import collect_env

    report = commands.add_parser(
        "collect-env", help="what a bug report needs of this machine and install (as vLLM's)"
    )
    collect_env.add_arguments(report)
    report.set_defaults(func=collect_env.main)


def _add_client_commands(commands: argparse._SubParsersAction) -> None:
    """`conveyor chat` and `conveyor complete`: terminal clients of a running server."""
    from server import client_cli

    chat = commands.add_parser("chat", help="chat with a running server from the terminal")
    client_cli.add_chat_arguments(chat)
    chat.set_defaults(func=client_cli.main(client_cli.chat))
    complete = commands.add_parser("complete", help="complete prompts on a running server")
    client_cli.add_arguments(complete)
    complete.set_defaults(func=client_cli.main(client_cli.complete))


def _add_reply_parsers(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """How chat requests are templated, and tool calls and reasoning read out of a reply."""
    parser.add_argument(
        "--chat-template",
        type=load_chat_template,
        default=None,
        help="the chat template to use instead of the model's: a Jinja file, or the template "
        "itself",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        default=None,
        help="more variables for the chat template on every chat request, under what a "
        "request's chat_template_kwargs sets (vLLM's flag), e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--chat-template-content-format",
        choices=CONTENT_FORMATS,
        default="auto",
        help="how the chat template takes a message's content: string, or openai (a list of "
        '{"type": "text", ...} parts); auto reads it from the template (vLLM\'s flag)',
    )
    parser.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat replies when add_generation_prompt is true (else the last "
        "message's role)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: tool_choice auto is always served",
    )
    parser.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help="leave the tools out of the prompt of a tool_choice 'none' request (by default "
        "the template shows them and the reply is read as text, as vLLM's)",
    )
    parser.add_argument(
        "--tool-call-parser",
        default=None,
        metavar="{" + ",".join(PARSERS) + "}",
        help="how tool calls are read from the output under tool_choice auto "
        "(default: the chat template's own format where it shows one), or a name a "
        "--tool-parser-plugin registers",
    )
    parser.add_argument(
        "--tool-parser-plugin",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Python file registering tool-call formats of your own by name, for "
        "--tool-call-parser (vLLM's flag; server/tool_plugins.py says how)",
    )
    parser.add_argument(
        "--reasoning-parser-plugin",
        type=Path,
        default=None,
        metavar="FILE",
        help="a Python file registering reasoning tags of your own by name, for "
        "--reasoning-parser (vLLM's flag; server/reasoning_plugins.py says how)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        metavar="{" + ",".join(REASONING_PARSERS) + "}",
        help="return a thinking model's <think> text as message.reasoning, apart from the "
        "content (deepseek_r1 and qwen3 read the same tags; openai_gptoss reads gpt-oss's "
        "analysis channel, as a Harmony chat template does without the flag)",
    )


def _add_batch_commands(commands: argparse._SubParsersAction) -> None:
    batch = commands.add_parser("batch", help="batch files").add_subparsers(
        dest="batch_command", required=True
    )
    run = batch.add_parser(
        "run",
        help="run a batch file (OpenAI's batch input format) offline; run again to resume",
    )
    run.add_argument("input", type=Path, help="the batch's requests, one JSON object per line")
    run.add_argument("output", type=Path, help="every line's result, one JSON object per line")
    run.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="where the run's progress is kept (default: OUTPUT.state beside the output)",
    )
    run.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME")
    _add_config_option(run)
    _add_reply_parsers(run)
    _add_engine_args(run)
    add_vllm_only_flags(run)
    run.set_defaults(func=batch_run)


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        CONFIG_OPTION,
        default=None,
        metavar="FILE",
        help="a YAML file of options (keys are the long option names, `max-model-len: 4096`); "
        "options given on the command line take precedence",
    )


def batch_run(args: argparse.Namespace) -> int:
    import asyncio

    from engine.core.async_engine import AsyncEngine
    from server.app import build_app
    from server.batches.offline import run_file

    logging.basicConfig(level=logging.WARNING, format=PLAIN)
    state = args.state_dir or args.output.with_name(args.output.name + ".state")
    try:
        settings = ServerSettings(
            served_model_name=args.served_model_name[0] if args.served_model_name else None,
            served_model_aliases=tuple(args.served_model_name or ())[1:],
            chat_template=args.chat_template,
            state_dir=state,
            tool_call_parser=tool_call_parser(args),
            exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
            reasoning_parser=reasoning_parser(args),
        )
        engine = AsyncEngine.from_config(engine_config(args))
        app = build_app(engine, settings)
    except (ValueError, OSError) as exc:
        logger.error("cannot start: %s", exc)
        return 2
    return asyncio.run(run_file(app, engine, args.input, args.output))


def _add_ignore_patterns(group: argparse._ActionsContainer) -> None:
    group.add_argument(
        "--ignore-patterns",
        nargs="+",
        default=list(DEFAULT_IGNORE_PATTERNS),
        help="files of a hub repository not to fetch, as the hub's patterns match them (vLLM's "
        "flag; default: original/*, Meta's copies of the weights)",
    )


def download(args: argparse.Namespace) -> int:
    """Fetch the default model or convert a GGUF file or a quantized checkpoint (into
    Conveyor's cache), or fetch a hub model (into the Hugging Face cache, `$HF_HOME`, or
    `--download-dir`, at `--revision`), so that `serve` later needs no network and starts in
    seconds."""
    from engine.loading.hub import MODEL_FILES, fetched, snapshot
    from engine.loading.quantized_checkpoint import quantized_folder

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    wanted = EngineConfig(
        model=args.model,
        revision=args.revision,
        download_dir=args.download_dir,
        hf_token=args.hf_token,
        ignore_patterns=tuple(args.ignore_patterns),
    )
    try:
        model = fetched(wanted).model
        if model is None or is_gguf_file(model) or quantized_folder(model):
            from engine.loading.model_loader import checkpoint_path

            model = checkpoint_path(model)
        if model == args.model:  # a hub id no flag asked to fetch otherwise
            model = str(snapshot(args.model, None, MODEL_FILES, wanted, weights=True))
    except ValueError as exc:
        logger.error("cannot fetch or convert: %s", exc)
        return 2
    print(model)
    return 0


def _add_bench_commands(commands: argparse._SubParsersAction) -> None:
    from bench import offline
    from bench import serve as bench_serve

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True
    )
    serve_bench = bench.add_parser("serve", help="load an OpenAI-compatible server")
    bench_serve.add_arguments(serve_bench)
    serve_bench.set_defaults(func=bench_serve.main)
    offline_bench = bench.add_parser("offline", help="continuous vs static batching")
    offline.add_arguments(offline_bench)
    offline_bench.set_defaults(func=offline.main)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    given = sys.argv[1:] if argv is None else argv
    argv = given
    for command in CONFIGURED_COMMANDS:  # their options may come from a `--config` file
        if given[: len(command)] == list(command):
            options = given[len(command) :]
            argv = [*command, *with_config_file(_command_parser(parser, command), options)]
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None:  # an abbreviation reaches argparse unread
        parser.error(f"write {CONFIG_OPTION} in full")
    if args.command == "serve":
        _take_model_tag(parser, args, given)
    return args.func(args)


# The commands whose options a `--config` file may give.
CONFIGURED_COMMANDS = (("serve",), ("batch", "run"))


def _command_parser(
    parser: argparse.ArgumentParser, command: tuple[str, ...]
) -> argparse.ArgumentParser:
    for name in command:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = commands.choices[name]
    return parser


def _take_model_tag(
    parser: argparse.ArgumentParser, args: argparse.Namespace, given: list[str]
) -> None:
    """The model given as the command's first argument taken as `--model` (over a config
    file's `model`; refused beside another `--model` on the command line)."""
    if args.model_tag is None:
        return
    on_command_line = any(a == "--model" or a.startswith("--model=") for a in given)
    if on_command_line and args.model != args.model_tag:
        parser.error(f"the model is given twice: {args.model_tag} and --model {args.model}")
    args.model = args.model_tag


if __name__ == "__main__":
    sys.exit(main())
