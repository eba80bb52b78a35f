"""Markdown reference of every config key, generated from the JSON Schemas (the README embeds it).

Covers both programs' configs and the edge relay's bandwidth-budget file.

``python -m relay_common.configdoc`` prints it, ``--update README.md`` rewrites the README's sections
between ``<!-- config:NAME -->`` markers; a test keeps the README in step with the schemas.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from relay_common.config import load_schema

SCHEMAS = {
    "edge-relay": "edge-relay-config.schema.json",
    "cloud-ingest": "cloud-ingest-config.schema.json",
    "bandwidth-budget": "bandwidth-budget.schema.json",
}


def _type(sub: Mapping[str, Any]) -> str:
    if "enum" in sub:
        return " \\| ".join(f"`{v}`" for v in sub["enum"])
    t = sub.get("type", "")
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
        description = sub.get("description", "").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")
        yield key, _type(sub), default, description
        if sub.get("type") == "object" and "properties" in sub:
            yield from _rows(sub, f"{key}.")
        if sub.get("type") == "array" and "properties" in sub.get("items", {}):
            yield from _rows(sub["items"], f"{key}[].")


def markdown(program: str) -> str:
    schema = load_schema(SCHEMAS[program])
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, typ, default, desc in _rows(schema):
        lines.append(f"| `{key}` | {typ} | {f'`{default}`' if default else ''} | {desc} |")
    return "\n".join(lines)


def section(program: str) -> str:
    return f"<!-- config:{program} -->\n{markdown(program)}\n<!-- /config:{program} -->"


def update(text: str) -> str:
    for program in SCHEMAS:
        pattern = re.compile(rf"<!-- config:{program} -->.*?<!-- /config:{program} -->", re.S)
        text = pattern.sub(lambda _m, p=program: section(p), text)
    return text


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--update":
        with open(sys.argv[2], encoding="utf-8") as f:
            text = f.read()
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            f.write(update(text))
        return
    for program in SCHEMAS:
        print(section(program) + "\n")


if __name__ == "__main__":
    main()
