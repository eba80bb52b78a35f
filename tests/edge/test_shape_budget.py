"""Tests of BudgetShaper (edge_relay/budget/shaper.py): the bandwidth budget's per-class shaping."""

from __future__ import annotations

import itertools
import math
import re
from array import array
from collections.abc import Iterable, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_relay.budget import Budget, ClassPolicy, Matcher, UplinkBudget
from edge_relay.budget.shaper import BudgetShaper, ClassStats
from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import to_batch
from schemas import codec
from schemas.model import STALE_NAN, STALE_NAN_BITS, Labels, float_bits, is_stale

INTERVAL_S = 5.0
STEP = 5000  # ms between scrapes
HUGE = 2**62
Sample = tuple[Labels, int, float]


def L(name: str, **labels: str) -> Labels:
    return tuple(sorted({"__name__": name, "job": "kepler", **labels}.items()))


def budget(*classes: ClassPolicy) -> Budget:
    return Budget("test", UplinkBudget(sustained_bytes_per_second=10_000, burst_bytes=100_000), classes)


def by_name(pattern: str) -> tuple[Matcher, ...]:
    return (Matcher(name=re.compile(pattern)),)


def scrape(ts: int, items: Iterable[tuple[Labels, float]], target: str = "kepler") -> ShapedScrape:
    labels, values = [], array("d")
    for lab, v in items:
        labels.append(lab)
        values.append(v)
    return ShapedScrape(target, ts, labels, values)


def samples(out: ShapedScrape | None) -> list[Sample]:
    if out is None:
        return []
    stamps = out.timestamps if out.timestamps is not None else [out.timestamp_ms] * len(out)
    return list(zip(out.labels, stamps, out.values, strict=True))


def check_output(out: ShapedScrape | None) -> None:
    """Each output must be one valid scrape block: a series at most once (codec rule)."""
    if out is None:
        return
    assert len(set(out.labels)) == len(out.labels)
    if out.timestamps is not None:
        assert len(out.timestamps) == len(out)
    batch = to_batch("c1", "edge-1", [out])
    batch.seq = 1
    codec.validate_batch(batch)


def cycle(shaper: BudgetShaper, ts: int, items: Iterable[tuple[Labels, float]]) -> list[Sample]:
    """One relay cycle: shape the scrape, then flush, as the relay does."""
    out = shaper.shape(scrape(ts, items))
    closed = shaper.flush(ts + 1)
    check_output(out)
    check_output(closed)
    return samples(out) + samples(closed)


def final(shaper: BudgetShaper) -> list[Sample]:
    closed = shaper.flush(HUGE)
    check_output(closed)
    return samples(closed)


def of(emitted: Iterable[Sample], labels: Labels) -> list[tuple[int, float]]:
    return [(ts, v) for lab, ts, v in emitted if lab == labels]


def increase(values: Sequence[float]) -> float:
    """Prometheus' increase() without extrapolation: a drop is a reset."""
    total = 0.0
    for before, after in itertools.pairwise(values):
        total += after - before if after >= before else after
    return total


def balanced(stats: ClassStats) -> bool:
    return stats.samples_in == stats.samples_out + stats.suppressed + stats.merged


# --------------------------------------------------------------------------------------------------
# Pass-through


def test_pass_through_is_identity() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all")), INTERVAL_S)
    s = scrape(1000, [(L("a"), 1.5), (L("b_total"), 7.0), (L("c"), STALE_NAN)])
    assert shaper.shape(s) is s
    assert float_bits(s.values[2]) == STALE_NAN_BITS
    assert shaper.flush(HUGE) is None
    assert shaper.stats[0] == ClassStats(samples_in=3, samples_out=3)


def test_pass_through_class_next_to_a_shaped_one_is_untouched() -> None:
    b = budget(
        ClassPolicy("gpu", matchers=by_name("DCGM_.*")),
        ClassPolicy("other", resolution_s=20, aggregation="max"),
    )
    shaper = BudgetShaper(b, INTERVAL_S)
    gpu = [L("DCGM_FI_DEV_POWER_USAGE", gpu=str(i)) for i in range(3)]
    for t in range(8):
        values = [100.0 + t, -0.0, STALE_NAN if t == 5 else math.inf]
        out = shaper.shape(scrape(t * STEP, [*zip(gpu, values, strict=True), (L("node_load1"), 1.0)]))
        passed = [(lab, ts, v) for lab, ts, v in samples(out) if lab in gpu]
        assert [lab for lab, _, _ in passed] == gpu
        assert [float_bits(v) for _, _, v in passed] == [float_bits(v) for v in values]
        assert {ts for _, ts, _ in passed} == {t * STEP}
        shaper.flush(t * STEP + 1)


# --------------------------------------------------------------------------------------------------
# Downsampling


def test_counter_4x_downsampled_keeps_increase_exact_across_resets() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=20)), INTERVAL_S)
    c = L("kepler_container_joules_total")
    # Resets: inside a window (to a value that stays below the one before), across a window boundary,
    # and one where the counter climbs past its pre-reset value before the window closes.
    raw = [10, 20, 30, 40, 50, 3, 6, 9, 12, 2, 4, 6, 8, 10, 12, 14, 100, 1, 150, 160, 170, 180, 190, 200]
    emitted: list[Sample] = []
    for t, v in enumerate(raw):
        emitted += cycle(shaper, t * STEP, [(c, float(v))])
    emitted += final(shaper)
    kept = of(emitted, c)
    raw_points = [(t * STEP, float(v)) for t, v in enumerate(raw)]
    assert set(kept) <= set(raw_points)  # real samples at their real timestamps
    assert [ts for ts, _ in kept] == sorted({ts for ts, _ in kept})
    assert increase([v for _, v in kept]) == increase([float(v) for v in raw])
    assert len(kept) < len(raw) / 2
    assert balanced(shaper.stats[0])


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(0, 50).map(lambda d: ("inc", d)), st.integers(0, 300).map(lambda v: ("reset", v))
        ),
        min_size=1,
        max_size=60,
    ),
    st.sampled_from([10.0, 20.0, 60.0]),
)
def test_counter_increase_exact_for_any_resets(steps: list[tuple[str, int]], resolution: float) -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=resolution)), INTERVAL_S)
    c = L("x_total")
    raw: list[float] = []
    value = 0
    for kind, n in steps:
        value = value + n if kind == "inc" else min(n, value)  # a reset never goes up
        raw.append(float(value))
    emitted: list[Sample] = []
    for t, v in enumerate(raw):
        emitted += cycle(shaper, t * STEP, [(c, v)])
    emitted += final(shaper)
    kept = of(emitted, c)
    assert kept[0] == (0, raw[0])  # the first sample of a counter goes out at once
    assert kept[-1] == ((len(raw) - 1) * STEP, raw[-1])
    assert increase([v for _, v in kept]) == increase(raw)
    assert balanced(shaper.stats[0])


@pytest.mark.parametrize(
    ("aggregation", "expect"),
    [
        ("max", [(15000, 9.0), (35000, 7.0), (45000, 2.0)]),
        ("min", [(15000, 1.0), (35000, -4.0), (45000, 0.5)]),
        ("avg", [(15000, 4.0), (35000, 2.0), (45000, 1.25)]),
        ("last", [(15000, 1.0), (35000, 4.0), (45000, 0.5)]),
    ],
)
def test_gauge_aggregation_per_window(aggregation: str, expect: list[tuple[int, float]]) -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=20, aggregation=aggregation)), 5)
    g = L("node_load1")
    values = [2.0, 9.0, 4.0, 1.0, 7.0, -4.0, 1.0, 4.0, 2.0, 0.5]
    emitted: list[Sample] = []
    for t, v in enumerate(values):
        emitted += cycle(shaper, t * STEP, [(g, v)])
    emitted += final(shaper)
    assert of(emitted, g) == expect  # each window at its last sample's timestamp
    stats = shaper.stats[0]
    assert (stats.samples_in, stats.samples_out, stats.merged) == (10, 3, 7)


def test_windows_are_aligned_to_wall_time() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=20)), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    for t in (13, 14, 15, 16, 17, 18, 19, 20, 21):  # x 5 s: windows [60,80) and [80,100) s
        emitted += cycle(shaper, t * STEP, [(g, float(t))])
    emitted += final(shaper)
    assert of(emitted, g) == [(75000, 15.0), (95000, 19.0), (105000, 21.0)]


# --------------------------------------------------------------------------------------------------
# Suppression, staleness, precision


def test_suppression_with_heartbeat() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", heartbeat_s=30)), INTERVAL_S)
    g = L("node_memory_MemTotal_bytes")
    values = [8.0] * 14 + [9.0, 9.0, 8.0]
    emitted: list[Sample] = []
    for t, v in enumerate(values):
        emitted += cycle(shaper, t * STEP, [(g, v)])
    # One per heartbeat while unchanged; a change goes out at once.
    assert of(emitted, g) == [(0, 8.0), (30000, 8.0), (60000, 8.0), (70000, 9.0), (80000, 8.0)]
    stats = shaper.stats[0]
    assert (stats.samples_out, stats.suppressed) == (5, 12)
    assert balanced(stats)


def test_series_back_after_stale_marker_sends_its_first_value() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", heartbeat_s=300)), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    for t, v in enumerate([1.0, 1.0, STALE_NAN, 1.0, 1.0]):
        emitted += cycle(shaper, t * STEP, [(g, v)])
    got = of(emitted, g)
    assert [ts for ts, _ in got] == [0, 10000, 15000]
    assert is_stale(got[1][1])


def test_stale_marker_passes_bit_exact_and_closes_the_window() -> None:
    b = budget(ClassPolicy("all", resolution_s=60, aggregation="avg", significant_digits=2, heartbeat_s=30))
    shaper = BudgetShaper(b, INTERVAL_S)
    g, h = L("g"), L("h")
    out = shaper.shape(scrape(0, [(g, 1.0), (h, 5.0)]))
    assert len(out) == 0
    shaper.shape(scrape(STEP, [(g, 2.0), (h, 5.0)]))
    out = shaper.shape(scrape(2 * STEP, [(g, STALE_NAN), (h, STALE_NAN)]))
    closed = shaper.flush(2 * STEP + 1)
    check_output(out)
    check_output(closed)
    # The window goes out at once; the stale marker, a second sample of the series, with the flush.
    assert samples(out) == [(g, STEP, 1.5), (h, STEP, 5.0)]
    assert [(lab, ts) for lab, ts, _ in samples(closed)] == [(g, 2 * STEP), (h, 2 * STEP)]
    assert all(float_bits(v) == STALE_NAN_BITS for _, _, v in samples(closed))
    assert shaper.flush(HUGE) is None  # the window is not emitted again, and the series is forgotten
    assert not shaper._states


def test_stale_marker_of_a_series_without_state_passes() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=60)), INTERVAL_S)
    out = shaper.shape(scrape(0, [(L("gone"), STALE_NAN)]))
    assert [float_bits(v) for v in out.values] == [STALE_NAN_BITS]


def test_other_nan_passes_without_aggregation() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=60, aggregation="max")), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    for t, v in enumerate([1.0, 5.0, math.nan, 2.0, 3.0]):
        emitted += cycle(shaper, t * STEP, [(g, v)])
    emitted += final(shaper)
    got = of(emitted, g)
    assert [ts for ts, _ in got] == [STEP, 2 * STEP, 4 * STEP]
    assert got[0][1] == 5.0 and math.isnan(got[1][1]) and not is_stale(got[1][1]) and got[2][1] == 3.0


def test_precision_significant_digits_and_decimals() -> None:
    b = budget(
        ClassPolicy("digits", matchers=by_name("d_.*"), significant_digits=3),
        ClassPolicy("decimals", decimals=2),
    )
    shaper = BudgetShaper(b, INTERVAL_S)
    d = [L("d_a"), L("d_b"), L("d_c"), L("d_d"), L("d_e"), L("d_f")]
    e = [L("e_a"), L("e_b"), L("e_c")]
    out = shaper.shape(
        scrape(
            0,
            [
                *zip(d, [1234.5678, 0.000123456, -98765.0, 12.0, math.inf, STALE_NAN], strict=True),
                *zip(e, [3.14159, 2.5, -math.inf], strict=True),
            ],
        )
    )
    got = dict(zip(out.labels, out.values, strict=True))
    assert [got[x] for x in d[:5]] == [1230.0, 0.000123, -98800.0, 12.0, math.inf]
    assert float_bits(got[d[5]]) == STALE_NAN_BITS
    assert [got[x] for x in e] == [3.14, 2.5, -math.inf]
    assert shaper.stats[0].precision_rounded == 3
    assert shaper.stats[1].precision_rounded == 1


def test_rounding_makes_suppression_see_equal_values() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", significant_digits=2, heartbeat_s=60)), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    for t, v in enumerate([101.0, 104.0, 96.0, 130.0]):
        emitted += cycle(shaper, t * STEP, [(g, v)])
    assert of(emitted, g) == [(0, 100.0), (2 * STEP, 96.0), (3 * STEP, 130.0)]


def test_repeated_explicit_timestamps_are_not_sent_twice() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", heartbeat_s=60)), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    repeated = 0
    for t, own in enumerate([1000, 1000, 900, 2000]):
        s = scrape(t * STEP, [(g, float(t))])
        s.timestamps = [own]
        out = shaper.shape(s)
        check_output(out)
        emitted += samples(out)
        repeated += out.repeated_timestamps
    assert of(emitted, g) == [(1000, 0.0), (2000, 3.0)]
    # Dropped, so a loss for the ledger (duplicate_sample), not shaping: never counted as merged.
    assert repeated == 2
    assert shaper.stats[0] == ClassStats(samples_in=2, samples_out=2)
    assert balanced(shaper.stats[0])


# --------------------------------------------------------------------------------------------------
# Levels, reloads, flush


def test_levels_double_the_resolution_up_to_max_and_never_for_a_non_degradable_class() -> None:
    b = budget(
        ClassPolicy("fixed", matchers=by_name("a.*"), resolution_s=10),
        ClassPolicy("zero", matchers=by_name("b.*"), max_resolution_s=60),
        ClassPolicy("other", resolution_s=10, max_resolution_s=60),
    )
    shaper = BudgetShaper(b, INTERVAL_S)
    shaper.set_level(0, 3)
    assert (shaper.level(0), shaper.resolution_s(0)) == (0, 10.0)
    assert shaper.resolution_s(1) == INTERVAL_S  # 0 means every scrape
    got = []
    for level in range(6):
        shaper.set_level(2, level)
        got.append((shaper.level(2), shaper.resolution_s(2)))
    assert got == [(0, 10.0), (1, 20.0), (2, 40.0), (3, 60.0), (3, 60.0), (3, 60.0)]
    for level, expect in [(1, 10.0), (2, 20.0), (3, 40.0), (4, 60.0), (5, 60.0)]:
        shaper.set_level(1, level)
        assert shaper.resolution_s(1) == expect
    shaper.set_level(2, -1)
    assert (shaper.level(2), shaper.resolution_s(2)) == (0, 10.0)


def test_a_level_takes_effect_at_the_next_window_boundary() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", aggregation="max", max_resolution_s=40)), INTERVAL_S)
    g = L("g")
    emitted: list[Sample] = []
    for t in range(3):  # every scrape
        emitted += cycle(shaper, t * STEP, [(g, float(t))])
    shaper.set_level(0, 2)  # 20 s windows from the next sample on: [0,20) s holds 15 s only
    for t in range(3, 9):
        emitted += cycle(shaper, t * STEP, [(g, float(t))])
    shaper.set_level(0, 0)  # back to every scrape once [40,60) s, open since 40 s, closes
    for t in range(9, 13):
        emitted += cycle(shaper, t * STEP, [(g, float(t))])
    emitted += final(shaper)
    assert of(emitted, g) == [
        (0, 0.0),
        (5000, 1.0),
        (10000, 2.0),
        (15000, 3.0),
        (35000, 7.0),
        (55000, 11.0),
        (60000, 12.0),
    ]
    assert balanced(shaper.stats[0])


def test_set_budget_keeps_state_and_levels() -> None:
    gauges = ClassPolicy("gauges", matchers=by_name("g.*"), heartbeat_s=60, max_resolution_s=40)
    b1 = budget(gauges, ClassPolicy("rest", resolution_s=20, aggregation="max"))
    shaper = BudgetShaper(b1, INTERVAL_S)
    shaper.set_level(0, 1)
    g, r = L("g"), L("r")
    emitted: list[Sample] = []
    for t in range(6):
        emitted += cycle(shaper, t * STEP, [(g, 1.0), (r, float(t % 4))])
    # Reload: "gauges" survives (level, suppression memory), "rest" is renamed; r's open window
    # [20,40) s is finished under the old class, not lost; the new class then suppresses r's unchanged
    # value against that window's.
    b2 = budget(gauges, ClassPolicy("renamed", heartbeat_s=60))
    shaper.set_budget(b2)
    assert shaper.level(0) == 1 and shaper.resolution_s(0) == 10.0
    assert shaper.level(1) == 0
    for t in range(6, 12):
        emitted += cycle(shaper, t * STEP, [(g, 1.0), (r, 2.0)])
    emitted += final(shaper)
    assert of(emitted, g) == [(5000, 1.0)]  # never again within the heartbeat: state survived
    assert of(emitted, r) == [(15000, 3.0), (35000, 2.0)]
    # r's two samples that joined the old window count in the old class.
    assert [s.samples_in for s in shaper.stats] == [12, 4]
    assert shaper._by_name["rest"].samples_in == 8
    assert all(balanced(s) for s in shaper._by_name.values())


def test_flush_emits_windows_of_vanished_series() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=60, aggregation="avg")), INTERVAL_S)
    gone, stays = L("gone"), L("stays")
    shaper.shape(scrape(60000, [(gone, 1.0), (stays, 1.0)]))
    shaper.shape(scrape(65000, [(gone, 3.0), (stays, 1.0)]))
    for t in range(14, 24):
        shaper.shape(scrape(t * STEP, [(stays, 1.0)]))
        assert shaper.flush(t * STEP + 1) is None  # [60,120) s is still open
    closed = shaper.flush(120000)
    check_output(closed)
    assert samples(closed) == [(gone, 65000, 2.0), (stays, 115000, 1.0)]
    assert closed is not None and closed.timestamp_ms == 115000
    assert shaper.flush(130000) is None
    shaper.flush(66000 + 600_000)
    assert gone not in shaper._states  # forgotten


def test_flush_on_shutdown_emits_every_open_window_once() -> None:
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=300)), INTERVAL_S)
    series = [L("s", i=str(i)) for i in range(50)]
    for t in range(3):
        assert len(shaper.shape(scrape(t * STEP, [(s, float(t)) for s in series]))) == 0
    closed = shaper.flush(HUGE)
    check_output(closed)
    assert sorted(samples(closed)) == sorted((s, 2 * STEP, 2.0) for s in series)
    assert shaper.flush(HUGE) is None


# --------------------------------------------------------------------------------------------------
# Ordering and accounting under random operation


SERIES = [L("w_total", i="0"), L("w_total", i="1"), L("temp", i="0"), L("temp", i="1"), L("util", i="0")]


def random_budgets() -> list[Budget]:
    return [
        budget(
            ClassPolicy("counters", matchers=by_name(".*_total"), resolution_s=10, max_resolution_s=80),
            ClassPolicy(
                "gauges", matchers=by_name("temp"), aggregation="max", heartbeat_s=30, max_resolution_s=40
            ),
            ClassPolicy("other", significant_digits=2, max_resolution_s=20),
        ),
        budget(
            ClassPolicy("gauges", matchers=by_name("temp|util"), aggregation="avg", max_resolution_s=60),
            ClassPolicy("other", resolution_s=20, heartbeat_s=15),
        ),
    ]


op = st.one_of(
    st.tuples(st.just("scrape"), st.sets(st.integers(0, len(SERIES) - 1)), st.integers(0, 4)),
    st.tuples(st.just("level"), st.integers(0, 2), st.integers(-1, 5)),
    st.tuples(st.just("budget"), st.integers(0, 1), st.just(0)),
    st.tuples(st.just("skip_flush"), st.just(0), st.just(0)),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, max_size=80), st.integers(0, 3))
def test_per_series_timestamps_strictly_increase_under_random_changes(
    ops: list[tuple[str, int, int]], jitter: int
) -> None:
    budgets = random_budgets()
    shaper = BudgetShaper(budgets[0], INTERVAL_S)
    previous: set[Labels] = set()
    t = 1_700_000_000_000
    flush_next = True
    outputs: list[ShapedScrape | None] = []
    fed = 0
    for kind, a, b in ops:
        if kind == "level":
            shaper.set_level(a % len(shaper.stats), b)
        elif kind == "budget":
            shaper.set_budget(budgets[a])
        elif kind == "skip_flush":
            flush_next = False
        else:
            t += STEP + jitter * 997
            present = [SERIES[i] for i in sorted(a)]
            items = [(s, float((t // STEP + b) % 7)) for s in present]
            items += [(s, STALE_NAN) for s in previous - set(present)]  # like TargetShaper
            previous = set(present)
            fed += len(items)
            outputs.append(shaper.shape(scrape(t, items)))
            if flush_next:
                outputs.append(shaper.flush(t + 1))
            flush_next = True
    outputs.append(shaper.flush(HUGE))
    outputs.append(shaper.flush(HUGE))  # anything carried by the first one
    last: dict[Labels, int] = {}
    for out in outputs:
        check_output(out)
        for labels, ts, _ in samples(out):
            assert ts > last.get(labels, -1), (labels, ts, last.get(labels))
            last[labels] = ts
    assert not shaper._carry
    assert sum(s.samples_in for s in shaper._by_name.values()) == fed
    assert all(balanced(s) for s in shaper._by_name.values())


def test_stats_add_up() -> None:
    b = budget(
        ClassPolicy("counters", matchers=by_name(".*_total"), resolution_s=20),
        ClassPolicy("gauges", resolution_s=20, aggregation="avg", heartbeat_s=60),
    )
    shaper = BudgetShaper(b, INTERVAL_S)
    c, g = L("c_total"), L("g")
    counter = [5, 10, 20, 30, 40, 1, 2, 3, 4, 5, 6, 7]
    for t, v in enumerate(counter):
        cycle(shaper, t * STEP, [(c, float(v)), (g, 1.0)])
    final(shaper)
    cs, gs = shaper.stats
    # Counter: the first sample at once; window [0,20) s of 3 samples: the last (2 merged); window
    # [20,40) s of 4 with a reset inside: the sample before it and the last (2 merged); [40,60) s of 4:
    # the last (3 merged).
    assert (cs.samples_in, cs.samples_out, cs.suppressed, cs.merged) == (12, 5, 0, 7)
    # Gauge: 3 windows of 4 samples, k-1 merged each; the unchanged average suppressed twice.
    assert (gs.samples_in, gs.samples_out, gs.suppressed, gs.merged) == (12, 1, 2, 9)
    assert balanced(cs) and balanced(gs)


# --------------------------------------------------------------------------------------------------
# The edge clock stepping back (issue 12 item 6)

HOUR = 3_600_000


def clock_budget() -> Budget:
    return budget(
        ClassPolicy("agg", matchers=by_name("g|c_total"), resolution_s=30, aggregation="avg"),
        ClassPolicy("quiet", heartbeat_s=60),
    )


def run(shaper: BudgetShaper, stamps: Sequence[int], first: int = 0) -> tuple[list[Sample], int]:
    """Cycles at ``stamps`` (scrape ``first + i`` at ``stamps[i]``), then a final flush; returns what was
    emitted and how many samples were dropped as repeated timestamps."""
    g, c, q = L("g"), L("c_total"), L("q")
    emitted: list[Sample] = []
    repeated = 0
    for i, ts in enumerate(stamps, start=first):
        out = shaper.shape(scrape(ts, [(g, float(i % 7)), (c, float(i)), (q, 1.0)]))
        closed = shaper.flush(ts + 1)
        check_output(out)
        check_output(closed)
        repeated += out.repeated_timestamps
        emitted += samples(out) + samples(closed)
    return emitted + final(shaper), repeated


def test_clock_step_back_resets_state_and_drops_nothing() -> None:
    t0 = 1_700_000_000_000
    before = [t0 + i * STEP for i in range(120)]  # 10 minutes
    # NTP steps the clock back an hour: the next hour of scrapes is "older" than every series' state.
    after = [before[-1] + STEP - HOUR + i * STEP for i in range(HOUR // STEP)]
    stepped = BudgetShaper(clock_budget(), INTERVAL_S)
    emitted, repeated = run(stepped, before + after)
    # The same as two relays: one that saw the scrapes before the step, one that started after it.
    # Before the step every open window is closed and sent at its real timestamps; after it, the
    # series are shaped as new ones (a counter's first value, suppression from scratch).
    first, second = BudgetShaper(clock_budget(), INTERVAL_S), BudgetShaper(clock_budget(), INTERVAL_S)
    expect_before, _ = run(first, before)
    expect_after, _ = run(second, after, first=len(before))
    assert repeated == 0
    assert sorted(emitted) == sorted(expect_before + expect_after)
    # The hour after the step is there: an average per 30 s window (today's code dropped them all).
    assert len(of(expect_after, L("g"))) >= HOUR // 30_000
    for i, got in enumerate(stepped.stats):
        a, b = first.stats[i], second.stats[i]
        assert got.samples_in == a.samples_in + b.samples_in == len(before + after) * (2 if i == 0 else 1)
        assert (got.samples_out, got.suppressed, got.merged) == (
            a.samples_out + b.samples_out,
            a.suppressed + b.suppressed,
            a.merged + b.merged,
        )
        assert balanced(got)


def test_clock_step_back_only_restarts_the_target_it_happened_to() -> None:
    # Targets are scraped in parallel and each is checked against its own last scrape time, so
    # another target's scrape a moment earlier in the same cycle is no step.
    shaper = BudgetShaper(budget(ClassPolicy("all", resolution_s=30)), INTERVAL_S)
    a, b = L("a"), L("b", job="node")
    emitted: list[Sample] = []
    for t in range(4):
        for target, labels, skew in (("kepler", a, 7), ("node", b, 0)):
            out = shaper.shape(scrape(t * STEP + skew, [(labels, float(t))], target))
            check_output(out)
            emitted += samples(out)
        closed = shaper.flush(t * STEP + 8)
        check_output(closed)
        emitted += samples(closed)
    emitted += final(shaper)
    assert of(emitted, a) == [(3 * STEP + 7, 3.0)]
    assert of(emitted, b) == [(3 * STEP, 3.0)]
