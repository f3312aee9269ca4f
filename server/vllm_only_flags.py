"""vLLM serve flags that command lines copied from vLLM's recipes carry and that have nothing to
set here: accepted where what they ask for is what Conveyor does anyway, refused with the reason
where it is not (another value than Conveyor's only one), so a copied command line either serves
as it would under vLLM or says what it cannot have."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

# The executor backends whose ranks are local worker processes, as Conveyor's are.
LOCAL_EXECUTORS = ("mp", "uni")


def only_one(reason: str) -> Callable[[str], int]:
    """An integer flag whose only value here is 1."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value != 1:
            raise argparse.ArgumentTypeError(f"only 1 is served: {reason}")
        return value

    return parse


def non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
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


def backend(text: str) -> str:
    if text not in BACKENDS:
        raise argparse.ArgumentTypeError(f"not a structured-output backend: {text!r}")
    return text


def backend_config(text: str) -> dict:
    """`--structured-outputs-config`'s JSON object; only its `backend` is read."""
    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not a JSON object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("not a JSON object")
    if "backend" in value:
        backend(str(value["backend"]))
    return value


def add_vllm_only_flags(parser: argparse.ArgumentParser) -> None:
    flags = parser.add_argument_group(
        "vLLM flags with nothing to set here (accepted where their value is Conveyor's own)"
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
        type=only_one(
            "for data parallelism run one server per device behind a router (the README's "
            "Scaling out section)"
        ),
        default=1,
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
        help="accepted: structured outputs are always compiled by llguidance (vLLM's guidance "
        "backend), whichever backend is named",
    )
    flags.add_argument(
        "--structured-outputs-config",
        type=backend_config,
        default=None,
        help="accepted as --guided-decoding-backend (its backend)",
    )
