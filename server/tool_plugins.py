"""`--tool-parser-plugin FILE`: tool-call formats of a deployment's own, in a Python file that
registers them by name for `--tool-call-parser` (as vLLM's flag loads a file of parsers).

The file decorates a function that reads one block of calls, `read(text)`, returning the calls
as `(name, arguments)` pairs (arguments as a dict, or as the JSON text the model wrote) or None
where the text is not calls in its format (it then stays content):

    from server.tool_plugins import tagged_calls

    @tagged_calls("my_model", open="<call>", close="</call>")
    def read(text):
        name, _, arguments = text.partition(" ")
        return [(name.strip(), arguments)] if name.strip() else None

- `tagged_calls(name, open, close)`: calls between tags anywhere in a reply; the text around
  them streams as content, and each block's calls go out once it closes.
- `reply_calls(name, openers)`: a reply that opens with one of `openers` is calls, read whole
  when it ends; any other reply is content.

Conveyor's own parsers' names are taken. Such formats are not enforced for `strict` tools (the
calls are read, not constrained).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from server.call_formats import Calls, Schemas
from server.plugin_files import PluginParsers
from server.tool_parsers import FORMATS, PARSERS, Tagged, WholeReply
from server.tools import tool_call

logger = logging.getLogger(__name__)

# What a plugin's function returns: `(name, arguments)` pairs, or None for no calls.
PluginCalls = list[tuple[str, Any]] | None
PluginReader = Callable[[str], PluginCalls]
PLUGINS = PluginParsers(
    "tool parser", "--tool-parser-plugin", "--tool-call-parser", PARSERS, FORMATS
)


def tagged_calls(name: str, open: str, close: str) -> Callable[[PluginReader], PluginReader]:
    """Register `name`: calls between `open` and `close`, each block read by the function."""
    if not open or not close:
        raise ValueError(f"tool parser {name!r}: give both tags")
    return _registering(name, lambda read: Tagged(open, close, read))


def reply_calls(name: str, openers: tuple[str, ...]) -> Callable[[PluginReader], PluginReader]:
    """Register `name`: a reply that opens with one of `openers` is calls, read whole."""
    if not openers or not all(openers):
        raise ValueError(f"tool parser {name!r}: give the texts a reply of calls opens with")
    return _registering(name, lambda read: WholeReply(tuple(openers), read))


def _registering(
    name: str, form: Callable[[Any], Tagged | WholeReply]
) -> Callable[[PluginReader], PluginReader]:
    PLUGINS.claim(name)

    def register(function: PluginReader) -> PluginReader:
        FORMATS[name] = form(_block_reader(name, function))
        return function

    return register


def _block_reader(name: str, function: PluginReader) -> Callable[..., Calls | None]:
    """The plugin's function as a format's block reader. A function that fails, or returns
    something other than named calls, reads no calls there (the text stays content): a model's
    output cannot fail the request through it. Each such failure is logged."""

    def read(text: str, /, schemas: Schemas | None = None) -> Calls | None:
        try:
            found = function(text)
            return [_call(*call) for call in found] if found else None
        except Exception:
            logger.warning("tool parser %r failed on a reply; read as content", name, exc_info=True)
            return None

    return read


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise TypeError(f"a call needs a name, got {name!r}")
    return tool_call(name, arguments if isinstance(arguments, str) else json.dumps(arguments))
