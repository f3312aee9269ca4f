"""`--reasoning-parser-plugin FILE`: the reasoning tags of a deployment's own models, in a Python
file that registers them by name for `--reasoning-parser` (as vLLM's flag loads a file of
parsers). A reply's text between a start tag and an end tag is its reasoning, as with
Conveyor's own parsers (`server/reasoning.py`):

    from server.reasoning_plugins import reasoning_tags

    reasoning_tags("my_model", starts=("<reason>",), ends=("</reason>",))

`special=True` where the tags are special tokens of the model's tokenizer (the reply's text
then keeps them, which it must to be read). Conveyor's own parsers' names are taken.
"""

from __future__ import annotations

from server.plugin_files import PluginParsers
from server.reasoning import PARSERS, TAGS, ThoughtTags

PLUGINS = PluginParsers(
    "reasoning parser", "--reasoning-parser-plugin", "--reasoning-parser", PARSERS, TAGS
)


def reasoning_tags(
    name: str, starts: tuple[str, ...], ends: tuple[str, ...], special: bool = False
) -> None:
    """Register `name`: reasoning opened by any of `starts` and closed by any of `ends`."""
    PLUGINS.claim(name)
    if isinstance(starts, str) or isinstance(ends, str):
        raise TypeError(f"reasoning parser {name!r}: give the tags as tuples of texts")
    if not starts or not ends or not all(starts) or not all(ends):
        raise ValueError(f"reasoning parser {name!r}: give its start and end tags")
    TAGS[name] = ThoughtTags(tuple(starts), tuple(ends), special)
