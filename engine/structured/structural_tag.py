"""A structural tag as llguidance's grammar: the `structural_tag` output format of vLLM and
SGLang, in either of its two shapes.

- The first: `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`: free text, in
  which each structure starts once the text writes one of the triggers (a prefix of its
  `begin`), and its JSON follows the structure's schema up to its `end`.
- The second: `{"format": FORMAT}`, FORMAT one of `const_string`, `json_schema`, `grammar`,
  `regex`, `any_text`, `sequence`, `or`, `tag`, `triggered_tags` and `tags_with_separator`,
  nested as xgrammar defines them. The first shape is one `triggered_tags`.

Free text (`any_text`, and the text around triggered tags) runs to the end of the output or to
the literal that closes it (the end of the tag it sits in); it ends at the first place that
literal appears. Elsewhere, followed by a format that could begin anywhere, it is refused.

A literal that is one of the tokenizer's special tokens (`<|python_tag|>`, and any token added
to the vocabulary, such as Qwen's `<tool_call>`) stands for that token, not for its spelling
in text; free text holds no such token."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.structured.grammar import JSON_OPTIONS, lark_of
from engine.structured.schema_objects import closed_objects

# What follows a format: the end of the output, a literal that closes it, or a format that
# could begin anywhere (so free text cannot tell where it stops).
END_OF_OUTPUT = "end of output"
UNKNOWN = "unknown"

TAG_LISTS = ("triggered_tags", "tags_with_separator")
LEAVES = ("const_string", "json_schema", "grammar", "regex", "any_text")
FORMATS = (*LEAVES, "sequence", "or", "tag", *TAG_LISTS)

# Metacharacters of llguidance's regular expressions, with the slash that delimits a terminal.
_REGEX_META = set("\\.+*?()|[]{}^$#&-~/")
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class FormatError(ValueError):
    """A structural tag that cannot be read, with the path of the part at fault."""


@dataclass(slots=True)
class _Grammar:
    """The Lark grammar being written: its rules, terminals and subgrammars."""

    special: dict[str, int]
    lines: list[str] = field(default_factory=list)
    subgrammars: list[dict[str, str]] = field(default_factory=list)
    # Rules and terminals by their text, so that equal ones are written once.
    names: dict[str, str] = field(default_factory=dict)
    # Splits text at the special tokens (made on first use).
    splitter: re.Pattern[str] | None = None

    def name(self, prefix: str) -> str:
        return f"{prefix}{len(self.lines) + len(self.subgrammars)}"

    def rule(self, body: str, lazy: bool = False) -> str:
        return self._define("r", ("[lazy]: " if lazy else ": ") + body)

    def terminal(self, body: str) -> str:
        return self._define("T", ": " + body)

    def _define(self, prefix: str, definition: str) -> str:
        key = prefix + definition
        if key not in self.names:
            self.names[key] = self.name(prefix)
            self.lines.append(self.names[key] + definition)
        return self.names[key]

    def pieces(self, text: str) -> list[str]:
        """`text` as Lark items: its special tokens as `<[id]>`, the rest as string literals."""
        if not text:
            return []
        if not self.special:
            return [_string(text)]
        if self.splitter is None:
            tokens = sorted(self.special, key=len, reverse=True)
            self.splitter = re.compile("(" + "|".join(map(re.escape, tokens)) + ")")
        parts = self.splitter.split(text)
        return [
            f"<[{self.special[part]}]>" if part in self.special else _string(part)
            for part in parts
            if part
        ]

    def literal(self, text: str) -> str:
        return " ".join(self.pieces(text))


def structural_tag_grammar(spec: str, special: dict[str, int]) -> str:
    """llguidance's grammar for the structural tag `spec` (JSON text of either shape);
    `special` maps the tokenizer's special tokens to their ids. Raises `FormatError`."""
    try:
        value = json.loads(spec)
    except ValueError as error:
        raise FormatError(f"the structural tag is not JSON ({error})") from None
    except RecursionError:
        raise FormatError("the structural tag nests too deeply") from None
    grammar = _Grammar(special)
    try:
        start = _format(grammar, _top_format(value), "format", END_OF_OUTPUT)
    except RecursionError:
        raise FormatError("the structural tag nests too deeply") from None
    main = "\n".join(["%llguidance {}", f"start: {start or _EMPTY}", *grammar.lines])
    if not grammar.subgrammars:
        return main
    return json.dumps({"grammars": [{"name": "main", "lark_grammar": main}, *grammar.subgrammars]})


def _top_format(value: Any) -> dict[str, Any]:
    _need(isinstance(value, dict), "structural_tag", "must be an object")
    if "format" in value:
        _need(isinstance(value["format"], dict), "format", "must be an object")
        return value["format"]
    _need(
        "structures" in value and "triggers" in value,
        "structural_tag",
        "needs a format, or structures and triggers",
    )
    structures = value["structures"]
    _need(isinstance(structures, list), "structures", "must be a list")
    tags = []
    for i, structure in enumerate(structures):
        _need(isinstance(structure, dict), f"structures[{i}]", "must be an object")
        schema = structure.get("schema")
        content = {"type": "json_schema", "json_schema": True if schema is None else schema}
        tags.append(
            {"begin": structure.get("begin"), "content": content, "end": structure.get("end")}
        )
    return {
        "type": "triggered_tags",
        "triggers": value["triggers"],
        "tags": tags,
        "at_least_one": value.get("at_least_one", False),
    }


def _format(grammar: _Grammar, node: Any, path: str, follow: str) -> str:
    """Lark items matching `node` and then `follow` when `follow` is a literal."""
    _need(isinstance(node, dict), path, "must be an object")
    kind = node.get("type")
    _need(
        kind in FORMATS,
        f"{path}.type",
        f"must be one of {', '.join(FORMATS)}, not {json.dumps(kind)}",
    )
    if kind == "sequence":
        return _sequence(grammar, node, path, follow)
    if kind == "or":
        elements = _list(node, "elements", path)
        options = [
            _format(grammar, e, f"{path}.elements[{i}]", follow) for i, e in enumerate(elements)
        ]
        return grammar.rule(" | ".join(o or _EMPTY for o in options))
    if kind == "tag":
        return _tag(grammar, node, path, follow)
    if kind == "any_text":
        return _text(grammar, node, path, follow)
    if kind == "triggered_tags":
        return _triggered(grammar, node, path, follow)
    if kind == "tags_with_separator":
        return _separated(grammar, node, path, follow)
    return _join(_leaf(grammar, node, path), _closing(grammar, follow))


def _sequence(grammar: _Grammar, node: dict[str, Any], path: str, follow: str) -> str:
    elements = _list(node, "elements", path)
    last = len(elements) - 1
    return _join(
        *(
            _format(grammar, e, f"{path}.elements[{i}]", follow if i == last else UNKNOWN)
            for i, e in enumerate(elements)
        )
    )


def _tag(grammar: _Grammar, node: dict[str, Any], path: str, follow: str) -> str:
    begin, end = _string_field(node, "begin", path), _string_field(node, "end", path)
    content = node.get("content")
    if end:
        return _join(
            grammar.literal(begin),
            _format(grammar, content, f"{path}.content", end),
            _closing(grammar, follow),
        )
    return _join(grammar.literal(begin), _format(grammar, content, f"{path}.content", follow))


def _text(grammar: _Grammar, node: dict[str, Any], path: str, follow: str) -> str:
    """Any text not holding one of `excluded_str`, up to the first `follow`."""
    excluded = node.get("excluded_str", [])
    _need(
        isinstance(excluded, list) and all(isinstance(s, str) and s for s in excluded),
        f"{path}.excluded_str",
        "must be a list of non-empty strings",
    )
    return _free_text(grammar, follow, f"{path} (any_text)", excluded)


def _free_text(grammar: _Grammar, follow: str, path: str, excluded: Sequence[str] = ()) -> str:
    body = "/(?s:.*)/"
    if excluded:
        body += " & ~/(?s:.*)(?:" + "|".join(_regex_escape(s) for s in excluded) + ")(?s:.*)/"
    text = grammar.terminal(body)
    if follow == END_OF_OUTPUT:
        return text
    _need(
        follow != UNKNOWN,
        path,
        "free text must end the output or a tag's content (with a non-empty end)",
    )
    pieces = grammar.pieces(follow)
    if pieces[0].startswith("<["):  # text stops where the special token comes
        return _join(text, *pieces)
    return _join(grammar.rule(f"{text} {pieces[0]}", lazy=True), *pieces[1:])


def _triggered(grammar: _Grammar, node: dict[str, Any], path: str, follow: str) -> str:
    triggers = _list(node, "triggers", path)
    _need(
        all(isinstance(t, str) and t for t in triggers),
        f"{path}.triggers",
        "must be non-empty strings",
    )
    tags = _tags(grammar, node, path)
    at_least_one, stop_after_first = _flags(node, path)
    bare, triggered = [], []
    for i, (begin, rest) in enumerate(tags):
        matching = [t for t in triggers if begin.startswith(t)]
        _need(len(matching) == 1, f"{path}.tags[{i}].begin", "must start with exactly one trigger")
        trigger = matching[0]
        bare.append(_join(grammar.literal(begin), rest))
        lead = _free_text(grammar, trigger, f"{path}.tags[{i}]")
        triggered.append(_join(lead, grammar.literal(begin[len(trigger) :]), rest))
    then = grammar.rule(" | ".join(triggered))  # a tag after free text
    first = grammar.rule(" | ".join(bare)) if at_least_one else then
    if stop_after_first:
        once = _join(first, _closing(grammar, follow))
        if at_least_one:
            return once
        rest_of_output = _free_text(grammar, follow, f"{path} (text without a tag)")
        return grammar.rule(f"{once} | {rest_of_output}")
    tail = _free_text(grammar, follow, f"{path} (text after the tags)")
    return _join(first if at_least_one else "", f"{then}*", tail)


def _separated(grammar: _Grammar, node: dict[str, Any], path: str, follow: str) -> str:
    tags = _tags(grammar, node, path)
    separator = _string_field(node, "separator", path)
    at_least_one, stop_after_first = _flags(node, path)
    one = grammar.rule(" | ".join(_join(grammar.literal(b), rest) for b, rest in tags))
    if stop_after_first:
        items = one
    else:
        items = grammar.rule(_join(one, f"({_join(grammar.literal(separator), one)})*"))
    return _join(items if at_least_one else f"{items}?", _closing(grammar, follow))


def _tags(grammar: _Grammar, node: dict[str, Any], path: str) -> list[tuple[str, str]]:
    """Each tag's begin, and Lark items for the rest of it (content and end)."""
    tags = []
    for i, tag in enumerate(_list(node, "tags", path)):
        at = f"{path}.tags[{i}]"
        _need(isinstance(tag, dict), at, "must be an object")
        _need(tag.get("type", "tag") == "tag", f"{at}.type", 'must be "tag"')
        begin = _string_field(tag, "begin", at)
        without_begin = {**tag, "type": "tag", "begin": ""}
        tags.append((begin, _tag(grammar, without_begin, at, UNKNOWN)))
    return tags


def _leaf(grammar: _Grammar, node: dict[str, Any], path: str) -> str:
    kind = node["type"]
    if kind == "const_string":
        return grammar.literal(_string_field(node, "value", path))
    if kind == "json_schema":
        schema = node.get("json_schema")
        if not isinstance(schema, dict | bool):
            raise FormatError(f"{path}.json_schema must be a JSON Schema")
        return "%json " + json.dumps(_with_json_options(schema))
    if kind == "regex":
        pattern = _string_field(node, "pattern", path)
        _need(bool(pattern), f"{path}.pattern", "must not be empty")
        return grammar.terminal("/" + _slashes_escaped(pattern) + "/")
    text = _string_field(node, "grammar", path)
    _need(bool(text.strip()), f"{path}.grammar", "must not be empty")
    name = grammar.name("g")
    grammar.subgrammars.append({"name": name, "lark_grammar": lark_of(text)})
    return "@" + name


def _with_json_options(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """The schema as `%json` takes it: JSON written as everywhere else, objects that list
    their properties closed."""
    if schema is True:
        schema = {}
    if schema is False:
        schema = {"not": {}}
    closed: dict[str, Any] = closed_objects(schema)
    return {**closed, "x-guidance": {**JSON_OPTIONS, **closed.get("x-guidance", {})}}


def _closing(grammar: _Grammar, follow: str) -> str:
    return "" if follow in (END_OF_OUTPUT, UNKNOWN) else grammar.literal(follow)


def _flags(node: dict[str, Any], path: str) -> tuple[bool, bool]:
    flags = node.get("at_least_one", False), node.get("stop_after_first", False)
    for name, flag in zip(("at_least_one", "stop_after_first"), flags, strict=True):
        _need(isinstance(flag, bool), f"{path}.{name}", "must be true or false")
    return flags


def _list(node: dict[str, Any], key: str, path: str) -> list[Any]:
    value = node.get(key)
    if not isinstance(value, list) or not value:
        raise FormatError(f"{path}.{key} must be a non-empty list")
    return value


def _string_field(node: dict[str, Any], key: str, path: str) -> str:
    value = node.get(key, "")
    _need(isinstance(value, str), f"{path}.{key}", "must be a string")
    return value


def _join(*items: str) -> str:
    return " ".join(item for item in items if item)


def _string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    """`text` as a regex matching itself, in llguidance's syntax."""
    out = []
    for char in text:
        if char in _REGEX_META:
            out.append("\\" + char)
        elif char.isprintable() and not char.isspace():
            out.append(char)
        else:
            out.append(f"\\x{{{ord(char):x}}}")
    return "".join(out)


def _slashes_escaped(pattern: str) -> str:
    """`pattern` to sit between slashes: each unescaped `/` escaped, and each line break, tab or
    other control character, raw or escaped by a backslash (as `re.escape` writes one), spelled
    as an escape (a Lark regex holds none raw)."""
    out: list[str] = []
    escaped = False
    for char in pattern:
        if not char.isprintable():
            if escaped:
                out.pop()  # the backslash escaped the character itself
            out.append(_CONTROL_ESCAPES.get(char, f"\\x{{{ord(char):x}}}"))
            escaped = False
            continue
        if char == "/" and not escaped:
            out.append("\\")
        out.append(char)
        escaped = char == "\\" and not escaped
    return "".join(out)


def _need(ok: bool, path: str, message: str) -> None:
    if not ok:
        raise FormatError(f"{path} {message}")


_EMPTY = '""'
