"""Markdown reference of every config key, generated from the JSON Schemas (``docs/configuration.md``).

Covers both programs' configs and the edge relay's bandwidth-budget file.

``python -m relay_common.configdoc`` prints it, ``--update docs/configuration.md`` rewrites that file's
sections between ``<!-- config:NAME -->`` markers; a test keeps the file in step with the schemas.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from relay_common import docsections
from relay_common.config import load_schema

TAG = "config"
DOCUMENT = "docs/configuration.md"

SCHEMAS = {
    "edge-relay": "edge-relay-config.schema.json",
    "cloud-ingest": "cloud-ingest-config.schema.json",
    "bandwidth-budget": "bandwidth-budget.schema.json",
}


def _type(sub: Mapping[str, Any]) -> str:
    if "enum" in sub:
        return " \\| ".join(f"`{v}`" for v in sub["enum"])
    t = sub.get("type", "")
    if isinstance(t, list):
        t = t[0]  # ["object", "array"]: a section that may also be a list of them (its description says so)
    if t == "array":
        return "list"
    if t == "object" and "additionalProperties" in sub and "properties" not in sub:
        return "map of string"
    return str(t)


def _rows(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        default = "required" if name in required else json.dumps(sub["default"]) if "default" in sub else ""
        description = docsections.cell(sub.get("description", ""))
        yield key, _type(sub), default, description
        if "object" in sub.get("type", ()) and "properties" in sub:
            yield from _rows(sub, f"{key}.")
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            yield from _rows(sub["items"], f"{key}[].")


def markdown(program: str) -> str:
    schema = load_schema(SCHEMAS[program])
    rows = (
        (f"`{key}`", typ, f"`{default}`" if default else "", desc)
        for key, typ, default, desc in _rows(schema)
    )
    return docsections.table(("key", "type", "default", "meaning"), rows)


REFERENCE = docsections.Reference(
    tag=TAG,
    document=DOCUMENT,
    names=tuple(SCHEMAS),
    markdown=markdown,
    description="Config reference generated from the JSON Schemas",
)
section = REFERENCE.section
update = REFERENCE.update


def main(argv: Sequence[str] = ()) -> None:
    REFERENCE.main(argv, prog="python -m relay_common.configdoc")


if __name__ == "__main__":
    main(sys.argv[1:])
