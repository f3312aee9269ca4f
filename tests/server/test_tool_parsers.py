"""Reading Hermes-style tool calls out of free text, whole or arriving in pieces."""

from __future__ import annotations

import json

import pytest

from server.tool_parsers import HermesReader, parse_calls, parser_for, reader_for

CALL = '<tool_call>{"name": "time", "arguments": {"zone": 3}}</tool_call>'
CALL2 = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, None, [("time", {"zone": 3})]),
        (CALL + "\n" + CALL2, None, [("time", {"zone": 3}), ("weather", {"city": "Oslo"})]),
        ("Let me check. " + CALL, "Let me check. ", [("time", {"zone": 3})]),
        ("No tools needed.", "No tools needed.", []),
        ("<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ('<tool_call>{"zone": 3}</tool_call>', '<tool_call>{"zone": 3}</tool_call>', []),
        ("Cut short <tool_call>{", "Cut short <tool_call>{", []),
        ("a <tool but not a tag", "a <tool but not a tag", []),
    ],
    ids=[
        "one",
        "parallel",
        "text-then-call",
        "text",
        "malformed",
        "no-name",
        "unclosed",
        "lookalike",
    ],
)
def test_whole_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("hermes", text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in parsed_calls)


@pytest.mark.parametrize("text", ["Hi " + CALL + " bye " + CALL2, "x <tool y", CALL[:-3]])
def test_pieces_cut_anywhere_give_the_whole_outputs_reading(text: str) -> None:
    for size in (1, 2, 5, 13):
        reader = HermesReader()
        content, calls = "", []
        for start in range(0, len(text), size):
            piece, done = reader.feed(text[start : start + size])
            assert "<tool_call" not in piece or piece.startswith("<tool_call>{")  # no half tags
            content += piece
            calls += done
        content += reader.finish()[0]
        whole_content, whole_calls = parse_calls("hermes", text)
        assert (content if content.strip() else None) == whole_content
        assert names_and_arguments(calls) == names_and_arguments(whole_calls)


def test_a_partial_tag_is_held_back_until_it_is_known() -> None:
    reader = HermesReader()
    assert reader.feed("Checking <tool")[0] == "Checking "
    assert reader.feed("box>")[0] == "<toolbox>"


def test_the_parser_comes_from_the_flag_or_the_template() -> None:
    assert parser_for("hermes", None) == "hermes"
    assert parser_for(None, "{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_for(None, "{{ messages }}") is None


LLAMA_CALL = '{"name": "time", "parameters": {"zone": 3}}'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (LLAMA_CALL, None, [("time", {"zone": 3})]),
        ("<|python_tag|>" + LLAMA_CALL, None, [("time", {"zone": 3})]),
        (
            LLAMA_CALL + "; " + '{"name": "weather", "parameters": {"city": "Oslo"}}',
            None,
            [("time", {"zone": 3}), ("weather", {"city": "Oslo"})],
        ),
        ("It is sunny.", "It is sunny.", []),
        ('{"name": "time", "parameters": {"zone"', '{"name": "time", "parameters": {"zone"', []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    ids=["one", "python-tag", "parallel", "text", "cut-short", "not-a-call"],
)
def test_llama3_json_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("llama3_json", text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


def test_llama3_json_streams_text_and_holds_a_call_until_the_end() -> None:
    reader = reader_for("llama3_json")
    assert reader.feed("It is ") == ("It is ", [])
    assert reader.feed("sunny.") == ("sunny.", [])
    holding = reader_for("llama3_json")
    assert holding.feed(" <|python") == ("", [])
    assert holding.feed('_tag|>{"name": "time", "parameters": {}}') == ("", [])
    content, calls = holding.finish()
    assert content == "" and names_and_arguments(calls) == [("time", {})]
    assert parser_for(None, "{{ '<|python_tag|>' }}") == "llama3_json"
