"""Strict functions under `tool_choice: "auto"`: the reply runs free, but a call it opens in the
parser's format names a listed function, a strict function's arguments fit its schema, and
`parallel_tool_calls: false` ends the reply after the first call. Checked on the compiled
format with texts, and end to end on a random model pushed toward the call tag."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest

from engine.structured.compiler import GrammarCompiler
from server.harmony import split_harmony
from server.protocol import ChatCompletionRequest
from server.reasoning import THINK
from server.settings import ServerSettings
from server.strict_tools import strict_calls_format
from server.tool_parsers import parse_calls
from tests.helpers import format_allows, grammar_compiler, tiny_llama, tiny_tokenizer
from tests.server.test_tool_calls import TOOL_TEMPLATE, WEATHER, tool_tokenizer
from tests.server_utils import app_client

STRICT_WEATHER = {
    "type": "function",
    "function": {"name": "weather", "parameters": WEATHER, "strict": True},
}
LOOSE_TIME = {
    "type": "function",
    "function": {"name": "time", "parameters": {"type": "object", "required": ["zone"]}},
}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
OSLO = '{"city": "Oslo", "unit": "c"}'
KELVIN = '{"city": "Oslo", "unit": "k"}'  # not in the strict schema's enum


def request(
    parallel: bool = True, tools: list | None = None, tool_choice: dict | None = None
) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": tools or [STRICT_WEATHER, LOOSE_TIME],
            "parallel_tool_calls": parallel,
            "tool_choice": tool_choice,
        }
    )


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return grammar_compiler()


def hermes(name: str, arguments: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


CASES = {
    "hermes": [
        ("Just an answer.", True, True),
        ("Sure. " + hermes("weather", OSLO), True, True),
        (f'<tool_call>{{"name": "weather", "arguments": {OSLO}}}</tool_call>', True, True),
        (hermes("weather", KELVIN), False, False),
        (hermes("time", '{"zone": "whatever"}'), True, True),  # not strict: any object
        (hermes("time", '"no object"'), False, False),
        (hermes("news", "{}"), False, False),
        (hermes("weather", OSLO) + " and " + hermes("time", '{"zone": 1}'), True, False),
        # one block of a JSON list, as the tools written for a template without a tool section
        # teach, on one line or on its own lines
        (f'<tool_call>[{{"name": "weather", "arguments": {OSLO}}}]</tool_call>', True, True),
        (
            f'<tool_call>[\n{{"name": "weather", "arguments": {OSLO}}},\n'
            '{"name": "time", "arguments": {"zone": 1}}\n]</tool_call>',
            True,
            False,
        ),
        (f'<tool_call>[{{"name": "weather", "arguments": {KELVIN}}}]</tool_call>', False, False),
    ],
    "llama3_json": [
        (f'{{"name": "weather", "parameters": {OSLO}}}', True, True),
        (f'{{"name": "weather", "parameters": {KELVIN}}}', False, False),
        (f'<|python_tag|>{{"name": "weather", "parameters": {OSLO}}}', True, True),
        ("No call.", True, True),
    ],
    "granite": [
        (f'<|tool_call|>[{{"name": "weather", "arguments": {OSLO}}}]', True, True),
        (f'<|tool_call|>[{{"name": "weather", "arguments": {KELVIN}}}]', False, False),
        (
            f'<|tool_call|>[{{"name": "weather", "arguments": {OSLO}}}, '
            '{"name": "time", "arguments": {"zone": 2}}]',
            True,
            False,
        ),
        (f'<|tool_call|>[{{"name": "weather", "arguments": {OSLO}}}] more', False, False),
        (f'<tool_call>[{{"name": "weather", "arguments": {OSLO}}}]', True, True),
    ],
    "phi4_mini_json": [
        (f'functools[{{"name": "weather", "arguments": {OSLO}}}]', True, True),
        (f'functools[{{"name": "weather", "arguments": {KELVIN}}}]', False, False),
    ],
}


@pytest.mark.parametrize(
    ("parser", "text", "parallel_ok", "single_ok"),
    [(parser, *case) for parser, cases in CASES.items() for case in cases],
)
def test_calls_in_each_format(compiler, parser, text, parallel_ok, single_ok) -> None:
    for parallel, allowed in ((True, parallel_ok), (False, single_ok)):
        spec = strict_calls_format(request(parallel), parser)
        assert spec is not None and spec.param == "tools"
        assert format_allows(compiler, spec, text) == allowed, (parallel, text)


def test_no_strict_function_or_no_tag_format_leaves_the_reply_free() -> None:
    assert strict_calls_format(request(tools=[LOOSE_TIME]), "hermes") is None
    assert strict_calls_format(request(), "pythonic") is None
    assert strict_calls_format(request(), None) is None


CALL_TAGS = ["<tool_call>", "</tool_call>"]


def tag_tokenizer():
    """The tiny tokenizer with Qwen's call tags as tokens of their own (not special)."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(CALL_TAGS)
    tokenizer.chat_template = TOOL_TEMPLATE
    return tokenizer


def pushed_into(opening: int) -> dict:
    """A request whose bias makes the model open a call at once, and keep opening it."""
    return {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": [STRICT_WEATHER],
        "parallel_tool_calls": False,
        "logit_bias": {str(opening): 100},
        "max_tokens": 250,
        "seed": 1,
    }


async def one_strict_call(client, body: dict) -> tuple[dict, dict]:
    """The reply's choice and its one call, which names the strict function and fits its
    schema."""
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert choice["finish_reason"] == "tool_calls"
    return choice, call


async def test_a_random_model_pushed_into_a_call_makes_a_valid_one() -> None:
    """A bias makes the model open `<tool_call>` at once, and keep opening it; strict, its one
    call (parallel calls off) is well formed and fits the schema, and the reply ends there."""
    tokenizer = tag_tokenizer()
    [opening] = tokenizer.convert_tokens_to_ids(CALL_TAGS[:1])
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        body = pushed_into(opening)
        choice, _ = await one_strict_call(client, body)
        assert not (choice["message"]["content"] or "").strip()

        loose = {
            **body,
            "tools": [
                {**STRICT_WEATHER, "function": {**STRICT_WEATHER["function"], "strict": False}}
            ],
        }
        response = await client.post("/v1/chat/completions", json=loose)
        [choice] = response.json()["choices"]
        assert not choice["message"].get("tool_calls")  # unconstrained: tag after tag


def test_a_reply_may_open_its_reasoning_before_calls() -> None:
    """Where the reply may open its own thought, `<think>` (a token of its own, as in Qwen3)
    may come first; free text alone does not hold that token."""
    tokenizer = copy.deepcopy(tag_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    compiler = grammar_compiler(tokenizer)
    think, end_think = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    ids = [
        think,
        *tokenizer.encode("Oslo, so weather.", add_special_tokens=False),
        end_think,
        *tokenizer.encode(hermes("weather", OSLO), add_special_tokens=False),
    ]
    for thought, allowed in ((THINK, True), (None, False)):
        spec = strict_calls_format(request(), "hermes", thought)
        assert spec is not None
        matcher = compiler.matcher(spec)
        assert bool(matcher.consume_tokens(ids) and matcher.is_accepting()) == allowed


def allowed(mode: str, *names: str) -> dict:
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}


def test_allowed_tools_under_auto_narrow_the_calls(compiler) -> None:
    """`allowed_tools` in `auto` mode: a call may name only the allowed functions, strict or
    not; free text stays free."""
    spec = strict_calls_format(request(tool_choice=allowed("auto", "time")), "hermes")
    assert spec is not None
    assert format_allows(compiler, spec, "No call needed.")
    assert format_allows(compiler, spec, hermes("time", '{"zone": 4}'))
    assert not format_allows(compiler, spec, hermes("weather", OSLO))


async def test_allowed_tools_required_calls_only_the_allowed_ones() -> None:
    """`required` mode: every call names an allowed function; the template still shows all
    the tools (so a prompt cached with them stays cached)."""
    tokenizer = tool_tokenizer()
    async with app_client(tokenizer=tokenizer) as (client, _):
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": [STRICT_WEATHER, LOOSE_TIME],
            "tool_choice": allowed("required", "weather"),
            "max_tokens": 120,
            "seed": 3,
        }
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        [choice] = response.json()["choices"]
        calls = choice["message"]["tool_calls"]
        assert calls and {call["function"]["name"] for call in calls} == {"weather"}
        for call in calls:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
        rendered = await client.post("/v1/chat/completions/render", json=body)
        prompt = tokenizer.decode(rendered.json()["token_ids"])
        assert "weather:" in prompt and "time:" in prompt


async def test_strict_tools_leave_a_thinking_model_its_thought() -> None:
    """Without a reasoning parser too, a reply may open `<think>` (a token of its own, which
    free text under the format does not hold) before it calls or answers."""
    tokenizer = copy.deepcopy(tag_tokenizer())
    tokenizer.add_tokens(["<think>", "</think>"])
    [think] = tokenizer.convert_tokens_to_ids(["<think>"])
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="hermes")
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        body = {
            "model": "tiny",
            "messages": MESSAGES,
            "tools": [STRICT_WEATHER],
            "logit_bias": {str(think): 100},
            "max_tokens": 4,
            "seed": 1,
        }
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"].startswith("<think>")


def coder_call(name: str, *parameters: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("Plain text.", True),
        (coder_call("weather", ("city", "Oslo"), ("unit", "c")), True),
        (coder_call("weather", ("city", "New\nYork"), ("unit", "f")), True),  # raw text
        (coder_call("weather", ("city", "Oslo"), ("unit", "k")), False),  # not in the enum
        (coder_call("weather", ("unit", "c")), False),  # a required parameter left out
        (coder_call("weather", ("unit", "c"), ("city", "Oslo")), False),  # out of order
        (coder_call("time", ("anything", "[1, 2]")), True),  # not strict: any parameters
        (coder_call("news", ("q", "x")), False),
    ],
)
def test_qwen3_coder_calls_follow_the_schema(compiler, text: str, allowed: bool) -> None:
    spec = strict_calls_format(request(), "qwen3_coder")
    assert spec is not None
    assert format_allows(compiler, spec, text) == allowed
    if allowed and text.startswith("<tool_call>"):  # the parser reads what the format allows
        [call] = parse_calls("qwen3_coder", text, {"weather": WEATHER})[1]
        assert call["function"]["name"] in ("weather", "time")


def glm_call(name: str, *pairs: tuple[str, str], separator: str = "\n") -> str:
    body = "".join(
        f"<arg_key>{key}</arg_key>{separator}<arg_value>{value}</arg_value>{separator}"
        for key, value in pairs
    )
    return f"<tool_call>{name}{separator}{body}</tool_call>"


def minimax_call(*invokes: tuple[str, list[tuple[str, str]]]) -> str:
    body = "".join(
        f'<invoke name="{name}">\n'
        + "".join(f'<parameter name="{key}">{value}</parameter>\n' for key, value in pairs)
        + "</invoke>\n"
        for name, pairs in invokes
    )
    return f"<minimax:tool_call>\n{body}</minimax:tool_call>"


def kimi_calls(*calls: tuple[str, str]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{arguments}"
        "<|tool_call_end|>"
        for i, (name, arguments) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def deepseek_calls(*calls: tuple[str, str], version: str) -> str:
    if version == "v3":
        each = [
            f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```"
            "<｜tool▁call▁end｜>"
            for name, arguments in calls
        ]
    else:
        each = [
            f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>"
            for name, arguments in calls
        ]
    separator = "\n" if version == "v3" else ""
    return f"<｜tool▁calls▁begin｜>{separator.join(each)}<｜tool▁calls▁end｜>"


def seed_call(name: str, *pairs: tuple[str, str]) -> str:
    body = "".join(f"<parameter={key}>{value}</parameter>\n" for key, value in pairs)
    return f"<seed:tool_call>\n<function={name}>\n{body}</function>\n</seed:tool_call>"


def dsml_call(name: str, *parameters: tuple[str, str, str]) -> str:
    """DeepSeek-V3.2's calls block of one call, each parameter `(key, string mark, value)`."""
    body = "".join(
        f'<｜DSML｜parameter name="{key}" string="{mark}">{value}</｜DSML｜parameter>\n'
        for key, mark, value in parameters
    )
    invoke = f'<｜DSML｜invoke name="{name}">\n{body}</｜DSML｜invoke>\n'
    return f"<｜DSML｜function_calls>\n{invoke}</｜DSML｜function_calls>"


def step3_call(name: str, *pairs: tuple[str, str]) -> str:
    body = "".join(f'<steptml:parameter name="{k}">{v}</steptml:parameter>' for k, v in pairs)
    return (
        "<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜>"
        f'<steptml:invoke name="{name}">{body}</steptml:invoke><｜tool_call_end｜>'
        "<｜tool_calls_end｜>"
    )


def json_call(name: str, arguments: str, key: str = "arguments") -> str:
    return f'{{"name": "{name}", "{key}": {arguments}}}'


def longcat(*calls: str) -> str:
    return "".join(f"<longcat_tool_call>{call}</longcat_tool_call>" for call in calls)


OSLO_PAIRS = [("city", "Oslo"), ("unit", "c")]
NATIVE_CASES = [
    # (parser, text, allowed with parallel calls, allowed with one call)
    ("glm45", "Plain text.", True, True),
    ("glm45", "Let me see. " + glm_call("weather", *OSLO_PAIRS), True, True),
    ("glm45", glm_call("weather", ("city", "New\nYork"), ("unit", "f")), True, True),
    ("glm45", glm_call("weather", ("city", "Oslo"), ("unit", "k")), False, False),
    ("glm45", glm_call("weather", ("unit", "c")), False, False),
    ("glm45", glm_call("time", ("anything", "[1]")), True, True),
    ("glm45", glm_call("news", ("q", "x")), False, False),
    ("glm45", glm_call("weather", *OSLO_PAIRS) + "\n" + glm_call("time"), True, False),
    ("glm47", glm_call("weather", *OSLO_PAIRS, separator=""), True, True),
    ("glm47", glm_call("weather", ("city", "Oslo"), ("unit", "k"), separator=""), False, False),
    ("seed_oss", "Sure. " + seed_call("weather", *OSLO_PAIRS), True, True),
    ("seed_oss", seed_call("weather", ("city", "Oslo"), ("unit", "k")), False, False),
    ("seed_oss", seed_call("weather", ("unit", "c"), ("city", "Oslo")), False, False),
    ("seed_oss", seed_call("weather", *OSLO_PAIRS) + "\n" + seed_call("time"), True, False),
    ("minimax_m2", minimax_call(("weather", OSLO_PAIRS)), True, True),
    ("minimax_m2", minimax_call(("weather", [("city", "Oslo"), ("unit", "k")])), False, False),
    ("minimax_m2", minimax_call(("weather", OSLO_PAIRS), ("time", [("zone", "1")])), True, False),
    ("minimax_m2", minimax_call(("news", [])), False, False),
    ("kimi_k2", "Checking. " + kimi_calls(("weather", OSLO)), True, True),
    ("kimi_k2", kimi_calls(("weather", KELVIN)), False, False),
    ("kimi_k2", kimi_calls(("weather", OSLO), ("time", '{"zone": 1}')), True, False),
    ("kimi_k2", kimi_calls(("news", "{}")), False, False),
    ("deepseek_v3", deepseek_calls(("weather", OSLO), version="v3"), True, True),
    ("deepseek_v3", deepseek_calls(("weather", KELVIN), version="v3"), False, False),
    ("deepseek_v3", deepseek_calls(("weather", OSLO), ("time", "{}"), version="v3"), True, False),
    ("deepseek_v31", "Sure. " + deepseek_calls(("weather", OSLO), version="v31"), True, True),
    ("deepseek_v31", deepseek_calls(("weather", KELVIN), version="v31"), False, False),
    ("deepseek_v31", deepseek_calls(("time", '"no object"'), version="v31"), False, False),
    (
        "deepseek_v32",
        "Sure. " + dsml_call("weather", ("city", "true", "Oslo"), ("unit", "true", "c")),
        True,
        True,
    ),
    (
        "deepseek_v32",
        dsml_call("weather", ("city", "true", "Oslo"), ("unit", "true", "k")),
        False,
        False,
    ),
    # A string is marked as one.
    (
        "deepseek_v32",
        dsml_call("weather", ("city", "false", '"Oslo"'), ("unit", "true", "c")),
        False,
        False,
    ),
    ("deepseek_v32", dsml_call("news"), False, False),
    (
        "deepseek_v4",
        dsml_call("weather", ("city", "true", "Oslo"), ("unit", "true", "c")).replace(
            "function_calls>", "tool_calls>"
        ),
        True,
        True,
    ),
    (
        "deepseek_v4",
        dsml_call("weather", ("city", "true", "Oslo"), ("unit", "true", "k")).replace(
            "function_calls>", "tool_calls>"
        ),
        False,
        False,
    ),
    ("mistral", "Sure. [TOOL_CALLS]weather[ARGS]" + OSLO, True, True),
    ("mistral", "[TOOL_CALLS]weather[ARGS]" + KELVIN, False, False),
    ("mistral", "[TOOL_CALLS]weather[ARGS]" + OSLO + "[TOOL_CALLS]time[ARGS]{}", True, False),
    ("mistral", "[TOOL_CALLS]weather[ARGS]" + OSLO + " And then some text.", False, False),
    ("mistral", "[TOOL_CALLS]news[ARGS]{}", False, False),
    ("mistral", f"[TOOL_CALLS][{json_call('weather', OSLO)}]", True, True),
    (
        "mistral",
        f"[TOOL_CALLS] [{json_call('weather', OSLO)}, {json_call('time', '{}')}]",
        True,
        False,
    ),
    ("mistral", f"[TOOL_CALLS][{json_call('weather', KELVIN)}]", False, False),
    ("step3", "Sure. " + step3_call("weather", *OSLO_PAIRS), True, True),
    ("step3", step3_call("weather", ("city", "Oslo"), ("unit", "k")), False, False),
    ("step3", step3_call("news", ("q", "x")), False, False),
    ("apertus", f'Sure. <|tools_prefix|>[{{"weather": {OSLO}}}]<|tools_suffix|>', True, True),
    ("apertus", f'<|tools_prefix|>[{{"weather": {KELVIN}}}]<|tools_suffix|>', False, False),
    (
        "apertus",
        f'<|tools_prefix|>[{{"weather": {OSLO}}}, {{"time": {{}}}}]<|tools_suffix|>',
        True,
        False,
    ),
    ("longcat", "Sure. " + longcat(json_call("weather", OSLO)), True, True),
    ("longcat", longcat(json_call("weather", KELVIN)), False, False),
    ("longcat", longcat(json_call("weather", OSLO), json_call("time", "{}")), True, False),
    (
        "internlm",
        "<|action_start|><|plugin|>\n"
        + json_call("weather", OSLO, "parameters")
        + "<|action_end|>",
        True,
        True,
    ),
    (
        "internlm",
        "<|action_start|><|plugin|>" + json_call("weather", KELVIN) + "<|action_end|>",
        False,
        False,
    ),
    ("hunyuan_a13b", f"<tool_calls>[{json_call('weather', OSLO)}]</tool_calls>", True, True),
    ("hunyuan_a13b", f"<tool_calls>[{json_call('weather', KELVIN)}]</tool_calls>", False, False),
    (
        "jamba",
        f"<tool_calls>[{json_call('weather', OSLO)}, {json_call('time', '{}')}]</tool_calls>",
        True,
        False,
    ),
    ("jamba", f"<tool_calls>[{json_call('news', '{}')}]</tool_calls>", False, False),
    (
        "minimax",
        f"<tool_calls>\n{json_call('weather', OSLO)}\n{json_call('time', '{}')}\n</tool_calls>",
        True,
        False,
    ),
    ("minimax", f"<tool_calls>\n{json_call('weather', KELVIN)}\n</tool_calls>", False, False),
]


@pytest.mark.parametrize(("parser", "text", "parallel_ok", "single_ok"), NATIVE_CASES)
def test_native_formats_follow_the_schema(compiler, parser, text, parallel_ok, single_ok):
    """GLM's, Seed-OSS's, MiniMax's, Kimi K2's, DeepSeek's, LongCat's, InternLM's, Hunyuan's and
    Jamba's calls: a strict function's in
    its schema, others free, only listed names, one call without parallel calls; what the
    format allows, the parser reads as calls."""
    for parallel, allowed in ((True, parallel_ok), (False, single_ok)):
        spec = strict_calls_format(request(parallel), parser)
        assert spec is not None
        assert format_allows(compiler, spec, text) == allowed, (parallel, text)
    if parallel_ok and "weather" in text:
        calls = parse_calls(parser, text, {"weather": WEATHER})[1]
        assert calls and calls[0]["function"]["name"] == "weather"
        if "Oslo" in text:
            assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}


KIMI_TAGS = [
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
]


async def test_a_model_whose_call_tags_are_special_tokens_makes_and_returns_a_valid_call():
    """Kimi K2's tags are special tokens: the format writes them as those tokens, the reply's
    text keeps them (the parser's tags are special in this tokenizer), and the call is read
    back, its id as Kimi's template writes it."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(KIMI_TAGS, special_tokens=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    opening = tokenizer.convert_tokens_to_ids(KIMI_TAGS[0])
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="kimi_k2")
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        _, call = await one_strict_call(client, pushed_into(opening))
        assert re.fullmatch(r"functions\.weather:[0-9]+", call["id"]), call["id"]


async def test_a_mistral_model_makes_and_returns_a_valid_call():
    """Mistral's `[TOOL_CALLS]` and `[ARGS]` are special tokens: pushed into `[TOOL_CALLS]`, a
    random model writes one call in either of Mistral's forms, and it is read back whole."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.add_tokens(["[TOOL_CALLS]", "[ARGS]"], special_tokens=True)
    tokenizer.chat_template = TOOL_TEMPLATE
    opening = tokenizer.convert_tokens_to_ids("[TOOL_CALLS]")
    settings = ServerSettings(served_model_name="tiny", tool_call_parser="mistral")
    model = tiny_llama(vocab_size=len(tokenizer))
    async with app_client(settings, model=model, tokenizer=tokenizer) as (client, _):
        choice, _ = await one_strict_call(client, pushed_into(opening))
        assert choice["message"]["content"] is None


ANALYSIS = "<|channel|>analysis<|message|>Call the tool.<|end|><|start|>assistant"
HARMONY_CASES = [
    (ANALYSIS + "<|channel|>commentary to=functions.weather <|constrain|>json<|message|>"
     + OSLO + "<|call|>", True),
    ("<|start|>assistant to=functions.weather<|channel|>commentary json<|message|>" + OSLO
     + "<|call|>", True),
    (ANALYSIS + "<|channel|>commentary to=functions.weather <|constrain|>json<|message|>"
     + KELVIN + "<|call|>", False),
    (ANALYSIS + "<|channel|>commentary to=functions.news <|constrain|>json<|message|>{}<|call|>",
     False),
    # A name that begins with a listed one is not that one.
    (ANALYSIS + "<|channel|>commentary to=functions.weathers<|message|>{}<|call|>", False),
    (ANALYSIS + "<|channel|>final<|message|>It is sunny.<|return|>", True),
]  # fmt: skip


@pytest.mark.parametrize(("text", "allowed"), HARMONY_CASES)
def test_harmony_calls_follow_the_schema(compiler, text: str, allowed: bool) -> None:
    """gpt-oss's messages to functions: only listed ones, a strict function's body in its
    schema, the header as gpt-oss writes it; what the format allows reads as the call."""
    spec = strict_calls_format(request(True), "openai")
    assert spec is not None
    assert format_allows(compiler, spec, text) == allowed
    if allowed and "functions." in text:
        [call] = split_harmony(text)[2]
        assert call["function"]["name"] == "weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Oslo", "unit": "c"}
