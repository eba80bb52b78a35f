"""The shipped files generated from the records: the budget schema's enums and the GPU recording rules.

JSON Schema and Prometheus cannot import the registry, so their copies of it are written from it:

- ``schemas/bandwidth-budget.schema.json``: ``classes[].preset``'s enum and description (each preset's
  ``summary``), and ``anomaly.presets``' enum and description (which presets imply which GPU exporter).
  Only those four values are rewritten, in place: the rest of the file, its layout included, is the
  hand-written schema's.
- ``deploy/prometheus/rules/gpu-vendors.rules.yml``: the whole file, from each record's ``rules``.

``python -m vendors.generate --update`` rewrites both (from the repository's root); ``--check`` exits 1
when one is stale. ``tests/common/test_vendor_registry.py`` fails when the shipped files differ from these.
"""

from __future__ import annotations

import json
import re
import sys
import textwrap
from pathlib import Path
from typing import Any, Final

from vendors import registry
from vendors.record import RecordingRule, RuleSection

SCHEMA_PATH: Final = "schemas/bandwidth-budget.schema.json"
RULES_PATH: Final = "deploy/prometheus/rules/gpu-vendors.rules.yml"

_COUNT_WORDS: Final = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


# --- the budget schema ---------------------------------------------------------------------------


def preset_description() -> str:
    parts = ", ".join(f"{name} ({preset.summary})" for name, preset in registry.PRESETS.items())
    return f"Built-in matchers: {parts}. Combined with `match` by OR."


def anomaly_presets_description() -> str:
    """Which class presets imply which GPU exporter: ``dcgm*`` for a record's own ``dcgm``,
    ``dcgm-critical``, ``kepler-gpu: dcgm`` for another record's preset."""
    groups = []
    for gpu in registry.GPUS:
        implied = [p for p, g in registry.PRESET_GPUS.items() if g == gpu]
        own = [p for p in implied if p == gpu or p.startswith(f"{gpu}-")]
        tokens = [f"{gpu}*"] if own else []
        tokens += [f"{p}: {gpu}" for p in implied if p not in own]
        groups.append(", ".join(tokens))
    n = len(registry.GPUS)
    count = _COUNT_WORDS[n] if n < len(_COUNT_WORDS) else str(n)
    return (
        "Which vendors' rules run (by the GPU exporter scraped). Default: the vendors of the classes' "
        f"presets ({'; '.join(groups)}), all {count} when no class names one."
    )


_STRING: Final = r'"(?:[^"\\]|\\.)*"'
# (where, pattern): each pattern's groups 2 and 4 are the enum list and the description string.
_SCHEMA_SPOTS: Final = (
    (
        "classes[].preset",
        re.compile(rf'("preset": \{{\s*"enum": )(\[[^\]]*\])(,\s*"description": )({_STRING})'),
    ),
    (
        "anomaly.presets",
        re.compile(
            r'("presets": \{\s*"type": "array",\s*"uniqueItems": true,\s*"items": \{\s*"enum": )'
            rf'(\[[^\]]*\])(\s*\}},\s*"description": )({_STRING})'
        ),
    ),
)


def _json_list(values: list[str], old: str) -> str:
    """``values`` as JSON in the layout of the list it replaces (one line, or one item a line)."""
    if "\n" not in old:
        return json.dumps(values)
    item_indent = re.match(r"\[\n([ \t]*)", old)
    close_indent = re.search(r"\n([ \t]*)\]$", old)
    if item_indent is None or close_indent is None:
        return json.dumps(values)
    lead = item_indent.group(1)
    items = ",\n".join(f"{lead}{json.dumps(v)}" for v in values)
    return f"[\n{items}\n{close_indent.group(1)}]"


def budget_schema(text: str) -> str:
    """``text`` (the budget schema) with the registry's preset and GPU exporter enums and descriptions."""
    values = {
        "classes[].preset": (list(registry.PRESETS), preset_description()),
        "anomaly.presets": (list(registry.GPUS), anomaly_presets_description()),
    }
    for where, pattern in _SCHEMA_SPOTS:
        found = list(pattern.finditer(text))
        if len(found) != 1:
            raise ValueError(
                f"{SCHEMA_PATH}: {where}: expected its enum and description once, found {len(found)}"
            )
        enum, description = values[where]

        def spot(m: re.Match[str], enum: list[str] = enum, description: str = description) -> str:
            new_enum = _json_list(enum, m.group(2))
            return f"{m.group(1)}{new_enum}{m.group(3)}{json.dumps(description, ensure_ascii=False)}"

        text = pattern.sub(spot, text)
    doc = json.loads(text)
    preset = doc["properties"]["classes"]["items"]["properties"]["preset"]
    presets = doc["properties"]["anomaly"]["properties"]["presets"]
    got = {"classes[].preset": (preset["enum"], preset["description"])}
    got["anomaly.presets"] = (presets["items"]["enum"], presets["description"])
    if got != values:  # the edit went somewhere else than meant
        raise ValueError(f"{SCHEMA_PATH}: the generated enums did not land where expected")
    return text


# --- the recording rules -------------------------------------------------------------------------

RULES_HEADER: Final = """\
Generated from the exporters' records in vendors/ (`python -m vendors.generate --update`): edit those,
not this file; tests/common/test_vendor_registry.py checks that it is current.

Vendor-independent GPU series, recorded from each vendor's exporter, in base units, with a `vendor`
label ({vendors}) and a `gpu` label (the device: the exporter's GPU index or address, "0" on a
single-GPU module). The alerts (gpu.rules.yml) and the dashboard read only these. Unit-tested by
tests/gpu-vendors.rules.test.yml (`promtool test rules`).

  gpu:temperature_celsius   core temperature
  gpu:utilization_ratio     0..1 busy
  gpu:memory_used_bytes     device memory in use
  gpu:memory_total_bytes    device memory size
  gpu:power_watts           board / package power
  gpu:power_limit_watts     the limit the exporter reports, else the board's nominal limit
  gpu:clock_hertz           graphics clock
  gpu:errors:rate5m         hardware errors per second over 5 minutes, by error_type

Each exporter's other labels stay (UUID, model, serial number, pod, ...), minus the ones that tell one
sensor, engine or scope from another, so that the used / total and power / limit pairs match one to
one. Each section says its exporter's quirks, and the nominal power limit used where the exporter
reports none: adjust it to your boards (the alert fires above 95% of the limit)."""

_WIDTH: Final = 110
_RULE_INDENT: Final = "      "
_HEADING_WIDTH: Final = 103
_PLAIN_MAX: Final = 100  # an `expr:` line longer than this is written folded (>-)
_YAML_INDICATORS: Final = frozenset("-?:,[]{}#&*!|>'\"%@`")
_PLAIN_LABEL: Final = re.compile(r"[a-z_][a-z0-9_]*")


def _comment(text: str, indent: str) -> list[str]:
    """``text`` as comment lines: paragraphs (split by empty lines) wrapped, indented lines (a table)
    kept as they are."""
    lines: list[str] = []
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            width = _WIDTH - len(indent) - 2
            lines.extend(
                textwrap.wrap(" ".join(paragraph), width, break_on_hyphens=False, break_long_words=False)
            )
            paragraph.clear()

    for line in text.split("\n"):
        if line.startswith(" ") or not line.strip():
            flush()
            lines.append(line.rstrip())
        else:
            paragraph.append(line.strip())
    flush()
    return [f"{indent}# {line}".rstrip() for line in lines]


def _expr(expr: str) -> list[str]:
    line = f"{_RULE_INDENT}  expr: {expr}"
    unsafe = ": " in expr or " #" in expr or expr != expr.strip() or "\n" in expr
    if len(line) > _PLAIN_MAX or unsafe or expr[0] in _YAML_INDICATORS:
        return [f"{_RULE_INDENT}  expr: >-", f"{_RULE_INDENT}    {expr}"]
    if expr.startswith("("):
        return [f"{_RULE_INDENT}  expr: '{expr}'"]
    return [line]


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    inner = ", ".join(f"{k}: {v if _PLAIN_LABEL.fullmatch(v) else json.dumps(v)}" for k, v in labels)
    return f"{{{inner}}}"


def _rule(rule: RecordingRule, vendor: str) -> list[str]:
    lines = _comment(rule.comment, _RULE_INDENT) if rule.comment else []
    lines.append(f"{_RULE_INDENT}- record: {rule.record}")
    lines += _expr(rule.expr)
    lines.append(f"{_RULE_INDENT}  labels: {_labels((('vendor', vendor), *rule.labels))}")
    return lines


def _section(section: RuleSection, vendor: str) -> list[str]:
    heading = f"{_RULE_INDENT}# --- {section.heading} "
    lines = [heading + "-" * max(3, _HEADING_WIDTH - len(heading))]
    if section.notes:
        lines += _comment(section.notes, _RULE_INDENT)
        if section.rules and section.rules[0].comment:
            lines.append(f"{_RULE_INDENT}#")  # the notes are the section's, not its first rule's
    for rule in section.rules:
        lines += _rule(rule, vendor)
    return lines


def rules_yaml() -> str:
    """``gpu-vendors.rules.yml``: one group, each record's sections in the registry's order."""
    vendors = [r.vendor for r in registry.RECORDS if r.rules and r.vendor]
    lines = _comment(RULES_HEADER.format(vendors=" | ".join(vendors)), "")
    lines += ["groups:", "  - name: gpu-vendors", "    rules:"]
    for record in registry.RECORDS:
        for section in record.rules:
            lines += _section(section, record.vendor or "")  # a record with rules has one (registry)
    return "\n".join(lines) + "\n"


def recording_rules() -> list[dict[str, Any]]:
    """The rules as Prometheus reads them (what ``rules_yaml`` must load back as)."""
    out = []
    for record in registry.RECORDS:
        for section in record.rules:
            for rule in section.rules:
                labels = {"vendor": record.vendor, **dict(rule.labels)}
                out.append({"record": rule.record, "expr": rule.expr, "labels": labels})
    return out


# --- the command line ----------------------------------------------------------------------------


def _outputs(root: Path) -> dict[Path, str]:
    schema = root / SCHEMA_PATH
    return {schema: budget_schema(schema.read_text(encoding="utf-8")), root / RULES_PATH: rules_yaml()}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in (["--update"], ["--check"]):
        print("usage: python -m vendors.generate --update | --check  (from the repository's root)")
        return 2
    stale = []
    for path, text in _outputs(Path.cwd()).items():
        if path.read_text(encoding="utf-8") == text:
            continue
        stale.append(path)
        if args == ["--update"]:
            path.write_text(text, encoding="utf-8")
    verb = "rewrote" if args == ["--update"] else "stale"
    for path in stale:
        print(f"{verb}: {path}")
    return 1 if stale and args == ["--check"] else 0


if __name__ == "__main__":
    sys.exit(main())
