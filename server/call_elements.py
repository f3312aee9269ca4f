"""Tool calls written as elements of parameter elements, read while they arrive (see
`server/call_stream.py`): Qwen3-Coder's and Seed-OSS's `<function=NAME>` of `<parameter=KEY>`
elements, MiniMax-M2's, DeepSeek-V3.2's and Step3's `<invoke name="NAME">` of `<parameter
name="KEY">` elements (with their prefixes), and GLM's `NAME` of `<arg_key>` / `<arg_value>`
pairs.

A call shows once its first parameter (or the end of its element) is written; each parameter
goes into the arguments once its key is written, a value the schema types as a string as its
characters arrive, any other once its element closes (typed as the whole block's reader types
it).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from server.call_formats import (
    ARG_KEY,
    ARG_VALUE,
    DSML,
    FUNCTION,
    PARAMETER,
    STEP3_CALL,
    STEP3_CALL_END,
    STEP3_SEP,
    STEPTML,
    Schemas,
    glm_name,
    is_text,
    marked_schema,
    properties_of,
    typed,
)
from server.call_stream import PartialCall, TagScanner
from server.json_stream import JsonWriter, escaped

ARG_KEY_END, ARG_VALUE_END = "</arg_key>", "</arg_value>"


@dataclass(slots=True)
class _Value:
    """A parameter's value as its text arrives, written as the whole block's reader writes it:
    a string's characters as they come, anything else once it ends, typed by `schema`."""

    schema: Any
    trim: bool  # one line break after the opening tag and one before the closing one are not its
    _begun: bool = False  # whether its first character has come
    _held: str = ""  # a line break that may end it, and so not be part of it
    _whole: list[str] = field(default_factory=list)  # a value read whole

    @property
    def text(self) -> bool:
        return is_text(self.schema)

    def opening(self) -> str:
        return '"' if self.text else ""

    def more(self, piece: str) -> str:
        """The text `piece` of the value lets be written."""
        if not piece:
            return ""
        if not self.text:
            self._whole.append(piece)
            return ""
        if not self.trim:
            return escaped(piece)
        if not self._begun:
            self._begun, piece = True, piece.removeprefix("\n")
        piece, self._held = self._held + piece, ""
        if piece.endswith("\n"):
            piece, self._held = piece[:-1], "\n"
        return escaped(piece)

    def closing(self) -> str:
        if self.text:
            return '"'
        value = "".join(self._whole)
        if self.trim:
            value = value.removeprefix("\n").removesuffix("\n")
        return json.dumps(typed(value, self.schema))


@dataclass(frozen=True, slots=True)
class ElementTags:
    """How a format writes a call as an element of parameter elements: the tags, the call's
    head (up to `>`) as its name, a parameter's head as its key and its mark (`string="..."`,
    "" where none), and whether a call's body may instead be its arguments' JSON object."""

    function: str
    function_end: str
    parameter: str
    parameter_end: str
    name: Callable[[str], str | None]
    key: Callable[[str], tuple[str, str] | None]
    json_body: bool = False


def _stripped(head: str) -> str | None:
    return head.strip() or None


def _unmarked(head: str) -> tuple[str, str] | None:
    return (head.strip(), "")


_QUOTED = re.compile(r'([^"]+)"')
_MARKED = re.compile(r'([^"]+)"(?: string="(true|false)")?')


def _quoted(head: str) -> str | None:
    named = _QUOTED.fullmatch(head)
    return None if named is None else named.group(1)


def _marked(head: str) -> tuple[str, str] | None:
    keyed = _MARKED.fullmatch(head)
    return None if keyed is None else (keyed.group(1), keyed.group(2) or "")


# Qwen3-Coder's and Seed-OSS's `<function=NAME>` of `<parameter=KEY>` elements.
FUNCTION_ELEMENTS = ElementTags(
    FUNCTION, "</function>", PARAMETER, "</parameter>", _stripped, _unmarked
)


def invoke_elements(prefix: str, before: str = "", after: str = "") -> ElementTags:
    """MiniMax-M2's `<invoke name="NAME">` of `<parameter name="KEY">` elements, or with a
    prefix after each `<` (DeepSeek-V3.2's `｜DSML｜`, Step3's `steptml:`), each invoke
    after `before` and before `after` (Step3's call tags)."""
    return ElementTags(
        f'{before}<{prefix}invoke name="',
        f"</{prefix}invoke>{after}",
        f'<{prefix}parameter name="',
        f"</{prefix}parameter>",
        _quoted,
        _marked,
        json_body=True,
    )


INVOKES, DSML_INVOKES = invoke_elements(""), invoke_elements(DSML)
STEP3_INVOKES = invoke_elements(STEPTML, f"{STEP3_CALL}function{STEP3_SEP}", STEP3_CALL_END)


@dataclass(slots=True)
class Elements(TagScanner):
    """Calls written as elements (`tags`) of parameter elements, the values typed by `schemas`
    as the whole block's reader types them."""

    tags: ElementTags = FUNCTION_ELEMENTS
    schemas: Schemas | None = None
    _properties: dict[str, Any] = field(default_factory=dict)
    _value: _Value = field(default_factory=lambda: _Value(None, True))
    _writer: JsonWriter = field(default_factory=JsonWriter)
    _keys: int = 0

    def _step(self) -> bool:
        tags = self.tags
        if self._state == "between":
            return self._expect(((tags.function, "name"),)) is not None
        if self._state in ("name", "key"):
            end = self._buffer.find(">")
            if end < 0:
                return False
            head, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
            (self._named if self._state == "name" else self._keyed)(head)
            return self._state != "failed"
        if self._state == "body":
            return self._body()
        if self._state == "parameters":
            tag = self._expect(((tags.parameter, "key"), (tags.function_end, "between")))
            if tag == tags.function_end:
                self._show()
                self._write("}" if self._keys else "{}")
            return tag is not None
        if self._state == "json":
            return self._json()
        text, ended = self._until(tags.parameter_end)
        self._write(self._value.more(text))
        if ended:
            self._write(self._value.closing())
            self._state = "parameters"
        return ended

    def _named(self, head: str) -> None:
        name = self.tags.name(head)
        if name is None:
            self._state = "failed"
            return
        self._begin(PartialCall(name))
        self._properties = properties_of(self.schemas, name)
        self._keys, self._state = 0, "body" if self.tags.json_body else "parameters"

    def _body(self) -> bool:
        """A body that opens with `{` is the arguments' JSON object; any other, parameters."""
        rest = self._buffer.lstrip()
        if not rest:
            return False
        if rest.startswith("{"):
            self._buffer, self._writer, self._state = rest, JsonWriter(), "json"
        else:
            self._state = "parameters"
        return True

    def _json(self) -> bool:
        text, ended = self._until(self.tags.function_end)
        self._write_json(self._writer, text)
        if self._call.size > 1:  # a key, or the end: the object has begun well
            self._show()
        if ended:
            self._state = "between"
        return ended

    def _keyed(self, head: str) -> None:
        keyed = self.tags.key(head)
        if keyed is None:
            self._state = "failed"
            return
        key, mark = keyed
        self._value = _Value(marked_schema(mark, self._properties.get(key)), trim=True)
        opening = ("{" if self._keys == 0 else ", ") + json.dumps(key) + ": "
        self._show()
        self._write(opening + self._value.opening())
        self._keys += 1
        self._state = "value"


@dataclass(slots=True)
class GlmCall(TagScanner):
    """GLM's `NAME` then `<arg_key>KEY</arg_key>` and `<arg_value>VALUE</arg_value>` pairs;
    the call's arguments close with its block."""

    schemas: Schemas | None = None
    _state: str = "name"
    _properties: dict[str, Any] = field(default_factory=dict)
    _value: _Value = field(default_factory=lambda: _Value(None, False))

    def _step(self) -> bool:
        if self._state == "name":
            return self._named()
        if self._state == "next":
            return self._expect(((ARG_KEY, "key"),)) is not None
        if self._state == "key":
            return self._keyed()
        if self._state == "open":
            opened = self._expect(((ARG_VALUE, "value"),)) is not None
            if opened:  # a key and its value's tag: the call has begun well
                self._show()
            return opened
        text, ended = self._until(ARG_VALUE_END)
        self._write(self._value.more(text))
        if ended:
            self._write(self._value.closing())
            self._state = "next"
        return ended

    def _named(self) -> bool:
        end = self._buffer.find(ARG_KEY)
        if end < 0:
            return False
        name = glm_name(self._buffer[:end])
        if name is None:
            self._state = "failed"
            return False
        self._begin(PartialCall(name))
        self._properties = properties_of(self.schemas, name)
        self._state = "next"
        self._buffer = self._buffer[end:]
        return True

    def _keyed(self) -> bool:
        end = self._buffer.find(ARG_KEY_END)
        if end < 0:
            return False
        key = self._buffer[:end].strip()
        self._buffer = self._buffer[end + len(ARG_KEY_END) :]
        self._value = _Value(self._properties.get(key), trim=False)
        opening = ("{" if self._call.size == 0 else ", ") + json.dumps(key) + ": "
        self._write(opening + self._value.opening())
        self._state = "open"
        return True
