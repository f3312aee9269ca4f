"""The calls of a required tool_choice read as they stream: each call's name first, then its
arguments in pieces, assembling to the same calls whatever the cuts."""

from __future__ import annotations

import json

import pytest

from server.call_array import CallArrayReader, assemble

OUTPUT = (
    '[{"name": "weather", "parameters": {"city": "Oslo, \\"N\\"", "unit": "c"}}, '
    '{"name": "time", "parameters": {"zone": [1, {"a": "}"}]}}]'
)
EXPECTED = [
    ("weather", {"city": 'Oslo, "N"', "unit": "c"}),
    ("time", {"zone": [1, {"a": "}"}]}),
]


def read(pieces: list[str]) -> list[dict]:
    reader = CallArrayReader()
    return [entry for piece in pieces for entry in reader.feed(piece)]


def named(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(OUTPUT)])
def test_any_cuts_assemble_the_same_calls(size):
    pieces = [OUTPUT[i : i + size] for i in range(0, len(OUTPUT), size)]
    entries = read(pieces)
    assert named(assemble(entries)) == EXPECTED
    firsts = [e for e in entries if "id" in e]
    assert [e["index"] for e in firsts] == [0, 1]
    assert all(e["id"].startswith("call_") and e["type"] == "function" for e in firsts)


def test_the_name_comes_before_any_arguments_and_arguments_stream():
    entries = read(list(OUTPUT))
    first_arguments = next(i for i, e in enumerate(entries) if "id" not in e)
    assert "id" in entries[0] and entries[0]["function"] == {"name": "weather", "arguments": ""}
    assert first_arguments == 1
    assert sum(1 for e in entries if e["index"] == 0 and "id" not in e) > 5


def test_blanks_around_the_arguments_are_dropped():
    text = '[ {"name" : "time" , "parameters" :  {"zone": 3}  } ]'
    calls = assemble(read(list(text)))
    assert [c["function"]["arguments"] for c in calls] == ['{"zone": 3}']


def test_arguments_before_the_name_wait_for_it():
    entries = read(['[{"parameters": {"zone": 3}, ', '"name": "time"}]'])
    assert named(assemble(entries)) == [("time", {"zone": 3})]


def test_an_output_cut_short_keeps_what_it_has():
    cut = OUTPUT.index('"unit": "c"') + len('"unit": "c')
    calls = assemble(read([OUTPUT[:cut]]))
    assert [c["function"]["name"] for c in calls] == ["weather"]
    assert calls[0]["function"]["arguments"] == '{"city": "Oslo, \\"N\\"", "unit": "c'
