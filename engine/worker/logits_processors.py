"""Logits processors of a deployment's own (`--logits-processors`, vLLM's flag naming classes by
import path): each sees every sampled row's logits before Conveyor's own rules, and may change
them in place (or return new ones).

A processor is a class built once with the vocabulary's size and the device:

    class NoDigits:
        def __init__(self, vocab_size: int, device: torch.device) -> None: ...

        def apply(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor | None:
            for index, row in enumerate(rows):
                if row.args.get("no_digits"):
                    logits[index, DIGITS] = float("-inf")

`rows[i]` describes row i of `logits` (`[rows, vocab]`, fp32): the request's prompt and output
token ids so far and its own arguments (`vllm_xargs`, as vLLM's requests pass them). A
processor that leaves every row's argmax where it was says so (`argmax_invariant = True`), and
greedy rows may then be chosen inside the model as before; otherwise every row's logits come
out of the model to be processed. Conveyor's rules (output formats, allowed tokens, bad words,
biases, penalties, `min_tokens`) apply after, so a processor cannot let a format's ruled-out
token through.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class Row:
    """What a processor knows of a row's request."""

    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    args: Mapping[str, Any]


class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor | None: ...


def load_processors(
    paths: Sequence[str], vocab_size: int, device: torch.device
) -> list[LogitsProcessor]:
    """Each class `paths` name (`package.module.Class` or `package.module:Class`), built."""
    return [_build(path, vocab_size, device) for path in paths]


def _build(path: str, vocab_size: int, device: torch.device) -> LogitsProcessor:
    module_name, _, name = path.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"--logits-processors {path!r}: give it as package.module.Class")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--logits-processors {path!r}: {exc}") from exc
    if not isinstance(found, type) or not callable(getattr(found, "apply", None)):
        raise ValueError(f"--logits-processors {path!r}: not a class with an apply method")
    return found(vocab_size, device)


def keeps_argmax(processors: Sequence[LogitsProcessor]) -> bool:
    """Whether every processor leaves each row's argmax where it was."""
    return all(getattr(processor, "argmax_invariant", False) for processor in processors)


def apply_processors(
    processors: Sequence[LogitsProcessor], logits: torch.Tensor, requests: list[Request]
) -> torch.Tensor:
    rows = [
        Row(r.prompt_token_ids, r.output_token_ids, r.sampling_params.extra_args or {})
        for r in requests
    ]
    for processor in processors:
        changed = processor.apply(logits, rows)
        if changed is not None:
            logits = changed
    return logits
