"""vLLM serve flags that command lines copied from vLLM's recipes carry and that Conveyor has no
flag of its own for: accepted where what they ask for is what Conveyor does anyway, mapped onto
Conveyor's settings where it has them (CUDA graphs from a compilation config), refused with the
reason where it has not (another value than Conveyor's only one), so a copied command line either
serves as it would under vLLM or says what it cannot have."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.flag_values import at_least, integer, json_object, number

# The executor backends whose ranks are local worker processes, as Conveyor's are.
LOCAL_EXECUTORS = ("mp", "uni")


def only_one(reason: str) -> Callable[[str], int]:
    """An integer flag whose only value here is 1."""

    def parse(text: str) -> int:
        value = integer(text)
        if value != 1:
            raise argparse.ArgumentTypeError(f"only 1 is served: {reason}")
        return value

    return parse


def one_of(values: tuple[str, ...], reason: str) -> Callable[[str], str]:
    """A flag whose only values here are `values` (what Conveyor does)."""

    def parse(text: str) -> str:
        if text not in values:
            raise argparse.ArgumentTypeError(f"{text!r} is not served: {reason}")
        return text

    return parse


def data_parallel_rank(args: argparse.Namespace) -> int:
    """The server's data-parallel rank: 0 alone; with `--data-parallel-rank`, the rank among
    `--data-parallel-size` servers behind a router. A size above 1 without a rank asks one
    server to run several replicas, which it does not."""
    size, rank = args.data_parallel_size, args.data_parallel_rank
    if rank is None:
        if size > 1:
            raise ValueError(
                f"--data-parallel-size {size}: one server serves one replica; run one server "
                "per device behind a router, each with its --data-parallel-rank (the README's "
                "Scaling out section, deploy/fleet.sh)"
            )
        return 0
    if rank >= size:
        raise ValueError(f"--data-parallel-rank {rank} is not below --data-parallel-size {size}")
    return rank


def non_negative(text: str) -> float:
    value = number(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return value


def executor(text: str) -> str:
    if text not in LOCAL_EXECUTORS:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not served: tensor-parallel ranks are local processes "
            f"({' or '.join(LOCAL_EXECUTORS)})"
        )
    return text


# vLLM's structured-output backends: Conveyor compiles every format with llguidance (vLLM's
# `guidance`), which reads the same schemas, regexes, choices and grammars.
BACKENDS = ("auto", "guidance", "xgrammar", "outlines", "lm-format-enforcer")


def preemption_mode(text: str) -> str:
    if text != "recompute":
        raise argparse.ArgumentTypeError(
            f"{text!r} is not served: a preempted request's KV is recomputed (recompute)"
        )
    return text


def backend(text: str) -> str:
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"not a structured-output backend: {text!r}")
    return text


# vLLM's structured-outputs options: their kinds. The JSON ones, and the backend, set how
# enforced JSON is written (`server/json_style.py`); the others have nothing to set (one
# compiler, no fallback; reasoning is parsed by --reasoning-parser and formats wait for the
# reasoning to end).
STRUCTURED_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "backend": str,
    "disable_fallback": bool,
    "disable_any_whitespace": bool,
    "disable_additional_properties": bool,
    "whitespace_pattern": (str, type(None)),
    "reasoning_parser": str,
    "reasoning_parser_plugin": str,
    "enable_in_reasoning": bool,
}


def backend_config(text: str) -> dict:
    """`--structured-outputs-config`'s JSON object: vLLM's options, checked."""
    value = json_object(text)
    unknown = sorted(set(value) - set(STRUCTURED_OPTIONS))
    if unknown:
        names = ", ".join(unknown)
        raise argparse.ArgumentTypeError(f"unknown structured outputs options: {names}")
    for name, given in value.items():
        if not isinstance(given, STRUCTURED_OPTIONS[name]):
            raise argparse.ArgumentTypeError(f"structured outputs option {name}: wrong type")
    if "backend" in value:
        backend(value["backend"])
    if value.get("enable_in_reasoning"):
        raise argparse.ArgumentTypeError(
            "enable_in_reasoning is not served: a format holds once the reasoning has ended"
        )
    return value


# What Conveyor replays from CUDA graphs for each of vLLM's `cudagraph_mode`s: decode steps
# whole and steps with prompt chunks piece by piece around attention (its one way for every
# mode that asks for graphs), decode steps only, or nothing.
GRAPH_MODES = {
    "NONE": "none",
    "PIECEWISE": "all",
    "FULL": "all",
    "FULL_AND_PIECEWISE": "all",
    "FULL_DECODE_ONLY": "decode",
}
# Keys of vLLM's compilation config that tune its own torch.compile pipeline (passes, custom
# ops, caches): accepted and changing nothing, since Conveyor's layers compile with --compile.
COMPILE_INTERNALS = frozenset(
    {
        "level",
        "mode",
        "backend",
        "custom_ops",
        "splitting_ops",
        "compile_sizes",
        "compile_ranges_split_points",
        "use_inductor",
        "inductor_compile_config",
        "inductor_passes",
        "pass_config",
        "use_inductor_graph_partition",
        "cudagraph_num_of_warmups",
        "cudagraph_copy_inputs",
        "cudagraph_specialize_lora",
        "full_cuda_graph",
        "debug_dump_path",
        "cache_dir",
        "local_cache_dir",
        "compile_cache_save_format",
        "compile_mm_encoder",
        "dynamic_shapes_config",
    }
)


@dataclass(frozen=True, slots=True)
class GraphChoice:
    """What a vLLM compilation config or optimization level asks of CUDA graphs."""

    eager: bool = False
    sizes: tuple[int, ...] = ()
    largest: int | None = None
    mixed: bool = True


def compilation_config(text: str) -> GraphChoice:
    """`--compilation-config` (or `-O`): an optimization level (0: no graphs; 1-3: Conveyor's
    graphs) or vLLM's JSON object, of which the CUDA graph keys are read."""
    if text.strip().isdigit():
        level = int(text)
        if level > 3:
            raise argparse.ArgumentTypeError(f"optimization levels are 0-3, not {level}")
        return GraphChoice(eager=level == 0)
    try:
        value = json_object(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(
            f"an optimization level (0-3) or a JSON object ({exc})"
        ) from None
    try:
        return _graph_choice(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _graph_choice(fields: dict[str, Any]) -> GraphChoice:
    graph_keys = {"cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size"}
    unknown = sorted(set(fields) - graph_keys - COMPILE_INTERNALS - {"use_cudagraph"})
    if unknown:
        raise ValueError(f"unknown compilation config fields: {', '.join(unknown)}")
    mode = str(fields.get("cudagraph_mode", "FULL_AND_PIECEWISE")).upper()
    if mode not in GRAPH_MODES:
        raise ValueError(f"cudagraph_mode {mode!r} is not one of {', '.join(GRAPH_MODES)}")
    sizes = fields.get("cudagraph_capture_sizes") or []
    largest = fields.get("max_cudagraph_capture_size")
    if not isinstance(sizes, list) or not all(_positive(n) for n in sizes):
        raise ValueError("cudagraph_capture_sizes must be a list of positive integers")
    if largest is not None and not _positive(largest):
        raise ValueError("max_cudagraph_capture_size must be a positive integer")
    eager = GRAPH_MODES[mode] == "none" or fields.get("use_cudagraph") is False
    return GraphChoice(eager, tuple(sizes), largest, GRAPH_MODES[mode] == "all")


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def graph_choice(args: argparse.Namespace) -> GraphChoice:
    """The CUDA graphs a command line's vLLM flags ask for, together (`--cuda-graph-sizes`
    names the sizes where the compilation config does not)."""
    choices = [c for c in (args.compilation_config, args.optimization_level) if c is not None]
    eager = any(c.eager for c in choices)
    sizes = next((c.sizes for c in choices if c.sizes), tuple(args.cuda_graph_sizes or ()))
    largest = next((c.largest for c in choices if c.largest is not None), None)
    return GraphChoice(eager, sizes, largest, all(c.mixed for c in choices))


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    flags = parser.add_argument_group(
        "vLLM's own flags (accepted where Conveyor does what they ask, or mapped onto its settings)"
    )
    flags.add_argument(
        "--swap-space",
        type=non_negative,
        default=None,
        metavar="GIB",
        help="no effect: a preempted request's KV is recomputed, not swapped to host memory "
        "(as in vLLM's V1 engine)",
    )
    flags.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="no effect: tensor-parallel ranks sum with torch.distributed's own all-reduce",
    )
    flags.add_argument(
        "--distributed-executor-backend",
        type=executor,
        default=None,
        help="mp (or uni): tensor-parallel ranks are local processes; ray is refused",
    )
    flags.add_argument(
        "--max-parallel-loading-workers",
        type=int,
        default=None,
        help="no effect: each rank reads its own share of the weights",
    )
    flags.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="no effect: usage always carries prompt_tokens_details.cached_tokens",
    )
    flags.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=only_one(
            "pipeline parallelism is not built; --tensor-parallel-size splits a model "
            "across the devices of one host"
        ),
        default=1,
    )
    flags.add_argument(
        "--data-parallel-size",
        "-dp",
        type=at_least(1),
        default=1,
        help="with --data-parallel-rank: how many servers share the traffic behind a router; "
        "one server does not split itself into several",
    )
    flags.add_argument(
        "--data-parallel-rank",
        "-dpn",
        type=at_least(0),
        default=None,
        help="this server's rank among --data-parallel-size servers behind a router (vLLM's "
        "external load balancing): its metrics' engine label, and its KV events' ports are "
        "the configured ones plus the rank",
    )
    flags.add_argument(
        "--data-parallel-size-local",
        "-dpl",
        type=only_one("each data-parallel rank is a server of its own (--data-parallel-rank)"),
        default=None,
    )
    flags.add_argument(
        "--data-parallel-external-lb",
        action="store_true",
        help="no effect: data-parallel ranks are servers behind a router of their own",
    )
    flags.add_argument(
        "--data-parallel-address",
        "-dpa",
        default=None,
        help="no effect: data-parallel ranks serve apart, with nothing to coordinate",
    )
    flags.add_argument(
        "--data-parallel-rpc-port",
        "-dpp",
        type=int,
        default=None,
        help="no effect: data-parallel ranks serve apart, with nothing to coordinate",
    )
    flags.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="no effect: every response carries its X-Request-Id",
    )
    flags.add_argument(
        "--guided-decoding-backend",
        type=backend,
        default=None,
        help="structured outputs are always compiled by llguidance, whichever backend is "
        "named; under guidance, objects that list their properties stay open to others (as "
        "vLLM's guidance backend leaves them), under the others they are closed",
    )
    flags.add_argument(
        "--structured-outputs-config",
        type=backend_config,
        default=None,
        help="vLLM's JSON object: its backend as --guided-decoding-backend; "
        "disable_any_whitespace, disable_additional_properties (closes objects under guidance) "
        "and whitespace_pattern set how enforced JSON is written, for every request",
    )
    flags.add_argument(
        "--compilation-config",
        "-cc",
        type=compilation_config,
        default=None,
        help="vLLM's JSON object: cudagraph_mode NONE runs every step eagerly, FULL_DECODE_ONLY "
        "replays decode steps only, the others Conveyor's graphs (decode steps whole, other "
        "steps piecewise); cudagraph_capture_sizes and max_cudagraph_capture_size choose the "
        "decode sizes captured; the torch.compile keys change nothing (see --compile)",
    )
    flags.add_argument(
        "-O",
        "--optimization-level",
        type=compilation_config,
        default=None,
        help="0: every step eagerly (no CUDA graphs); 1, 2, 3: Conveyor's graphs; a JSON object "
        "as --compilation-config",
    )
    flags.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=None,
        help="the decode batch sizes replayed from CUDA graphs",
    )
    flags.add_argument(
        "--max-seq-len-to-capture",
        type=int,
        default=None,
        help="no effect: decode graphs cover every sequence length",
    )
    flags.add_argument(
        "--enable-expert-parallel",
        "-ep",
        action="store_true",
        help="accepted: under --tensor-parallel-size each rank holds its share of every "
        "expert's channels (the same tokens, one all-reduce per layer) rather than whole experts",
    )
    flags.add_argument(
        "--api-server-count",
        type=only_one(
            "one process serves HTTP beside the engine loop; scale out with replicas behind a "
            "router (the README's Scaling out section)"
        ),
        default=1,
    )
    flags.add_argument(
        "--num-scheduler-steps",
        type=only_one("each step is scheduled on its own (overlapped with --async-scheduling)"),
        default=1,
    )
    flags.add_argument(
        "--preemption-mode",
        type=preemption_mode,
        default=None,
        help="recompute: a preempted request's KV is recomputed (swap is refused)",
    )
    for name, values, why in (
        ("--config-format", ("auto", "hf"), "the model's config.json is read (not params.json)"),
        (
            "--safetensors-load-strategy",
            ("lazy",),
            "safetensors files are memory-mapped and read as each weight loads",
        ),
        (
            "--prefix-caching-hash-algo",
            ("sha256",),
            "prefix-cache blocks are keyed by SHA-256 of their parent's key and tokens",
        ),
    ):
        flags.add_argument(
            name, type=one_of(values, why), default=None, help=f"{' or '.join(values)}: {why}"
        )
    flags.add_argument(
        "--use-tqdm-on-load",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no effect: loading logs its steps, without a progress bar",
    )
    flags.add_argument(
        "--mm-processor-cache-gb",
        type=non_negative,
        default=None,
        metavar="GIB",
        help="no effect: each request's images are processed for it (no processor cache)",
    )
    for name, why in (
        ("--skip-mm-profiling", "no start-up pass profiles image inputs"),
        ("--enable-server-load-tracking", "/load and /get_load always answer"),
        ("--log-error-stack", "an unexpected error is always logged with its traceback"),
        ("--disable-frontend-multiprocessing", "HTTP and the engine loop share one process"),
        ("--use-v2-block-manager", "Conveyor has one block manager"),
        ("--disable-cascade-attn", "attention reads shared prefixes in place, without cascades"),
        ("--kv-sharing-fast-prefill", "no layers share KV here"),
        ("--fully-sharded-loras", "adapters run on one device"),
    ):
        flags.add_argument(name, action="store_true", help=f"no effect: {why}")
    flags.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="no effect: adapters stay loaded until unloaded (--max-loras run in one step)",
    )
    flags.add_argument(
        "--mm-encoder-tp-mode",
        choices=["weights", "data"],
        default=None,
        help="no effect: an image encoder runs on one device",
    )
