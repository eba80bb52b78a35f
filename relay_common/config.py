"""Configuration loading shared by both programs.

A config file is YAML, validated against a JSON Schema shipped in the ``schemas`` package. The schema
is the single place where every key, its type, its default and its meaning are written down; this
module fills in the defaults from it, so code never repeats them.  Every error names the file, the
key (as a dotted path) and what was expected.
"""

from __future__ import annotations

import copy
import json
import math
import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


class ConfigError(ValueError):
    """A config file that cannot be used; the message names file, key and expectation."""


@cache
def load_schema(name: str) -> dict[str, Any]:
    path = SCHEMA_DIR / name
    with path.open(encoding="utf-8") as f:
        schema: dict[str, Any] = json.load(f)
    return schema


def _key_path(path: Any) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else str(p) for p in path]
    text = ".".join(parts).replace(".[", "[")
    return text or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    key = _key_path(error.absolute_path)
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    if error.validator == "additionalProperties":
        allowed = sorted(schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed)) if isinstance(error.instance, dict) else []
        where = "" if key == "(top level)" else f" under `{key}`"
        return (
            f"unknown key {', '.join(f'`{e}`' for e in extra)}{where}; expected one of: {', '.join(allowed)}"
        )
    if error.validator == "required":
        return f"`{key}`: {error.message}"
    expected = schema.get("description", "")
    hint = f" (expected: {expected})" if expected else ""
    return f"key `{key}`: {error.message}{hint}"


def _types(schema: Mapping[str, Any]) -> set[str]:
    """A schema's ``type`` as a set (JSON Schema allows one name or a list: ``["object", "array"]``)."""
    t = schema.get("type", ())
    return {t} if isinstance(t, str) else set(t)


def _resolve(root: Mapping[str, Any], schema: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schema`` with a local ``$ref`` (``#/properties/...``) replaced by what it points to."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return schema
    target: Any = root
    for part in ref[2:].split("/"):
        target = target[part]
    return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}


def apply_defaults(schema: Mapping[str, Any], value: Any, root: Mapping[str, Any] | None = None) -> Any:
    """Return ``value`` with every missing property that has a schema default filled in."""
    root = schema if root is None else root
    schema = _resolve(root, schema)
    if "object" in _types(schema) and isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            # Sections default to {} in the schema; optional sections (like tls) have no default and
            # stay absent, so "not configured" remains visible.
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = apply_defaults(sub, value[name], root)
        extra_schema = schema.get("additionalProperties")
        if isinstance(extra_schema, Mapping):
            for name in value:
                if name not in schema.get("properties", {}):
                    value[name] = apply_defaults(extra_schema, value[name], root)
    elif "array" in _types(schema) and isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        return [apply_defaults(schema["items"], item, root) for item in value]
    return value


def _non_finite(value: Any, path: tuple[str | int, ...] = ()) -> tuple[str | int, ...] | None:
    """Path of the first NaN/Inf number; JSON Schema bounds cannot refuse NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, sub in items:
        found = _non_finite(sub, (*path, key))
        if found is not None:
            return found
    return None


def validate(data: Any, schema_name: str, source: str) -> dict[str, Any]:
    """Validate ``data`` against the named schema and return it with defaults applied."""
    schema = load_schema(schema_name)
    bad = _non_finite(data)
    if bad is not None:
        sub: Any = schema
        for part in bad:
            sub = sub.get("items", {}) if isinstance(part, int) else sub.get("properties", {}).get(part, {})
        hint = f" (expected: {sub['description']})" if sub.get("description") else ""
        raise ConfigError(
            f"{source}: invalid configuration:\n  key `{_key_path(bad)}`: not a finite number{hint}"
        )
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(data), key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        lines = "\n  ".join(_describe(e) for e in errors[:10])
        raise ConfigError(f"{source}: invalid configuration:\n  {lines}")
    result = apply_defaults(schema, copy.deepcopy(data))
    assert isinstance(result, dict)
    return result


EnvOverride = tuple[str, tuple[str, ...], type]


def load(
    path: str | os.PathLike[str], schema_name: str, env_overrides: tuple[EnvOverride, ...] = ()
) -> dict[str, Any]:
    """Read, override from the environment, validate, fill defaults."""
    data = read(path)
    for key_path, env_names, cast in env_overrides:
        _env_override(data, key_path, env_names, cast)
    return validate(data, schema_name, os.fspath(path))


def read(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's top-level mapping, not yet validated (for checks that must see the raw YAML)."""
    source = os.fspath(path)
    try:
        text = Path(source).read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{source}: cannot read config file: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text (byte {e.start}): save the file as UTF-8") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{source}: not valid YAML{where}: {getattr(e, 'problem', e)}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def _env_override(config: dict[str, Any], key_path: str, env_names: tuple[str, ...], cast: type) -> None:
    """Let an environment variable override one key (first set variable wins)."""
    for env in env_names:
        raw = os.environ.get(env)
        if raw is None or raw == "":
            continue
        try:
            value = cast(raw)
        except ValueError as e:
            raise ConfigError(f"environment variable {env}={raw!r}: expected {cast.__name__}") from e
        *parents, last = key_path.split(".")
        node = config
        for p in parents:
            if isinstance(node.get(p), list) and node[p] and isinstance(node[p][0], dict):
                node = node[p][0]  # a section given as a list (of targets): the first one's key
                continue
            if not isinstance(node.get(p), dict):
                node[p] = {}  # an empty YAML section (`mqtt:`) reads as None
            node = node[p]
        node[last] = value
        return


def check_range(section: dict[str, Any], name: str, low_key: str, high_key: str, source: str) -> None:
    """Refuse a pair of keys where the maximum is below the minimum."""
    if section[high_key] < section[low_key]:
        raise ConfigError(
            f"{source}: key `{name}.{high_key}`: expected a value >= {name}.{low_key} "
            f"({section[low_key]}), got {section[high_key]}"
        )
