"""Calls that stream while their block arrives (JSON objects, Kimi K2's and DeepSeek-V3.1's
delimited calls, and the parameter elements of Qwen3-Coder, Seed-OSS, GLM, MiniMax-M2 and
DeepSeek-V3.2): a call as soon as it has begun, its arguments as they grow, and, cut anywhere,
the same calls a whole reply gives."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from server.call_array import assemble
from server.tool_parsers import parse_calls, reader_for
from tests.server.test_json_stream import TEXTS, random_value, written_as

SCHEMAS = {
    "write": {
        "type": "object",
        "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
    },
    "weather": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "array"}},
    },
}


def fed(parser: str, pieces: list[str], schemas: dict | None = None) -> list[list[dict]]:
    """The entries each piece gave (the last list: what the end of the reply gave)."""
    reader = reader_for(parser, schemas)
    out = [reader.feed(piece)[1] for piece in pieces]
    return [*out, reader.finish()[1]]


def test_a_hermes_call_streams_once_its_arguments_begin_then_as_they_grow() -> None:
    pieces = [
        '<tool_call>{"name": "weather", "argu',
        'ments": {',
        '"city": "Os',
        'lo"}}',
        "</tool_call>",
    ]
    named, first, second, third, closing, end = fed("hermes", pieces)
    assert named == []  # a name alone is not yet a call: its arguments must begin as an object
    [announced] = first
    assert announced["function"] == {"name": "weather", "arguments": "{"}
    assert announced["index"] == 0 and announced["type"] == "function"
    assert announced["id"].startswith("call_")
    assert second == [{"index": 0, "function": {"arguments": '"city": "Os'}}]
    assert third == [{"index": 0, "function": {"arguments": 'lo"}'}}]
    assert closing == [] and end == []


def test_a_second_call_is_numbered_after_the_first() -> None:
    call = '<tool_call>{"name": "%s", "arguments": {}}</tool_call>'
    entries = [e for step in fed("hermes", [call % "a", "\n", call % "b"]) for e in step]
    assert [(e["index"], e["function"]["name"]) for e in entries if "id" in e] == [
        (0, "a"),
        (1, "b"),
    ]
    assert [c["function"]["arguments"] for c in assemble(entries)] == ["{}", "{}"]


def test_a_list_of_calls_in_one_block_streams_each() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"arguments": {"y": 2}, "name": "b"}]'
    steps = fed("hermes", [text[:40], text[40:], "</tool_call>"])
    assert [e["function"]["name"] for e in steps[0]] == ["a"]
    # b's arguments came before its name: they are sent with it.
    assert [e["function"] for e in steps[1] if "id" in e] == [
        {"name": "b", "arguments": '{"y": 2}'}
    ]


def test_qwen3_coder_streams_a_text_parameter_as_it_is_written() -> None:
    pieces = [
        "<tool_call>\n<function=write>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n",
        "def f():\n",
        '    return "x"\n',
        "</parameter>\n</function>\n</tool_call>",
    ]
    head, body, more, closing, end = fed("qwen3_coder", pieces, SCHEMAS)
    # The first entry carries what the arguments have grown to when the name is sent.
    assert [e["function"] for e in head] == [
        {"name": "write", "arguments": '{"path": "a.py", "content": "'}
    ]
    # The line break that may end the value waits for what follows it.
    assert body == [{"index": 0, "function": {"arguments": "def f():"}}]
    assert more == [{"index": 0, "function": {"arguments": '\\n    return \\"x\\"'}}]
    assert closing == [{"index": 0, "function": {"arguments": '"}'}}]
    [call] = assemble(head + body + more + closing + end)
    assert json.loads(call["function"]["arguments"]) == {
        "path": "a.py",
        "content": 'def f():\n    return "x"',
    }


def test_qwen3_coder_sends_a_typed_value_whole() -> None:
    pieces = ["<tool_call>\n<function=weather>\n<parameter=days>\n[1, ", "2]\n</parameter>\n"]
    head, rest, end = fed("qwen3_coder", pieces, SCHEMAS)
    assert [e["function"] for e in head] == [{"name": "weather", "arguments": '{"days": '}]
    assert rest == [{"index": 0, "function": {"arguments": "[1, 2]"}}]
    # The reply ended inside the call: it keeps what it has, closed as it was read.
    assert end == []


@pytest.mark.parametrize(
    ("parser", "opening", "closing"),
    [
        ("glm45", "<tool_call>write\n<arg_key>content</arg_key>\n<arg_value>", "</arg_value>\n"),
        ("minimax_m2", '<minimax:tool_call>\n<invoke name="write">\n<parameter name="content">',
         "</parameter>\n</invoke>\n"),
        ("deepseek_v32", '<｜DSML｜function_calls>\n<｜DSML｜invoke name="write">\n'
         '<｜DSML｜parameter name="content" string="true">',
         "</｜DSML｜parameter>\n</｜DSML｜invoke>\n"),
    ],
)  # fmt: skip
def test_a_text_parameter_streams_in_each_parameter_format(
    parser: str, opening: str, closing: str
) -> None:
    steps = fed(parser, [opening, "line one;", " line two", closing], SCHEMAS)
    [announced] = steps[0]
    assert announced["function"] == {"name": "write", "arguments": '{"content": "'}
    assert [e["function"]["arguments"] for e in steps[1] + steps[2]] == ["line one;", " line two"]
    [call] = assemble([entry for step in steps for entry in step])
    assert call["function"]["arguments"] == '{"content": "line one; line two"}'


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("glm45", "<tool_call>time<arg_key>zone</arg_key>3</tool_call>"),
        ("minimax_m2", '<minimax:tool_call><invoke name="time">3</invoke></minimax:tool_call>'),
        ("deepseek_v32", '<｜DSML｜function_calls><｜DSML｜invoke name="t">\n{zone}'
         "</｜DSML｜invoke></｜DSML｜function_calls>"),
    ],
)  # fmt: skip
def test_a_call_shows_only_once_its_arguments_begin_in_the_format(parser: str, text: str) -> None:
    """A name followed by text not in the format is no call: the block stays text."""
    assert parse_calls(parser, text, SCHEMAS) == (text, [])


def test_a_python_call_shows_once_its_first_argument_is_read() -> None:
    pieces = ["[get_weather(city=", '"Oslo", ', "days=[1, 2]", ")]"]
    named, first, second, closing, end = fed("pythonic", pieces)
    assert named == []
    assert [e["function"] for e in first] == [
        {"name": "get_weather", "arguments": '{"city": "Oslo"'}
    ]
    assert [e["function"] for e in second + closing] == [
        {"arguments": ', "days": '},  # the value waits for the `,` or `)` that ends it
        {"arguments": "[1, 2]}"},
    ]
    assert end == []


def test_a_python_value_is_read_once_however_many_commas_its_string_holds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The end of a value is found by following its strings and brackets, so a long string
    full of `,` and `)` is parsed once, not once a comma."""
    import server.call_python

    parsed = []
    real = server.call_python.python_expression
    monkeypatch.setattr(
        server.call_python, "python_expression", lambda text: parsed.append(text) or real(text)
    )
    text = '[f(a="' + ",)" * 3000 + "\", b='''x, \"y\")''')]"
    steps = fed("pythonic", [text[i : i + 3] for i in range(0, len(text), 3)])
    [call] = assemble([entry for step in steps for entry in step])
    assert json.loads(call["function"]["arguments"]) == {"a": ",)" * 3000, "b": 'x, "y")'}
    assert len(parsed) == 2  # one value, then the other


@pytest.mark.parametrize(
    ("parser", "text", "arguments"),
    [
        ("hermes", '<tool_call>{"name": "write", "arguments": {"path": "a', '{"path": "a'),
        ("qwen3_coder", "<tool_call>\n<function=write>\n<parameter=path>\nb", '{"path": "b'),
        # Begun and then not in the format: kept as far as it was read.
        ("hermes", '<tool_call>{"name": "write", "arguments": {"a": 1}</tool_call>', '{"a": 1}'),
    ],
)
def test_a_call_cut_short_or_malformed_keeps_what_was_streamed(
    parser: str, text: str, arguments: str
) -> None:
    content, calls = parse_calls(parser, text, SCHEMAS)
    assert content is None
    assert [c["function"] for c in calls] == [{"name": "write", "arguments": arguments}]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        ("hermes", '<tool_call>{"name": "time", "arguments": {"zone": 3}}'),
        ("glm47", "<tool_call>time<arg_key>zone</arg_key><arg_value>3</arg_value>"),
        ("hunyuan_a13b", '<tool_calls>[{"name": "time", "arguments": {"zone": 3}}]'),
        ("olmo3", "<function_calls>\ntime(zone=3)\n"),
    ],
)
def test_a_block_the_reply_leaves_open_reads_as_if_closed(parser: str, text: str) -> None:
    schemas = {"time": {"properties": {"zone": {"type": "integer"}}}}
    content, calls = parse_calls(parser, "Sure. " + text, schemas)
    assert content == "Sure. "
    assert [c["function"] for c in calls] == [{"name": "time", "arguments": '{"zone": 3}'}]


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"zone": 3}</tool_call>',
        "<tool_call>{",
        '<tool_call>{"name": "write"',  # cut short before its arguments began
    ],
)
def test_a_block_that_never_names_a_call_stays_text(text: str) -> None:
    assert parse_calls("hermes", text) == (text, [])


def random_arguments(rng: random.Random) -> dict[str, Any]:
    return {f"k{i}{rng.choice(TEXTS)}": random_value(rng) for i in range(rng.randrange(4))}


def hermes_reply(rng: random.Random, calls: list[tuple[str, dict]]) -> str:
    blocks = []
    for name, arguments in calls:
        key = rng.choice(["arguments", "parameters"])
        blocks.append(
            f"<tool_call>\n{written_as(rng, {'name': name, key: arguments})}\n</tool_call>"
        )
    return "Let me see.\n" + "\n".join(blocks)


def parameters_reply(rng: random.Random, parser: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as elements of parameters (`p*` values text, `extra` JSON), in `parser`'s tags."""

    def value(key: str, written: Any) -> str:
        return written if key.startswith("p") else json.dumps(written)

    blocks = []
    for name, arguments in calls:
        items = arguments.items()
        if parser in ("qwen3_coder", "seed_oss"):
            inner = "".join(f"<parameter={k}>\n{value(k, v)}\n</parameter>\n" for k, v in items)
            tag = "tool_call" if parser == "qwen3_coder" else "seed:tool_call"
            blocks.append(f"<{tag}>\n<function={name}>\n{inner}</function>\n</{tag}>")
        elif parser in ("glm45", "glm47"):
            gap = "\n" if parser == "glm45" else ""
            inner = "".join(
                f"<arg_key>{k}</arg_key>{gap}<arg_value>{value(k, v)}</arg_value>{gap}"
                for k, v in items
            )
            blocks.append(f"<tool_call>{name}{gap}{inner}</tool_call>")
        elif parser == "step3":
            inner = "".join(
                f'<steptml:parameter name="{k}">\n{value(k, v)}\n</steptml:parameter>'
                for k, v in items
            )
            blocks.append(
                "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
                f'<steptml:invoke name="{name}">{inner}</steptml:invoke><｜tool_call_end｜>'
                "<｜tool_calls_end｜>"
            )
        else:
            prefix = "｜DSML｜" if parser == "deepseek_v32" else ""
            if prefix and rng.random() < 0.3:  # the arguments' JSON object as the body
                inner = written_as(rng, arguments)
            else:
                inner = "".join(
                    f'<{prefix}parameter name="{k}">\n{value(k, v)}\n</{prefix}parameter>\n'
                    for k, v in items
                )
            invoke = f'<{prefix}invoke name="{name}">\n{inner}\n</{prefix}invoke>'
            tag = f"{prefix}function_calls" if prefix else "minimax:tool_call"
            blocks.append(f"<{tag}>\n{invoke}\n</{tag}>")
    return "Sure.\n" + "\n".join(blocks)


PARAMETER_FORMATS = [
    "qwen3_coder",
    "seed_oss",
    "glm45",
    "glm47",
    "minimax_m2",
    "deepseek_v32",
    "step3",
]


def delimited_reply(rng: random.Random, parser: str, calls: list[tuple[str, dict]]) -> str:
    if parser == "kimi_k2":
        written = "".join(
            f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>"
            f"{written_as(rng, arguments)}<|tool_call_end|>"
            for i, (name, arguments) in enumerate(calls)
        )
        return f"Checking.<|tool_calls_section_begin|>{written}<|tool_calls_section_end|>"
    if parser == "apertus":  # a JSON list of `{"NAME": {...}}` objects
        keyed = written_as(rng, [{name: arguments} for name, arguments in calls])
        return f"Sure.<|tools_prefix|>{keyed}<|tools_suffix|>"
    if parser == "minimax":  # `<tool_calls>`: a JSON list, or an object a line
        objects = [{"name": name, "arguments": arguments} for name, arguments in calls]
        if rng.random() < 0.5:
            return f"Sure.<tool_calls>\n{written_as(rng, objects)}\n</tool_calls>"
        lines = "\n".join(json.dumps(item, ensure_ascii=rng.random() < 0.5) for item in objects)
        return f"Sure.<tool_calls>\n{lines}\n</tool_calls>"
    if parser == "deepseek_v3":
        written = "".join(
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n"
            f"{written_as(rng, arguments)}\n```<｜tool▁call▁end｜>"
            for name, arguments in calls
        )
    else:
        written = "".join(
            f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{written_as(rng, arguments)}"
            "<｜tool▁call▁end｜>"
            for name, arguments in calls
        )
    return f"Sure.<｜tool▁calls▁begin｜>{written}<｜tool▁calls▁end｜>"


def cut(rng: random.Random, text: str) -> list[str]:
    bounds = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randrange(1, 40))))
    return [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]


DELIMITED_FORMATS = ["kimi_k2", "deepseek_v3", "deepseek_v31", "minimax", "apertus"]
WHOLE_REPLY_FORMATS = ["llama3_json", "granite", "phi4_mini_json", "xlam", "mistral"]


PYTHON_FORMATS = ["pythonic", "olmo3", "lfm2"]
GEMMA_FORMATS = ["gemma4", "functiongemma"]


def gemma_value(value: Any, quote: str) -> str:
    """`value` in Gemma's call syntax (bare keys, strings between `quote`s)."""
    if isinstance(value, str):
        return quote + value + quote
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(item, quote) for item in value) + "]"
    if isinstance(value, dict):
        pairs = (f"{key}:{gemma_value(item, quote)}" for key, item in value.items())
        return "{" + ",".join(pairs) + "}"
    return json.dumps(value)


def simple_keys(value: Any) -> Any:
    """`value` with its objects' keys made plain names, as Gemma's bare keys are."""
    if isinstance(value, list):
        return [simple_keys(item) for item in value]
    if isinstance(value, dict):
        return {f"k{i}": simple_keys(item) for i, item in enumerate(value.values())}
    return value


def gemma_reply(parser: str, calls: list[tuple[str, dict]]) -> str:
    quote, (open_, close) = (
        ('<|"|>', ("<|tool_call>", "<tool_call|>"))
        if parser == "gemma4"
        else ("<escape>", ("<start_function_call>", "<end_function_call>"))
    )
    return "Sure. " + "".join(
        f"{open_}call:{name}{gemma_value(arguments, quote)}{close}" for name, arguments in calls
    )


def python_reply(rng: random.Random, parser: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written as Python: a list of them, or one a line in OLMo 3's block."""
    written = [
        f"{name}({', '.join(f'{key}={value!r}' for key, value in arguments.items())})"
        for name, arguments in calls
    ]
    if parser == "olmo3":
        return "Sure.<function_calls>\n" + "\n".join(written) + "\n</function_calls>"
    if parser == "lfm2":
        return "Sure.<|tool_call_start|>[" + ", ".join(written) + "]<|tool_call_end|>"
    listed = "[" + rng.choice([", ", ",\n"]).join(written) + "]"
    return rng.choice([listed, f"<|python_start|>{listed}<|python_end|>"])


def whole_reply(rng: random.Random, parser: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written as a reply of nothing else (or, for Mistral, after `[TOOL_CALLS]`)."""
    listed = written_as(rng, [{"name": name, "arguments": args} for name, args in calls])
    if parser == "llama3_json":
        objects = [written_as(rng, {"name": name, "parameters": args}) for name, args in calls]
        return rng.choice(["", "<|python_tag|>"]) + "; ".join(objects)
    if parser == "granite":
        return rng.choice(["<|tool_call|>", "<tool_call>"]) + listed
    if parser == "phi4_mini_json":
        return "functools" + listed
    if parser == "xlam":
        return rng.choice([listed, f"```json\n{listed}\n```"])
    if rng.random() < 0.5:
        return "Sure. [TOOL_CALLS]" + listed
    named = "".join(f"[TOOL_CALLS]{name}[ARGS]{written_as(rng, args)}" for name, args in calls)
    return "Sure. " + named


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize(
    "parser",
    [
        "hermes",
        *DELIMITED_FORMATS,
        *PARAMETER_FORMATS,
        *WHOLE_REPLY_FORMATS,
        *PYTHON_FORMATS,
        *GEMMA_FORMATS,
    ],
)
def test_random_calls_cut_anywhere_stream_to_the_whole_replys_calls(parser: str, seed: int) -> None:
    rng = random.Random(seed)
    names = ["write", "weather", "other"]
    calls = [(rng.choice(names), random_arguments(rng)) for _ in range(rng.randrange(1, 4))]
    if parser in PARAMETER_FORMATS:  # `p*` values text, `extra` any JSON, as the schema says
        calls = [
            (name, {**{f"p{i}": str(v) for i, v in enumerate(args.values())}, "extra": args})
            for name, args in calls
        ]
        properties = {f"p{i}": {"type": "string"} for i in range(4)}
        schemas = {name: {"properties": {**properties, "extra": {}}} for name in names}
        text = parameters_reply(rng, parser, calls)
    elif parser == "hermes":
        schemas, text = None, hermes_reply(rng, calls)
    elif parser in PYTHON_FORMATS:  # keywords are names: the values as they came
        calls = [(name, {f"p{i}": v for i, v in enumerate(args.values())}) for name, args in calls]
        schemas, text = None, python_reply(rng, parser, calls)
    elif parser in GEMMA_FORMATS:
        calls = [(name, simple_keys(arguments)) for name, arguments in calls]
        schemas, text = None, gemma_reply(parser, calls)
    elif parser in WHOLE_REPLY_FORMATS:
        schemas, text = None, whole_reply(rng, parser, calls)
    else:
        schemas, text = None, delimited_reply(rng, parser, calls)
    whole_content, whole = parse_calls(parser, text, schemas)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == calls
    reader, entries, content = reader_for(parser, schemas), [], ""
    for piece in cut(rng, text):
        more_content, more = reader.feed(piece)
        content, entries = content + more_content, entries + more
    rest, more = reader.finish()
    content += rest
    assert (content if content.strip() else None) == whole_content
    streamed = assemble(entries + more)
    assert [c["function"] for c in streamed] == [c["function"] for c in whole]
    if parser == "kimi_k2":  # Kimi's ids are its own, streamed or not
        assert [c["id"] for c in streamed] == [c["id"] for c in whole]
    announced = [e for e in entries + more if "id" in e]
    assert [e["index"] for e in announced] == list(range(len(calls)))
