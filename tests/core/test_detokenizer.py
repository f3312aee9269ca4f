from __future__ import annotations

import copy
import random

import pytest

from engine.core.detokenizer import (
    IncrementalDetokenizer,
    StopAutomaton,
    StopStringMatcher,
    automaton_for,
    plain_decode,
)
from tests.helpers import tiny_tokenizer

TEXTS = [
    "Hello world! How are you today?",
    "Café naïve jalapeño",
    "東京 and emoji 🚀 together",
    "🚀🚀 東京東京",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_deltas_rebuild_the_text_without_broken_characters(text):
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    # Byte-level BPE: a multi-byte character is split over several tokens.
    if any(ord(ch) > 127 for ch in text):
        assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    prompt = tokenizer.encode("Hello there.", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.add([token]) for token in ids]
    deltas.append(detokenizer.flush())
    assert all("\ufffd" not in delta for delta in deltas)
    assert "".join(deltas) == text


def test_flush_returns_an_incomplete_character_at_the_end():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(ids) > 1
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    assert detokenizer.add(ids[:1]) == ""
    assert detokenizer.flush() == tokenizer.decode(ids[:1])


def test_special_tokens_are_skipped_or_kept():
    tokenizer = tiny_tokenizer()
    eos = tokenizer.eos_token_id
    hidden = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    shown = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    ids = [*tokenizer.encode("Hello", add_special_tokens=False), eos]
    assert "".join(hidden.add([i]) for i in ids) == "Hello"
    assert "".join(shown.add([i]) for i in ids) == "Hello<eos>"


@pytest.mark.parametrize("skip", [True, False])
def test_plain_decode_is_the_tokenizers_decode(skip):
    tokenizer = tiny_tokenizer()
    decode = plain_decode(tokenizer)
    # The backend's own decode is taken: it is not the tokenizer's method.
    assert decode.__code__ is not plain_decode(_OnlyDecode(tokenizer)).__code__
    eos = tokenizer.eos_token_id
    for text in TEXTS:
        ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
        for end in range(1, len(ids) + 1):
            window = ids[max(0, end - 6) : end]
            assert decode(window, skip) == tokenizer.decode(window, skip_special_tokens=skip)


def test_plain_decode_keeps_the_tokenizers_decode_where_it_cleans_up_spaces():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.clean_up_tokenization_spaces = True
    calls = []
    tokenizer.decode = lambda ids, skip_special_tokens: calls.append(ids) or "x"
    assert plain_decode(tokenizer)([5, 6], True) == "x"
    assert calls == [[5, 6]]


class _OnlyDecode:
    """A tokenizer with nothing but `decode`."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens=True):
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def test_plain_decode_calls_decode_on_any_other_tokenizer():
    tokenizer = tiny_tokenizer()
    ids = tokenizer.encode("Hello world!", add_special_tokens=False)
    assert plain_decode(_OnlyDecode(tokenizer))(ids, True) == tokenizer.decode(ids)


def held(text: str, stops: tuple[str, ...]) -> int:
    """The longest suffix of `text` that is a proper prefix of some stop (brute force)."""
    return max(
        (
            size
            for stop in stops
            for size in range(1, min(len(stop) - 1, len(text)) + 1)
            if text.endswith(stop[:size])
        ),
        default=0,
    )


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop that starts first in `text`, the shortest of those (brute force)."""
    found = [(text.find(stop), len(stop), stop) for stop in stops if stop in text]
    return (min(found)[0], min(found)[2]) if found else None


@pytest.mark.parametrize("seed", range(40))
def test_the_automaton_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    alphabet = "abc"
    stops = tuple(
        {
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 6))
        }
    )
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
    pieces, start = [], 0
    while start < len(text):
        size = rng.randint(1, 4)
        pieces.append(text[start : start + size])
        start += size
    matcher = StopStringMatcher(stops)
    emitted, hit = feed_checked(matcher, pieces, stops)
    if hit is None:
        assert emitted + matcher.flush() == text


def feed_checked(
    matcher: StopStringMatcher, pieces: list[str], stops: tuple[str, ...]
) -> tuple[str, str | None]:
    """Feed `pieces` in turn; after each, what was emitted and any stop hit are what brute force
    says. Returns the text emitted and the stop hit (None if none)."""
    emitted, fed = "", ""
    for piece in pieces:
        fed += piece
        delta, hit = matcher.add(piece)
        emitted += delta
        expected = first_stop(fed, stops)
        if expected is not None:
            assert hit == expected[1] and emitted == fed[: expected[0]]
            return emitted, hit
        assert hit is None and emitted == fed[: len(fed) - held(fed, stops)]
    return emitted, None


def test_many_long_stop_strings_cost_time_in_the_text_not_the_stops():
    stops = tuple(f"{i:04d}" + "x" * 1020 for i in range(64))
    matcher = StopStringMatcher(stops)
    matcher.add("")
    calls = 0
    automaton = matcher._automaton
    assert automaton is not None
    original = automaton.step

    def counted(state, char):
        nonlocal calls
        calls += 1
        return original(state, char)

    automaton.step = counted
    for _ in range(200):
        matcher.add("ab")
    assert calls == 400  # one step a character, whatever the stops


def feed(matcher: StopStringMatcher, pieces: list[str]) -> tuple[list[str], str | None]:
    emitted = []
    for piece in pieces:
        delta, stop = matcher.add(piece)
        emitted.append(delta)
        if stop is not None:
            return emitted, stop
    emitted.append(matcher.flush())
    return emitted, None


def test_stop_string_split_across_pieces_is_found_and_removed():
    matcher = StopStringMatcher(("STOP",))
    emitted, stop = feed(matcher, ["Hello S", "T", "OP and more"])
    assert stop == "STOP"
    assert "".join(emitted) == "Hello "
    # While the stop could still be forming, nothing of it was emitted.
    assert emitted == ["Hello ", "", ""]


def test_held_text_is_released_when_the_stop_does_not_complete():
    matcher = StopStringMatcher(("STOP",))
    emitted, stop = feed(matcher, ["Hello S", "T", "ILL here"])
    assert stop is None
    assert emitted == ["Hello ", "", "STILL here", ""]


def test_stop_string_can_be_kept_in_the_output():
    matcher = StopStringMatcher(("\n\n",), include_stop=True)
    emitted, stop = feed(matcher, ["one\n", "\ntwo"])
    assert stop == "\n\n"
    assert "".join(emitted) == "one\n\n"


def test_earliest_of_several_stop_strings_wins():
    matcher = StopStringMatcher(("world", "lo w"))
    emitted, stop = feed(matcher, ["hello world"])
    assert stop == "lo w"
    assert "".join(emitted) == "hel"


def test_a_large_stop_set_builds_one_shared_automaton_and_still_matches():
    """Requests giving the same large set share one automaton, built once; each matcher keeps
    its own state over it."""
    stops = tuple(f"{i:04d}" + "x" * 1020 for i in range(8))
    assert automaton_for(stops) is automaton_for(stops)
    small = ("ab", "cd")
    assert automaton_for(small) is not automaton_for(small)
    first, second = StopStringMatcher(stops), StopStringMatcher(stops)
    assert first.add("hello 0003" + "x" * 500) == ("hello ", None)
    assert second.add("nothing here") == ("nothing here", None)
    emitted, hit = first.add("x" * 520 + " tail")
    assert (emitted, hit) == ("", stops[3])


@pytest.mark.parametrize("seed", range(20))
def test_one_lazily_built_automaton_serves_many_texts_as_brute_force_says(seed):
    """States and fail links are worked out as texts reach them: one automaton shared by many
    matchers, over stops that overlap themselves, finds what brute force finds in each text."""
    rng = random.Random(seed)
    stops = tuple({"".join(rng.choice("ab") for _ in range(rng.randint(1, 9))) for _ in range(12)})
    shared = StopAutomaton(stops)
    for _ in range(30):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 40)))
        matcher = StopStringMatcher(stops)
        matcher._automaton = shared
        feed_checked(matcher, list(text), stops)


def test_a_large_stop_set_costs_little_until_the_text_resembles_it():
    stops = tuple(f"{i:04d}" + "x" * 1020 for i in range(64))
    automaton = StopAutomaton(stops)
    matcher = StopStringMatcher(stops)
    matcher._automaton = automaton
    matcher.add("an answer that resembles none of them " * 20)
    assert len(automaton.depth) < 10  # states made, of the 65,000 an eager build makes
    emitted, hit = matcher.add("0042" + "x" * 1020)
    assert emitted == ""
    assert hit == stops[42]
    assert len(automaton.depth) < 1200
