"""Incremental, UTF-8 safe detokenization with stop strings.

Tokens are decoded in a short sliding window: the text of `tokens[prefix:read]` is compared with
that of `tokens[prefix:]`, and only the difference is emitted, never while it ends in the
replacement character (a multi-byte character still incomplete). Text that could be the start of
a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


Decode = Callable[[list[int], bool], str]


def plain_decode(tokenizer: Tokenizer) -> Decode:
    """`tokenizer.decode` as a function of (ids, skip_special_tokens); where that is the Rust
    backend's decode and nothing more (a Hugging Face fast tokenizer that neither overrides
    decoding nor cleans up spaces), the backend's own, about a third of the cost per call."""
    backend = _plain_backend(tokenizer)
    if backend is not None:
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


def _plain_backend(tokenizer: Any) -> Any | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    kind = type(tokenizer)
    if (
        kind.decode is not PreTrainedTokenizerBase.decode
        or kind._decode is not TokenizersBackend._decode
    ):
        return None
    return backend


def wrote(
    markers: tuple[str, ...], output_token_ids: list[int], decode: Callable[[list[int]], str]
) -> bool:
    """Whether the newest token completed one of `markers` (asked after every token, so the
    first yes is that token's). Each token spells at least one character, so a marker lies
    within the text of its length's worth of last tokens; a token may also carry text past it
    (`</think>` merged with a newline)."""
    longest = max(map(len, markers))
    text = decode(output_token_ids[-longest:])
    return any(marker in text for marker in markers)


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas that never split a character."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self._decode_ids = plain_decode(tokenizer)
        self._skip_special = skip_special_tokens
        # A little prompt context makes the first output token decode with its leading space.
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        self._tokens: list[int] = list(context)
        self._prefix = 0
        self._read = len(context)

    def _decode(self, tokens: list[int]) -> str:
        return self._decode_ids(tokens, self._skip_special)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text that is now complete."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever text is still held back, complete or not (the sequence ended)."""
        prefix_text = self._decode(self._tokens[self._prefix : self._read])
        full_text = self._decode(self._tokens[self._prefix :])
        self._prefix = self._read = len(self._tokens)
        return full_text[len(prefix_text) :]


class StopAutomaton:
    """The stop strings as one Aho-Corasick automaton over characters: fed text a character at a
    time, its state is the longest suffix of the text so far that begins some stop string, so
    every stop ending at a character is found, and what may still become one is known, in time
    that grows with the text fed, not with the number or length of the stop strings.

    Built lazily: a state (a trie node) exists once the text reaches it, found by binary search
    in the sorted stops, and its fail link and transitions are worked out on first use. Text
    that never resembles a stop touches a handful of states, so 64 stops of 1,024 characters
    cost almost nothing until the output spells one (an eager build took about 75 ms and 18 MB).
    A state is handed out only once "settled": its fail link, and every fail link along its fail
    chain and of its ancestors, is known, so a transition never needs more than settled links
    and no computation recurses."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._sorted = sorted(set(stops))
        self._index: dict[str, int] = {}
        for index, stop in enumerate(stops):
            self._index.setdefault(stop, index)
        # Per state: the stops it prefixes are _sorted[lo:hi]; its depth, parent and last char.
        self._lo, self._hi = [0], [len(self._sorted)]
        self.depth = [0]
        self._parent, self._char = [0], [""]
        self._kids: list[dict[str, int]] = [{}]  # child per char, -1 for none
        self._moves: list[dict[str, int]] = [{}]  # full transitions, fail links followed
        self.fail = [0]  # -1 until settled
        # The longest stop ending at each settled state (an index into the stops, -1 for none).
        self.longest = [self._spelled(0)]

    def step(self, state: int, char: str) -> int:
        """The state after `char` from a settled state; the result is settled."""
        target = self._moves[state].get(char)
        if target is None:
            target = self._move(state, char)
        if self.fail[target] < 0:
            self._settle(target)
        return target

    def _spelled(self, state: int) -> int:
        first = self._sorted[self._lo[state]] if self._lo[state] < self._hi[state] else None
        return self._index[first] if first is not None and len(first) == self.depth[state] else -1

    def _child(self, state: int, char: str) -> int:
        known = self._kids[state].get(char)
        if known is not None:
            return known
        depth, lo, hi = self.depth[state], self._lo[state], self._hi[state]
        if lo < hi and len(self._sorted[lo]) == depth:
            lo += 1  # the stop this state spells has no next character
        start = bisect_left(self._sorted, char, lo, hi, key=lambda stop: stop[depth])
        end = bisect_right(self._sorted, char, start, hi, key=lambda stop: stop[depth])
        child = -1
        if start < end:
            child = len(self.depth)
            self._lo.append(start)
            self._hi.append(end)
            self.depth.append(depth + 1)
            self._parent.append(state)
            self._char.append(char)
            self._kids.append({})
            self._moves.append({})
            self.fail.append(-1)
            self.longest.append(-1)
        self._kids[state][char] = child
        return child

    def _move(self, state: int, char: str) -> int:
        """The transition from a settled state: its child on `char`, else its fail state's."""
        chain, node = [], state
        while True:
            known = self._moves[node].get(char)
            if known is not None:
                target = known
                break
            chain.append(node)
            child = self._child(node, char)
            if child >= 0 or node == 0:
                target = max(child, 0)
                break
            node = self.fail[node]
        for node in chain:
            self._moves[node][char] = target
        return target

    def _settle(self, state: int) -> None:
        path = []
        while self.fail[state] < 0:  # the root is settled
            path.append(state)
            state = self._parent[state]
        for node in reversed(path):  # shallowest first: each one's parent is settled
            self._settle_below_settled(node)

    def _settle_below_settled(self, state: int) -> None:
        # A fail link is the move from the parent's fail state, whose chain is settled; the state
        # it lands on is a child of a settled state, so it settles the same way, shallower.
        pending = [state]
        while pending:
            node = pending[-1]
            if self.fail[node] >= 0:
                pending.pop()
                continue
            parent = self._parent[node]
            target = 0 if parent == 0 else self._move(self.fail[parent], self._char[node])
            if target != 0 and self.fail[target] < 0:
                pending.append(target)
                continue
            self.fail[node] = target
            spelled = self._spelled(node)
            self.longest[node] = spelled if spelled >= 0 else self.longest[target]
            pending.pop()


# Stop-string sets whose automaton is worth sharing between requests that give the same set
# (an evaluation harness sends one set thousands of times): 64 stops of 1024 characters take
# about 75 ms and 18 MB to build.
LARGE_STOP_CHARS = 4096


@lru_cache(maxsize=16)
def stop_automaton(stops: tuple[str, ...]) -> StopAutomaton:
    """The automaton of `stops`, shared (it is never changed once built)."""
    return StopAutomaton(stops)


def automaton_for(stops: tuple[str, ...]) -> StopAutomaton:
    """A shared automaton for a large set, a fresh one for a small set (cheap to build)."""
    if sum(len(stop) for stop in stops) >= LARGE_STOP_CHARS:
        return stop_automaton(stops)
    return StopAutomaton(stops)


class StopStringMatcher:
    """Accumulates output text, finds stop strings across token boundaries, and says what is
    safe to emit. Of several stops, the one that starts first wins (of those, the shortest)."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = stops
        # Built at the first text, on the thread that steps the engine, not where requests
        # arrive: 64 stops of 1024 characters take tens of milliseconds.
        self._automaton: StopAutomaton | None = None
        self._state = 0
        self._include = include_stop
        self.text = ""
        self._emitted = 0

    def add(self, piece: str) -> tuple[str, str | None]:
        """Add decoded text; return (text safe to emit now, the stop string hit or None)."""
        start = len(self.text)
        self.text += piece
        if not self._stops:
            return self._emit(len(self.text)), None
        if self._automaton is None:
            self._automaton = automaton_for(self._stops)
        hit = self._feed(start)
        if hit is not None:
            begin, stop = hit
            self.text = self.text[: begin + len(stop) if self._include else begin]
            return self._emit(len(self.text)), stop
        held = self._automaton.depth[self._state] if self._automaton else 0
        return self._emit(len(self.text) - held), None

    def _feed(self, start: int) -> tuple[int, str] | None:
        """Run the automaton over the text from `start`: the stop that starts first among those
        ending in it."""
        automaton, best = self._automaton, None
        assert automaton is not None
        for position in range(start, len(self.text)):
            self._state = automaton.step(self._state, self.text[position])
            index = automaton.longest[self._state]
            if index >= 0:
                stop = self._stops[index]
                begin = position + 1 - len(stop)
                if best is None or begin < best[0]:
                    best = (begin, stop)
        return best

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta
