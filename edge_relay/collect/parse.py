"""Parse Prometheus text exposition (0.0.4) and OpenMetrics 1.0 bodies into samples.

``parse()`` returns ``(labels, value, timestamp_ms_or_None)`` per sample, where ``labels`` is a
:data:`schemas.model.Labels` tuple (sorted by name, ``__name__`` included, empty values dropped).

Any malformed line fails the whole body: a truncated or garbled scrape must be a failed scrape,
never a partial one.

Speed: the relay parses tens of thousands of samples every few seconds on a small CPU, so the
hot path avoids label parsing altogether.  A :class:`SeriesCache` maps the raw series text of a
line (``foo{a="b"}``) to its interned label tuple.  For each line the parser tries the text before
the last space (and, for lines with a timestamp, before the second-to-last space) as a cache key.
Only strings that a full parse has proven to be a complete, valid series are ever stored, and a
complete series followed by whitespace and a token that is not ``{`` can only be read one way, so
a cache hit plus a valid value token gives exactly what the full parse would.  Anything unusual
(misses, odd whitespace, exemplars, comments, errors) takes the full, authoritative path.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from decimal import ROUND_HALF_EVEN, Decimal, DecimalException
from typing import Any

from schemas.model import Labels

__all__ = ["ParseError", "SampleLimitExceeded", "SeriesCache", "is_openmetrics", "parse"]

Sample = tuple[Labels, float, int | None]

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_EXCERPT_CHARS = 80


class ParseError(ValueError):
    """The body is not a valid exposition; the whole scrape must be treated as failed."""

    def __init__(self, reason: str, lineno: int | None = None, line: str | None = None) -> None:
        self.reason = reason
        self.lineno = lineno
        self.line = line
        message = reason if lineno is None else f"line {lineno}: {reason}: {_excerpt(line or '')}"
        super().__init__(message)


class SampleLimitExceeded(ParseError):
    """The body holds more samples than the configured ``sample_limit``."""


class ParseDeadlineExceeded(ParseError):
    """The scrape's wall-clock deadline passed while parsing: a huge body must not hold up the cycle
    (and so every other target) beyond the scrape timeout."""


class _LineError(Exception):
    """Raised inside the line loop; ``parse()`` adds the line number and excerpt."""


def _excerpt(line: str) -> str:
    if len(line) > _EXCERPT_CHARS:
        line = line[:_EXCERPT_CHARS] + "..."
    return repr(line)


class SeriesCache:
    """Raw series text -> interned :data:`Labels`, shared across scrapes of the same targets.

    Text-format and OpenMetrics keys live in separate maps: a key that is valid in the liberal
    text format (e.g. with spaces before ``{``) must never be accepted in an OpenMetrics body.

    Two generations: every ``generation`` bodies parsed, the current maps become the old ones and
    the old ones are dropped; a series found in the old maps moves back to the current ones. So the
    cache holds the live series plus at most two generations of churn, never every series the
    targets ever had (at 20,000 series with pods replaced every 30 scrapes a never-dropped cache grew
    by ~1,000 series a cycle to its ``max_entries``, some 300 MiB). When the maps together still reach
    ``max_entries`` everything is dropped, so a target with exploding cardinality costs re-parsing,
    never unbounded memory.
    """

    def __init__(self, max_entries: int = 200_000, generation: int = 16) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self.generation = max(1, generation)
        self.overflows = 0  # how often the cache hit its bound and was cleared
        self._text: dict[str, Labels] = {}
        self._om: dict[str, Labels] = {}
        self._text_old: dict[str, Labels] = {}
        self._om_old: dict[str, Labels] = {}
        self._bodies = 0
        # Equal label sets reached through different raw texts (label order, trailing comma,
        # empty values, text vs OpenMetrics) still share one tuple.  (name, value) pairs are
        # shared too, so thousands of series repeating the same labels stay small. Both are
        # started again with each generation (sharing is memory's sake, never correctness').
        self._labelsets: dict[Labels, Labels] = {}
        self._pairs: dict[tuple[str, str], tuple[str, str]] = {}

    def __len__(self) -> int:
        return len(self._text) + len(self._om) + len(self._text_old) + len(self._om_old)

    def clear(self) -> None:
        for held in (self._text, self._om, self._text_old, self._om_old, self._labelsets, self._pairs):
            held.clear()

    def body_started(self) -> None:
        """A body is about to be parsed: every ``generation`` of them, the generations move on."""
        self._bodies += 1
        if self._bodies >= self.generation:
            self._bodies = 0
            self._text_old, self._text = self._text, {}
            self._om_old, self._om = self._om, {}
            self._labelsets, self._pairs = {}, {}

    def recall(self, om: bool, key: str) -> Labels | None:
        """The labels of ``key`` from the old generation, moved to the current one; None if absent."""
        labels = (self._om_old if om else self._text_old).pop(key, None)
        if labels is not None:
            (self._om if om else self._text)[key] = labels
        return labels

    def _store(self, om: bool, key: str, labels: Labels) -> Labels:
        if len(self) >= self.max_entries:
            self.clear()
            self.overflows += 1
        labels = self._labelsets.setdefault(labels, labels)
        (self._om if om else self._text)[key] = labels
        return labels


def is_openmetrics(content_type: str) -> bool:
    """True for ``application/openmetrics-text`` (any parameters), else text format."""
    return content_type.partition(";")[0].strip().lower() == "application/openmetrics-text"


# --- grammar -------------------------------------------------------------------------------

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LNAME = r"[a-zA-Z_][a-zA-Z0-9_]*"
# Unrolled "(?:[^"\\]|\\.)*": same language, several times faster in `re`, and still no
# catastrophic backtracking because an escape always starts at a backslash.
_QUOTED_BODY = r'[^"\\]*(?:\\.[^"\\]*)*'
_QUOTED = rf'"{_QUOTED_BODY}"'
_T_PAIR = rf"{_LNAME}[ \t]*=[ \t]*{_QUOTED}[ \t]*"
_OM_PAIR = rf"{_LNAME}={_QUOTED}"

# Series prefix of a line (match, not fullmatch): group 1 = name, group 2 = label block content.
_TEXT_SERIES = re.compile(
    rf"[ \t]*({_NAME})(?:[ \t]*\{{([ \t]*(?:{_T_PAIR}(?:,[ \t]*{_T_PAIR})*(?:,[ \t]*)?)?)\}})?"
)
_OM_SERIES = re.compile(rf"({_NAME})(?:\{{((?:{_OM_PAIR}(?:,{_OM_PAIR})*,?)?)\}})?")
# Pairs inside an already validated block; findall cannot drift because the block is well formed.
_PAIR = re.compile(rf'({_LNAME})[ \t]*=[ \t]*"({_QUOTED_BODY})"')
_OM_EXEMPLAR = re.compile(rf"\{{(?:{_OM_PAIR}(?:,{_OM_PAIR})*)?\}} ([^ ]+)(?: ([^ ]+))?")
_TEXT_WS = re.compile(r"[ \t]+")

# Go strconv.ParseFloat syntax as Prometheus uses it (it rejects 'p'/'_', i.e. hex floats).
_FLOAT = re.compile(
    r"[+-]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?)"
    r"|[nN][aA][nN]"
)
_NONFINITE = re.compile(r"[+-]?(?i:inf|infinity)|(?i:nan)")
_TEXT_TS = re.compile(r"-?[0-9]+")
_OM_TS = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_OM_META = re.compile(rf"# (?:HELP|UNIT) {_NAME}(?: .*)?|# TYPE {_NAME} ([a-z]+)")
_OM_TYPES = frozenset(
    ("counter", "gauge", "histogram", "gaugehistogram", "stateset", "info", "summary", "unknown")
)

_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


def _unescape(raw: str) -> str:
    # Unknown escapes stay verbatim, as in Prometheus' lvalReplacer.
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m[1], m[0]), raw)


# --- tokens ----------------------------------------------------------------------------------


def _float(tok: str) -> float:
    if _FLOAT.fullmatch(tok) is None:
        raise _LineError(f"invalid value {tok!r}")
    value = float(tok)
    if value - value != 0.0 and _NONFINITE.fullmatch(tok) is None:
        # Go's ParseFloat (so Prometheus) fails with ErrRange where Python quietly gives inf.
        raise _LineError(f"value {tok!r} out of float64 range")
    return value


def _fast_value(v: str) -> float | None:
    """``float(v)`` if ``v`` is valid Go/Prometheus float syntax, else None (caller falls back)."""
    try:
        value = float(v)
    except ValueError:
        return None
    # float() is more liberal than Go: reject what only it accepts (surrounding whitespace, '_',
    # non-ASCII digits, signed NaN, overflow to inf).  Mirrored inline in parse()'s hot loop.
    if (
        v.isascii()
        and "_" not in v
        and v[0] > " "
        and v[-1] > " "
        and (value - value == 0.0 or _NONFINITE.fullmatch(v) is not None)
    ):
        return value
    return None


def _text_ts(tok: str) -> int:
    if _TEXT_TS.fullmatch(tok) is None:
        raise _LineError(f"invalid timestamp {tok!r} (expected integer milliseconds)")
    ts = int(tok)
    if not _INT64_MIN <= ts <= _INT64_MAX:
        raise _LineError(f"timestamp {tok!r} out of range")
    return ts


def _om_ts(tok: str) -> int:
    if _OM_TS.fullmatch(tok) is None:
        raise _LineError(f"invalid timestamp {tok!r} (expected seconds)")
    try:
        seconds = Decimal(tok)
    except DecimalException:  # exponent beyond what decimal can hold
        raise _LineError(f"timestamp {tok!r} out of range") from None
    # Reject absurd exponents before scaling; int64 ms covers ~2.9e8 years either way.
    if seconds and seconds.adjusted() > 16:
        raise _LineError(f"timestamp {tok!r} out of range")
    # Exact decimal scaling: float(tok) * 1000 turns "1.001" into 1000.99999 and
    # "2158054038.483" into ...482.9998, a millisecond off once truncated.
    ms = int(seconds.scaleb(3).to_integral_value(rounding=ROUND_HALF_EVEN))
    if not _INT64_MIN <= ms <= _INT64_MAX:
        raise _LineError(f"timestamp {tok!r} out of range")
    return ms


# --- full (slow) path -------------------------------------------------------------------------


def _labels(name: str, block: str | None, cache: SeriesCache) -> Labels:
    intern = cache._pairs.setdefault
    head = ("__name__", name)
    head = intern(head, head)
    if not block:
        return (head,)
    found = _PAIR.findall(block)
    names = {lname for lname, _ in found}
    if len(names) != len(found) or "__name__" in names:
        raise _LineError(_duplicate(found))
    pairs = [head]
    known = cache._pairs.get
    for pair in found:
        if pair[1]:  # an empty value == label absent (and remote write forbids empty values)
            if "\\" in pair[1]:
                pair = (pair[0], _unescape(pair[1]))
            shared = known(pair)
            if shared is None:
                # A new pair keeps its name as the one string of that name (sys.intern): series with
                # distinct values (container ids, pod names) otherwise each held a copy of every name,
                # ~60 B a label of the ~450-1,100 B a new series costs in this cache.
                shared = (sys.intern(pair[0]), pair[1])
                cache._pairs[shared] = shared
            pairs.append(shared)
    pairs.sort()
    return tuple(pairs)


def _duplicate(found: list[tuple[str, str]]) -> str:
    seen = {"__name__"}
    for lname, _ in found:
        if lname in seen:
            return f"duplicate label name {lname!r}"
        seen.add(lname)
    return "duplicate label name"


def _block_error(line: str, start: int, om: bool) -> str:
    """Explain why the label block opening at ``line[start] == '{'`` is malformed."""
    ws = "" if om else " \t"
    i, n = start + 1, len(line)
    lname = re.compile(_LNAME)
    quoted = re.compile(_QUOTED)
    while True:
        while i < n and line[i] in ws:
            i += 1
        if i >= n:
            return "unterminated label set (missing '}')"
        if line[i] == "}":
            return "malformed label set"
        m = lname.match(line, i)
        if m is None:
            return "invalid label name"
        i = m.end()
        while i < n and line[i] in ws:
            i += 1
        if i >= n or line[i] != "=":
            return f"expected '=' after label name {m[0]!r}"
        i += 1
        while i < n and line[i] in ws:
            i += 1
        if i >= n or line[i] != '"':
            return f"expected quoted value for label {m[0]!r}"
        q = quoted.match(line, i)
        if q is None:
            return f"unterminated label value for label {m[0]!r}"
        i = q.end()
        while i < n and line[i] in ws:
            i += 1
        if i >= n:
            return "unterminated label set (missing '}')"
        if line[i] == "}":
            return "malformed label set"
        if line[i] != ",":
            return f"expected ',' or '}}' after value of label {m[0]!r}"
        i += 1


def _full_line(line: str, om: bool, cache: SeriesCache, ts_memo: dict[str, int]) -> Sample | None:
    """Authoritative parse of one line; None for comments and (text format) blank lines."""
    if om:
        if not line:
            raise _LineError("blank line (not allowed in OpenMetrics)")
        if line[0] == "#":
            if line == "# EOF":
                raise _LineError("content after '# EOF'")
            m = _OM_META.fullmatch(line)
            if m is None:
                raise _LineError("invalid comment (OpenMetrics allows only # HELP, # TYPE, # UNIT, # EOF)")
            if m[1] is not None and m[1] not in _OM_TYPES:
                raise _LineError(f"unknown metric type {m[1]!r}")
            return None
        m = _OM_SERIES.match(line)
    else:
        stripped = line.lstrip(" \t")
        if not stripped or stripped[0] == "#":
            return None
        m = _TEXT_SERIES.match(line)
    if m is None:
        raise _LineError("invalid metric name")
    end = m.end()
    rest = line[end:]
    bare = m[2] is None

    if om:
        if rest[:1] == "{":
            raise _LineError(_block_error(line, end, om) if bare else "unexpected '{' after the label set")
        if bare and rest and rest[0] != " ":
            raise _LineError("invalid character in metric name")
        # rest follows the series, so a " # " in it cannot be inside a label value.
        head, sep, exemplar = rest.partition(" # ")
        toks = head.split(" ")
        if len(toks) < 2 or toks[0] != "" or toks[1] == "":
            what = "missing value" if not head.strip(" ") else "expected a single space before the value"
            raise _LineError(what)
        if len(toks) > 3 or toks[-1] == "":
            raise _LineError("unexpected whitespace or text after value/timestamp")
        value = _float(toks[1])
        ts = None
        if len(toks) == 3:
            ts = ts_memo.get(toks[2])
            if ts is None:
                ts = ts_memo[toks[2]] = _om_ts(toks[2])
        if sep:
            ex = _OM_EXEMPLAR.fullmatch(exemplar)
            if ex is None:
                raise _LineError("malformed exemplar")
            _float(ex[1])
            if ex[2] is not None:
                _om_ts(ex[2])
        key_map = cache._om
    else:
        after = rest.lstrip(" \t")
        if after[:1] == "{":
            if not bare:
                raise _LineError("unexpected '{' after the label set")
            raise _LineError(_block_error(line, end + len(rest) - len(after), om))
        if bare and after and len(after) == len(rest):
            raise _LineError("invalid character in metric name")
        after = after.rstrip(" \t")
        if not after:
            raise _LineError("missing value")
        toks = _TEXT_WS.split(after)
        if len(toks) > 2:
            raise _LineError("unexpected text after timestamp")
        value = _float(toks[0])
        ts = _text_ts(toks[1]) if len(toks) == 2 else None
        key_map = cache._text

    key = line[:end]
    labels = key_map.get(key)
    if labels is None:
        labels = cache.recall(om, key)
    if labels is None:
        labels = cache._store(om, key, _labels(m[1], m[2], cache))
    return labels, value, ts


# --- entry point -----------------------------------------------------------------------------

# The body is split into lines one block of about this many characters at a time, and the sample
# limit is checked after each block: a body far over the limit is refused after parsing at most one
# block past it (65,536 samples at most: 4-byte lines), and only one block's line strings (~50 B each,
# more than the text they hold) exist at once.  Measured on the simulator's bodies (2,000 and 20,000
# series, bytes in, decoding included): 2^16 cost 1-5% per sample over one split of the whole body,
# 2^18 and larger were within the run-to-run noise of it.
_BLOCK_CHARS = 1 << 18


def parse(
    body: str | bytes | bytearray,
    content_type: str = "",
    cache: SeriesCache | None = None,
    sample_limit: int = 0,
    deadline: float | None = None,
) -> list[Sample]:
    """Parse a whole exposition body; raise :class:`ParseError` if any line is malformed.

    ``body`` may be the raw bytes of the response: they are decoded as UTF-8 block by block, so the
    body is never held twice (bytes and str).  More than ``sample_limit`` samples (when > 0) raise
    :class:`SampleLimitExceeded` as soon as a block takes the count over it.  Past ``deadline`` (a
    ``time.monotonic()`` value) the next block raises :class:`ParseDeadlineExceeded`.
    """
    om = is_openmetrics(content_type)
    if cache is None:
        cache = SeriesCache()
    cache.body_started()
    if om:
        stop = _om_content_end(body)
        series = cache._om
        ts_of = _om_ts
    else:
        stop = len(body)
        series = cache._text
        ts_of = _text_ts
    ts_memo: dict[str, int] = {}  # timestamps often repeat within a body; Decimal is slow
    get = series.get
    recall = cache.recall  # a series not seen in this generation yet: from the old one
    out: list[Sample] = []
    append = out.append
    line = ""
    lines: list[str] = []
    base = 0  # lines before the current block
    try:
        for lines, last in _blocks(body, stop):
            for line in lines:
                # Comments and blank lines never hit the cache; skip the lookups for them.
                if line[:1] != "#":
                    i = line.rfind(" ")
                    if i > 0:
                        labels = get(line[:i]) or recall(om, line[:i])
                        if labels is not None:
                            v = line[i + 1 :]
                            try:
                                value = float(v)
                            except ValueError:
                                pass
                            else:
                                # Inlined _fast_value(): a call per sample costs ~10% here.
                                if (
                                    v.isascii()
                                    and "_" not in v
                                    and v[0] > " "
                                    and v[-1] > " "
                                    and (value - value == 0.0 or _NONFINITE.fullmatch(v) is not None)
                                ):
                                    append((labels, value, None))
                                    continue
                        else:
                            j = line.rfind(" ", 0, i)
                            if j > 0:
                                labels = get(line[:j]) or recall(om, line[:j])
                                if labels is not None:
                                    sample = _with_timestamp(
                                        labels, line[j + 1 : i], line[i + 1 :], ts_of, ts_memo
                                    )
                                    if sample is not None:
                                        append(sample)
                                        continue
                sample = _full_line(line, om, cache, ts_memo)
                if sample is not None:
                    append(sample)
            base += len(lines)
            if deadline is not None and time.monotonic() > deadline:
                raise ParseDeadlineExceeded(
                    f"scrape deadline passed while parsing ({len(out)} samples of {len(body)} bytes so "
                    "far); scrape failed"
                )
            if 0 < sample_limit < len(out):
                raise SampleLimitExceeded(
                    f"sample_limit {sample_limit} exceeded: body has {'' if last else 'more than '}"
                    f"{len(out)} samples; scrape failed"
                )
    except _LineError as exc:
        # A line's validity depends only on its text, so the first identical line is this one.
        lineno = base + lines.index(line) + 1
        raise ParseError(str(exc), lineno, line) from None
    except UnicodeDecodeError as exc:
        # Only the block is at hand: count its lines up to the bad byte.
        block, at = exc.object, exc.start
        lineno = base + block.count(b"\n", 0, at) + 1
        bad = _text(block[block.rfind(b"\n", 0, at) + 1 : exc.end])
        raise ParseError(f"body is not UTF-8 ({exc.reason})", lineno, bad) from None
    return out


def _blocks(body: str | bytes | bytearray, stop: int) -> Iterator[tuple[list[str], bool]]:
    """``body[:stop].split("\\n")`` in consecutive pieces cut at newlines, each with "is the last one"
    (bytes are decoded per piece: a newline byte is never part of a multi-byte UTF-8 sequence)."""
    if stop < 0:
        return  # an OpenMetrics body that is only "# EOF"
    raw = isinstance(body, bytes | bytearray)
    nl: Any = b"\n" if raw else "\n"
    # Bytes are decoded straight from a view: slicing them first would copy every block once more.
    view = memoryview(body) if raw else None
    pos = 0
    while True:
        cut = body.find(nl, pos + _BLOCK_CHARS, stop) if pos + _BLOCK_CHARS < stop else -1
        end = stop if cut < 0 else cut
        text: str = str(view[pos:end], "utf-8") if view is not None else body[pos:end]  # type: ignore[assignment]
        yield text.split("\n"), cut < 0
        if cut < 0:
            return
        pos = cut + 1


def _with_timestamp(
    labels: Labels, v: str, t: str, ts_of: Callable[[str], int], ts_memo: dict[str, int]
) -> Sample | None:
    """Fast path for ``series value timestamp``; None sends the line to the full parse."""
    value = _fast_value(v)
    if value is None:
        return None
    ts = ts_memo.get(t)
    if ts is None:
        try:
            ts = ts_of(t)
        except _LineError:
            return None
        ts_memo[t] = ts
    return labels, value, ts


def _om_content_end(body: str | bytes | bytearray) -> int:
    """Where the lines before an OpenMetrics body's closing ``# EOF`` end (-1: there are none), found
    without splitting the body; a missing ``# EOF`` or one followed by content raises ParseError with
    the line numbers a split of the body (its last newline removed) would give."""
    raw = isinstance(body, bytes | bytearray)
    nl: Any = b"\n" if raw else "\n"
    eof: Any = b"# EOF" if raw else "# EOF"
    end = len(body) - 1 if body.endswith(nl) else len(body)
    start = body.rfind(nl, 0, end) + 1  # the last line is body[start:end]
    if body[start:end] == eof:
        return start - 1
    # The first "# EOF" line: the last line is not one, so any is followed by a newline.
    first = 0 if body.startswith(eof + nl) else body.find(nl + eof + nl, 0, end + 1) + 1
    if first == 0 and not body.startswith(eof + nl):
        lineno = body.count(nl, 0, end) + 1
        raise ParseError("missing '# EOF' (truncated OpenMetrics body?)", lineno, _text(body[start:end]))
    after = first + len(eof) + 1
    cut = body.find(nl, after, end)
    line = body[after : end if cut < 0 else cut]
    raise ParseError("content after '# EOF'", body.count(nl, 0, first) + 2, _text(line))


def _text(piece: str | bytes | bytearray) -> str:
    return piece if isinstance(piece, str) else bytes(piece).decode("utf-8", "replace")
