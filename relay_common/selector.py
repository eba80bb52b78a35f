"""PromQL series selectors: the ``match`` of a backfill request, parsed by both programs.

The cloud checks an operator's selector before it sends a request (``cloud-ingest backfill``), so a typo
fails at once; the relay parses it again from the request and matches it against the recorder's series.
The wire format carries the selector as text, capped in length (``schemas.codec.command``); its grammar
lives here, once, with its regexes matched by the one regex engine (``relay_common.regex``: RE2
semantics as in Prometheus 3, linear time, since the pattern comes from outside the node).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from relay_common.regex import Regex, RegexError
from relay_common.relabel import LABEL_NAME
from schemas.codec.command import MAX_SELECTOR_CHARS
from schemas.model import Labels

MAX_MATCHERS: Final = 32

_OPS: Final = ("=~", "!~", "!=", "=")
_ESCAPES: Final = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t", "r": "\r"}
_HEX: Final = {"x": 2, "u": 4, "U": 8}


class SelectorError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Matcher:
    name: str
    op: str
    value: str
    # Not ``re``: the pattern comes from the cloud, and a backtracking one would stall the scrape cycle.
    regex: Regex | None = None

    def matches(self, value: str) -> bool:
        if self.regex is not None:
            return self.regex.matches(value) == (self.op == "=~")
        return (value == self.value) == (self.op == "=")


@dataclass(frozen=True, slots=True)
class Selector:
    text: str
    matchers: tuple[Matcher, ...]

    def __call__(self, labels: Labels) -> bool:
        got = dict(labels)
        # An absent label is the empty string, as in PromQL.
        return all(m.matches(got.get(m.name, "")) for m in self.matchers)


def parse_selector(text: str) -> Selector:
    """A PromQL series selector: ``name``, ``{matchers}`` or ``name{matchers}``, matchers ``l="v"``,
    ``l!="v"``, ``l=~"re"``, ``l!~"re"`` (RE2 regexes, anchored, as Prometheus reads them; values in
    double or single quotes with Go escapes). Refused: anything else, more than ``MAX_MATCHERS``
    matchers, and a selector every series matches (PromQL's "at least one non-empty matcher")."""
    if not isinstance(text, str) or len(text) > MAX_SELECTOR_CHARS:
        raise SelectorError(f"a selector is a string of at most {MAX_SELECTOR_CHARS} characters")
    p = _Parser(text)
    matchers: list[Matcher] = []
    p.space()
    if p.peek() != "{":
        name = p.name()
        if not re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", name):
            raise p.fail(f"{name!r} is not a metric name")
        matchers.append(Matcher("__name__", "=", name))
        p.space()
    if p.peek() == "{":
        p.i += 1
        while True:
            p.space()
            if p.peek() == "}":
                break
            label = p.name()
            if not LABEL_NAME.fullmatch(label):
                raise p.fail(f"{label!r} is not a label name")
            p.space()
            op = next((o for o in _OPS if text.startswith(o, p.i)), None)
            if op is None:
                raise p.fail("expected one of = != =~ !~")
            p.i += len(op)
            p.space()
            value = p.string()
            regex = None
            if op in ("=~", "!~"):
                try:
                    regex = Regex(value)
                except RegexError as e:
                    raise p.fail(f"label {label}: {e.why}") from None
            matchers.append(Matcher(label, op, value, regex))
            if len(matchers) > MAX_MATCHERS:
                raise p.fail(f"more than {MAX_MATCHERS} matchers")
            p.space()
            if p.peek() == ",":
                p.i += 1
                continue
            if p.peek() != "}":
                raise p.fail("expected , or }")
            break
        p.i += 1
        p.space()
    if p.i != len(text):
        raise p.fail("unexpected text after the selector")
    if not any(not m.matches("") for m in matchers):
        raise SelectorError(f"{text!r}: a selector needs at least one matcher that does not match empty")
    return Selector(text, tuple(matchers))


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.i = text, 0

    def fail(self, why: str) -> SelectorError:
        return SelectorError(f"selector {self.text[:80]!r} at {self.i}: {why}")

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def space(self) -> None:
        while self.peek() in (" ", "\t", "\n") and self.peek():
            self.i += 1

    def name(self) -> str:
        start = self.i
        while self.peek() and (self.peek().isascii() and (self.peek().isalnum() or self.peek() in "_:")):
            self.i += 1
        if start == self.i:
            raise self.fail("expected a name")
        return self.text[start : self.i]

    def string(self) -> str:
        quote = self.peek()
        if quote not in ('"', "'"):
            raise self.fail("expected a quoted value")
        self.i += 1
        out: list[str] = []
        while True:
            c = self.peek()
            if not c or c == "\n":
                raise self.fail("unterminated string")
            self.i += 1
            if c == quote:
                return "".join(out)
            if c != "\\":
                out.append(c)
                continue
            e = self.peek()
            self.i += 1
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
            elif e in _HEX:
                digits = self.text[self.i : self.i + _HEX[e]]
                if len(digits) != _HEX[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                    raise self.fail(f"bad \\{e} escape")
                code = int(digits, 16)
                if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                    raise self.fail(f"\\{e}{digits} is not a character")
                out.append(chr(code))
                self.i += _HEX[e]
            else:
                raise self.fail(f"unknown escape \\{e}")
