"""Tool calls read out of text, for the parser tests: as a stream would hand it over in pieces,
and reduced to what a client compares."""

from __future__ import annotations

import json
from typing import Any

from server.call_array import assemble
from server.tool_parsers import reader_for


def names_and_arguments(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def read_in_pieces(
    parser: str, text: str, size: int, schemas: dict[str, Any] | None = None
) -> tuple[str | None, list[dict[str, Any]]]:
    """What `parser`'s streaming reader makes of `text` fed `size` characters at a time: the
    content (None if only blanks, as `parse_calls` gives it) and the calls."""
    reader = reader_for(parser, schemas)
    content, entries = "", []
    for start in range(0, len(text), size):
        piece, more = reader.feed(text[start : start + size])
        content += piece
        entries += more
    rest, more = reader.finish()
    content, entries = content + rest, entries + more
    return (content if content.strip() else None), assemble(entries)
