"""vLLM's options for how enforced JSON is written, server-wide (`--structured-outputs-config`)
or per request (`structured_outputs`): `disable_any_whitespace` (no blank after `,` and `:`),
`whitespace_pattern` (whitespace between tokens matching a regex, instead of the fixed
separators), and `backend: "guidance"`, under which objects that list their properties stay
open to others (as vLLM's guidance backend leaves them) unless `disable_additional_properties`.
They rewrite the schema the request's format compiles: options for llguidance's JSON compiler
under the schema's `x-guidance`, objects opened in place, so that each way of writing a schema
is its own compiled grammar."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from engine.core.sampling_params import StructuredOutputs
from engine.structured.schema_objects import with_objects
from server import json_text

# The backend names under which vLLM leaves objects open: its guidance backend's.
OPEN_BACKENDS = ("guidance",)


@dataclass(frozen=True, slots=True)
class JsonStyle:
    compact: bool = False
    # `disable_additional_properties`: objects closed whatever the backend.
    closed: bool = False
    # The server's backend is vLLM's guidance: objects the schema leaves open stay open.
    open_backend: bool = False
    whitespace_pattern: str | None = None

    @classmethod
    def of(cls, fields: dict[str, Any]) -> JsonStyle:
        """The style vLLM's option names ask for (the others in `fields` are not read here)."""
        pattern = fields.get("whitespace_pattern")
        return cls(
            compact=bool(fields.get("disable_any_whitespace")),
            closed=bool(fields.get("disable_additional_properties")),
            open_backend=fields.get("backend") in OPEN_BACKENDS,
            whitespace_pattern=pattern if isinstance(pattern, str) and pattern else None,
        )

    def over(self, base: JsonStyle) -> JsonStyle:
        """This (a request's) style on top of the server's: what either turns on."""
        return JsonStyle(
            self.compact or base.compact,
            self.closed or base.closed,
            self.open_backend or base.open_backend,
            self.whitespace_pattern or base.whitespace_pattern,
        )

    @property
    def open_objects(self) -> bool:
        return self.open_backend and not self.closed

    def applied(self, spec: StructuredOutputs) -> StructuredOutputs:
        """`spec` written in this style (a JSON format's schema rewritten; other formats, and
        a schema that is not a JSON object, as they are)."""
        rewrites = self.compact or self.whitespace_pattern is not None or self.open_objects
        if not rewrites or spec.kind not in ("json", "json_object"):
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
        if self.open_objects:
            schema = with_objects(schema, True)
        options = dict(schema.get("x-guidance") or {})
        if self.compact or self.whitespace_pattern is not None:
            options.update(item_separator=",", key_separator=":")
        if self.whitespace_pattern is not None:  # around the bare separators and brackets
            options.update(whitespace_flexible=True, whitespace_pattern=self.whitespace_pattern)
        if options:
            schema = {**schema, "x-guidance": options}
        return replace(spec, kind="json", spec=json.dumps(schema, separators=(",", ":")))


# Conveyor's own way: `, ` and `: ` between items, no other whitespace, objects that list
# their properties closed.
PLAIN = JsonStyle()
