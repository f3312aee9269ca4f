"""Tools for a model whose chat template has no tool section (the default SmolLM2 is one).

Such a template drops `tools=` and the calls in earlier turns, so the model would never learn
that it may call anything. For these templates the conversation itself carries the tools, in the
Hermes format the `hermes` parser reads:

- the system message (one is added if the conversation has none) ends with the tools, one JSON
  object per line between `<tools>` and `</tools>`, and how to call them:
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant turn that made calls holds them as such blocks after its text;
- a tool result becomes a user turn holding `<tool_response>...</tool_response>` (results in a
  row share one turn).

Whether a template renders tools is found once per template by rendering a probe tool with it.
"""

from __future__ import annotations

import json
from typing import Any

# The parser that reads calls made in the format the written tools teach.
WRITTEN_TOOLS_PARSER = "hermes"
PROBE_NAME = "conveyor_probe_function"
PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_NAME, "parameters": {}}}]

TOOL_INSTRUCTIONS = """\
You can call functions to answer the question. Here are the functions you can call:
<tools>{tools}</tools>
To call functions, reply with a JSON list of calls between <tool_call> and </tool_call>, and \
nothing else, in this form:
<tool_call>[
{{"name": "function_name", "arguments": {{"argument1": "value1", "argument2": "value2"}}}}
]</tool_call>
Give arguments of the type each function's parameters ask for. If no function fits, answer in \
plain text instead."""

_renders: dict[str, bool] = {}
MAX_PROBED = 64


def renders_tools(tokenizer: Any, template: str | None = None) -> bool:
    """Whether the chat template (`template`, else the tokenizer's) writes the tools it is
    given into the prompt."""
    template = template if template is not None else getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return False
    if template not in _renders:
        if len(_renders) >= MAX_PROBED:  # requests' own templates: keep the memory bounded
            _renders.clear()
        _renders[template] = _probe(tokenizer, template)
    return _renders[template]


def _probe(tokenizer: Any, template: str) -> bool:
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}],
            chat_template=template,
            tools=PROBE_TOOLS,
            tokenize=False,
            add_generation_prompt=True,
        )
    except Exception:  # a template that fails on tools does not render them
        return False
    return PROBE_NAME in text


def with_tools_written(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """The conversation with the tools (if any are offered) in its system message, and earlier
    calls and results written out as text."""
    written = _history_as_text(conversation)
    if not tools:
        return written
    instructions = TOOL_INSTRUCTIONS.format(tools=json.dumps(tools))
    if written and written[0]["role"] == "system":
        content = _appended(written[0]["content"], instructions, "\n\n")
        return [{"role": "system", "content": content}, *written[1:]]
    return [{"role": "system", "content": instructions}, *written]


def _appended(content: str | list[dict[str, Any]] | None, text: str, joint: str) -> Any:
    """`text` after a message's content: a string joined on `joint`, or OpenAI's list of parts
    with a text part more."""
    if isinstance(content, list):
        return [*content, {"type": "text", "text": text}]
    return f"{content}{joint}{text}" if content else text


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _history_as_text(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    written: list[dict[str, Any]] = []
    after_result = False
    for message in conversation:
        if message["role"] == "tool":
            response = f"<tool_response>\n{_text(message['content'])}\n</tool_response>"
            if after_result:
                written[-1]["content"] += "\n" + response
            else:
                written.append({"role": "user", "content": response})
            after_result = True
            continue
        after_result = False
        # Other keys (an assistant turn's reasoning_content) stay for the template.
        rest = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if message.get("tool_calls"):
            block = _calls_block(message["tool_calls"])
            rest["content"] = _appended(rest["content"], block, "\n")
        written.append(rest)
    return written


def _calls_block(calls: list[dict[str, Any]]) -> str:
    listed = [
        {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}
        for call in calls
    ]
    return f"<tool_call>{json.dumps(listed)}</tool_call>"
