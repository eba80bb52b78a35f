from __future__ import annotations

import email.utils
import random

import pytest

from relay_common.backoff import DEFAULT_RETRY_AFTER_CAP_S, Backoff, parse_retry_after


class FixedRng:
    """Returns the given values in turn, so jitter can be asserted exactly."""

    def __init__(self, *values: float) -> None:
        self._values = list(values)

    def random(self) -> float:
        return self._values.pop(0) if len(self._values) > 1 else self._values[0]


def test_full_jitter_ceiling_grows_and_caps() -> None:
    b = Backoff(0.5, 4.0, rng=FixedRng(1.0))  # r=1.0 exposes the ceiling itself
    assert [b.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert b.attempts == 6


def test_full_jitter_scales_ceiling() -> None:
    b = Backoff(1.0, 100.0, multiplier=3.0, rng=FixedRng(0.5, 0.0, 0.25))
    assert [b.next_delay() for _ in range(3)] == [0.5, 0.0, 2.25]


def test_equal_jitter_keeps_half_the_ceiling() -> None:
    b = Backoff(2.0, 8.0, jitter="equal", rng=FixedRng(0.0, 1.0, 0.5, 0.0))
    assert [b.next_delay() for _ in range(4)] == [1.0, 4.0, 6.0, 4.0]


def test_reset_starts_over() -> None:
    b = Backoff(1.0, 60.0, rng=FixedRng(1.0))
    for _ in range(5):
        b.next_delay()
    assert b.ceiling_s == 32.0
    b.reset()
    assert b.attempts == 0
    assert b.next_delay() == 1.0


def test_clone_is_independent_and_fresh() -> None:
    b = Backoff(1.0, 60.0, multiplier=3.0, jitter="equal", rng=FixedRng(1.0))
    b.next_delay()
    b.next_delay()
    c = b.clone()
    assert (c.initial_s, c.max_s, c.multiplier, c.attempts, c.ceiling_s) == (1.0, 60.0, 3.0, 0, 1.0)
    assert c.next_delay() == 1.0
    assert b.next_delay() == 9.0  # the original keeps its own progress


@pytest.mark.parametrize("jitter", ["full", "equal"])
def test_delays_always_within_bounds(jitter: str) -> None:
    b = Backoff(0.1, 30.0, jitter=jitter, rng=random.Random(42))  # type: ignore[arg-type]
    ceiling = 0.1
    for _ in range(200):
        d = b.next_delay()
        low = 0.0 if jitter == "full" else ceiling / 2
        assert low <= d <= ceiling
        ceiling = min(30.0, ceiling * 2)


def test_many_retries_do_not_overflow() -> None:
    b = Backoff(1.0, 300.0, multiplier=10.0, rng=FixedRng(1.0))
    for _ in range(5000):
        assert b.next_delay() <= 300.0


def test_default_rng_is_jittered() -> None:
    b = Backoff(10.0, 10.0)
    delays = {b.next_delay() for _ in range(20)}
    assert len(delays) > 1
    assert all(0.0 <= d <= 10.0 for d in delays)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": 0.0, "max_s": 1.0},
        {"initial_s": -1.0, "max_s": 1.0},
        {"initial_s": float("nan"), "max_s": 1.0},
        {"initial_s": 2.0, "max_s": 1.0},
        {"initial_s": 1.0, "max_s": float("inf")},
        {"initial_s": 1.0, "max_s": 2.0, "multiplier": 0.5},
        {"initial_s": 1.0, "max_s": 2.0, "jitter": "none"},
    ],
)
def test_invalid_parameters(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]


# -- Retry-After ----------------------------------------------------------------------------------

NOW = 1_700_000_000.0


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (None, None),
        ("", None),
        ("   ", None),
        ("0", 0.0),
        ("120", 120.0),
        (" 7 ", 7.0),
        ("1.5", 1.5),
        ("+3", 3.0),
        ("-5", 0.0),
        ("86400", DEFAULT_RETRY_AFTER_CAP_S),
        ("9" * 400, DEFAULT_RETRY_AFTER_CAP_S),  # float() gives inf: still capped, not an error
        ("soon", None),
        ("1e3", None),
        ("nan", None),
        ("inf", None),
        ("12 seconds", None),
        ("Wed, 32 Foo 2015 99:99:99 GMT", None),
    ],
)
def test_parse_retry_after_delta_and_garbage(header: str | None, expected: float | None) -> None:
    assert parse_retry_after(header, now=NOW) == expected


def test_parse_retry_after_http_date() -> None:
    header = email.utils.formatdate(NOW + 42, usegmt=True)
    assert parse_retry_after(header, now=NOW) == pytest.approx(42.0)


def test_parse_retry_after_http_date_in_the_past_is_zero() -> None:
    header = email.utils.formatdate(NOW - 3600, usegmt=True)
    assert parse_retry_after(header, now=NOW) == 0.0


def test_parse_retry_after_http_date_far_future_is_capped() -> None:
    header = email.utils.formatdate(NOW + 10 * 86400, usegmt=True)
    assert parse_retry_after(header, now=NOW) == DEFAULT_RETRY_AFTER_CAP_S
    assert parse_retry_after(header, now=NOW, cap_s=30.0) == 30.0


def test_parse_retry_after_obsolete_date_forms() -> None:
    # RFC 9110 requires recipients to accept the obsolete RFC 850 and asctime formats too.
    assert parse_retry_after("Tuesday, 14-Nov-23 22:13:40 GMT", now=NOW) == pytest.approx(20.0)
    assert parse_retry_after("Tue Nov 14 22:13:40 2023", now=NOW) == pytest.approx(20.0)


def test_parse_retry_after_uses_wall_clock_by_default() -> None:
    header = email.utils.formatdate(None, usegmt=True)  # now
    delay = parse_retry_after(header)
    assert delay is not None
    assert 0.0 <= delay <= 1.0
