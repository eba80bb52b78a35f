"""``relay_common.regex``: the same whole-string matches as ``relabel.compile_regex`` (``re`` on the
RE2 translation), without backtracking, for the regexes of backfill requests."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relay_common.regex import MAX_INSTRUCTIONS, LinearRegex
from relay_common.relabel import RelabelError, compile_regex
from relay_common.selector import SelectorError, parse_selector

_ATOMS = ["a", "b", "ab", ".", "[ab]", "[^a]", "[a-c]", r"\d", r"\w", r"\s", r"\b", r"\B", "^", "$", r"\A"]
_ATOMS += [r"\z", "x?", "", "é", r"\n", r"[[:alpha:]]", "[^\n]"]


@st.composite
def patterns(draw: st.DrawFn, depth: int = 0) -> str:
    kind = draw(st.integers(0, 5 if depth < 3 else 0))
    if kind == 0:
        return draw(st.sampled_from(_ATOMS))
    if kind == 1:
        return draw(patterns(depth + 1)) + draw(patterns(depth + 1))
    if kind == 2:
        return f"(?:{draw(patterns(depth + 1))}|{draw(patterns(depth + 1))})"
    if kind == 3:
        rep = draw(st.sampled_from(["*", "+", "?", "{2}", "{1,3}", "{0,}", "*?", "+?"]))
        return f"({draw(patterns(depth + 1))}){rep}"
    flag = draw(st.sampled_from(["i", "m", "s", "-s", "i-m"]))
    return f"(?{flag}:{draw(patterns(depth + 1))})"


@settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.one_of(patterns(), patterns().map(lambda p: f"(?i){p}")),
    st.lists(st.text(alphabet="abAB1 _é\nxK", max_size=7), min_size=1, max_size=6),
)
def test_it_matches_what_re_matches_on_the_re2_translation(pattern: str, values: list[str]) -> None:
    try:
        reference = compile_regex(pattern)
    except RelabelError:
        with pytest.raises(RelabelError):
            LinearRegex(pattern)
        return
    linear = LinearRegex(pattern)
    for value in values:
        assert linear.fullmatch(value) == (reference.fullmatch(value) is not None), (pattern, value)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("pattern", "value"),
    [("(.*.*)*z", "a" * 40), ("a*a*a*a*z", "a" * 4096), (".*a.*a.*z", "a" * 4096), ("(a|aa)*z", "a" * 4096)],
)
def test_patterns_that_make_re_backtrack_for_hours_are_answered(pattern: str, value: str) -> None:
    """``re`` takes minutes to hours on each of these (200 s for the first at 18 characters); without
    backtracking every character is visited once."""
    regex = LinearRegex(pattern)
    assert not regex.fullmatch(value)
    assert regex.fullmatch(value + "z")


def test_a_pattern_that_expands_too_far_is_refused_with_its_reason() -> None:
    with pytest.raises(RelabelError, match=str(MAX_INSTRUCTIONS)):
        LinearRegex("(a{1000}){1000}")
    with pytest.raises(SelectorError, match="states"):
        parse_selector('{__name__=~"(x{1000}){1000}"}')


def test_backfill_selectors_match_with_it() -> None:
    selector = parse_selector('{__name__=~"(.*.*)*z", job!~"(a|aa)*b"}')
    assert selector((("__name__", "az"), ("job", "aaa")))
    assert not selector((("__name__", "a" * 200), ("job", "aaa")))
    assert not selector((("__name__", "az"), ("job", "aab")))
