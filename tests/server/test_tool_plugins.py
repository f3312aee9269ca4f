"""`--tool-parser-plugin`: a file of a deployment's own tool-call formats, named by
`--tool-call-parser` (`server/tool_plugins.py`): calls read from replies whole and streamed,
a failing reader leaving the reply as content, and what is refused before the model loads."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from server.call_array import assemble
from server.cli import build_parser, serve, server_settings
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


@pytest.mark.parametrize(
    ("plugin", "parser", "reason"),
    [
        (PLUGIN, "nonesuch", "--tool-call-parser 'nonesuch' is not one of"),
        ("import no_such_module_here\n", "hermes", "ModuleNotFoundError"),
        (
            "from server.tool_plugins import tagged_calls\n"
            "tagged_calls('hermes', open='<a>', close='</a>')(print)\n",
            "hermes",
            "one of Conveyor's own",
        ),
    ],
)
def test_what_cannot_serve_stops_the_start_before_the_model_loads(
    tmp_path, caplog, plugin, parser, reason
):
    argv = ["serve", "--tool-parser-plugin", plugin_file(tmp_path, plugin)]
    args = build_parser().parse_args([*argv, "--tool-call-parser", parser])
    with caplog.at_level(logging.ERROR):
        assert serve(args) == 2
    assert reason in caplog.text


def test_a_missing_plugin_file_is_refused(tmp_path):
    args = build_parser().parse_args(["serve", "--tool-parser-plugin", str(tmp_path / "no.py")])
    with pytest.raises(ValueError, match="no such file"):
        server_settings(args)
