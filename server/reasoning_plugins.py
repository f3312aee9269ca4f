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

import logging
from pathlib import Path

from server.plugin_files import import_file
from server.reasoning import PARSERS, TAGS, ThoughtTags

logger = logging.getLogger(__name__)

# Every name a plugin has registered, in order.
_registered: list[str] = []


def reasoning_tags(
    name: str, starts: tuple[str, ...], ends: tuple[str, ...], special: bool = False
) -> None:
    """Register `name`: reasoning opened by any of `starts` and closed by any of `ends`."""
    if name in PARSERS:
        raise ValueError(f"reasoning parser {name!r} is one of Conveyor's own: choose another name")
    if isinstance(starts, str) or isinstance(ends, str):
        raise TypeError(f"reasoning parser {name!r}: give the tags as tuples of texts")
    if not starts or not ends or not all(starts) or not all(ends):
        raise ValueError(f"reasoning parser {name!r}: give its start and end tags")
    TAGS[name] = ThoughtTags(tuple(starts), tuple(ends), special)
    _registered.append(name)


def load_plugin(path: Path) -> list[str]:
    """Import the file at `path`; the reasoning parsers it registered, by name."""
    before = len(_registered)
    import_file(path, "--reasoning-parser-plugin")
    return _registered[before:]


def check_parser(name: str | None) -> None:
    """Refuse a `--reasoning-parser` that neither Conveyor nor a loaded plugin names."""
    if name is not None and name not in PARSERS and name not in TAGS:
        known = ", ".join(sorted({*PARSERS, *TAGS}))
        raise ValueError(f"--reasoning-parser {name!r} is not one of {known}")
