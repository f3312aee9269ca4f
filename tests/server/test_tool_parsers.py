"""Reading Hermes-style tool calls out of free text, whole or arriving in pieces."""

from __future__ import annotations

import pytest

from server.call_array import assemble
from server.tool_parsers import parse_calls, parser_for, reader_for
from tests.server.call_reading import names_and_arguments, read_in_pieces

CALL = '<tool_call>{"name": "time", "arguments": {"zone": 3}}</tool_call>'
CALL2 = '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'


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
        reader = reader_for("hermes")
        content, entries = "", []
        for start in range(0, len(text), size):
            piece, more = reader.feed(text[start : start + size])
            assert "<tool_call" not in piece or piece.startswith("<tool_call>{")  # no half tags
            content += piece
            entries += more
        rest, more = reader.finish()
        content, calls = content + rest, assemble(entries + more)
        whole_content, whole_calls = parse_calls("hermes", text)
        assert (content if content.strip() else None) == whole_content
        assert names_and_arguments(calls) == names_and_arguments(whole_calls)


def test_a_partial_tag_is_held_back_until_it_is_known() -> None:
    reader = reader_for("hermes")
    assert reader.feed("Checking <tool")[0] == "Checking "
    assert reader.feed("box>")[0] == "<toolbox>"


def test_the_parser_comes_from_the_flag_or_the_template() -> None:
    assert parser_for("hermes", None) == "hermes"
    assert parser_for("qwen3_xml", None) == "qwen3_coder"  # vLLM's other names
    assert parser_for("llama4_pythonic", "<tool_call>") == "pythonic"
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
        ('{"name": "time", "parameters"', '{"name": "time", "parameters"', []),
        ('{"answer": 42}', '{"answer": 42}', []),
    ],
    ids=["one", "python-tag", "parallel", "text", "cut-short", "not-a-call"],
)
def test_llama3_json_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("llama3_json", text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


def test_llama3_json_streams_text_or_holds_the_reply_and_streams_its_calls() -> None:
    reader = reader_for("llama3_json")
    assert reader.feed("It is ") == ("It is ", [])
    assert reader.feed("sunny.") == ("sunny.", [])
    holding = reader_for("llama3_json")
    assert holding.feed(" <|python") == ("", [])
    content, [entry] = holding.feed('_tag|>{"name": "time", "parameters": {}}')
    assert content == "" and entry["function"] == {"name": "time", "arguments": "{}"}
    assert holding.finish() == ("", [])
    assert parser_for(None, "{{ '<|python_tag|>' }}") == "llama3_json"


SCHEMAS = {
    "time": {"type": "object", "properties": {"zone": {"type": "integer"}}},
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
    },
}
CODER_CALL = (
    "<tool_call>\n<function=weather>\n<parameter=city>\n42\n</parameter>\n"
    "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call>"
)
CODER_TIME = (
    "<tool_call>\n<function=time>\n<parameter=zone>\n-3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        # The schema says city is a string: "42" stays text; days is an array.
        (CODER_CALL, None, [("weather", {"city": "42", "days": [1, 2]})]),
        (
            "Two calls. " + CODER_CALL + "\n" + CODER_TIME,
            "Two calls. \n",
            [("weather", {"city": "42", "days": [1, 2]}), ("time", {"zone": -3})],
        ),
        (
            "<tool_call>\n<function=ping>\n</function>\n</tool_call>",
            None,
            [("ping", {})],
        ),
        ("No call here.", "No call here.", []),
    ],
    ids=["typed", "text-and-two", "no-parameters", "text"],
)
def test_qwen3_coder_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("qwen3_coder", text, SCHEMAS)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


PYTHONIC = '[time(zone=3), weather(city="Oslo", days=[1, 2])]'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (PYTHONIC, None, [("time", {"zone": 3}), ("weather", {"city": "Oslo", "days": [1, 2]})]),
        ("<|python_start|>[ping()]<|python_end|>", None, [("ping", {})]),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        ("[time(3)]", "[time(3)]", []),  # positional arguments have no names
        ("[time(zone=os.sep)]", "[time(zone=os.sep)]", []),  # not a literal
        ("Sunny today.", "Sunny today.", []),
    ],
    ids=["two", "tags", "not-calls", "positional", "not-literal", "text"],
)
def test_pythonic_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("pythonic", text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (
            'Sure.[TOOL_CALLS][{"name": "time", "arguments": {"zone": 3}}]',
            "Sure.",
            [("time", {"zone": 3})],
        ),
        (
            '[TOOL_CALLS]time[ARGS]{"zone": 3}[TOOL_CALLS]weather[ARGS]{"city": "Oslo"}',
            None,
            [("time", {"zone": 3}), ("weather", {"city": "Oslo"})],
        ),
        ('[TOOL_CALLS]time{"zone": 1}', None, [("time", {"zone": 1})]),
        ("[TOOL_CALLS]not calls", "[TOOL_CALLS]not calls", []),
        ("[TOOL nothing", "[TOOL nothing", []),
    ],
    ids=["json-list", "args-form", "bare-form", "malformed", "lookalike"],
)
def test_mistral_outputs(text: str, content: str | None, calls: list) -> None:
    parsed_content, parsed_calls = parse_calls("mistral", text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("qwen3_coder", "Hi " + CODER_CALL + " and " + CODER_TIME),
        ("pythonic", PYTHONIC),
        ("pythonic", "Just text [not a call"),
        ("mistral", 'Let me see.[TOOL_CALLS]time[ARGS]{"zone": 3}'),
        ("mistral", "[TOOL_CALL but no"),
    ],
)
def test_every_parser_reads_pieces_cut_anywhere_as_the_whole(parser: str, text: str) -> None:
    whole_content, whole_calls = parse_calls(parser, text, SCHEMAS)
    for size in (1, 3, 7):
        content, calls = read_in_pieces(parser, text, size, SCHEMAS)
        assert content == whole_content
        assert names_and_arguments(calls) == names_and_arguments(whole_calls)


def test_the_template_shows_qwen3_coder_and_mistral_formats() -> None:
    coder = "<tool_call>\n<function={{ name }}>\n<parameter={{ key }}>\n</tool_call>"
    assert parser_for(None, coder) == "qwen3_coder"
    assert parser_for(None, "{{ '[TOOL_CALLS]' }}") == "mistral"


GRANITE_CALLS = '[{"name": "time", "arguments": {"zone": 3}}, {"name": "weather", "arguments": {}}]'
TWO = [("time", {"zone": 3}), ("weather", {})]


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("granite", "<|tool_call|>" + GRANITE_CALLS, None, TWO),
        ("granite", "<tool_call>" + GRANITE_CALLS, None, TWO),
        ("granite", " " + GRANITE_CALLS, None, TWO),
        ("granite", "It is sunny.", "It is sunny.", []),
        ("granite", "<|tool_call|>[{\"name\": ", "<|tool_call|>[{\"name\": ", []),
        ("granite", "[1, 2]", "[1, 2]", []),
        ("phi4_mini_json", "functools" + GRANITE_CALLS, None, TWO),
        ("phi4_mini_json", "functools[]", "functools[]", []),
        ("phi4_mini_json", "Use functools[...] here.", "Use functools[...] here.", []),
    ],
    ids=["granite-3.0", "granite-3.1", "granite-bare", "granite-text", "granite-cut-short",
         "granite-not-calls", "phi4", "phi4-empty", "phi4-text"],
)  # fmt: skip
def test_granite_and_phi4_mini_outputs(parser, text, content, calls) -> None:
    parsed_content, parsed_calls = parse_calls(parser, text)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls


@pytest.mark.parametrize("parser", ["granite", "phi4_mini_json"])
def test_whole_reply_calls_stream_while_the_reply_is_held(parser) -> None:
    opener = "<|tool_call|>" if parser == "granite" else "functools"
    reader = reader_for(parser)
    pieces = [opener[:4], opener[4:] + GRANITE_CALLS[:9], GRANITE_CALLS[9:]]
    fed = [reader.feed(piece) for piece in pieces]
    assert [content for content, _ in fed] == ["", "", ""]
    # The calls stream as they are written while the reply is held.
    assert fed[0][1] == fed[1][1] == [] and fed[2][1]
    content, more = reader.finish()
    calls = assemble(fed[2][1] + more)
    assert content == "" and [c["function"]["name"] for c in calls] == ["time", "weather"]
    text = reader_for(parser)
    assert text.feed("Sunny ") == ("Sunny ", []) and text.feed("today.") == ("today.", [])


@pytest.mark.parametrize("size", [1, 3, 9, 100])
def test_a_reply_that_begins_like_calls_and_is_not_stays_text_in_any_pieces(size) -> None:
    text = 'functools, {"name": "time", "arguments": {}} and so on.'
    assert read_in_pieces("phi4_mini_json", text, size) == (text, [])
    assert parse_calls("phi4_mini_json", text) == (text, [])


def test_granite_and_phi4_templates_name_their_parsers() -> None:
    granite = "{%- if tools %}<|start_of_role|>available_tools<|end_of_role|>{%- endif %}"
    granite += "{{- '<|tool_call|>' + message.tool_calls | tojson }}"
    assert parser_for(None, granite) == "granite"
    phi4 = "{{ '<|system|>' + message['content'] + '<|tool|>' + message['tools'] + '<|/tool|>' }}"
    assert parser_for(None, phi4) == "phi4_mini_json"


DEEP = "[" * 3000 + "]" * 3000


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", f"<tool_call>{DEEP}</tool_call>"),
        ("llama3_json", '{"name": "f", "parameters": ' + DEEP + "}"),
        ("mistral", f"[TOOL_CALLS]{DEEP}"),
        ("granite", f"<|tool_call|>{DEEP}"),
        ("phi4_mini_json", f"functools{DEEP}"),
        ("pythonic", DEEP),
    ],
)
def test_a_reply_nested_past_reading_is_no_call(parser: str, text: str) -> None:
    """A model led to write thousands of brackets gets no call from them, not an error."""
    assert parse_calls(parser, text)[1] == []


def test_json_text_counts_only_the_brackets_outside_strings() -> None:
    from server.json_text import MAX_DEPTH, loads

    assert loads('{"a": "' + "[" * 5000 + '"}') == {"a": "[" * 5000}
    assert loads("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    with pytest.raises(ValueError, match="nested deeper"):
        loads("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
