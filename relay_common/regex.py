"""The one regex engine for every pattern a user writes: relabel rules, budget class matchers, backfill
selectors. RE2 semantics, as Prometheus (Go's ``regexp``) reads them, matched in time linear in the input.

Why not ``re``: it backtracks. ``([a-z0-9]+-?)*-canary`` took 4 s per 34-character pod name, ``(.*.*)*z``
200 s on 18 characters, and a match holds the GIL, so one target's relabel rule stalled every target's
scrape. Prometheus never backtracks; neither may the relay.

The engine is Google's RE2 (``google-re2``, the C++ library Go's ``regexp`` was ported from): a DFA, or
an NFA simulation when captures are wanted, so every match costs time linear in the string. Two parts:

- ``translate`` reads the pattern as Go's ``regexp/syntax`` does (Perl flags, as ``regexp.Compile``)
  and writes the same pattern in C++ RE2's spelling, or refuses it with Go's reason and the offset. Go
  and C++ RE2 agree on almost everything; the pass exists for where they do not, and so a rule is never
  read differently from Prometheus:

  - refused, as Go refuses them: lookaround, atomic groups, possessive and doubled quantifiers
    (``a**``, ``a++``), backreferences (``\\1``, ``(?P=n)``), conditionals, comments, recursion, ``\\Z``,
    ``\\C`` (C++ RE2 takes it), unknown escapes and flags (RE2 knows ``i m s U``), a flag negation with
    no flag (``(?i-)``), repeat counts over 1000, nested repeats that multiply beyond 1000 copies
    (``(a{100}){100}``: C++ RE2 agrees), invalid group names, unknown Unicode or POSIX classes,
    reversed ranges, a pattern that is not valid UTF-8 (a lone surrogate);
  - refused because Prometheus wraps the pattern in ``^(?s:`` ... ``)$``: a ``)`` that would close the
    wrapper, a ``\\Q`` without ``\\E`` (Prometheus reads its closing ``)$`` as text and fails);
  - spelt for C++ RE2 where it reads text differently from Go: a ``{`` that starts no repeat in Go
    (``a{,2}``, ``a{01}``: Go's counts take no leading zero) is a literal; ``\\_`` is ``_``; octal
    (``\\012``), hex and the C escapes become ``\\x{..}``; a part repeated ``{0}`` is written as its
    groups alone (C++ RE2 counts what is inside among nested repeats, Go does not); capture groups are
    written unnamed and their names kept here, so ``$name`` resolves as in Go (the leftmost group of
    that name that took part: Go takes a name twice);
  - taken as written: ``\\d \\w \\s \\b \\B`` (ASCII, in both), ``\\pL``, ``\\p{Greek}``, ``\\PL``,
    ``\\p{^Greek}``, POSIX classes (negated too: ``[[:^alpha:]]``), flag groups anywhere (``a(?i)b``),
    the ``U`` (ungreedy) flag, ``(?<name>`` (Go 1.22) beside ``(?P<name>``, ``\\Q...\\E``.

- ``Regex`` compiles the result as Prometheus 3 does (``^(?s:<regex>)$``: anchored at both ends, ``.``
  matching a newline) and answers ``matches`` (a DFA without captures; the answers for short values
  remembered, within a bound) and ``fullmatch`` (a ``Match`` with the groups, for ``relabel.expand``).

Strings: RE2 reads UTF-8, and a Python ``str`` with a lone surrogate (how ``surrogateescape`` carries an
undecodable byte) has none. Go reads an invalid byte as U+FFFD, so each lone surrogate is matched as
U+FFFD; a capture gives back the original characters.

Bounds: RE2 gives each compiled program a memory budget (8 MiB), for the program and its DFA's cache of
states. A pattern whose program does not fit (``\\pL{1000}``) is refused with RE2's reason ("pattern too
large"), which Go would have taken; values that drive a pattern through more states than the cache
holds (``.*a.{20}`` over random text) make RE2 start the cache over or fall back to its NFA: slower per
character, still linear, never more memory.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Protocol

import re2

MAX_REPEAT: Final = 1000  # Go's and RE2's limit on a repeat count, and on nested repeats' product
_MAX_RUNE: Final = 0x10FFFF

_ASSERTIONS: Final = frozenset("AbBz")  # zero-width escapes; Go lets a quantifier follow them
_PERL_CLASSES: Final = frozenset("dDsSwW")
_C_ESCAPES: Final = {"a": 0x07, "f": 0x0C, "t": 0x09, "n": 0x0A, "r": 0x0D, "v": 0x0B}
_POSIX_CLASSES: Final = frozenset(
    {"alnum", "alpha", "ascii", "blank", "cntrl", "digit", "graph", "lower", "print", "punct", "space"}
    | {"upper", "word", "xdigit"}
)
_HEX_DIGITS: Final = frozenset("0123456789abcdefABCDEF")
_OCTAL_DIGITS: Final = frozenset("01234567")
# Go's parseRepeat and parseInt: ASCII digits, no leading zero; anything else after `{` is literal text.
_REPEAT: Final = re.compile(r"\{(0|[1-9][0-9]*)(?:(,)(0|[1-9][0-9]*)?)?\}")
_FLAGS: Final = re.compile(r"\(\?([a-zA-Z]*)(?:(-)([a-zA-Z]*))?([:)])")
_UNSUPPORTED_GROUPS: Final = (
    ("(?=", "lookahead"),
    ("(?!", "negative lookahead"),
    ("(?<=", "lookbehind"),
    ("(?<!", "negative lookbehind"),
    ("(?>", "atomic groups"),
    ("(?P=", "backreferences"),
    ("(?P>", "recursion"),
    ("(?(", "conditionals"),
    ("(?#", "comments"),
)
_SURROGATES: Final = re.compile("[\ud800-\udfff]")
# ``Regex.matches`` remembers its answers for short values: label names (labeldrop, labelmap) and metric
# names recur on every series, and a lookup costs a twentieth of a call into RE2. Cleared when full.
_MEMO_ENTRIES: Final = 4096
_MEMO_VALUE_CHARS: Final = 256


class RegexError(ValueError):
    """A pattern Prometheus would refuse; ``why`` says what, and where."""

    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


def _char(code: int) -> str:
    """One character in C++ RE2 spelling, the same inside and outside a bracket."""
    c = chr(code)
    if c.isascii() and (c.isalnum() or c == "_"):
        return c
    return f"\\x{{{code:X}}}"


def _is_name(name: str) -> bool:
    """Go's isValidCaptureName: ASCII letters, digits and ``_``, any first character."""
    return bool(name) and all(c == "_" or (c.isascii() and c.isalnum()) for c in name)


@dataclass(frozen=True, slots=True)
class Translation:
    text: str  # C++ RE2 syntax, not yet anchored
    names: tuple[str | None, ...]  # capture group 1, 2, ...: its name, or None


class _GoSyntax:
    """One pass over a pattern the way Go's ``regexp/syntax`` parses it, writing C++ RE2 text."""

    def __init__(self, pattern: str) -> None:
        self.p = pattern
        self.i = 0
        self.out: list[str] = []
        self.names: list[str | None] = []
        # Per open group (the pattern itself first): the most copies a repeat inside it makes of any
        # one part, for Go's check that nested repeats stay within MAX_REPEAT copies.
        self.copies = [1]
        self.can_repeat = False  # there is something a quantifier would repeat
        self.repeated = False  # the last token was a quantifier (Go refuses a second one right after)
        self.last_copies = 1  # copies inside the thing a quantifier would repeat
        # Where that thing's text is in ``out`` (from, to) and the groups opened before it.
        self.last_span = (0, 0, 0)
        self.opened: list[tuple[int, int]] = []  # per open group: where it starts, groups before it

    def fail(self, why: str) -> RegexError:
        return RegexError(f"{why} (at offset {self.i} of {self.p!r})")

    def run(self) -> Translation:
        p = self.p
        bad = _SURROGATES.search(p)
        if bad is not None:
            self.i = bad.start()
            raise self.fail("invalid UTF-8 (a lone surrogate)")
        while self.i < len(p):
            c = p[self.i]
            if c == "\\":
                self.escape()
            elif c == "[":
                self.bracket()
            elif c == "(":
                self.group()
            elif c == ")":
                if len(self.copies) == 1:
                    raise self.fail("unmatched `)`")
                self.i += 1
                self.commit()
                inside = self.copies.pop()
                self.can_repeat = False  # its last part counted already, inside
                self.item(")", inside, self.opened.pop())
            elif c in "*+?{":
                self.quantifier()
            elif c == "|":
                self.i += 1
                self.commit()
                self.out.append("|")
                self.can_repeat = self.repeated = False
            else:  # `^ $ .` are written alike; any other character is itself
                self.i += 1
                self.item(c if c in "^$." else _char(ord(c)))
        if len(self.copies) != 1:
            raise self.fail("missing `)`")
        return Translation("".join(self.out), tuple(self.names))

    def item(self, text: str, copies: int = 1, began: tuple[int, int] | None = None) -> None:
        """Something a quantifier can follow (Go lets one follow `^`, `$` and `\\b` too); ``began``:
        where a group ending here started."""
        self.commit()
        start, groups_before = began if began is not None else (len(self.out), len(self.names))
        self.out.append(text)
        self.can_repeat, self.repeated, self.last_copies = True, False, copies
        self.last_span = (start, len(self.out), groups_before)

    def commit(self) -> None:
        """Count the last part, with whatever quantifiers it got, in its group's copies."""
        if self.can_repeat:
            self.copies[-1] = max(self.copies[-1], self.last_copies)

    def quantifier(self) -> None:
        p, start, c = self.p, self.i, self.p[self.i]
        factor = 1
        if c == "{":
            m = _REPEAT.match(p, start)
            if m is None:  # Go reads a `{` that starts no repeat as a literal
                self.i += 1
                self.item(_char(ord("{")))
                return
            low = int(m[1])
            high = low if m[2] is None else (int(m[3]) if m[3] is not None else None)
            if low > MAX_REPEAT or (high is not None and high > MAX_REPEAT):
                raise self.fail(f"invalid repeat count: above {MAX_REPEAT}")
            if high is not None and high < low:
                raise self.fail("invalid repeat count: the maximum is below the minimum")
            # Go's repeatIsValid: x{0} is not looked into; x{n,} counts n copies, x{n,m} m.
            factor = 0 if high == 0 else (high if high is not None else max(low, 1))
            self.i = m.end()
        else:
            self.i += 1
        end, self.i = self.i, start  # a refusal points at the quantifier
        if self.repeated:
            raise self.fail("RE2 refuses a repeated quantifier (possessive `*+`, `++`, or `**`)")
        if not self.can_repeat:
            raise self.fail("quantifier without anything to repeat")
        if end < len(p) and p[end] == "?":
            end += 1
        copies = factor * self.last_copies
        if copies > MAX_REPEAT:
            raise self.fail(
                f"invalid repeat count: {p[start:end]} of a part already repeated "
                f"{self.last_copies} times makes more than {MAX_REPEAT} copies"
            )
        self.i = end
        if factor == 0:
            # x{0} matches only the empty string and its groups never take part. Go does not look
            # into it when it counts nested repeats, C++ RE2 does: it gets x's groups alone.
            first, last, groups_before = self.last_span
            self.out[first:last] = ["(?:" + "()" * (len(self.names) - groups_before) + ")"]
            self.last_span = (first, first + 1, groups_before)
        self.out.append(p[start:end])
        self.repeated, self.last_copies = True, copies

    def group(self) -> None:
        p, start = self.p, self.i
        if not p.startswith("(?", start):
            self.open("(", None)
            self.i += 1
            return
        for prefix, why in _UNSUPPORTED_GROUPS:
            if p.startswith(prefix, start):
                raise self.fail(f"RE2 does not support {why}")
        if p.startswith("(?P<", start) or p.startswith("(?<", start):
            begin = p.index("<", start) + 1
            end = p.find(">", begin)
            if end < 0 or not _is_name(p[begin:end]):
                raise self.fail("invalid named capture (a name is ASCII letters, digits and `_`)")
            self.open("(", p[begin:end])
            self.i = end + 1
            return
        m = _FLAGS.match(p, start)
        if m is None:
            raise self.fail("invalid or unsupported Perl syntax after `(?`")
        on, negated, off, end = m[1], m[2] is not None, m[3] or "", m[4]
        if negated and not off:
            raise self.fail("invalid flag group: a negation `-` without a flag")
        for flag in on + off:
            if flag not in "imsU":
                raise self.fail(f"RE2 has no flag {flag!r} (it knows i, m, s, U)")
        self.i = m.end()
        if end == ":":
            self.open(m[0], None, capture=False)
            return
        # `(?i)`: the flags hold to the end of the enclosing group. It adds no node (Go: a quantifier
        # right after repeats what came before it), so it is written as it is, where it is.
        self.out.append(m[0])
        self.repeated = False

    def open(self, text: str, name: str | None, *, capture: bool = True) -> None:
        self.commit()
        self.opened.append((len(self.out), len(self.names)))
        if capture:
            self.names.append(name)
        self.copies.append(1)
        self.out.append(text)
        self.can_repeat = self.repeated = False

    def escape(self) -> None:
        p, i = self.p, self.i
        if i + 1 >= len(p):
            raise self.fail("trailing backslash")
        c = p[i + 1]
        if c == "Q":
            end = p.find("\\E", i + 2)
            if end < 0:
                raise self.fail("`\\Q` without `\\E`: Prometheus' closing `)$` would be read as text")
            literal = p[i + 2 : end]
            self.i = end + 2
            if not literal:
                # Adds no node, as in Go: written as the empty flag group, which adds none in RE2 either.
                self.out.append("(?)")
                self.repeated = False
            for ch in literal:  # only the last character takes a following quantifier
                self.item(_char(ord(ch)))
            return
        if c in _ASSERTIONS or c in _PERL_CLASSES:
            self.i = i + 2
            self.item(f"\\{c}")
        elif c in "pP":
            self.item(self.unicode_class())
        elif c == "Z":
            raise self.fail("RE2 has no \\Z: use \\z (end of text)")
        elif c == "C":
            raise self.fail("\\C (any byte) is not supported by Go's regexp")
        else:
            self.item(_char(self.char_escape()))

    def char_escape(self) -> int:
        """The character of the escape at ``self.i`` (its backslash), as Go's parseEscape reads it;
        ``self.i`` ends past it."""
        p = self.p
        start = self.i
        c = p[start + 1]
        self.i = start + 2
        if c in _C_ESCAPES:
            return _C_ESCAPES[c]
        if c in "1234567" and not (self.i < len(p) and p[self.i] in _OCTAL_DIGITS):
            self.i = start
            raise self.fail("RE2 does not support backreferences (\\1): octal needs two digits (\\012)")
        if c in _OCTAL_DIGITS:  # up to two more octal digits
            code = int(c)
            for _ in range(2):
                if self.i < len(p) and p[self.i] in _OCTAL_DIGITS:
                    code = code * 8 + int(p[self.i])
                    self.i += 1
            return code
        if c == "x":
            return self.hex_escape()
        if c.isascii() and not c.isalnum():  # punctuation is itself; Go takes `\_` too
            return ord(c)
        self.i = start
        raise self.fail(f"RE2 does not know the escape \\{c}")

    def hex_escape(self) -> int:
        p = self.p
        if p.startswith("{", self.i):
            end = self.i + 1
            code = 0
            while end < len(p) and p[end] in _HEX_DIGITS:
                code = code * 16 + int(p[end], 16)
                if code > _MAX_RUNE:
                    raise self.fail("invalid escape sequence: \\x{..} above 10FFFF")
                end += 1
            if end == self.i + 1 or not p.startswith("}", end):
                raise self.fail("invalid escape sequence: \\x{..} takes hex digits")
            self.i = end + 1
            return code
        digits = p[self.i : self.i + 2]
        if len(digits) != 2 or not set(digits) <= _HEX_DIGITS:
            raise self.fail("invalid escape sequence: \\x takes two hex digits")
        self.i += 2
        return int(digits, 16)

    def unicode_class(self) -> str:
        """``\\pN``, ``\\p{Name}``, ``\\p{^Name}`` (and ``\\P``) at ``self.i``, checked by RE2 itself:
        its tables and Go's have the same names (categories, scripts, ``Any``)."""
        p, start = self.p, self.i
        if start + 2 >= len(p):
            raise self.fail("invalid character class range: \\p needs a class name")
        if p[start + 2] == "{":
            end = p.find("}", start + 3)
            if end < 0:
                raise self.fail("invalid character class range: missing `}`")
            end += 1
        else:
            end = start + 3
        text = p[start:end]
        name = text[3:-1] if p[start + 2] == "{" else text[2:]
        if not name.isascii() or not _compiles(text):
            raise self.fail(f"invalid character class range {text}")
        self.i = end
        return text

    def bracket(self) -> None:
        p = self.p
        start = self.i
        self.i += 1
        parts = ["["]
        if p.startswith("^", self.i):
            parts.append("^")
            self.i += 1
        first = True  # `]` first is a literal
        while True:
            if self.i >= len(p):
                self.i = start
                raise self.fail("missing `]`")
            if p[self.i] == "]" and not first:
                self.i += 1
                break
            first = False
            item, low = self.class_item()
            if low is None or not (p.startswith("-", self.i) and not p.startswith("-]", self.i)):
                parts.append(item)
                continue
            self.i += 1
            range_start = self.i
            high = self.class_char()
            if high < low:
                self.i = range_start
                raise self.fail(f"invalid character class range {chr(low)}-{chr(high)}")
            parts.append(f"{item}-{_char(high)}")
        parts.append("]")
        self.item("".join(parts))

    def class_item(self) -> tuple[str, int | None]:
        """One item of a bracket in RE2 spelling, and its character if it is a single one."""
        p = self.p
        if p.startswith("[:", self.i):
            end = p.find(":]", self.i + 2)
            if end >= 0:  # else (Go) not a class name: `[` is a literal
                name = p[self.i + 2 : end]
                if name.removeprefix("^") not in _POSIX_CLASSES:
                    raise self.fail(f"unknown POSIX class [:{name}:]")
                self.i = end + 2
                return f"[:{name}:]", None
        if p.startswith("\\", self.i) and self.i + 1 < len(p):
            e = p[self.i + 1]
            if e in "pP":
                return self.unicode_class(), None
            if e in _PERL_CLASSES:
                self.i += 2
                return f"\\{e}", None
        code = self.class_char()
        return _char(code), code

    def class_char(self) -> int:
        """Go's parseClassChar: any escape a character may be written as, or the character."""
        p = self.p
        if self.i >= len(p):
            raise self.fail("missing `]`")
        if p[self.i] != "\\":
            self.i += 1
            return ord(p[self.i - 1])
        if self.i + 1 >= len(p):
            raise self.fail("trailing backslash")
        return self.char_escape()


_OPTIONS: Final = re2.Options()
_OPTIONS.log_errors = False  # a refusal is the caller's to report, not RE2's to print on stderr
_BOOLEAN_OPTIONS: Final = re2.Options()
_BOOLEAN_OPTIONS.log_errors = False
_BOOLEAN_OPTIONS.never_capture = True  # "does it match" runs on the DFA alone


def _compiles(text: str) -> bool:
    try:
        re2.compile(text, _OPTIONS)
    except re2.error:
        return False
    return True


def translate(pattern: str) -> Translation:
    """``pattern`` as Go reads it, in C++ RE2's spelling; ``RegexError`` (Go's reason, and where) if
    Go or Prometheus would refuse it."""
    return _GoSyntax(pattern).run()


def _valid_utf8(value: str) -> str:
    """``value`` with every lone surrogate as U+FFFD, as Go reads an invalid byte."""
    return _SURROGATES.sub("\ufffd", value)


class _Spans(Protocol):
    def span(self, group: int) -> tuple[int, int]: ...


class Match:
    """A match's groups, as slices of the string that was matched."""

    __slots__ = ("_match", "_regex", "_text")

    def __init__(self, regex: Regex, text: str | bytes, match: _Spans) -> None:
        self._regex = regex
        self._text = text  # UTF-8, or (with a lone surrogate) the str, as the spans count
        self._match = match

    def group(self, index: int) -> str | None:
        """Group ``index`` (0: the whole match); None if it took no part, or there is no such group."""
        if not 0 <= index <= self._regex.groups:
            return None
        start, end = self._match.span(index)
        if start < 0:
            return None
        piece = self._text[start:end]
        return piece.decode() if isinstance(piece, bytes) else piece

    def named(self, name: str) -> str | None:
        """Go's rule for ``${name}``: the leftmost group of that name that took part."""
        for index in self._regex.indexes.get(name, ()):
            got = self.group(index)
            if got is not None:
                return got
        return None


class Regex:
    """``pattern`` as Prometheus 3 compiles it (``^(?s:<pattern>)$``), matched in linear time.
    ``RegexError`` for a pattern Go (or Prometheus, or RE2's memory budget) refuses."""

    __slots__ = ("_boolean", "_capturing", "_memo", "groups", "indexes", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._memo: dict[str, bool] = {}
        translation = translate(pattern)
        text = f"(?s:{translation.text})"
        self.groups = len(translation.names)
        indexes: dict[str, list[int]] = {}
        for index, name in enumerate(translation.names, 1):
            if name is not None:
                indexes.setdefault(name, []).append(index)
        self.indexes = {name: tuple(found) for name, found in indexes.items()}
        try:
            self._capturing = re2.compile(text, _OPTIONS)
            self._boolean = re2.compile(text, _BOOLEAN_OPTIONS) if self.groups else self._capturing
        except re2.error as e:
            why = e.args[0].decode(errors="replace") if e.args and isinstance(e.args[0], bytes) else str(e)
            raise RegexError(f"RE2 refuses {pattern!r}: {why}") from None

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r})"

    def matches(self, value: str) -> bool:
        """Whether the whole of ``value`` matches."""
        memo = self._memo
        hit = memo.get(value)
        if hit is not None:
            return hit
        try:
            data = value.encode()
        except UnicodeEncodeError:
            data = _valid_utf8(value).encode()
        hit = self._boolean.fullmatch(data) is not None
        if len(value) <= _MEMO_VALUE_CHARS:
            if len(memo) >= _MEMO_ENTRIES:
                memo.clear()  # shared by the scrape threads: a clear costs them a miss, nothing more
            memo[value] = hit
        return hit

    def fullmatch(self, value: str) -> Match | None:
        """The match of the whole of ``value``, with its groups; None if it does not match."""
        # Matched as UTF-8: the binding's str path converts every offset back (3x the time).
        text: str | bytes
        try:
            text = data = value.encode()
        except UnicodeEncodeError:
            data, text = _valid_utf8(value), value  # spans in characters: slices of the original
        m = self._capturing.fullmatch(data)
        return None if m is None else Match(self, text, m)
