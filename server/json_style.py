"""vLLM's options for how enforced JSON is written, server-wide (`--structured-outputs-config`)
or per request (`structured_outputs`): `disable_any_whitespace` (no blank after `,` and `:`),
`disable_additional_properties` (an object schema that does not say otherwise lists all its
properties) and `whitespace_pattern` (whitespace between tokens matching a regex, instead of
the fixed separators). They rewrite the schema the request's format compiles: options for
llguidance's JSON compiler under the schema's `x-guidance`, objects closed in place, so that
each way of writing a schema is its own compiled grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from engine.core.sampling_params import StructuredOutputs
from server import json_text

# Schema keywords whose value is a map of names to schemas, a list of schemas, or one schema.
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONES = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "not",
    "if",
    "then",
    "else",
    "contains",
    "propertyNames",
)


@dataclass(frozen=True, slots=True)
class JsonStyle:
    compact: bool = False
    closed: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def of(cls, fields: dict[str, Any]) -> JsonStyle:
        """The style vLLM's option names ask for (the others in `fields` are not read here)."""
        pattern = fields.get("whitespace_pattern")
        return cls(
            compact=bool(fields.get("disable_any_whitespace")),
            closed=bool(fields.get("disable_additional_properties")),
            whitespace_pattern=pattern if isinstance(pattern, str) and pattern else None,
        )

    def over(self, base: JsonStyle) -> JsonStyle:
        """This (a request's) style on top of the server's: what either turns on."""
        return JsonStyle(
            self.compact or base.compact,
            self.closed or base.closed,
            self.whitespace_pattern or base.whitespace_pattern,
        )

    def applied(self, spec: StructuredOutputs) -> StructuredOutputs:
        """`spec` written in this style (a JSON format's schema rewritten; other formats, and
        a schema that is not a JSON object, as they are)."""
        if self == PLAIN or spec.kind not in ("json", "json_object"):
            return spec
        if spec.kind == "json_object":
            schema: Any = {"type": "object"}
        else:
            try:
                schema = json_text.loads(spec.spec)  # nested no deeper than can be rewritten
            except ValueError:
                return spec  # the compiler reports it, naming the field
        if not isinstance(schema, dict):
            return spec
        if self.closed:
            schema = closed_objects(schema)
        options = dict(schema.get("x-guidance") or {})
        if self.compact or self.whitespace_pattern is not None:
            options.update(item_separator=",", key_separator=":")
        if self.whitespace_pattern is not None:  # around the bare separators and brackets
            options.update(whitespace_flexible=True, whitespace_pattern=self.whitespace_pattern)
        if options:
            schema = {**schema, "x-guidance": options}
        return replace(spec, kind="json", spec=json.dumps(schema, separators=(",", ":")))


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that does not say otherwise closed
    (`"additionalProperties": false`), through every place a schema may nest."""
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    for key in SCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            result[key] = {name: closed_objects(sub) for name, sub in result[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(result.get(key), list):
            result[key] = [closed_objects(sub) for sub in result[key]]
    for key in SCHEMA_ONES:
        if key in result:
            result[key] = closed_objects(result[key])
    kind = result.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    is_object = is_object or "properties" in result
    if is_object and "additionalProperties" not in result:
        result["additionalProperties"] = False
    return result


# Conveyor's own way: `, ` and `: ` between items, no other whitespace, objects as their
# schemas say.
PLAIN = JsonStyle()
