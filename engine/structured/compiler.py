"""Compiles output formats into llguidance matchers against the model's tokenizer, once per
format: a request gets a copy of the compiled matcher, so repeated schemas cost a copy.

Compiling can take a while for a large schema, so the server compiles before it queues a
request (`AsyncEngine.prepare`, off the event loop and off the step's thread); the engine core
then only copies."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Any

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import StructuredOutputs
from engine.structured.grammar import grammar_of

# Compiled formats kept; the least recently used goes first.
CACHE_SIZE = 512


class GrammarCompiler:
    """Compiled matchers by format, for one tokenizer and a vocabulary of `vocab_size` (the
    model's logits, which may be wider than the tokenizer's own)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: frozenset[int],
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        # Seconds each compile took, until the engine's stats take them.
        self._compile_times: deque[float] = deque()
        self._tokenizer: Any = None
        self._special: dict[str, int] | None = None
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """How many compiled formats are held."""
        return len(self._compiled)

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher for `spec` at its start (compiled now if it was not before)."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled matcher of `spec`, from the cache or compiled now; raises
        `InvalidRequestError` naming the request's field for a format that does not compile."""
        key = (spec.kind, spec.spec)  # the same format from any request field
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        started = time.perf_counter()
        compiled = self._compile(spec)
        self._compile_times.append(time.perf_counter() - started)
        with self._lock:
            self._compiled[key] = compiled
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputs) -> Any:
        from llguidance import LLMatcher

        # The matcher compiles the grammar and holds its error, if any: no separate validation.
        matcher = LLMatcher(self.tokenizer(), grammar_of(spec, self.special_tokens()), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"Invalid {spec.param}: {matcher.get_error()}", param=spec.param
            )
        return matcher

    def take_compile_times(self) -> list[float]:
        """The compile times recorded since the last call."""
        times = []
        while self._compile_times:
            times.append(self._compile_times.popleft())
        return times

    def special_tokens(self) -> dict[str, int]:
        """The tokens llguidance holds apart from text, by their text: every token added to
        the vocabulary (Qwen's `<tool_call>` and `<think>` as much as its `<|im_end|>`), which
        no string in a grammar spells."""
        if self._special is None:
            added = getattr(self._hf_tokenizer, "added_tokens_decoder", {})
            tokenizer = self.tokenizer()
            self._special = {
                token.content: i
                for i, token in added.items()
                if i < self.vocab_size and tokenizer.is_special_token(i)
            }
        return self._special

    def tokenizer(self) -> Any:
        """llguidance's view of the model's tokenizer, made on first use (about a second for a
        vocabulary of 50K tokens)."""
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer

                self._tokenizer = from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer
