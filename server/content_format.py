"""How a chat template takes a message's content (vLLM's `--chat-template-content-format`): as
one string, or as OpenAI's list of parts (`[{"type": "text", "text": ...}]`), which templates
written for image-text models, and some text ones, loop over. `auto` reads the template: one
that loops over a message's content takes parts."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")


def content_format(setting: str, template: str | None) -> str:
    """`string` or `openai` for the template under `--chat-template-content-format setting`."""
    if setting != "auto":
        return setting
    return "openai" if template is not None and loops_over_content(template) else "string"


@lru_cache(maxsize=16)
def loops_over_content(template: str) -> bool:
    """Whether the Jinja template has a `for` loop over a message's `content` (directly, through
    filters, or through a variable set to it). A template that does not parse does not."""
    from jinja2 import Environment, TemplateSyntaxError, nodes

    try:
        tree = Environment().parse(template)
    except TemplateSyntaxError:
        return False
    names = {
        node.target.name
        for node in tree.find_all(nodes.Assign)
        if isinstance(node.target, nodes.Name) and _is_content(node.node)
    }
    for loop in tree.find_all(nodes.For):
        iterated = _unfiltered(loop.iter)
        if _is_content(iterated) or (isinstance(iterated, nodes.Name) and iterated.name in names):
            return True
    return False


def _unfiltered(node: Any) -> Any:
    """The expression under any filters applied to it (`content | selectattr(...)`)."""
    from jinja2 import nodes

    while isinstance(node, nodes.Filter) and node.node is not None:
        node = node.node
    return node


def _is_content(node: Any) -> bool:
    """`x['content']` or `x.content`."""
    from jinja2 import nodes

    node = _unfiltered(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False
