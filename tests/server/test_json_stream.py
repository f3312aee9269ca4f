"""JSON written again a character at a time: whole, it is `json.dumps` of what `json.loads`
reads; cut anywhere, what it wrote is where the whole begins; text that is not JSON stops it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.json_stream import JsonWriter

TEXTS = ["", "Oslo", 'say "hi"\n', "back\\slash/", "tab\there", "é ü 北京 😀", "\x01\x7f"]


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice(TEXTS) + rng.choice(TEXTS)
    if kind == 1:
        return rng.choice([0, -7, 12345678901234567890, 2.5, -0.125, 1e-7, 3e21])
    if kind == 2:
        return rng.choice([True, False, None])
    if kind in (3, 4):
        return rng.choice(TEXTS)
    if kind == 5:
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {
        f"k{i}{rng.choice(TEXTS)}": random_value(rng, depth + 1) for i in range(rng.randrange(4))
    }


def written_as(rng: random.Random, value: Any) -> str:
    """`value` as a model might write it: any spacing, escapes or none."""
    indent = rng.choice([None, 0, 2])
    separators = rng.choice([(",", ":"), (", ", ": "), (" ,", " : ")])
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=indent, separators=separators)


def rewrite(text: str) -> tuple[str, JsonWriter]:
    writer, out = JsonWriter(), []
    for char in text:
        written, took = writer.push(char)
        out.append(written)
        if not took:
            break
    out.append(writer.finish())
    return "".join(out), writer


@pytest.mark.parametrize("seed", range(40))
def test_whole_values_are_written_as_json_dumps_writes_them(seed: int) -> None:
    rng = random.Random(seed)
    value = random_value(rng)
    text = written_as(rng, value)
    written, writer = rewrite(text)
    assert writer.done
    assert written == json.dumps(json.loads(text))


@pytest.mark.parametrize("seed", range(40))
def test_what_a_cut_value_wrote_begins_the_whole(seed: int) -> None:
    rng = random.Random(seed)
    text = written_as(rng, {"a": random_value(rng), "b": [random_value(rng)]})
    whole = json.dumps(json.loads(text))
    for cut in sorted(rng.sample(range(len(text)), min(12, len(text)))):
        writer, out = JsonWriter(), []
        for char in text[:cut]:
            out.append(writer.push(char)[0])
        assert whole.startswith("".join(out))
        assert not writer.done and not writer.failed


def test_escapes_are_decoded_and_written_as_json_dumps_writes_them() -> None:
    text = r'{"a\u00e9": "\ud83d\ude00 \/ \" \\ \n \u0041"}'
    assert rewrite(text)[0] == json.dumps(json.loads(text))


def test_a_value_at_the_top_ends_where_it_ends() -> None:
    # A number ends at the first character that is not its own, which is left to the caller.
    writer = JsonWriter()
    assert [writer.push(c) for c in "12}"] == [("", True), ("", True), ("12", False)]
    assert writer.done
    assert rewrite('"x"}')[0] == '"x"'
    assert rewrite("[1] tail")[0] == "[1]"
    assert rewrite("7")[0] == "7"  # a number the text ends on


@pytest.mark.parametrize(
    "text", ['{"a" 1}', "{a: 1}", "[1,,]", '{"a": tru}', '"\\x"', "]", '{"a": 01}', "[1 2]"]
)
def test_text_that_is_not_json_stops_the_writer(text: str) -> None:
    assert rewrite(text)[1].failed


def test_nesting_deeper_than_the_reader_allows_stops_the_writer() -> None:
    assert rewrite("[" * 300)[1].failed
    assert rewrite("[" * 100 + "]" * 100)[1].done
