"""`--chat-template-content-format auto` reads the template (`server/content_format.py`): one
that loops over a message's content takes OpenAI's list of parts, one that prints it a string;
tools written into a conversation of parts (for a template with no tool section) become parts."""

from __future__ import annotations

import copy

import pytest

from server.content_format import content_format, loops_over_content
from server.protocol import ChatMessage
from server.tokenization import chat_prompt
from tests.helpers import tiny_tokenizer

LOOPS = {
    "printed": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", False),
    "looped": (
        "{% for m in messages %}{% for p in m['content'] %}{{ p.text }}{% endfor %}{% endfor %}",
        True,
    ),
    "attribute and filter": (
        "{% for m in messages %}{% for p in m.content | selectattr('type', 'equalto', 'text') %}"
        "{{ p.text }}{% endfor %}{% endfor %}",
        True,
    ),
    "through a variable": (
        "{% for m in messages %}{% set parts = m['content'] %}{% for p in parts %}{{ p.text }}"
        "{% endfor %}{% endfor %}",
        True,
    ),
    "either form": (
        "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
        "{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
        True,
    ),
    "over messages only": ("{% for m in messages %}{{ m.role }}{% endfor %}", False),
    "not a template": ("{% for m in %}", False),
}


@pytest.mark.parametrize("name", list(LOOPS))
def test_auto_gives_parts_to_templates_that_loop_over_the_content(name: str) -> None:
    template, loops = LOOPS[name]
    assert loops_over_content(template) is loops
    assert content_format("auto", template) == ("openai" if loops else "string")
    assert content_format("string", template) == "string"
    assert content_format("openai", template) == "openai"
    assert content_format("auto", None) == "string"


def test_tools_are_written_into_a_conversation_of_parts() -> None:
    """A template with neither tools nor a string content: the instructions for the tools join
    the system message as a part more, an earlier call's block joins its message's parts."""
    tokenizer = copy.deepcopy(tiny_tokenizer())  # shared by other tests
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}[{{ p.text }}]"
        "{% endfor %}{% endfor %}"
    )
    messages = [
        ChatMessage(role="system", content=[{"type": "text", "text": "Be brief."}]),
        ChatMessage(
            role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
        ),
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text, _ = chat_prompt(tokenizer, messages, tools=tools, parts=True)
    assert text.startswith("<system>[Be brief.][") and '"name": "add"' in text
    assert text.endswith("<user>[a][b]")
