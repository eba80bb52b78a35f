"""Whole-string regex matching in time linear in the string, for patterns from outside the node.

Python's ``re`` backtracks: ``(.*.*)*z`` takes 200 s on an 18-character label value, ``a*a*a*a*z`` 35 s on
1,000 characters. Prometheus matches with RE2, which never backtracks, so nothing stops a backfill
request (``edge_relay.recorder.backfill``) from carrying such a pattern, and its matching runs in the relay's
scrape cycle. ``LinearRegex`` matches what ``relabel.compile_regex`` matches (the same RE2 translation,
parsed by ``re``'s own parser) with a Thompson NFA instead: every position of the string is visited once,
with the set of states the pattern can be in. Only "does the whole string match" is answered; captures
(relabeling's ``$1``) still need ``re``.

The state sets met are memoised (a lazy DFA): the closure of a state set at a position depends only on
the characters on either side (the zero-width assertions RE2 has look no further), so after a few label
values most steps are two dict lookups.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from re import _constants as C  # type: ignore[attr-defined]
from re import _parser  # type: ignore[attr-defined]

from relay_common.relabel import RelabelError, translate_re2

# Instructions: (CHAR, predicate) consumes one character; (SPLIT, a, b) and (JMP, a) branch without
# consuming; (ASSERT, predicate of (before, after)) is zero-width; MATCH ends a match.
_CHAR, _SPLIT, _JMP, _ASSERT, _MATCH = range(5)
# A pattern whose counted repeats expand to more instructions than this is refused (``(a{1000}){1000}``).
MAX_INSTRUCTIONS = 20_000
_MEMO_MAX = 50_000

CharTest = Callable[[str], bool]
PositionTest = Callable[[str | None, str | None], bool]


def _is_word(ch: str | None) -> bool:
    """RE2's \\b looks at ASCII word characters only."""
    return ch is not None and ch.isascii() and (ch.isalnum() or ch == "_")


_CATEGORIES: dict[object, CharTest] = {
    C.CATEGORY_DIGIT: lambda c: c.isdigit(),
    C.CATEGORY_NOT_DIGIT: lambda c: not c.isdigit(),
    C.CATEGORY_SPACE: lambda c: c.isspace(),
    C.CATEGORY_NOT_SPACE: lambda c: not c.isspace(),
    C.CATEGORY_WORD: lambda c: c.isalnum() or c == "_",
    C.CATEGORY_NOT_WORD: lambda c: not (c.isalnum() or c == "_"),
}


class _Compiler:
    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.prog: list[tuple] = []

    def fail(self, why: str) -> RelabelError:
        return RelabelError("", f"regex {self.pattern!r}: {why}")

    def emit(self, *ins: object) -> int:
        if len(self.prog) >= MAX_INSTRUCTIONS:
            raise self.fail(f"its repeats expand to more than {MAX_INSTRUCTIONS} states")
        self.prog.append(ins)
        return len(self.prog) - 1

    def char_test(self, op: object, av: object, flags: int) -> CharTest | None:
        """The predicate of a one-character node, or None if ``op`` is not one."""
        negate = False
        test: CharTest
        if op is C.LITERAL:
            test = chr(av).__eq__  # type: ignore[arg-type]
        elif op is C.NOT_LITERAL:
            test, negate = chr(av).__eq__, True  # type: ignore[arg-type]
        elif op is C.ANY:
            return (lambda c: True) if flags & re.DOTALL else (lambda c: c != "\n")
        elif op is C.IN:
            test, negate = self.class_test(av)  # type: ignore[arg-type]
        else:
            return None
        if flags & re.IGNORECASE:
            # Folded before the negation: (?i)[^a] refuses "A" too.
            positive = test

            def folded(c: str, positive: CharTest = positive) -> bool:
                return positive(c) or positive(c.lower()) or positive(c.upper())

            test = folded
        if negate:
            return lambda c, test=test: not test(c)
        return test

    def class_test(self, items: list[tuple[object, object]]) -> tuple[CharTest, bool]:
        """A class's items as one predicate, and whether the class is negated."""
        negate = bool(items) and items[0][0] is C.NEGATE
        tests: list[CharTest] = []
        for op, av in items[1:] if negate else items:
            if op is C.LITERAL:
                tests.append(chr(av).__eq__)  # type: ignore[arg-type]
            elif op is C.RANGE:
                lo, hi = chr(av[0]), chr(av[1])  # type: ignore[index]
                tests.append(lambda c, lo=lo, hi=hi: lo <= c <= hi)
            elif op is C.CATEGORY and av in _CATEGORIES:
                tests.append(_CATEGORIES[av])
            else:
                raise self.fail(f"the class item {op} is not supported here")
        return (lambda c: any(t(c) for t in tests)), negate

    def position_test(self, op: object, av: object, flags: int) -> PositionTest:
        if op is C.AT:
            multi = bool(flags & re.MULTILINE)
            if av is C.AT_BEGINNING_STRING or (av is C.AT_BEGINNING and not multi):
                return lambda before, after: before is None
            if av is C.AT_BEGINNING:
                return lambda before, after: before is None or before == "\n"
            if av is C.AT_END_STRING:
                return lambda before, after: after is None
            if av is C.AT_END:
                if multi:
                    return lambda before, after: after is None or after == "\n"
                return lambda before, after: after is None  # the translation writes \Z for RE2's `$`
            if av is C.AT_BOUNDARY:
                return lambda before, after: _is_word(before) != _is_word(after)
            if av is C.AT_NON_BOUNDARY:
                return lambda before, after: _is_word(before) == _is_word(after)
            raise self.fail(f"the assertion {av} is not supported here")
        # A one-character lookaround, as the translation writes RE2's \b: (?<=[w]) (?![w]) ..., or one
        # around such tests only (\B: (?!\b)), which looks at the same two characters.
        direction, sub = av  # type: ignore[misc]
        nodes = list(sub)
        want = op is C.ASSERT
        test = self.char_test(*nodes[0], flags) if len(nodes) == 1 else None
        if test is None:
            inner = self.zero_width_test(nodes, flags)
            return lambda before, after: inner(before, after) == want
        if direction < 0:
            return lambda before, after: (before is not None and test(before)) == want
        return lambda before, after: (after is not None and test(after)) == want

    def zero_width_test(self, nodes: list[tuple[object, object]], flags: int) -> PositionTest:
        """A sequence of zero-width nodes (assertions, and groups and alternatives of them) as one test."""
        tests: list[PositionTest] = []
        for op, av in nodes:
            if op in (C.AT, C.ASSERT, C.ASSERT_NOT):
                tests.append(self.position_test(op, av, flags))
            elif op is C.SUBPATTERN:
                _group, add, remove, sub = av  # type: ignore[misc]
                tests.append(self.zero_width_test(list(sub), (flags | add) & ~remove))
            elif op is C.BRANCH:
                alts = [self.zero_width_test(list(alt), flags) for alt in av[1]]  # type: ignore[index]
                tests.append(lambda before, after, alts=alts: any(t(before, after) for t in alts))
            else:
                raise self.fail("only lookarounds of one character, or of assertions, are supported here")
        return lambda before, after: all(t(before, after) for t in tests)

    def sequence(self, nodes: object, flags: int) -> None:
        for op, av in nodes:  # type: ignore[attr-defined]
            self.node(op, av, flags)

    def node(self, op: object, av: object, flags: int) -> None:
        test = self.char_test(op, av, flags)
        if test is not None:
            self.emit(_CHAR, test)
        elif op is C.SUBPATTERN:
            _group, add, remove, sub = av  # type: ignore[misc]
            self.sequence(sub, (flags | add) & ~remove)
        elif op is C.BRANCH:
            jumps = []
            alternatives = av[1]  # type: ignore[index]
            for k, alt in enumerate(alternatives):
                if k < len(alternatives) - 1:
                    split = self.emit(_SPLIT, 0, 0)
                    self.sequence(alt, flags)
                    jumps.append(self.emit(_JMP, 0))
                    self.prog[split] = (_SPLIT, split + 1, len(self.prog))
                else:
                    self.sequence(alt, flags)
            for j in jumps:
                self.prog[j] = (_JMP, len(self.prog))
        elif op in (C.MAX_REPEAT, C.MIN_REPEAT):  # the same set of matches: no captures here
            low, high, sub = av  # type: ignore[misc]
            for _ in range(low):
                self.sequence(sub, flags)
            if high == C.MAXREPEAT:
                split = self.emit(_SPLIT, 0, 0)
                self.sequence(sub, flags)
                self.emit(_JMP, split)
                self.prog[split] = (_SPLIT, split + 1, len(self.prog))
            else:
                splits = []
                for _ in range(high - low):
                    splits.append(self.emit(_SPLIT, 0, 0))
                    self.sequence(sub, flags)
                for s in splits:
                    self.prog[s] = (_SPLIT, s + 1, len(self.prog))
        elif op in (C.AT, C.ASSERT, C.ASSERT_NOT):
            self.emit(_ASSERT, self.position_test(op, av, flags))
        else:
            raise self.fail(f"{op} is not supported here")


class LinearRegex:
    """``pattern`` (RE2) anchored at both ends, dot matching newlines (as ``relabel.compile_regex``),
    matched in linear time. ``RelabelError`` for a pattern RE2 refuses or this matcher does not take."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        translated = f"(?s:{translate_re2(pattern)})"
        try:
            parsed = _parser.parse(translated)
        except re.error as e:
            raise RelabelError("", f"not a valid regex {pattern!r}: {e}") from e
        compiler = _Compiler(pattern)
        compiler.sequence(parsed, parsed.state.flags)
        compiler.emit(_MATCH)
        self._prog = compiler.prog
        self._closures: dict[tuple[frozenset[int], str | None, str | None], frozenset[int]] = {}
        self._steps: dict[tuple[frozenset[int], str], frozenset[int]] = {}

    def _closure(self, seeds: frozenset[int], before: str | None, after: str | None) -> frozenset[int]:
        """The consuming (and matching) states reachable from ``seeds`` without consuming, between the
        characters ``before`` and ``after`` (None: an end of the string)."""
        key = (seeds, before, after)
        got = self._closures.get(key)
        if got is not None:
            return got
        prog, out, seen, stack = self._prog, set(), set(), list(seeds)
        while stack:
            pc = stack.pop()
            if pc in seen:
                continue
            seen.add(pc)
            ins = prog[pc]
            kind = ins[0]
            if kind == _SPLIT:
                stack += (ins[2], ins[1])
            elif kind == _JMP:
                stack.append(ins[1])
            elif kind == _ASSERT:
                if ins[1](before, after):
                    stack.append(pc + 1)
            else:
                out.add(pc)
        got = frozenset(out)
        if len(self._closures) > _MEMO_MAX:
            self._closures.clear()
        self._closures[key] = got
        return got

    def _step(self, states: frozenset[int], ch: str) -> frozenset[int]:
        key = (states, ch)
        got = self._steps.get(key)
        if got is None:
            prog = self._prog
            got = frozenset(pc + 1 for pc in states if prog[pc][0] == _CHAR and prog[pc][1](ch))
            if len(self._steps) > _MEMO_MAX:
                self._steps.clear()
            self._steps[key] = got
        return got

    def fullmatch(self, value: str) -> bool:
        n = len(value)
        states = self._closure(frozenset((0,)), None, value[0] if n else None)
        for i, ch in enumerate(value):
            seeds = self._step(states, ch)
            if not seeds:
                return False
            states = self._closure(seeds, ch, value[i + 1] if i + 1 < n else None)
        return any(self._prog[pc][0] == _MATCH for pc in states)
