"""Prometheus relabeling: ``metric_relabel_configs`` per scraped series, ``relabel_configs`` per target.

Semantics follow Prometheus' ``model/relabel/relabel.go`` (3.x, legacy label-name validation, which is
what the wire format takes): the actions ``replace`` (default), ``keep``, ``drop``, ``keepequal``,
``dropequal``, ``hashmod``, ``labelmap``, ``labeldrop``, ``labelkeep``, ``lowercase``, ``uppercase``;
the defaults ``separator: ";"``, ``regex: "(.*)"`` (anchored at both ends), ``replacement: "$1"``; the
same validation at load time (``compile_rules``); and at run time:

- ``replace`` does nothing when the regex does not match or the expanded target is not a valid label
  name, deletes the target label when the expanded replacement is empty;
- setting a label to the empty string deletes it (as Prometheus' ``labels.Builder`` does), so
  ``lowercase`` of a missing source deletes its target;
- ``hashmod`` is the big-endian uint64 of the last 8 bytes of the MD5 of the joined values, modulo
  ``modulus``, so shards agree with Prometheus' own;
- ``$1``, ``${1}``, ``$name``, ``${name}`` and ``$$`` in ``replacement``/``target_label`` expand like
  Go's ``regexp.Expand``: a name is the longest run of letters, digits and ``_`` (so ``$1x`` is the
  group named ``1x``, which is empty), an unknown or unmatched group expands to nothing, a malformed
  ``$`` stays literal.

Regexes are RE2, read as Prometheus 3 reads them (``^(?s:<regex>)$``: anchored at both ends, ``.``
matching a newline), by the one regex engine (``relay_common.regex``): linear in the value, and a
pattern Go's ``regexp`` refuses is refused at load, with the reason and where.

Only the relay's shape stage runs these rules per series, and only once per distinct exposed label set:
its decoration cache holds the result, so a stable target costs one dict lookup per series.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from relay_common.regex import Match, Regex, RegexError

ACTIONS: Final = (
    "replace",
    "keep",
    "drop",
    "keepequal",
    "dropequal",
    "hashmod",
    "labelmap",
    "labeldrop",
    "labelkeep",
    "lowercase",
    "uppercase",
)
DEFAULT_SEPARATOR: Final = ";"
DEFAULT_REGEX: Final = "(.*)"
DEFAULT_REPLACEMENT: Final = "$1"
LABEL_NAME: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
# Prometheus' relabelTargetLegacy: a label name in which $var / ${var} may stand for characters.
_TEMPLATED_NAME: Final = re.compile(r"(?:(?:[a-zA-Z_]|\$(?:\{[0-9A-Za-z_]+\}|[0-9A-Za-z_]+))+[0-9A-Za-z_]*)+")


class RelabelError(ValueError):
    """A rule Prometheus would refuse; ``key`` is the path of the offending key inside the rule list."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"key `{key}`: {why}" if key else why)
        self.key = key
        self.why = why


# --- Go's regexp.Expand ----------------------------------------------------------------------------


def _name_end(template: str, i: int) -> int:
    """End of the longest run of letters, digits and `_` from ``i`` (Go: unicode.IsLetter/IsDigit)."""
    n = len(template)
    while i < n and (template[i].isalpha() or template[i].isdecimal() or template[i] == "_"):
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class _Named:
    name: str


@functools.lru_cache(maxsize=1024)
def _parts(template: str) -> tuple[str | int | _Named, ...]:
    """``template`` read once as Go's Expand reads it: literal text, group numbers and group names."""
    parts: list[str | int | _Named] = []
    i = 0
    while True:
        j = template.find("$", i)
        if j < 0:
            parts.append(template[i:])
            return tuple(p for p in parts if p != "")
        parts.append(template[i:j])
        i = j + 1
        if template.startswith("$", i):
            parts.append("$")
            i += 1
            continue
        brace = template.startswith("{", i)
        start = i + 1 if brace else i
        end = _name_end(template, start)
        if end == start or (brace and not template.startswith("}", end)):
            parts.append("$")  # malformed: the `$` stays literal
            continue
        name = template[start:end]
        i = end + 1 if brace else end
        # Go reads up to 9 ASCII digits without a leading zero as a group number, anything else as a name.
        if name.isdigit() and name.isascii() and len(name) < 10 and not (name[0] == "0" and len(name) > 1):
            parts.append(int(name))
        else:
            parts.append(_Named(name))


def expand(template: str, m: Match) -> str:
    """``template`` with ``$n``/``${n}``/``$name``/``${name}`` replaced from ``m``, as Go's Expand."""
    if "$" not in template:
        return template
    out = []
    for part in _parts(template):
        if isinstance(part, str):
            out.append(part)
        elif isinstance(part, int):
            out.append(m.group(part) or "")
        else:
            out.append(m.named(part.name) or "")
    return "".join(out)


# --- rules -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    action: str
    source_labels: tuple[str, ...]
    separator: str
    regex: Regex
    modulus: int
    target_label: str
    replacement: str


_FIELDS: Final = ("source_labels", "separator", "regex", "modulus", "target_label", "replacement", "action")


def _text(value: Any) -> Any:
    """A plain integer as the decimal text Prometheus reads it as; anything else as it is."""
    return str(value) if type(value) is int else value


def compile_rule(raw: Mapping[str, Any], key: str) -> Rule:
    """One rule from its config mapping, validated as Prometheus does (``Config.Validate``)."""
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise RelabelError(key, f"unknown field(s) {unknown}; expected some of {list(_FIELDS)}")
    action = str(raw.get("action", "replace")).lower()  # Prometheus lower-cases the action
    if action not in ACTIONS:
        raise RelabelError(f"{key}.action", f"unknown relabel action {raw.get('action')!r}")
    sources = tuple(raw.get("source_labels") or ())
    for n, name in enumerate(sources):
        if not isinstance(name, str) or not LABEL_NAME.fullmatch(name):
            raise RelabelError(f"{key}.source_labels[{n}]", f"{name!r} is not a valid label name")
    separator = raw.get("separator", DEFAULT_SEPARATOR)
    target = raw.get("target_label", "")
    # Prometheus reads these YAML scalars as text: `regex: 0` (a hashmod shard's keep) is the regex "0".
    replacement = _text(raw.get("replacement", DEFAULT_REPLACEMENT))
    modulus = raw.get("modulus", 0)
    regex_text = _text(raw.get("regex", DEFAULT_REGEX))
    try:
        regex = Regex(regex_text)
    except RegexError as e:
        raise RelabelError(f"{key}.regex", e.why) from None

    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise RelabelError(f"{key}.{field}", why)

    need(action != "hashmod" or modulus > 0, "modulus", "hashmod requires a non-zero modulus")
    if action in ("replace", "hashmod", "lowercase", "uppercase", "keepequal", "dropequal"):
        need(target != "", "target_label", f"the {action} action requires a target_label")
    if action == "replace":
        valid = _TEMPLATED_NAME.fullmatch(target) if "$" in target else LABEL_NAME.fullmatch(target)
        need(valid is not None, "target_label", f"{target!r} is not a valid target_label for replace")
    if action in ("hashmod", "lowercase", "uppercase", "keepequal", "dropequal"):
        need(LABEL_NAME.fullmatch(target) is not None, "target_label", f"{target!r} is not a label name")
    if action in ("lowercase", "uppercase", "keepequal", "dropequal"):
        # Compared with the default, as Prometheus does: an explicit `replacement: $1` passes.
        need(replacement == DEFAULT_REPLACEMENT, "replacement", f"replacement cannot be set for {action}")
    if action == "labelmap":
        need(
            _TEMPLATED_NAME.fullmatch(replacement) is not None,
            "replacement",
            f"{replacement!r} is not a valid replacement for labelmap (a label name, $ groups allowed)",
        )
    # Prometheus compares with the defaults, so an explicit default value (separator: ";") passes,
    # except for regex: any regex given at all is refused.
    if action in ("keepequal", "dropequal"):
        for field, ok in (
            ("regex", "regex" not in raw),
            ("modulus", modulus == 0),
            ("separator", separator == DEFAULT_SEPARATOR),
        ):
            need(ok, field, f"{action} takes only source_labels and target_label")
    if action in ("labeldrop", "labelkeep"):
        for field, ok in (
            ("source_labels", "source_labels" not in raw),
            ("target_label", target == ""),
            ("modulus", modulus == 0),
            ("separator", separator == DEFAULT_SEPARATOR),
            ("replacement", replacement == DEFAULT_REPLACEMENT),
        ):
            need(ok, field, f"{action} takes only a regex")
    return Rule(action, sources, separator, regex, modulus, target, replacement)


def compile_rules(raw: Sequence[Mapping[str, Any]], key: str) -> tuple[Rule, ...]:
    """The rules of one ``*relabel_configs`` list; ``key`` is its path (``targets[1].relabel_configs``)."""
    return tuple(compile_rule(r, f"{key}[{i}]") for i, r in enumerate(raw))


def _simple_case(value: str, upper: bool) -> str:
    """Go's strings.ToUpper/ToLower: one character to one character (Python's may make two)."""
    if value.isascii():
        return value.upper() if upper else value.lower()
    out = []
    for ch in value:
        mapped = ch.upper() if upper else ch.lower()
        out.append(mapped if len(mapped) == 1 else ch)
    return "".join(out)


def apply(rules: Sequence[Rule], labels: dict[str, str]) -> bool:
    """Run ``rules`` over ``labels`` in place; False when a rule drops the series (or target)."""
    for rule in rules:
        action = rule.action
        value = rule.separator.join([labels.get(name, "") for name in rule.source_labels])
        if action == "keep":
            if not rule.regex.matches(value):
                return False
        elif action == "drop":
            if rule.regex.matches(value):
                return False
        elif action == "keepequal":
            if labels.get(rule.target_label, "") != value:
                return False
        elif action == "dropequal":
            if labels.get(rule.target_label, "") == value:
                return False
        elif action == "replace":
            m = rule.regex.fullmatch(value)
            if m is None:
                continue
            target = expand(rule.target_label, m)
            if not LABEL_NAME.fullmatch(target):
                continue
            _set(labels, target, expand(rule.replacement, m))
        elif action in ("lowercase", "uppercase"):
            _set(labels, rule.target_label, _simple_case(value, action == "uppercase"))
        elif action == "hashmod":
            digest = hashlib.md5(value.encode(), usedforsecurity=False).digest()
            labels[rule.target_label] = str(int.from_bytes(digest[8:], "big") % rule.modulus)
        elif action == "labelmap":
            # Over the labels as they were before this rule; a later name wins a collision.
            for name, label_value in sorted(labels.items()):
                m = rule.regex.fullmatch(name)
                if m is not None:
                    _set(labels, expand(rule.replacement, m), label_value)
        elif action == "labeldrop":
            for name in [n for n in labels if rule.regex.matches(n)]:
                del labels[name]
        else:  # labelkeep
            for name in [n for n in labels if not rule.regex.matches(n)]:
                del labels[name]
    return True


def _set(labels: dict[str, str], name: str, value: str) -> None:
    # Prometheus' labels.Builder: setting the empty value deletes the label.
    if value:
        labels[name] = value
    else:
        labels.pop(name, None)


def relabel(rules: Sequence[Rule], labels: Mapping[str, str]) -> dict[str, str] | None:
    """A relabeled copy of ``labels``, or None if dropped."""
    out = dict(labels)
    return out if apply(rules, out) else None
