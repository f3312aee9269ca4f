"""Tools for templates with no tool section: the conversation carries them, and the calls and
results of earlier turns, in the Hermes format the `hermes` parser reads."""

from __future__ import annotations

import copy
import json

from server.tool_parsers import parse_calls
from server.tool_prompt import renders_tools, with_tools_written
from tests.helpers import tiny_tokenizer

TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def tokenizer_with(template: str):
    tokenizer = copy.deepcopy(tiny_tokenizer())
    tokenizer.chat_template = template
    return tokenizer


def test_the_probe_tells_templates_that_render_tools_from_those_that_do_not():
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tools = "{% for t in tools or [] %}{{ t.function.name }}{% endfor %}" + plain
    failing = "{{ raise_exception('no tools') if tools else '' }}" + plain
    assert not renders_tools(tokenizer_with(plain))
    assert renders_tools(tokenizer_with(tools))
    assert not renders_tools(tokenizer_with(failing))


def test_tools_go_after_the_system_message_or_in_a_new_one():
    user = {"role": "user", "content": "Oslo?"}
    added = with_tools_written([user], TOOLS)
    assert [m["role"] for m in added] == ["system", "user"]
    assert json.dumps(TOOLS) in added[0]["content"]
    kept = with_tools_written([{"role": "system", "content": "Be brief."}, user], TOOLS)
    assert (
        kept[0]["content"].startswith("Be brief.\n\n") and json.dumps(TOOLS) in kept[0]["content"]
    )


def test_earlier_calls_and_results_are_written_as_text_the_parser_reads_back():
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": {"city": "Oslo"}},
    }
    conversation = [
        {"role": "user", "content": "Oslo and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "12C", "tool_call_id": "call_1"},
        {"role": "tool", "content": "20C", "tool_call_id": "call_1"},
    ]
    written = with_tools_written(conversation, None)
    assert [m["role"] for m in written] == ["user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in written)
    content, calls = parse_calls("hermes", written[1]["content"])
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("weather", {"city": "Oslo"}),
        ("weather", {"city": "Oslo"}),
    ]
    assert written[2]["content"] == (
        "<tool_response>\n12C\n</tool_response>\n<tool_response>\n20C\n</tool_response>"
    )


def test_a_conversation_without_tools_is_unchanged():
    conversation = [{"role": "system", "content": "Hi."}, {"role": "user", "content": "Yo."}]
    assert with_tools_written(conversation, None) == conversation
