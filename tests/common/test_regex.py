"""``relay_common.regex``: every pattern a user writes means what it means in Prometheus (Go's ``regexp``),
is refused where Go refuses it, and is matched in time linear in the value.

Three references: tables of Go's behaviour, Python's ``re`` on the patterns whose meaning both share
(a property over generated patterns), and Go itself (Prometheus' ``promtool``: which patterns it takes,
and what they match)."""

from __future__ import annotations

import json
import random
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from relay_common.regex import MAX_REPEAT, Regex, RegexError, translate
from relay_common.selector import SelectorError, parse_selector
from testkit.services import find_binary

# --- Go's meaning, as tables -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "matches", "misses"),
    [
        ("foo|bar", ["foo", "bar"], ["foobar", "xfoo"]),  # fully anchored, both alternatives
        (r"a\z", ["a"], ["a\n"]),  # \z: end of text
        ("a$", ["a"], ["a\n"]),  # re's $ would also match before a final newline
        ("(?m:a$\n)b", ["a\nb"], ["ab"]),
        (".*", ["x\ny", ""], []),  # Prometheus 3: dot matches a newline
        (r"\d+", ["0123456789"], ["\u0663", "١٢"]),  # ASCII digits only (re's \d is Unicode)
        (r"\w+", ["a_Z9"], ["é", "ß"]),
        (r"\s", [" ", "\t", "\n", "\f", "\r"], ["\v", "\u00a0", "\u2003"]),
        (r"\S+", ["é"], [" "]),
        (r"x\b.*", ["x y", "x"], ["xé"[:1] + "y"]),
        (r"é\b", [], []),
        (r".\B.", ["ab"], ["a "]),
        ("(?i)gpu", ["GPU", "gPu"], ["CPU"]),
        ("(?i)é", ["É"], []),  # case folding is Unicode, as in RE2
        ("(?i)a|b", ["A", "B"], ["c"]),
        (r"(?<g>a)b", ["ab"], []),
        (r"\Qa.b*\E+", ["a.b*", "a.b**"], ["axb"]),
        (r"[[:alpha:]]+[[:digit:]]", ["ab1"], ["é1", "ab"]),
        (r"[[:upper:][:space:]]+", ["A B"], ["a"]),
        (r"[[:punct:]]", ["!", "[", "`", "~"], ["a"]),
        ("a{,2}", ["a{,2}"], ["", "aa"]),  # RE2: a literal `{` here
        ("a{2}", ["aa"], ["a"]),
        (r"a\_[\_]", ["a__"], ["a_"]),  # Go reads an escaped `_` as itself
        ("a{01}", ["a{01}"], ["a"]),  # Go's parseInt takes no leading zero: a literal again
        ("a{1,02}", ["a{1,02}"], ["a", "aa"]),
        ("a{\u0661}", ["a{\u0661}"], ["a"]),  # nor a digit other than ASCII
        (r"\x41\x{42}", ["AB"], []),
        ("[a-c&&]", ["&", "b"], ["d"]),
        ("[]a]", ["]", "a"], ["b"]),
        ("[^]a]", ["b"], ["]"]),
        (r"[\d.-]+", ["1.-2"], ["x"]),
        ("x*?y", ["xxy"], []),
        ("(?:ab)+(?i:C)", ["ababc"], ["abC" + "x"]),
        ("(?s)a.b", ["a\nb"], []),
        ("(?-s:a.b)", ["axb"], ["a\nb"]),
        # Go takes these; the engine before RE2 (Python's re) refused them.
        (r"\pL+", ["aé", "Ω"], ["1", "_"]),
        (r"\p{Greek}+", ["αβ"], ["a"]),
        (r"\PL", ["1"], ["a"]),
        (r"\p{^Greek}", ["a"], ["α"]),
        (r"[\p{Lu}\d]+", ["A1Ω"], ["a"]),
        ("(?U)a+", ["aaa"], [""]),
        ("a(?i)b", ["ab", "aB"], ["AB"]),
        ("(?i:a)b(?i)c", ["Abc", "AbC"], ["ABc"]),
        (r"[\W]", ["-", "é"], ["a"]),
        ("[[:^alpha:]]", ["1", "é"], ["a"]),
        ("(?)a", ["a"], []),
        ("(?P<1a>x)", ["x"], []),
        ("(?P<n>a)(?P<n>b)", ["ab"], []),
        (r"\012\0\101", ["\n\x00A"], []),  # octal
        ("a{2}\\Q\\E{3}", ["a" * 6], ["aa"]),  # an empty \Q\E adds nothing: the {3} repeats a{2}
        ("^*a$+", ["a"], []),
        ("[[:a]", ["[", ":", "a"], ["]"]),  # no `:]`: not a class name, a `[`
    ],
)
def test_patterns_match_what_go_matches(pattern: str, matches: list[str], misses: list[str]) -> None:
    regex = Regex(pattern)
    for s in matches:
        assert regex.matches(s), (pattern, s)
        assert regex.fullmatch(s) is not None, (pattern, s)
    for s in misses:
        assert not regex.matches(s), (pattern, s)
        assert regex.fullmatch(s) is None, (pattern, s)


@pytest.mark.parametrize(
    ("pattern", "why"),
    [
        (r"a\Z", "no \\Z"),
        ("a(?=b)", "lookahead"),
        ("(?<!a)b", "lookbehind"),
        ("(?>a)", "atomic"),
        ("a++", "repeated quantifier"),
        ("a*+", "repeated quantifier"),
        ("a?+", "repeated quantifier"),
        ("a{2}+", "repeated quantifier"),
        ("a**", "repeated quantifier"),
        (r"(a)\1", "backreference"),
        ("(?P<n>a)(?P=n)", "backreference"),
        (r"\C", "any byte"),
        ("(?x)a", "no flag"),
        ("a{1001}", "1000"),
        ("[[:nope:]]", "unknown POSIX"),
        (r"\e", "does not know"),
        ("(?(1)a|b)", "conditionals"),
        ("(?#c)", "comments"),
        ("(a", "missing `)`"),
        ("a)", "unmatched"),
        ("[a", "missing `]`"),
        ("*a", "without anything to repeat"),
        ("(a{100}){100}", "more than 1000 copies"),  # Go's limit on nested repeats
        ("(a{2}b{501}){2}", "more than 1000 copies"),
        (r"\Qab", "without `\\E`"),  # Prometheus' closing `)$` would be read as text
        ("(?i-)a", "negation"),
        (r"\x{110000}", "10FFFF"),
        (r"\x{4_1}", "hex digits"),
        (r"\x4", "two hex digits"),
        ("[z-a]", "range z-a"),
        (r"\p{Foo}", "class range"),
        ("(?P<é>a)", "named capture"),
        ("(?P<>a)", "named capture"),
        (r"\8", "does not know"),
        (r"[\b]", "does not know"),
        ("a\ud800", "UTF-8"),
    ],
)
def test_refusals_say_why_and_where(pattern: str, why: str) -> None:
    with pytest.raises(RegexError, match=re.escape(why)) as refused:
        translate(pattern)
    assert "at offset" in refused.value.why


def test_the_offset_points_at_the_offending_part() -> None:
    for pattern, offset in (("ab**", 3), (r"x\1", 1), ("(a{100}){100}", 8), ("[b-a]", 3)):
        with pytest.raises(RegexError, match=f"at offset {offset} "):
            translate(pattern)


def test_nested_repeats_are_counted_as_go_counts_them() -> None:
    """Go's repeatIsValid: the copies a repeat makes multiply through nesting; ``x{0}`` is not looked
    into; ``*`` ``+`` ``?`` do not count."""
    for taken in ("(a{100}){10}", "((a{1000}){0}){2}", "(a{1000})*", "(a{10}|b{100}){10}", "a{2}b{1000}"):
        Regex(taken)
    for refused in ("(a{10}|b{101}){10}", "((a{10}){10}){11}", "(a{1000,}){2}"):
        with pytest.raises(RegexError, match=str(MAX_REPEAT)):
            Regex(refused)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab.*+?|()[]^$\\{},0123456789:-dwszpPQE<>i"), max_size=12))
@example("[0-")  # a range without its end: once an IndexError
@example("[a-\\")
@example("\\p")
@example("\\x{")
def test_every_input_is_refused_or_compiles(pattern: str) -> None:
    """Whatever the input, the engine either refuses it with its own error or compiles it: never a
    crash, never an error of RE2's own escaping."""
    try:
        regex = Regex(pattern)
    except RegexError:
        return
    regex.matches("ab")


# --- captures ------------------------------------------------------------------------------------------


def test_groups_are_slices_of_the_value() -> None:
    m = Regex("(a)(?P<x>b)?(é+)").fullmatch("aéé")
    assert m is not None
    assert (m.group(0), m.group(1), m.group(2), m.group(3), m.group(4)) == ("aéé", "a", None, "éé", None)
    assert m.named("x") is None and m.named("nope") is None
    m = Regex("(?U)(a+)(a*)").fullmatch("aaa")  # ungreedy: the first group takes as little as it can
    assert m is not None and (m.group(1), m.group(2)) == ("a", "aa")


def test_a_repeated_group_name_is_the_leftmost_that_took_part_as_in_go() -> None:
    regex = Regex("(?P<n>a)x|(?P<n>b)y")
    m = regex.fullmatch("by")
    assert m is not None and m.named("n") == "b"
    m = regex.fullmatch("ax")
    assert m is not None and m.named("n") == "a"


def test_a_lone_surrogate_is_matched_as_go_reads_an_invalid_byte() -> None:
    """Go reads an invalid UTF-8 byte as U+FFFD; ``surrogateescape`` carries one as a lone surrogate."""
    value = b"pod-\xff-1".decode("utf-8", "surrogateescape")
    assert Regex("pod-.-1").matches(value)
    assert Regex("pod-\\x{FFFD}-1").matches(value)
    assert not Regex("pod--1").matches(value)
    m = Regex("pod-(.)-(1)").fullmatch(value)
    assert m is not None and m.group(1) == "\udcff" and m.group(2) == "1"  # the original character


def test_remembered_answers_are_the_answers() -> None:
    """``matches`` remembers short values' answers and starts over when it holds too many: the answers
    stay RE2's (checked against ``fullmatch``, which remembers nothing)."""
    regex = Regex("(?i)[a-f]+_[0-9]{2}")
    values = [f"{n:x}_{n % 1000:d}" for n in range(10_000)] + ["x" * 300, "ABC_12"]
    for _ in range(2):
        for value in values:
            assert regex.matches(value) == (regex.fullmatch(value) is not None), value


# --- linear time ---------------------------------------------------------------------------------------

POD = "llm-triton-server-7d9f8b6c5d-x0001"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("pattern", "values", "hits"),
    [
        # 4 s per pod name on a backtracking engine
        ("([a-z0-9]+-?)*-canary", [f"{POD[:-4]}{n:04d}" for n in range(10_000)], 0),
        ("(.*.*)*z", ["a" * 40 + str(n) for n in range(10_000)], 0),  # hours on 40 characters
        ("(a|aa)*b", ["a" * 200 + str(n) for n in range(10_000)], 0),
        ("a*a*a*a*z", ["a" * 1000 + "z" * (n % 2) for n in range(10_000)], 5_000),
    ],
)
def test_patterns_that_make_a_backtracking_engine_take_hours_are_answered(
    pattern: str, values: list[str], hits: int
) -> None:
    """Each of these takes seconds to hours per value on ``re``; here every character is visited once,
    so 10,000 values are done long before the timeout."""
    regex = Regex(pattern)
    assert sum(regex.matches(v) for v in values) == hits
    assert sum(regex.fullmatch(v) is not None for v in values[:1000]) == hits // 10


def test_backfill_selectors_match_with_it() -> None:
    selector = parse_selector('{__name__=~"(.*.*)*z", job!~"(a|aa)*b"}')
    assert selector((("__name__", "az"), ("job", "aaa")))
    assert not selector((("__name__", "a" * 200), ("job", "aaa")))
    assert not selector((("__name__", "az"), ("job", "aab")))


def test_a_pattern_that_repeats_too_far_is_refused_with_its_reason() -> None:
    with pytest.raises(RegexError, match="more than 1000 copies"):
        Regex("(a{1000}){1000}")
    with pytest.raises(SelectorError, match="repeat"):
        parse_selector('{__name__=~"(x{1000}){1000}"}')


# --- Python's re, where the meaning is shared ------------------------------------------------------

_WORD = "[0-9A-Za-z_]"
_BOUNDARY = f"(?:(?<!{_WORD})(?={_WORD})|(?<={_WORD})(?!{_WORD}))"
# (RE2, re) spellings of the same thing; RE2's classes are ASCII, re's Unicode, so re gets them written
# out; re's \b and \B have Unicode word characters, and its \B never matches an empty string.
_ATOMS = [
    ("a", "a"),
    ("b", "b"),
    ("ab", "ab"),
    (".", "."),
    ("[ab]", "[ab]"),
    ("[^a]", "[^a]"),
    ("[a-c]", "[a-c]"),
    (r"\d", "[0-9]"),
    (r"\w", _WORD),
    (r"\s", r"[\t\n\f\r ]"),
    (r"\b", _BOUNDARY),
    (r"\B", f"(?!{_BOUNDARY})"),
    ("^", "^"),
    (r"\A", r"\A"),
    (r"\z", r"\Z"),
    ("x?", "x?"),
    ("", ""),
    ("é", "é"),
    (r"\n", r"\n"),
    ("[[:alpha:]]", "[A-Za-z]"),
    ("[^\n]", "[^\n]"),
    (r"\x41", "A"),
    (r"\Q.\E", r"\."),
    ("a{,2}", r"a\{,2\}"),
]
_REPEATS = ["*", "+", "?", "{2}", "{1,3}", "{0,}", "*?", "+?", "{0}"]


@st.composite
def pattern_pairs(draw: st.DrawFn, depth: int = 0, multiline: bool = False) -> tuple[str, str, bool]:
    """(ours, re's spelling, whether their groups must agree): captures are compared only where no
    repeated group can match the empty string, since there a backtracking engine and RE2 (and Go)
    count the empty turns differently."""
    kind = draw(st.integers(0, 5 if depth < 3 else 0))
    if kind == 0:
        if draw(st.booleans()):
            return "$", "$" if multiline else r"\Z", True  # re's `$` also matches before a final newline
        return (*draw(st.sampled_from(_ATOMS)), True)
    if kind == 1:
        a, b = draw(pattern_pairs(depth + 1, multiline)), draw(pattern_pairs(depth + 1, multiline))
        return a[0] + b[0], a[1] + b[1], a[2] and b[2]
    if kind == 2:
        a, b = draw(pattern_pairs(depth + 1, multiline)), draw(pattern_pairs(depth + 1, multiline))
        return f"(?:{a[0]}|{b[0]})", f"(?:{a[1]}|{b[1]})", a[2] and b[2]
    if kind == 3:
        rep = draw(st.sampled_from(_REPEATS))
        a = draw(pattern_pairs(depth + 1, multiline))
        never_empty = re.fullmatch(a[1], "", re.DOTALL | (re.MULTILINE if multiline else 0)) is None
        return f"({a[0]}){rep}", f"({a[1]}){rep}", a[2] and never_empty
    flag = draw(st.sampled_from(["i", "m", "s", "-s", "i-m", "-m"]))
    inner = multiline if "m" not in flag else not flag.startswith("-") and "-m" not in flag
    a = draw(pattern_pairs(depth + 1, inner))
    return f"(?{flag}:{a[0]})", f"(?{flag}:{a[1]})", a[2]


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(pattern_pairs(), pattern_pairs().map(lambda p: (f"(?i){p[0]}", f"(?i){p[1]}", p[2]))),
    st.lists(st.text(alphabet="abAB1 _é\nxK.{},2", max_size=7), min_size=1, max_size=6),
)
def test_it_matches_what_re_matches_where_both_mean_the_same(
    pair: tuple[str, str, bool], values: list[str]
) -> None:
    ours, theirs, comparable = pair
    regex = Regex(ours)
    reference = re.compile(theirs, re.DOTALL)
    for value in values:
        want = reference.fullmatch(value)
        assert regex.matches(value) == (want is not None), (ours, theirs, value)
        got = regex.fullmatch(value)
        assert (got is None) == (want is None), (ours, value)
        if comparable and got is not None and want is not None and "" not in want.groups():
            # Both prefer the leftmost-first match, so the groups agree too; except where a repeated
            # group's last turn matched nothing: a backtracking engine takes one more empty turn, RE2
            # (and Go) do not.
            groups = [got.group(k) for k in range(1, regex.groups + 1)]
            assert groups == list(want.groups()), (ours, theirs, value)


# --- Go itself: Prometheus' promtool --------------------------------------------------------------------
# Debian's promtool is Prometheus 2, which compiles ``^(?:<regex>)$``: the patterns below are given to it as
# ``(?s:<regex>)`` where the meaning matters. Its Go (1.19) does not know ``(?<name>``: left out.

_GO_ATOMS = [a for a, _ in _ATOMS] + [r"\pL", r"\p{Greek}", r"\PN", r"[\p{Lu}\d]", "[[:^alpha:]]", r"[\W]"]
_GO_ATOMS += [r"\012", r"\0", r"\x{3A9}", r"\_", "a{01}", "(?i)", "(?U)", "(?m-s)", "(?)", r"\Q\E", r"\Q*\E"]
_GO_ATOMS += ["[]a]", "[a-]", "[[:a]", "(?P<n>a)", "(?P<1>b)", "{", "[^\\n]", r"\$", "\\{2}"]
_GO_REPEATS = [*_REPEATS, "{3}?", "{1000}", "{30}", "{40}", "**", "{2}{3}", "{2,1}", "{1001}"]
_VALUES = ["", "a", "b", "A", "aa", "ab", "ba", "aaa", "a\nb", "\n", "é", "É", "Ω", "ω", "1", "12", "_", ":"]
_VALUES += ["{", "{2}", "a{01}", "*", "$", "a b", "-", "aB", "Ab", "AB", "abc", "\u212a", "k", "K"]


def _go_patterns(seed: int, count: int) -> Iterator[str]:
    rnd = random.Random(seed)

    def gen(depth: int) -> str:
        kind = rnd.randint(0, 5 if depth < 4 else 0)
        if kind == 0:
            return rnd.choice(_GO_ATOMS)
        if kind == 1:
            return gen(depth + 1) + gen(depth + 1)
        if kind == 2:
            return f"(?:{gen(depth + 1)}|{gen(depth + 1)})"
        if kind == 3:
            return f"({gen(depth + 1)}){rnd.choice(_GO_REPEATS)}"
        if kind == 4:
            return gen(depth + 1) + rnd.choice(_GO_REPEATS)
        return f"(?{rnd.choice(['i', 'm', 's', '-s', 'i-m', 'U'])}:{gen(depth + 1)})"

    for _ in range(count):
        yield gen(0)
    # and text that is mostly not a pattern at all
    noise = [*"ab.*+?|()[]^$\\{},0123:-dwszpPLE<>_=!ix", "(?", r"\p{Greek}", "[:alpha:]", r"\x{", "(?P<"]
    for _ in range(count):
        yield "".join(rnd.choice(noise) for _ in range(rnd.randint(1, 8)))


def _promtool() -> str:
    return find_binary("/usr/bin/promtool", "prometheus")


@pytest.mark.integration
def test_go_takes_exactly_the_patterns_it_takes_here(tmp_path: Path) -> None:
    """Which patterns are refused: Go's ``regexp`` (in ``promtool check config``) against ours, on
    generated patterns, valid and not."""
    patterns = sorted({p for p in _go_patterns(26, 400) if "(?<" not in p})
    files = []
    for n, pattern in enumerate(patterns):
        config = {
            "scrape_configs": [
                {
                    "job_name": "x",
                    "static_configs": [{"targets": ["a:1"]}],
                    "metric_relabel_configs": [{"source_labels": ["a"], "action": "drop", "regex": pattern}],
                }
            ]
        }
        path = tmp_path / f"p{n}.yml"
        path.write_text(yaml.safe_dump(config))
        files.append(path)
    run = subprocess.run([_promtool(), "check", "config", *map(str, files)], capture_output=True, text=True)
    taken_by_go = {Path(name).name for name in re.findall(r"SUCCESS: (\S+) is valid", run.stdout)}
    differ = []
    for n, pattern in enumerate(patterns):
        try:
            Regex(pattern)
            why = ""
        except RegexError as e:
            why = e.why
        if "unmatched `)`" in why:
            continue  # Prometheus 2's `^(?:` ... `)$` takes `a)|(b`; we refuse what would close it
        if "pattern too large" in why or "invalid repetition size" in why:
            continue  # RE2's memory budget and its count of x{0}: refused, with RE2's reason
        if (f"p{n}.yml" in taken_by_go) != (why == ""):
            differ.append((pattern, why or "taken here", "taken by Go" if f"p{n}.yml" in taken_by_go else ""))
    assert len(taken_by_go) > 100  # the generator makes valid patterns too
    assert not differ, differ


def _promql_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


@pytest.mark.integration
def test_what_go_matches_is_what_matches_here(tmp_path: Path) -> None:
    """What each pattern matches: ``promtool test rules`` evaluates ``m{v=~"<pattern>"}`` over one series
    per value, and expects exactly the values our engine matches."""
    patterns = []
    for pattern in _go_patterns(27, 300):
        try:
            regex = Regex(pattern)
        except RegexError:
            continue
        if "(?<" not in pattern:
            patterns.append((pattern, regex))
    assert len(patterns) > 150
    series = [("m" if not v else f"m{{v={_promql_string(v)}}}") for v in _VALUES]
    tests = []
    for pattern, regex in patterns:
        tests.append(
            {
                "expr": f"m{{v=~{_promql_string(f'(?s:{pattern})')}}}",
                "eval_time": "0m",
                "exp_samples": [
                    {"labels": s, "value": 1}
                    for s, value in zip(series, _VALUES, strict=True)
                    if regex.matches(value)
                ],
            }
        )
    spec = {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": "1"} for s in series],
                "promql_expr_test": tests,
            }
        ],
    }
    path = tmp_path / "regex_test.yml"
    path.write_text(yaml.safe_dump(spec, allow_unicode=True))
    run = subprocess.run([_promtool(), "test", "rules", str(path)], capture_output=True, text=True)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
