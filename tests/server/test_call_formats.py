"""The call formats of GLM, Kimi K2, DeepSeek, MiniMax, Seed-OSS, Hunyuan, Jamba, InternLM,
LongCat, OLMo 3 and xLAM read out of replies, whole or arriving in pieces; the parser a chat
template's tags show; which parsers keep special tokens in a reply's text; and every parser on
random replies."""

from __future__ import annotations

import copy
import json
import random

import pytest

from server.json_stream import JsonWriter
from server.tool_parsers import PARSERS, keeps_special_tokens, parse_calls, parser_for
from tests.helpers import tiny_tokenizer
from tests.server.call_reading import names_and_arguments, read_in_pieces

SCHEMAS = {
    "time": {"type": "object", "properties": {"zone": {"type": "integer"}}},
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
    },
}
TIME = ("time", {"zone": 3})
OSLO = ("weather", {"city": "Oslo"})

GLM = (
    "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>[1]</arg_value>\n</tool_call>"
)
KIMI = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.time:0<|tool_call_argument_begin|>"
    '{"zone": 3}<|tool_call_end|><|tool_call_begin|>functions.weather:1'
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_calls_section_end|>'
)
DEEPSEEK_V3 = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>time\n```json\n"
    '{"zone": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DEEPSEEK_V31 = (
    '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>time<｜tool▁sep｜>{"zone": 3}<｜tool▁call▁end｜>'
    '<｜tool▁call▁begin｜>weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
    "<｜tool▁calls▁end｜>"
)
MINIMAX_M2 = (
    '<minimax:tool_call>\n<invoke name="time">\n<parameter name="zone">3</parameter>\n'
    '</invoke>\n<invoke name="weather">\n<parameter name="city">Oslo</parameter>\n</invoke>\n'
    "</minimax:tool_call>"
)
DSML = (
    '<｜DSML｜function_calls>\n<｜DSML｜invoke name="weather">\n<｜DSML｜parameter name="city" '
    'string="true">42</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">[1]'
    '</｜DSML｜parameter>\n</｜DSML｜invoke>\n<｜DSML｜invoke name="time">\n{"zone": 3}\n'
    "</｜DSML｜invoke>\n</｜DSML｜function_calls>"
)
SEED = (
    "<seed:tool_call>\n<function=weather>\n<parameter=city>\n42\n</parameter>\n</function>\n"
    "</seed:tool_call>"
)
TOOL_CALLS_LIST = '<tool_calls>[{"name": "time", "arguments": {"zone": 3}}]</tool_calls>'
TOOL_CALLS_LINES = (
    '<tool_calls>\n{"name": "time", "arguments": {"zone": 3}}\n'
    '{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_calls>'
)
INTERNLM = '<|action_start|><|plugin|>\n{"name": "time", "parameters": {"zone": 3}}<|action_end|>'
LONGCAT = '<longcat_tool_call>{"name": "time", "arguments": {"zone": 3}}</longcat_tool_call>'
OLMO3 = (
    '<function_calls>\ntime(zone=3)\nweather(city="Oslo", days=[1], exact=true)\n</function_calls>'
)
XLAM = (
    '[{"name": "time", "arguments": {"zone": 3}}, '
    '{"name": "weather", "arguments": {"city": "Oslo"}}]'
)
GLM_TIME = "<tool_call>time<arg_key>zone</arg_key><arg_value>3</arg_value></tool_call>"
KIMI_UNNUMBERED = (
    "<|tool_calls_section_begin|><|tool_call_begin|>time<|tool_call_argument_begin|>{}"
    "<|tool_call_end|><|tool_calls_section_end|>"
)

GEMMA4 = (
    '<|tool_call>call:weather{city:<|"|>Oslo<|"|>,days:[1]}<tool_call|>'
    "<|tool_call>call:time{zone:3}<tool_call|>"
)
FUNCTIONGEMMA = "<start_function_call>call:weather{city:<escape>Oslo<escape>}<end_function_call>"
STEP3 = (
    "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
    '<steptml:invoke name="weather"><steptml:parameter name="city">Oslo</steptml:parameter>'
    "</steptml:invoke><｜tool_call_end｜><｜tool_call_begin｜>function<｜tool_sep｜>"
    '<steptml:invoke name="time"><steptml:parameter name="zone">3</steptml:parameter>'
    "</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>"
)
APERTUS = '<|tools_prefix|>[{"weather": {"city": "Oslo"}}, {"time": {"zone": 3}}]<|tools_suffix|>'
LFM2 = '<|tool_call_start|>[time(zone=3), weather(city="Oslo")]<|tool_call_end|>'

CALLS = [
    ("glm45", "Let me look. " + GLM, "Let me look. ", [("weather", {"city": "42", "days": [1]})]),
    ("glm47", GLM_TIME, None, [TIME]),
    ("glm45", "<tool_call>ping\n</tool_call>", None, [("ping", {})]),
    ("kimi_k2", "Checking." + KIMI, "Checking.", [TIME, OSLO]),
    ("deepseek_v3", DEEPSEEK_V3, None, [TIME]),
    ("deepseek_v31", "Sure. " + DEEPSEEK_V31, "Sure. ", [TIME, OSLO]),
    ("minimax_m2", MINIMAX_M2, None, [TIME, OSLO]),
    ("deepseek_v32", "Sure. " + DSML, "Sure. ", [("weather", {"city": "42", "days": [1]}), TIME]),
    # unmarked: typed by the schema (zone is an integer)
    ("deepseek_v32", DSML.replace(' string="true"', "").replace("42", "Oslo"), None,
     [("weather", {"city": "Oslo", "days": [1]}), TIME]),
    # A block whose first call was read whole keeps it where a later one goes wrong (it was
    # streamed before the later one did).
    ("deepseek_v32", DSML.replace('{"zone": 3}', "{zone}"), None,
     [("weather", {"city": "42", "days": [1]})]),
    ("seed_oss", SEED, None, [("weather", {"city": "42"})]),
    ("hunyuan_a13b", TOOL_CALLS_LIST, None, [TIME]),
    ("jamba", TOOL_CALLS_LIST, None, [TIME]),
    ("minimax", TOOL_CALLS_LINES, None, [TIME, OSLO]),
    ("internlm", "Let me check." + INTERNLM, "Let me check.", [TIME]),
    ("longcat", LONGCAT, None, [TIME]),
    ("ernie45", LONGCAT.replace("longcat_tool_call", "tool_call"), None, [TIME]),
    ("olmo3", OLMO3, None, [TIME, ("weather", {"city": "Oslo", "days": [1], "exact": True})]),
    ("xlam", XLAM, None, [TIME, OSLO]),
    ("gemma4", "Sure. " + GEMMA4, "Sure. ", [("weather", {"city": "Oslo", "days": [1]}), TIME]),
    ("functiongemma", FUNCTIONGEMMA, None, [OSLO]),
    ("step3", "Sure. " + STEP3, "Sure. ", [OSLO, TIME]),
    ("apertus", "Sure. " + APERTUS + " Done.", "Sure.  Done.", [OSLO, TIME]),
    ("deepseek_v4", DSML.replace("function_calls>", "tool_calls>"), None,
     [("weather", {"city": "42", "days": [1]}), TIME]),
    ("lfm2", "Checking. " + LFM2 + " Done.", "Checking.  Done.", [TIME, OSLO]),
    ("xlam", "```json\n" + XLAM + "\n```", None, [TIME, OSLO]),
]  # fmt: skip
# Text in a format's tags that is not calls in it stays content, as written.
NOT_CALLS = [
    ("glm45", "<tool_call>time<arg_key>zone</arg_key>3</tool_call>"),
    ("glm45", '<tool_call>{"name": "time"}</tool_call>'),
    ("kimi_k2", KIMI_UNNUMBERED),
    ("deepseek_v3", DEEPSEEK_V31),
    ("deepseek_v31", DEEPSEEK_V31.replace('{"zone": 3}', "zone=3")),
    ("minimax_m2", "<minimax:tool_call>stray</minimax:tool_call>"),
    ("minimax", "<tool_calls>\n{not json}\n</tool_calls>"),
    ("olmo3", "<function_calls>\ntime(3)\n</function_calls>"),
    # Python literals JSON cannot hold (a set, bytes, a complex number): no call, not an error.
    ("pythonic", "[time(zone={1, 2})]"),
    ("pythonic", '[weather(city=b"Oslo")]'),
    ("olmo3", "<function_calls>\ntime(zone=1j)\n</function_calls>"),
    ("xlam", "[1, 2]"),
    ("gemma4", "<|tool_call>call:time zone{zone:3}<tool_call|>"),
    ("lfm2", "<|tool_call_start|>time(zone=3)<|tool_call_end|>"),
    ("apertus", "<|tools_prefix|>[1, 2]<|tools_suffix|>"),
    ("step3", STEP3.replace("function<｜tool_sep｜>", "call<｜tool_sep｜>")),
    ("xlam", "It is sunny."),
]
CASES = CALLS + [(parser, text, text, []) for parser, text in NOT_CALLS]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_each_format_reads_its_calls_and_leaves_other_text_as_content(
    parser: str, text: str, content: str | None, calls: list
) -> None:
    parsed_content, parsed_calls = parse_calls(parser, text, SCHEMAS)
    assert parsed_content == content
    assert names_and_arguments(parsed_calls) == calls
    assert all(call["type"] == "function" for call in parsed_calls)


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES)
def test_pieces_cut_anywhere_read_as_the_whole(
    parser: str, text: str, content: str | None, calls: list
) -> None:
    text = "Before. " + text if parser != "xlam" else text
    whole_content, whole_calls = parse_calls(parser, text, SCHEMAS)
    for size in (1, 4, 11):
        content, calls = read_in_pieces(parser, text, size, SCHEMAS)
        assert content == whole_content
        assert names_and_arguments(calls) == names_and_arguments(whole_calls)


def test_kimi_calls_keep_the_id_the_model_wrote():
    """Kimi's template writes a call's id back into the conversation; vLLM keeps it too."""
    _, calls = parse_calls("kimi_k2", KIMI)
    assert [call["id"] for call in calls] == ["functions.time:0", "functions.weather:1"]
    _, others = parse_calls("deepseek_v31", DEEPSEEK_V31)
    assert all(call["id"].startswith("call_") for call in others)


@pytest.mark.parametrize(
    ("template", "parser"),
    [
        ("{{ '<tool_call>' + tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>", "glm45"),
        ("{{- '<tool_call>' ~ tc.name -}}<arg_key>{{ k }}</arg_key><arg_value>", "glm47"),
        ("{{ '<|tool_calls_section_begin|>' }}{{ '<|tool_call_begin|>' + id }}", "kimi_k2"),
        ("{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n' + '```json'}}",
         "deepseek_v3"),
        ("{{'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments}}", "deepseek_v31"),
        ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="{{ name }}">', "deepseek_v32"),
        ('<minimax:tool_call>\n<invoke name="{{ name }}">', "minimax_m2"),
        ("<seed:tool_call>\n<function={{ name }}>", "seed_oss"),
        ("<tool_calls>{{ calls | tojson }}</tool_calls>", "hunyuan_a13b"),
        ("<|action_start|><|plugin|>\n{{ call }}<|action_end|>", "internlm"),
        ("<longcat_tool_call>{{ call }}</longcat_tool_call>", "longcat"),
        ("<function_calls>{{ call }}</function_calls>", "olmo3"),
        ("{{- '<|tool_call>call:' + name + '{' -}}", "gemma4"),
        ("<start_function_call>call:{{ name }}{", "functiongemma"),
        ("<|tool_call_start|>[{{ calls }}]<|tool_call_end|>", "lfm2"),
        ('<｜tool_sep｜><steptml:invoke name="{{ name }}">', "step3"),
        ("{{ '<|tools_prefix|>' + calls | tojson + '<|tools_suffix|>' }}", "apertus"),
        ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="{{ name }}">', "deepseek_v4"),
        ("{{- '<|tool_call|>' + calls | tojson }}", "granite"),
        ("<tool_call>\n{{ call | tojson }}\n</tool_call>", "hermes"),
    ],
)  # fmt: skip
def test_the_template_tags_show_the_format(template: str, parser: str):
    assert parser_for(None, template) == parser
    assert parser_for("qwen3_xml", template) == "qwen3_coder"  # the flag wins, vLLM's names


def tokenizer_with(tags: list[str], special: bool):
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(tags, special_tokens=special)
    return tokenizer


KIMI_TAGS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"]


def test_a_parser_keeps_special_tokens_where_its_tags_are_special_tokens():
    assert keeps_special_tokens("kimi_k2", tokenizer_with(KIMI_TAGS, special=True))
    assert not keeps_special_tokens("kimi_k2", tokenizer_with(KIMI_TAGS, special=False))
    assert not keeps_special_tokens("hermes", tokenizer_with(KIMI_TAGS, special=True))
    assert keeps_special_tokens("glm45", tokenizer_with(["<arg_key>"], special=True))
    assert keeps_special_tokens("mistral", tiny_tokenizer())  # Mistral's tag always is one
    assert not keeps_special_tokens("llama3_json", tokenizer_with(["<|python_tag|>"], True))
    assert not keeps_special_tokens(None, tiny_tokenizer())


def test_gemma_calls_nested_past_reading_keep_what_was_read():
    """Gemma's syntax nested deeper than JSON is read back anywhere stops being read there."""
    text = "<|tool_call>call:f{" + "a:{" * 300 + "b:1" + "}" * 301 + "<tool_call|>"
    _, [call] = parse_calls("gemma4", text)
    arguments = call["function"]["arguments"]
    assert arguments.count("{") == 256 and json_or_its_start(arguments)


@pytest.mark.parametrize(
    "nested",
    ["-" * 20000 + "1", "not " * 20000 + "1", "1+" * 20000 + "1", "a" + ".a" * 20000],
    ids=["signs", "nots", "sums", "attributes"],
)
def test_python_calls_nested_past_parsing_are_no_calls(nested: str):
    """A model led to write thousands of signs gets no call from them, not an error (Python's
    parser refuses such text with a RecursionError or MemoryError)."""
    assert parse_calls("pythonic", f"[f(a={nested})]")[1] == []
    assert parse_calls("olmo3", f"<function_calls>f(a={nested})</function_calls>")[1] == []


# Pieces of every format's tags and bodies, for replies stitched together at random.
FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>",
    "<｜DSML｜function_calls>", "</｜DSML｜function_calls>", '<｜DSML｜invoke name="f">',
    "</｜DSML｜invoke>", '<｜DSML｜parameter name="a" string="false">', "</｜DSML｜parameter>",
    '<parameter name="a">', "</parameter>", "<seed:tool_call>", "</seed:tool_call>",
    "<function=f>", "</function>", "<parameter=a>", "<tool_calls>", "</tool_calls>",
    "<|action_start|><|plugin|>", "<|action_end|>", "<longcat_tool_call>", "</longcat_tool_call>",
    "<function_calls>", "</function_calls>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>",
    "<|tool_call>", "<tool_call|>", "call:f{", '<|"|>', "<start_function_call>",
    "<end_function_call>", "<escape>", "<|tool_call_start|>", "a:", "[f(a=1)]",
    "<｜tool_calls_begin｜>", "<｜tool_call_begin｜>", '<steptml:invoke name="f">',
    "</steptml:invoke>", '<steptml:parameter name="a">', "</steptml:parameter>",
    "<|tools_prefix|>", "<|tools_suffix|>", '{"f": {"a": 1}}',
    "functools", "```json", "```", "\n", " ", "{", "}", "[", "]", '"', ":", ",", "(", ")", "=",
    '{"name": "f", "arguments": {"a": 1}}', '{"a": 1}', "f(a=1)", "functions.f:0", "function",
    "f", "1", "true", "null", "-", "xxx",
]  # fmt: skip


@pytest.mark.parametrize("parser", sorted(set(PARSERS) - {"openai"}))
def test_any_reply_reads_the_same_streamed_or_whole_and_never_raises(parser: str):
    """Random replies stitched from every format's pieces: a parser never raises on them,
    reads them streamed in any piece size as it reads them whole, and every call it finds has
    JSON arguments, or, where the call was cut short or went wrong after it began, the start
    of JSON."""
    rng = random.Random(parser)
    schemas = {"f": {"properties": {"a": {"type": "integer"}}}}
    for _ in range(300):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 25)))
        content, calls = parse_calls(parser, text, schemas)
        streamed, streamed_calls = read_in_pieces(parser, text, rng.randint(1, 9), schemas)
        assert streamed == content, text
        assert [c["function"] for c in streamed_calls] == [c["function"] for c in calls], text
        assert all(json_or_its_start(c["function"]["arguments"]) for c in calls), text


def json_or_its_start(text: str) -> bool:
    """Whether `text` is a JSON object, or the start of one."""
    writer = JsonWriter()
    for char in text:
        writer.push(char)
    if writer.done:
        return isinstance(json.loads(text), dict)
    return text.startswith("{") and not writer.failed
