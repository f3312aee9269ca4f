"""Logits processors a deployment might name with `--logits-processors` (imported by path in
the tests)."""

from __future__ import annotations

import torch

from engine.worker.logits_processors import Row


class BanToken:
    """Rows whose request passes `{"ban": id}` never get that token."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.calls = 0

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> None:
        self.calls += 1
        for index, row in enumerate(rows):
            banned = row.args.get("ban")
            if isinstance(banned, int) and 0 <= banned < self.vocab_size:
                logits[index, banned] = float("-inf")


class EchoLast:
    """Rows whose request passes `{"echo": true}` repeat their last token: a new tensor."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        pass

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        out = logits.clone()
        for index, row in enumerate(rows):
            if row.args.get("echo"):
                last = (row.output_token_ids or row.prompt_token_ids)[-1]
                out[index, last] = float("inf")
        return out


class Scale:
    """Halves every logit: the argmax stays where it was."""

    argmax_invariant = True

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.calls = 0

    def apply(self, logits: torch.Tensor, rows: list[Row]) -> None:
        self.calls += 1
        logits.mul_(0.5)


NOT_A_CLASS = 3
