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

Regexes are RE2 in Prometheus and ``re`` here. ``translate_re2`` reads an RE2 pattern and writes the
``re`` pattern that matches the same strings, or refuses it with the reason, so a rule never silently
matches something else than it would in Prometheus:

- refused because RE2 refuses them: lookaround, atomic groups, possessive and doubled quantifiers,
  backreferences (``\\1``, ``(?P=n)``), conditionals, comments, ``\\Z``, ``\\C``, repeat counts over 1000,
  unknown escapes, flags other than ``i m s U``;
- refused because ``re`` cannot express them compactly: ``\\p{..}``/``\\pL`` Unicode classes, the ``U``
  (ungreedy) flag, negated POSIX classes, ``\\D \\W \\S`` inside a bracket, flag groups ``(?i)`` anywhere
  but at the very start (write ``(?i:...)``);
- translated: ``\\z`` -> ``\\Z``; ``$`` outside multi-line mode -> ``\\Z`` (``re``'s ``$`` also matches
  before a final newline); ``(?<name>`` -> ``(?P<name>``; ``\\Q...\\E`` -> the escaped literal;
  ``[[:alpha:]]`` and the other ASCII POSIX classes -> ranges; ``\\d \\w \\s \\b \\B`` -> their ASCII
  meaning (RE2's are ASCII, ``re``'s Unicode), while case folding under ``(?i)`` stays Unicode as in
  RE2; ``\\x{10FFFF}`` -> the character; a ``{`` that does not start a repeat (``a{,3}``) -> a literal;
  ``[``, ``&``, ``~``, ``|``, ``-`` inside a bracket are escaped (``re`` warns about future set syntax).
- ``.`` matches a newline, as in Prometheus 3 (which compiles ``^(?s:<regex>)$``; 2.x did not).

Only the relay's shape stage runs these rules per series, and only once per distinct exposed label set:
its decoration cache holds the result, so a stable target costs one dict lookup per series.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

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
_MAX_REPEAT: Final = 1000  # RE2's limit on {n,m}


class RelabelError(ValueError):
    """A rule Prometheus would refuse; ``key`` is the path of the offending key inside the rule list."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"key `{key}`: {why}" if key else why)
        self.key = key
        self.why = why


# --- RE2 -> re -----------------------------------------------------------------------------------

_DIGIT, _WORD, _SPACE = "0-9", "0-9A-Za-z_", "\\t\\n\\f\\r "
_PERL = {"d": _DIGIT, "w": _WORD, "s": _SPACE}
_POSIX = {
    "alnum": "0-9A-Za-z",
    "alpha": "A-Za-z",
    "ascii": "\\x00-\\x7f",
    "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f",
    "digit": "0-9",
    "graph": "!-~",
    "lower": "a-z",
    "print": " -~",
    "punct": "!-/:-@\\[-`{-~",
    "space": "\\t\\n\\v\\f\\r ",
    "upper": "A-Z",
    "word": _WORD,
    "xdigit": "0-9A-Fa-f",
}
_BOUNDARY = f"(?:(?<![{_WORD}])(?=[{_WORD}])|(?<=[{_WORD}])(?![{_WORD}]))"
_SIMPLE_ESCAPES = {"a": "\\a", "f": "\\f", "t": "\\t", "n": "\\n", "r": "\\r", "v": "\\v"}
# Go's parseInt: ASCII digits, no leading zero; `a{01}` is the literal text, as any `{` no repeat starts.
_REPEAT = re.compile(r"\{(0|[1-9][0-9]*)(,(0|[1-9][0-9]*)?)?\}")
_NAMED = re.compile(r"\(\?P?<([A-Za-z0-9_]+)>")  # RE2 takes both spellings, re (3.11) only (?P<
_FLAGS = re.compile(r"\(\?([a-zA-Z]*)(?:-([a-zA-Z]*))?([:)])")


class _RE2:
    """One pass over an RE2 pattern, writing the ``re`` equivalent (see the module docstring)."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.out: list[str] = []
        # Multi-line mode per open group: decides what `$` means.
        self.multiline = [False]
        self.base = 1  # depth of the outermost group the pattern may close (2 under a leading (?i))
        self.can_repeat = False  # the last item can take a quantifier
        self.repeated = False  # the last item already has one (RE2 refuses a second)

    def fail(self, why: str) -> RelabelError:
        return RelabelError("", f"{why} (at offset {self.i} of {self.p!r})")

    def run(self) -> str:
        p = self.p
        while self.i < len(p):
            c = p[self.i]
            if c == "\\":
                self.escape()
            elif c == "[":
                self.bracket()
            elif c == "(":
                self.group()
            elif c == ")":
                if len(self.multiline) == self.base:
                    raise self.fail("unmatched `)`")
                self.multiline.pop()
                self.emit(")", repeatable=True)
                self.i += 1
            elif c in "*+?{":
                self.quantifier()
            elif c == "$":
                self.emit("$" if self.multiline[-1] else "\\Z", repeatable=False)
                self.i += 1
            elif c in "^.|":
                self.emit(c, repeatable=c == ".")
                self.i += 1
            else:
                self.emit(re.escape(c), repeatable=True)
                self.i += 1
        if len(self.multiline) != self.base:
            raise self.fail("missing `)`")
        return "".join(self.out) + (")" if self.base == 2 else "")

    def emit(self, text: str, *, repeatable: bool) -> None:
        self.out.append(text)
        self.can_repeat, self.repeated = repeatable, False

    def quantifier(self) -> None:
        p, c = self.p, self.p[self.i]
        if c == "{":
            m = _REPEAT.match(p, self.i)
            if m is None:
                # RE2 reads a `{` that starts no repeat as a literal; re would read `{,3}` as one.
                self.emit("\\{", repeatable=True)
                self.i += 1
                return
            low, high = int(m[1]), m[3]
            if low > _MAX_REPEAT or (high and int(high) > _MAX_REPEAT):
                raise self.fail(f"repeat count above {_MAX_REPEAT} (RE2's limit)")
            if high and int(high) < low:
                raise self.fail("invalid repeat range")
            text, self.i = m[0], m.end()
        else:
            text, self.i = c, self.i + 1
        if self.repeated:
            raise self.fail("RE2 refuses a repeated quantifier (possessive `*+`, `++`, or `**`)")
        if not self.can_repeat:
            raise self.fail("quantifier without anything to repeat")
        if self.i < len(p) and p[self.i] == "?":
            text += "?"
            self.i += 1
        self.out.append(text)
        self.repeated = True

    def group(self) -> None:
        p, start = self.p, self.i
        if not p.startswith("(?", start):
            self.open("(")
            self.i += 1
            return
        for prefix, why in (
            ("(?=", "lookahead"),
            ("(?!", "negative lookahead"),
            ("(?<=", "lookbehind"),
            ("(?<!", "negative lookbehind"),
            ("(?>", "atomic groups"),
            ("(?P=", "backreferences"),
            ("(?P>", "recursion"),
            ("(?(", "conditionals"),
            ("(?#", "comments"),
        ):
            if p.startswith(prefix, start):
                raise self.fail(f"RE2 does not support {why}")
        named = _NAMED.match(p, start)
        if named is not None:
            if named[1][0].isdigit():
                raise self.fail("a group name must not start with a digit")
            self.open(f"(?P<{named[1]}>")
            self.i = named.end()
            return
        m = _FLAGS.match(p, start)
        if m is None:
            raise self.fail("unknown group syntax after `(?`")
        on, off, end = m[1], m[2] or "", m[3]
        if not on and m[2] is None and end == ")":
            raise self.fail("empty flag group `(?)`")
        if m[2] is not None and not off:
            raise self.fail("empty flag negation `(?-)`")
        for flag in on + off:
            if flag == "U":
                raise self.fail("the U (ungreedy) flag is not supported here: use lazy quantifiers (`*?`)")
            if flag not in "ims":
                raise self.fail(f"RE2 has no flag {flag!r} (it knows i, m, s, U)")
        multiline = self.multiline[-1]
        if "m" in on:
            multiline = True
        if "m" in off:
            multiline = False
        flags = on + (f"-{off}" if off else "")
        if end == ":":
            self.open(f"(?{flags}:", multiline)
            self.i = m.end()
            return
        # `(?i)`: re (3.11) takes global flags only at the start, and RE2's scope (to the end of the
        # enclosing group, across `|`) has no re spelling elsewhere.
        if start != 0 or len(self.multiline) != 1:
            raise self.fail("a flag group like (?i) is only supported at the start: use (?i:...)")
        if off:
            raise self.fail("flag negation at the start has no effect: remove it")
        self.open(f"(?{flags}:", multiline)
        self.base = 2
        self.i = m.end()

    def open(self, text: str, multiline: bool | None = None) -> None:
        self.multiline.append(self.multiline[-1] if multiline is None else multiline)
        self.emit(text, repeatable=False)

    def escape(self) -> None:
        p, i = self.p, self.i
        if i + 1 >= len(p):
            raise self.fail("trailing backslash")
        c = p[i + 1]
        self.i = i + 2
        if c == "Q":
            end = p.find("\\E", self.i)
            literal = p[self.i :] if end < 0 else p[self.i : end]
            self.i = len(p) if end < 0 else end + 2
            if literal:
                # Only the last character takes a following quantifier, as in RE2.
                self.out.append(re.escape(literal[:-1]))
                self.emit(re.escape(literal[-1]), repeatable=True)
            return
        if c in _PERL or c in "DWS":
            ranges = _PERL[c.lower()]
            self.emit(f"[{ranges}]" if c.islower() else f"[^{ranges}]", repeatable=True)
        elif c == "b":
            self.emit(_BOUNDARY, repeatable=False)
        elif c == "B":
            self.emit(f"(?!{_BOUNDARY})", repeatable=False)
        elif c == "A":
            self.emit("\\A", repeatable=False)
        elif c == "z":
            self.emit("\\Z", repeatable=False)
        elif c == "Z":
            raise self.fail("RE2 has no \\Z: use \\z (end of text)")
        elif c == "C":
            raise self.fail("\\C (any byte) is not supported")
        else:
            self.emit(self.char_escape(c), repeatable=True)

    def char_escape(self, c: str) -> str:
        """The ``re`` spelling of ``\\c`` (``self.i`` just past it) that stands for one character."""
        if c in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[c]
        if c == "x":
            p = self.p
            if p.startswith("{", self.i):
                end = p.find("}", self.i)
                digits = p[self.i + 1 : end] if end > 0 else ""
                self.i = end + 1
            else:
                digits, self.i = p[self.i : self.i + 2], self.i + 2
                if len(digits) != 2:
                    raise self.fail("\\x needs two hex digits")
            try:
                code = int(digits, 16)
                return re.escape(chr(code))
            except ValueError:
                raise self.fail(f"invalid hex escape \\x{digits}") from None
        if c in "pP":
            raise self.fail("Unicode classes (\\p, \\P) are not supported")
        if c.isdigit():
            raise self.fail("backreferences and octal escapes are not supported: use \\x..")
        if c.isascii() and not c.isalnum():  # Go takes `\_` too ("too many programs insist on it")
            return re.escape(c)
        raise self.fail(f"RE2 does not know the escape \\{c}")

    def bracket(self) -> None:
        p = self.p
        self.i += 1
        parts = ["["]
        if p.startswith("^", self.i):
            parts.append("^")
            self.i += 1
        first = True
        while True:
            if self.i >= len(p):
                raise self.fail("missing `]`")
            if p[self.i] == "]" and not first:
                self.i += 1
                break
            first = False
            low, single = self.class_item()
            if single and p.startswith("-", self.i) and not p.startswith("-]", self.i):
                self.i += 1
                high, single = self.class_item()
                if not single:
                    raise self.fail("a range cannot end in a class")
                parts.append(f"{low}-{high}")
            else:
                parts.append(low)
        if len(parts) == 1 or parts[1:] == ["^"]:
            raise self.fail("empty character class")
        parts.append("]")
        self.emit("".join(parts), repeatable=True)

    def class_item(self) -> tuple[str, bool]:
        """One item of a bracket in ``re`` spelling, and whether it is a single character."""
        p = self.p
        if self.i >= len(p):  # e.g. `[0-`: a range whose end is missing
            raise self.fail("missing `]`")
        c = p[self.i]
        if c == "[" and p.startswith("[:", self.i):
            end = p.find(":]", self.i + 2)
            name = p[self.i + 2 : end] if end > 0 else ""
            if name.startswith("^"):
                raise self.fail("negated POSIX classes ([:^name:]) are not supported")
            if name not in _POSIX:
                raise self.fail(f"unknown POSIX class [:{name}:]")
            self.i = end + 2
            return _POSIX[name], False
        if c != "\\":
            self.i += 1
            # Literal in both; escaped because re reads some of them as (future) set syntax.
            return (f"\\{c}" if c in "\\]^-[&~|" else c), True
        if self.i + 1 >= len(p):
            raise self.fail("trailing backslash")
        e = p[self.i + 1]
        self.i += 2
        if e in _PERL:
            return _PERL[e], False
        if e in "DWS":
            raise self.fail(f"\\{e} inside a bracket is not supported: write the negated class out")
        return self.char_escape(e), True


def translate_re2(pattern: str) -> str:
    """The ``re`` pattern matching what RE2 matches for ``pattern``; ``RelabelError`` if refused."""
    return _RE2(pattern).run()


def compile_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` anchored at both ends, dot matching newlines, as Prometheus 3 compiles it."""
    try:
        return re.compile(f"(?s:{translate_re2(pattern)})")
    except re.error as e:  # a translation re still refuses: name it rather than crash
        raise RelabelError("", f"not a valid regex {pattern!r}: {e}") from e


# --- Go's regexp.Expand ----------------------------------------------------------------------------


def _name_end(template: str, i: int) -> int:
    """End of the longest run of letters, digits and `_` from ``i`` (Go: unicode.IsLetter/IsDigit)."""
    n = len(template)
    while i < n and (template[i].isalpha() or template[i].isdecimal() or template[i] == "_"):
        i += 1
    return i


def expand(template: str, m: re.Match[str]) -> str:
    """``template`` with ``$n``/``${n}``/``$name``/``${name}`` replaced from ``m``, as Go's Expand."""
    if "$" not in template:
        return template
    out: list[str] = []
    i = 0
    while True:
        j = template.find("$", i)
        if j < 0:
            out.append(template[i:])
            return "".join(out)
        out.append(template[i:j])
        i = j + 1
        if template.startswith("$", i):
            out.append("$")
            i += 1
            continue
        brace = template.startswith("{", i)
        start = i + 1 if brace else i
        end = _name_end(template, start)
        if end == start or (brace and not template.startswith("}", end)):
            out.append("$")  # malformed: the `$` stays literal
            continue
        name = template[start:end]
        i = end + 1 if brace else end
        if name.isdigit() and name.isascii() and not (name[0] == "0" and len(name) > 1):
            group: int | str | None = int(name) if int(name) <= m.re.groups else None
        else:
            group = name if name in m.re.groupindex else None
        if group is not None:
            out.append(m.group(group) or "")


# --- rules -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    action: str
    source_labels: tuple[str, ...]
    separator: str
    regex: re.Pattern[str]
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
        regex = compile_regex(regex_text)
    except RelabelError as e:
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
            if rule.regex.fullmatch(value) is None:
                return False
        elif action == "drop":
            if rule.regex.fullmatch(value) is not None:
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
            for name in [n for n in labels if rule.regex.fullmatch(n) is not None]:
                del labels[name]
        else:  # labelkeep
            for name in [n for n in labels if rule.regex.fullmatch(n) is None]:
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
