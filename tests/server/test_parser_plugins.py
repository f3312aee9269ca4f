"""`--tool-parser-plugin` and `--reasoning-parser-plugin`: files of a deployment's own
tool-call formats and reasoning tags, named by `--tool-call-parser` and `--reasoning-parser`
(`server/tool_plugins.py`, `server/reasoning_plugins.py`): calls read from replies whole and
streamed, a failing reader leaving the reply as content, a plugin's tags reading reasoning,
and what is refused before the model loads."""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path

import pytest

from server.call_array import assemble
from server.cli import build_parser, serve, server_settings
from tests.helpers import CHAT_TEMPLATE, tiny_tokenizer
from tests.server.test_tool_calls import BASE, chat, check_call, tool_tokenizer
from tests.server_utils import app_client, blocks_in_use, sse_events

PLUGIN = """
import json

from server.tool_plugins import reply_calls, tagged_calls


@tagged_calls("angle_calls", open="<call>", close="</call>")
def read_tagged(text):
    name, _, arguments = text.strip().partition(" ")
    return [(name, arguments)] if name else None


@reply_calls("plan_calls", openers=("PLAN:",))
def read_plan(text):
    steps = [line.split("=", 1) for line in text.removeprefix("PLAN:").split(";") if line]
    return [(name.strip(), {"city": city.strip(), "unit": "c"}) for name, city in steps]


@tagged_calls("broken_calls", open="<call>", close="</call>")
def read_broken(text):
    raise RuntimeError("this reader fails on every block")
"""

TAGGED = 'Sure.<call>weather {"city": "Oslo", "unit": "c"}</call>'


def plugin_file(tmp_path: Path, text: str = PLUGIN) -> str:
    path = tmp_path / "my_calls.py"
    path.write_text(text)
    return str(path)


def settings_for(tmp_path: Path, parser: str):
    argv = ["serve", "--served-model-name", "tiny", "--tool-parser-plugin", plugin_file(tmp_path)]
    return server_settings(build_parser().parse_args([*argv, "--tool-call-parser", parser]))


def forced(text: str) -> dict:
    return {"structured_outputs": {"regex": re.escape(text)}, "tool_choice": "auto"}


async def test_a_plugins_tagged_calls_are_read_whole_and_streamed(tmp_path):
    settings = settings_for(tmp_path, "angle_calls")
    assert settings.tool_call_parser == "angle_calls"
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, engine):
        body = await chat(client, **forced(TAGGED))
        [choice] = body["choices"]
        assert choice["message"]["content"] == "Sure."
        [call] = choice["message"]["tool_calls"]
        check_call(call)
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo", "unit": "c"}'}
        assert choice["finish_reason"] == "tool_calls"
        response = await client.post(
            "/v1/chat/completions", json={**BASE, **forced(TAGGED), "stream": True}
        )
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.text) if e != "[DONE]"]
        assert "".join(d.get("content") or "" for d in deltas) == "Sure."
        entries = [entry for d in deltas for entry in d.get("tool_calls") or []]
        assert [c["function"] for c in assemble(entries)] == [call["function"]]
        assert blocks_in_use(engine) == 0


async def test_a_plugins_whole_reply_calls_and_plain_replies(tmp_path):
    settings = settings_for(tmp_path, "plan_calls")
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, _):
        body = await chat(client, **forced("PLAN:weather=Oslo;weather=Bergen"))
        calls = body["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
            "Oslo",
            "Bergen",
        ]
        plain = await chat(client, **forced("No plan today."))
        message = plain["choices"][0]["message"]
        assert message["content"] == "No plan today." and not message.get("tool_calls")
        assert plain["choices"][0]["finish_reason"] != "tool_calls"


async def test_a_reader_that_fails_leaves_the_reply_as_content(tmp_path, caplog):
    settings = settings_for(tmp_path, "broken_calls")
    async with app_client(settings, tokenizer=tool_tokenizer()) as (client, engine):
        with caplog.at_level(logging.WARNING, logger="server.tool_plugins"):
            body = await chat(client, **forced(TAGGED))
        message = body["choices"][0]["message"]
        assert message["content"] == TAGGED and not message.get("tool_calls")
        assert "tool parser 'broken_calls' failed" in caplog.text
        assert blocks_in_use(engine) == 0


def test_a_missing_plugin_file_is_refused(tmp_path):
    args = build_parser().parse_args(["serve", "--tool-parser-plugin", str(tmp_path / "no.py")])
    with pytest.raises(ValueError, match="no such file"):
        server_settings(args)


REASONING_PLUGIN = """
from server.reasoning_plugins import reasoning_tags

reasoning_tags("reason_tags", starts=("<reason>",), ends=("</reason>",))
"""


async def test_a_plugins_reasoning_tags_read_a_reply_as_reasoning(tmp_path):
    """A template that opens the reply in the plugin's tag: the random model never closes it,
    so its whole reply is reasoning under the plugin's parser, and content under another."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE.replace("<|assistant|>", "<|assistant|><reason>\n")
    path = plugin_file(tmp_path, REASONING_PLUGIN)
    body = {"model": "tiny", "messages": BASE["messages"], "max_tokens": 12, "temperature": 0}
    replies = {}
    for parser in ("reason_tags", "deepseek_r1"):
        argv = ["serve", "--served-model-name", "tiny", "--reasoning-parser-plugin", path]
        settings = server_settings(build_parser().parse_args([*argv, "--reasoning-parser", parser]))
        async with app_client(settings, tokenizer=tokenizer) as (client, engine):
            response = await client.post("/v1/chat/completions", json={**body, "ignore_eos": True})
            replies[parser] = response.json()["choices"][0]["message"]
            assert blocks_in_use(engine) == 0
    text = replies["deepseek_r1"]["content"]
    assert text and "reasoning" not in replies["deepseek_r1"]
    assert replies["reason_tags"]["reasoning"] == text
    assert replies["reason_tags"]["content"] is None


TOOLS_FLAGS = ("--tool-parser-plugin", "--tool-call-parser")
REASONING_FLAGS = ("--reasoning-parser-plugin", "--reasoning-parser")


@pytest.mark.parametrize(
    ("flags", "plugin", "parser", "reason"),
    [
        (TOOLS_FLAGS, PLUGIN, "nonesuch", "--tool-call-parser 'nonesuch' is not one of"),
        (TOOLS_FLAGS, "import no_such_module_here\n", "hermes", "ModuleNotFoundError"),
        (
            TOOLS_FLAGS,
            "from server.tool_plugins import tagged_calls\n"
            "tagged_calls('hermes', open='<a>', close='</a>')(print)\n",
            "hermes",
            "one of Conveyor's own",
        ),
        (REASONING_FLAGS, REASONING_PLUGIN, "nonesuch", "--reasoning-parser 'nonesuch' is not"),
        (
            REASONING_FLAGS,
            "from server.reasoning_plugins import reasoning_tags\n"
            "reasoning_tags('qwen3', starts=('<a>',), ends=('</a>',))\n",
            "qwen3",
            "one of Conveyor's own",
        ),
        (
            REASONING_FLAGS,
            "from server.reasoning_plugins import reasoning_tags\n"
            "reasoning_tags('bare', starts='<a>', ends='</a>')\n",
            "bare",
            "as tuples of texts",
        ),
    ],
)
def test_what_cannot_serve_stops_the_start_before_the_model_loads(
    tmp_path, caplog, flags, plugin, parser, reason
):
    plugin_flag, parser_flag = flags
    argv = ["serve", plugin_flag, plugin_file(tmp_path, plugin), parser_flag, parser]
    with caplog.at_level(logging.ERROR):
        assert serve(build_parser().parse_args(argv)) == 2
    assert reason in caplog.text
