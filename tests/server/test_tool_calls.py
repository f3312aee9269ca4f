"""Tool calling through /v1/chat/completions on a random-weight model: tools reach the chat
template, a named or required `tool_choice` always yields well-formed calls whose arguments fit
their schemas, streamed or not, and bad tool requests get a 400 naming the field."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import openai
import pytest

from server.call_array import assemble
from server.settings import ServerSettings
from tests.helpers import chat_tokenizer, tiny_llama, tiny_tokenizer
from tests.server_utils import app_client, blocks_in_use, live_server, sse_events

# A chat template that renders tools, the calls an assistant made and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }}:"
    "{{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}"
    "{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "Now.", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
BASE = {"model": "tiny", "max_tokens": 80, "seed": 5, "messages": MESSAGES, "tools": TOOLS}
NAMED = {"type": "function", "function": {"name": "weather"}}
DEEP: dict = {}
for _ in range(320):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def tool_tokenizer():
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


async def chat(client, **body):
    response = await client.post("/v1/chat/completions", json={**BASE, **body})
    assert response.status_code == 200, response.text
    return response.json()


def check_call(call: dict) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    name = call["function"]["name"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])


async def test_a_named_tool_choice_always_calls_it():
    async with app_client(tokenizer=tool_tokenizer()) as (client, engine):
        body = await chat(client, tool_choice=NAMED, n=2)
        for choice in body["choices"]:
            message = choice["message"]
            assert message["content"] is None
            [call] = message["tool_calls"]
            assert call["function"]["name"] == "weather"
            check_call(call)
            assert choice["finish_reason"] == "tool_calls"
        assert blocks_in_use(engine) == 0


@pytest.mark.parametrize("parallel", [True, False])
async def test_required_makes_calls_to_listed_functions(parallel: bool):
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, tool_choice="required", parallel_tool_calls=parallel)
        [choice] = body["choices"]
        calls = choice["message"]["tool_calls"]
        assert len(calls) >= 1 and (parallel or len(calls) == 1)
        for call in calls:
            check_call(call)
        assert choice["finish_reason"] == "tool_calls"


async def test_a_streamed_named_call_assembles_into_the_same_call():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        whole = await chat(client, tool_choice=NAMED)
        response = await client.post(
            "/v1/chat/completions", json={**BASE, "tool_choice": NAMED, "stream": True}
        )
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        entries = [
            entry for e in events for entry in e["choices"][0]["delta"].get("tool_calls") or []
        ]
        assert entries[0]["id"].startswith("call_") and entries[0]["type"] == "function"
        assert entries[0]["function"]["name"] == "weather"
        assert all("id" not in entry and entry["index"] == 0 for entry in entries[1:])
        arguments = "".join(entry["function"]["arguments"] for entry in entries)
        [call] = whole["choices"][0]["message"]["tool_calls"]
        assert arguments == call["function"]["arguments"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_streamed_required_calls_assemble_into_the_same_calls():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        whole = await chat(client, tool_choice="required")
        response = await client.post(
            "/v1/chat/completions", json={**BASE, "tool_choice": "required", "stream": True}
        )
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        entries = [
            entry for e in events for entry in e["choices"][0]["delta"].get("tool_calls") or []
        ]
        calls: dict[int, dict] = {}
        for entry in entries:
            if "id" in entry:  # a call's first entry: its id, type and name, before arguments
                assert entry["index"] == len(calls)
                calls[entry["index"]] = {k: v for k, v in entry.items() if k != "index"}
            else:
                assert set(entry) == {"index", "function"}
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
        assert len(entries) > len(calls)  # the arguments came in pieces
        expected = whole["choices"][0]["message"]["tool_calls"]
        assert [c["function"] for c in calls.values()] == [c["function"] for c in expected]
        for call in calls.values():
            check_call(call)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tools_reach_the_template_under_none_too_unless_the_server_leaves_them_out():
    """As vLLM's: tool_choice "none" keeps the tools in the prompt (the same prefix as the
    turns that may call, for the prefix cache) and reads the reply as text alone;
    `--exclude-tools-when-tool-choice-none` leaves them out."""
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        plain = await chat(client, tools=None, max_tokens=1)
        offered = await chat(client, max_tokens=1)
        none = await chat(client, tool_choice="none", max_tokens=8, ignore_eos=True)
    assert offered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    assert none["usage"]["prompt_tokens"] == offered["usage"]["prompt_tokens"]
    assert not none["choices"][0]["message"].get("tool_calls")
    assert none["choices"][0]["finish_reason"] == "length"
    settings = ServerSettings(served_model_name="tiny", exclude_tools_when_tool_choice_none=True)
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        left_out = await chat(client, tool_choice="none", max_tokens=1)
    assert left_out["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_a_template_without_a_tool_section_shows_no_tools_under_none():
    """The tools Conveyor writes for such a template teach the model to call them: under
    "none" the prompt leaves them out."""
    async with app_client() as (client, _):
        plain = await chat(client, tools=None, max_tokens=1)
        none = await chat(client, tool_choice="none", max_tokens=1)
    assert none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]


async def test_a_tool_loop_round_trips_calls_and_results():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        first = await chat(client, tool_choice=NAMED)
        [call] = first["choices"][0]["message"]["tool_calls"]
        turn = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "12 degrees"},
        ]
        second = await chat(client, messages=turn, tool_choice="none", max_tokens=4)
        rendered = tool_tokenizer().apply_chat_template(
            [
                MESSAGES[0],
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "function": {
                                "name": "weather",
                                "arguments": json.loads(call["function"]["arguments"]),
                            }
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call["id"], "content": "12 degrees"},
            ],
            tools=TOOLS,  # shown under tool_choice "none" too, as vLLM shows them
            tokenize=False,
            add_generation_prompt=True,
        )
        expected = len(tool_tokenizer()(rendered, add_special_tokens=False)["input_ids"])
        assert second["usage"]["prompt_tokens"] == expected


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        (
            {"messages": [*MESSAGES, {"role": "tool", "content": "12"}]},
            "messages[1].tool_call_id",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "w", "parameters": {"type": 7}}}
                ],
                "tool_choice": {"type": "function", "function": {"name": "w"}},
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    TOOLS[0],
                    {
                        "type": "function",
                        "function": {"name": "w", "parameters": {"minLength": -1}},
                    },
                ]
            },
            "tools[1].function.parameters",
        ),
        ({"tool_choice": NAMED, "response_format": {"type": "json_object"}}, "tool_choice"),
        (  # deeper than the schema checker's recursion reaches
            {"tools": [{"type": "function", "function": {"name": "w", "parameters": DEEP}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tool_choice": {
                    "type": "allowed_tools",
                    "allowed_tools": {
                        "mode": "auto",
                        "tools": [{"type": "function", "function": {"name": "news"}}],
                    },
                }
            },
            "tool_choice.allowed_tools.tools[0]",
        ),
    ],
)
async def test_bad_tool_requests_get_a_400_naming_the_field(body: dict, param: str):
    async with app_client(tokenizer=tool_tokenizer()) as (client, engine):
        response = await client.post("/v1/chat/completions", json={**BASE, **body})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert blocks_in_use(engine) == 0


# Under tool_choice "auto" the model writes calls in its template's format; a regex makes the
# random model write one, as a model taught the Hermes format would.
HERMES_OUTPUT = 'Sure. <tool_call>{"name": "time", "arguments": {"zone": 3}}</tool_call>'
FORCE_HERMES = {"structured_outputs": {"regex": re.escape(HERMES_OUTPUT)}}


async def test_auto_reads_calls_out_of_the_text():
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, tool_choice="auto", **FORCE_HERMES)
        [choice] = body["choices"]
        assert choice["message"]["content"] == "Sure. "
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "time", "arguments": '{"zone": 3}'}
        assert choice["finish_reason"] == "tool_calls"
        response = await client.post(
            "/v1/chat/completions",
            json={**BASE, "tool_choice": "auto", "stream": True, **FORCE_HERMES},
        )
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        deltas = [e["choices"][0]["delta"] for e in events]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
        entries = [entry for d in deltas for entry in d.get("tool_calls") or []]
        # The name comes first, then the arguments as they are written.
        assert entries[0]["function"] == {"name": "time", "arguments": "{"}
        assert len(entries) > 2 and {e["index"] for e in entries} == {0}
        [streamed] = assemble(entries)
        assert streamed["function"] == call["function"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_openai_sdk_assembles_calls_streamed_as_they_are_written():
    """The OpenAI SDK's stream helper reads the pieces of a call as it reads OpenAI's own: the
    argument deltas, then the call whole, the same as the reply not streamed."""
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
    long_output = (
        'Sure. <tool_call>{"name": "weather", "arguments": {"city": "' + "Oslo " * 20 + '"}}'
        "</tool_call>"
    )
    request = {**BASE, "tool_choice": "auto", "max_tokens": 300}
    extra = {"structured_outputs": {"regex": re.escape(long_output)}}
    async with live_server(settings, tokenizer=tool_tokenizer(), max_model_len=1024,
                           model=tiny_llama(max_positions=1024)) as server:  # fmt: skip
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        whole = await client.chat.completions.create(**request, extra_body=extra)
        deltas = []
        async with client.chat.completions.stream(**request, extra_body=extra) as stream:
            async for event in stream:
                if event.type == "tool_calls.function.arguments.delta":
                    deltas.append(event.arguments_delta)
            streamed = await stream.get_final_completion()
    [call] = whole.choices[0].message.tool_calls or []
    [again] = streamed.choices[0].message.tool_calls or []
    assert again.function.name == call.function.name == "weather"
    assert again.function.arguments == call.function.arguments
    assert json.loads(call.function.arguments) == {"city": "Oslo " * 20}
    assert len(deltas) > 5 and "".join(deltas) == call.function.arguments
    assert streamed.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
async def test_auto_calls_without_parallel_calls_keep_only_the_first(parallel: bool):
    """`parallel_tool_calls: false` under auto: a reply that wrote two calls gives the first,
    streamed or not, as vLLM's does (the reply runs free, so it may write more)."""
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
    two = (
        '<tool_call>{"name": "time", "arguments": {"zone": 3}}</tool_call>'
        '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>'
    )
    force = {"structured_outputs": {"regex": re.escape(two)}}
    request = {**BASE, "tool_choice": "auto", "parallel_tool_calls": parallel, "max_tokens": None}
    expected = ["time", "weather"] if parallel else ["time"]
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, engine):
        body = await chat(client, **{**request, **force})
        [choice] = body["choices"]
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == expected
        assert choice["finish_reason"] == "tool_calls"
        response = await client.post(
            "/v1/chat/completions", json={**request, **force, "stream": True}
        )
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        entries = [
            entry for e in events for entry in e["choices"][0]["delta"].get("tool_calls") or []
        ]
        assert [c["function"]["name"] for c in assemble(entries)] == expected
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        assert blocks_in_use(engine) == 0


async def test_without_a_parser_auto_returns_the_text():
    async with app_client(tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, tool_choice="auto", **FORCE_HERMES)
        assert body["choices"][0]["message"]["content"] == HERMES_OUTPUT
        assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("parser", "output"),
    [
        ("llama3_json", '{"name": "time", "parameters": {"zone": -2}}'),
        ("granite", '<tool_call>[{"name": "time", "arguments": {"zone": -2}}]'),
        ("phi4_mini_json", 'functools[{"name": "time", "arguments": {"zone": -2}}]'),
    ],
)
async def test_auto_reads_whole_reply_calls(parser: str, output: str):
    """Parsers that hold a reply that opens as calls until it ends, then read it whole (its
    calls streamed meanwhile)."""
    settings = ServerSettings(served_model_name="tiny", tool_call_parser=parser)
    force = {"structured_outputs": {"regex": re.escape(output)}}
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, tool_choice="auto", **force)
        [choice] = body["choices"]
        assert choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"] == {"name": "time", "arguments": '{"zone": -2}'}
        assert choice["finish_reason"] == "tool_calls"
        response = await client.post(
            "/v1/chat/completions",
            json={**BASE, "tool_choice": "auto", "stream": True, **force},
        )
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e != "[DONE]"]
        assert not "".join(d.get("content") or "" for d in deltas)
        # The calls stream while the reply is held: as soon as they begin.
        entries = [entry for d in deltas for entry in d.get("tool_calls") or []]
        [streamed] = assemble(entries)
        assert streamed["function"] == call["function"] and len(entries) > 1


# A template with no tool section: the tools are written into the conversation in the Hermes
# format, and calls in that format are read back without any parser flag.
LIST_OUTPUT = (
    '<tool_call>[{"name": "time", "arguments": {"zone": 3}}, '
    '{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}}]</tool_call>'
)


async def test_without_a_tool_section_the_tools_are_written_and_calls_read_back():
    long_context = tiny_llama(max_positions=2048)  # the written tools take ~800 tiny tokens
    async with app_client(
        tokenizer=chat_tokenizer(), model=long_context, max_model_len=2048, num_blocks=1024
    ) as (client, engine):
        plain = await chat(client, tools=None, max_tokens=1)
        offered = await chat(client, max_tokens=1)
        assert offered["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
        force = {"structured_outputs": {"regex": re.escape(LIST_OUTPUT)}}
        body = await chat(client, tool_choice="auto", max_tokens=200, **force)
        [choice] = body["choices"]
        assert choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["time", "weather"]
        for call in calls:
            check_call(call)
        assert choice["finish_reason"] == "tool_calls"
        turn = [
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": calls},
            *({"role": "tool", "tool_call_id": c["id"], "content": "ok"} for c in calls),
        ]
        second = await chat(client, messages=turn, max_tokens=1)
        assert second["usage"]["prompt_tokens"] > offered["usage"]["prompt_tokens"]
        assert blocks_in_use(engine) == 0


# Qwen3-Coder writes each argument as its own element; the schema types the values.
CODER_OUTPUT = (
    "<tool_call>\n<function=weather>\n<parameter=city>\n1234\n</parameter>\n"
    "<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>"
)


async def test_auto_reads_qwen3_coder_calls_typed_by_the_schema():
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="qwen3_coder")
    force = {"structured_outputs": {"regex": re.escape(CODER_OUTPUT)}}
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, tool_choice="auto", max_tokens=None, **force)
        [choice] = body["choices"]
        [call] = choice["message"]["tool_calls"]
        # The weather schema's city is a string: "1234" stays text.
        assert json.loads(call["function"]["arguments"]) == {"city": "1234", "unit": "c"}
        assert choice["finish_reason"] == "tool_calls"


async def test_a_mistral_parser_keeps_the_special_tokens_its_tag_is():
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="mistral")
    output = '[TOOL_CALLS][{"name": "time", "arguments": {"zone": 2}}]'
    force = {"structured_outputs": {"regex": re.escape(output)}}
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        rendered = await client.post("/v1/chat/completions/render", json=BASE)
        assert rendered.json()["sampling_params"]["skip_special_tokens"] is False
        plain = await client.post("/v1/chat/completions/render", json={**BASE, "tools": None})
        assert plain.json()["sampling_params"]["skip_special_tokens"] is True
        body = await chat(client, tool_choice="auto", **force)
        [call] = body["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "time", "arguments": '{"zone": 2}'}


# The formats of GLM, Kimi K2, DeepSeek-V3.1, MiniMax-M2, Seed-OSS, Gemma 4 and LFM2, written by
# the random model under a regex as those models write them.
NATIVE_OUTPUTS = {
    "glm45": "<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
    "<arg_key>unit</arg_key>\n<arg_value>c</arg_value>\n</tool_call>",
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.weather:0"
    '<|tool_call_argument_begin|>{"city": "Oslo", "unit": "c"}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>weather<｜tool▁sep｜>"
    '{"city": "Oslo", "unit": "c"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="weather">\n<parameter name="city">Oslo'
    '</parameter>\n<parameter name="unit">c</parameter>\n</invoke>\n</minimax:tool_call>',
    "seed_oss": "<seed:tool_call>\n<function=weather>\n<parameter=city>Oslo</parameter>\n"
    "<parameter=unit>c</parameter>\n</function>\n</seed:tool_call>",
    "gemma4": '<|tool_call>call:weather{city:<|"|>Oslo<|"|>,unit:<|"|>c<|"|>}<tool_call|>',
    "lfm2": '<|tool_call_start|>[weather(city="Oslo", unit="c")]<|tool_call_end|>',
}


@pytest.mark.parametrize("parser", sorted(NATIVE_OUTPUTS))
async def test_auto_reads_each_models_native_calls_streamed_or_not(parser: str):
    settings = ServerSettings(served_model_name="tiny", tool_call_parser=parser)
    force = {"structured_outputs": {"regex": re.escape("Sure. " + NATIVE_OUTPUTS[parser])}}
    request = {**BASE, "tool_choice": "auto", "max_tokens": 300, **force}
    long_context = tiny_llama(max_positions=1024)
    async with app_client(
        settings, tokenizer=tool_tokenizer(), model=long_context, max_model_len=1024
    ) as (client, engine):
        body = await chat(client, tool_choice="auto", max_tokens=300, **force)
        [choice] = body["choices"]
        assert choice["message"]["content"] == "Sure. "
        [call] = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
        assert choice["finish_reason"] == "tool_calls"
        if parser == "kimi_k2":  # Kimi's template writes the id it gave back into the prompt
            assert call["id"] == "functions.weather:0"
        response = await client.post("/v1/chat/completions", json={**request, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e != "[DONE]"]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
        entries = [entry for d in deltas for entry in d.get("tool_calls") or []]
        [streamed] = assemble(entries)
        assert streamed["function"] == call["function"]
        assert (streamed["id"] == call["id"]) == (parser == "kimi_k2")  # others: a fresh id each
        # The arguments stream as they are written.
        assert len(entries) > 1
        assert blocks_in_use(engine) == 0


@pytest.mark.parametrize("text", ["\n\n", "Nothing to call.\n"])
async def test_a_reply_without_calls_reads_the_same_streamed_or_not(text: str):
    """Under a parser, a reply that holds no call is its text as it streamed, blanks and all."""
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="qwen3_coder")
    request = {**BASE, "tool_choice": "auto", "structured_outputs": {"regex": re.escape(text)}}
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, **{k: request[k] for k in ("tool_choice", "structured_outputs")})
        [choice] = body["choices"]
        assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"
        response = await client.post("/v1/chat/completions", json={**request, "stream": True})
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e != "[DONE]"]
        assert "".join(d.get("content") or "" for d in deltas) == text
