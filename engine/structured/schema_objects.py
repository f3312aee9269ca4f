"""Which objects of a JSON Schema may hold properties it does not list.

JSON Schema lets an object hold any property its schema does not rule out, so
`{"properties": {"city": ...}}` allows `{"city": "Paris", "notes": ...}`: a weak model then
writes keys of its own invention until it runs out of tokens. vLLM's default backend (xgrammar
in its strict mode), SGLang and llama.cpp's server enforce such a schema as closed: an object
that lists its properties (`properties` or `patternProperties`) and says nothing of others
(`additionalProperties`, `unevaluatedProperties`) holds those alone. Conveyor enforces every
JSON Schema so; vLLM's guidance backend leaves them open, which `with_objects(schema, True)`
writes out in the schema, so that nothing closes them.

An object whose keys may come from elsewhere too is left as the schema says: one that combines
its own properties with `allOf`, `anyOf`, `oneOf`, `if`/`then`/`else`, `dependentSchemas` or
`$ref`, those branches' own objects, and every branch of an `allOf`. Closing either would rule
out the keys the other adds. So is one that requires keys it does not list. Objects
without listed properties (`{"type": "object"}`) stay any object, as in xgrammar.

Arrays that list their first items (`prefixItems`, or the older `items` list) and say nothing
of the rest are held to those items alike (`"items": false`, `"additionalItems": false`), as
xgrammar's strict mode holds them, unless they ask for more (`minItems` past the list,
`contains`) or combine with another schema.
"""

from __future__ import annotations

from typing import Any

# Schema keywords whose value is a map of names to schemas, a list of schemas, or one schema
# (`items` either: a list is the older form of `prefixItems`).
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
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
# Keywords that apply their schemas to the same object: the properties those list are the
# object's too.
IN_PLACE = ("allOf", "anyOf", "oneOf", "if", "then", "else", "dependentSchemas", "$ref")


def closed_objects(schema: Any) -> Any:
    """`schema` with each object that lists its properties and says nothing of others closed
    (`"additionalProperties": false`), and each array that lists its first items ended after
    them; raises RecursionError for a schema nested past Python's
    stack."""
    return with_objects(schema, False)


def with_objects(schema: Any, others: bool) -> Any:
    """`schema` (left as it is) with `"additionalProperties": others` on each object that lists
    its properties, says nothing of others and combines with no other schema, and the items
    past the listed ones of each such array allowed or not (`others`) alike."""
    return _walk(schema, others, combined=False)


def _walk(schema: Any, others: bool, combined: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    result = dict(schema)
    properties = "properties" in result or "patternProperties" in result
    tuple_items = _tuple_items_key(result)
    lists = properties or tuple_items is not None
    for key in SCHEMA_MAPS:
        if isinstance(result.get(key), dict):
            joined = key == "dependentSchemas" and lists
            subs = result[key].items()
            result[key] = {name: _walk(sub, others, joined) for name, sub in subs}
    for key in SCHEMA_LISTS:
        if isinstance(result.get(key), list):
            joined = key == "allOf" or (key in IN_PLACE and lists)
            result[key] = [_walk(sub, others, joined) for sub in result[key]]
    for key in SCHEMA_ONES:
        if key in result:
            joined = key in IN_PLACE and lists
            result[key] = _walk(result[key], others, joined)
    says = "additionalProperties" in result or "unevaluatedProperties" in result
    combines = any(key in result for key in IN_PLACE)
    alone = not combined and not combines
    if properties and not says and alone and not _expects_unlisted(result):
        result["additionalProperties"] = others
    if tuple_items is not None and alone and not _expects_more_items(result):
        result[tuple_items] = others
    return result


def _tuple_items_key(schema: dict[str, Any]) -> str | None:
    """For an array that lists its first items (`prefixItems`, or `items` as a list) and says
    nothing of the rest, the keyword that would (`items`, `additionalItems`); else None."""
    if "unevaluatedItems" in schema:
        return None
    if isinstance(schema.get("prefixItems"), list) and "items" not in schema:
        return "items"
    if isinstance(schema.get("items"), list) and "additionalItems" not in schema:
        return "additionalItems"
    return None


def _expects_more_items(schema: dict[str, Any]) -> bool:
    """Whether a listed array expects items beyond those it lists: `minItems` asks for more,
    or `contains` may want one that none of them is."""
    listed = schema.get("prefixItems", schema.get("items"))
    least = schema.get("minItems")
    many = isinstance(least, int) and isinstance(listed, list) and least > len(listed)
    return many or "contains" in schema


def _expects_unlisted(schema: dict[str, Any]) -> bool:
    """Whether the object expects keys beyond those it lists: `required` or `dependentRequired`
    names one, `minProperties` asks for more than it lists (without `patternProperties`), or
    the older `dependencies` may add some."""
    listed = schema.get("properties")
    listed = listed if isinstance(listed, dict) else {}
    names = list(schema.get("required") or [])
    dependent = schema.get("dependentRequired")
    if isinstance(dependent, dict):
        names += [name for group in dependent.values() if isinstance(group, list) for name in group]
    least = schema.get("minProperties")
    many = isinstance(least, int) and least > len(listed) and "patternProperties" not in schema
    return many or "dependencies" in schema or any(name not in listed for name in names)
