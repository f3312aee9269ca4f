"""The output format a request asks for, from whichever field it uses: OpenAI's
`response_format`, vLLM's `structured_outputs`, or vLLM's older `guided_*` fields. A request
that names a format always gets it enforced; naming two is an error."""

from __future__ import annotations

import json
from typing import Any

from engine.core.errors import InvalidRequestError
from engine.core.sampling_params import StructuredOutputs
from server import json_text
from server.json_style import PLAIN, JsonStyle
from server.protocol import ResponseFormat, SamplingFields, StructuredOutputsFields
from server.reasoning import ThoughtTags


def structured_outputs(body: SamplingFields, style: JsonStyle = PLAIN) -> StructuredOutputs | None:
    """The one format `body` asks for, or None for free text; a JSON one written in the
    server's `style` with the request's own options on top."""
    found = [
        spec
        for spec in (
            _response_format(body.response_format),
            _structured_outputs(body.structured_outputs),
            *_guided(body),
        )
        if spec is not None
    ]
    if len(found) > 1:
        names = ", ".join(spec.param for spec in found)
        raise InvalidRequestError(
            f"Only one output format may be given; this request gives {names}.",
            param=found[1].param,
        )
    if not found:
        return None
    options = body.structured_outputs
    asked = JsonStyle.of(options.model_dump()) if options is not None else PLAIN
    return asked.over(style).applied(found[0])


def _response_format(value: ResponseFormat | None) -> StructuredOutputs | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return StructuredOutputs("json_object", param="response_format")
    if value.type == "structural_tag":
        fields = value.model_dump(include={"format", "structures", "triggers", "at_least_one"})
        tag = {name: given for name, given in fields.items() if given is not None}
        return StructuredOutputs("structural_tag", json.dumps(tag), "response_format")
    if value.json_schema is None:
        raise InvalidRequestError(
            "response_format of type json_schema needs a json_schema with a schema.",
            param="response_format",
        )
    return StructuredOutputs("json", _compact_json(value.json_schema.schema_), "response_format")


def _structured_outputs(value: StructuredOutputsFields | None) -> StructuredOutputs | None:
    if value is None:
        return None
    given = [
        kind
        for kind, present in (
            ("json", value.json_ is not None),
            ("regex", value.regex is not None),
            ("choice", value.choice is not None),
            ("grammar", value.grammar is not None),
            ("json_object", bool(value.json_object)),
            ("structural_tag", value.structural_tag is not None),
        )
        if present
    ]
    if len(given) != 1:
        raise InvalidRequestError(
            "structured_outputs must give exactly one of json, regex, choice, grammar, "
            f"json_object or structural_tag; it gives {len(given)}.",
            param="structured_outputs",
        )
    kind = given[0]
    param = f"structured_outputs.{kind}"
    if kind == "json":
        return StructuredOutputs("json", _compact_json(value.json_), param)
    if kind == "regex":
        return StructuredOutputs("regex", value.regex or "", param)
    if kind == "choice":
        return StructuredOutputs("choice", json.dumps(value.choice), param)
    if kind == "grammar":
        return StructuredOutputs("grammar", value.grammar or "", param)
    if kind == "structural_tag":
        return StructuredOutputs("structural_tag", _compact_json(value.structural_tag), param)
    return StructuredOutputs("json_object", param=param)


def _guided(body: SamplingFields) -> list[StructuredOutputs | None]:
    return [
        None
        if body.guided_json is None
        else StructuredOutputs("json", _compact_json(body.guided_json), "guided_json"),
        None
        if body.guided_regex is None
        else StructuredOutputs("regex", body.guided_regex, "guided_regex"),
        None
        if body.guided_choice is None
        else StructuredOutputs("choice", json.dumps(body.guided_choice), "guided_choice"),
        None
        if body.guided_grammar is None
        else StructuredOutputs("grammar", body.guided_grammar, "guided_grammar"),
    ]


def _compact_json(schema: Any) -> str:
    """A schema or structural tag as compact JSON text (its keys in their order: the
    properties' order is the output's), so that equal ones share one compiled grammar; a
    string is taken as JSON text already."""
    if isinstance(schema, str):
        try:
            schema = json_text.loads(schema)
        except ValueError:
            return schema  # the compiler reads it, or reports it as not JSON
    return json.dumps(schema, separators=(",", ":"))


def thought_first(spec: StructuredOutputs, tags: ThoughtTags) -> StructuredOutputs:
    """`spec` after an optional thought between `tags`: for a thinking model whose reply may
    open its own thought (Qwen3's template leaves `<think>` to the reply), which may think
    first and then writes the format. A structural tag, which says where thoughts go itself,
    and a format that cannot be read (its compile reports it) are kept as they are."""
    node = _format_node(spec)
    if node is None:
        return spec
    tag = {"format": after_optional_thought(node, tags)}
    return StructuredOutputs("structural_tag", json.dumps(tag), spec.param)


# Structural tag nodes: nothing at all, and a choice of nodes or nothing.
NOTHING: dict[str, Any] = {"type": "const_string", "value": ""}


def optional(*nodes: dict[str, Any]) -> dict[str, Any]:
    return {"type": "or", "elements": [*nodes, NOTHING]}


def after_optional_thought(node: dict[str, Any], tags: ThoughtTags) -> dict[str, Any]:
    """The structural tag node of `node` after a thought between `tags`, or none."""
    thoughts = [
        {"type": "tag", "begin": start, "content": {"type": "any_text"}, "end": tags.ends[0]}
        for start in tags.starts
    ]
    return {"type": "sequence", "elements": [optional(*thoughts), node]}


def _format_node(spec: StructuredOutputs) -> dict[str, Any] | None:
    """The structural tag node of a format, or None."""
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex" and spec.spec:
        return {"type": "regex", "pattern": spec.spec}
    if spec.kind == "grammar" and spec.spec.strip():
        return {"type": "grammar", "grammar": spec.spec}
    try:
        value = json_text.loads(spec.spec) if spec.kind in ("json", "choice") else None
    except ValueError:
        return None
    if spec.kind == "json" and isinstance(value, dict | bool):
        return {"type": "json_schema", "json_schema": value}
    if spec.kind != "choice" or not isinstance(value, list) or not value:
        return None
    if not all(isinstance(choice, str) and choice for choice in value):
        return None
    return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}
