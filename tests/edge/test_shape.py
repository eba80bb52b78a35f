"""Tests of edge_relay/collect/shape.py: target labels, synthetic series, staleness, duplicates, label
limits."""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edge_relay.collect.shape import (
    DECORATE_GENERATION,
    ParsedSample,
    ShapedScrape,
    TargetShaper,
    fill_labels_for,
    total_samples,
)
from edge_relay.encode.batches import to_batch
from relay_common import relabel
from schemas import codec
from schemas.codec import DEFAULT_LIMITS, Limits, SeriesChecker
from schemas.model import STALE_NAN_BITS, Labels, float_bits, is_stale

TARGET_LABELS = {"job": "kepler", "instance": "edge-1:28282"}
FILL_LABELS = {"cluster": "c1", "node": "edge-1"}
SYNTHETIC = ("up", "scrape_duration_seconds", "scrape_samples_scraped")


def L(name: str, **labels: str) -> Labels:
    """An exposed label set as the parser returns it (sorted, __name__ included)."""
    return tuple(sorted({"__name__": name, **labels}.items()))


def decorated(name: str, **labels: str) -> Labels:
    return tuple(sorted({**FILL_LABELS, **TARGET_LABELS, "__name__": name, **labels}.items()))


def shaper(
    target_labels: dict[str, str] | None = None,
    fill_labels: dict[str, str] | None = None,
    limits: Limits = DEFAULT_LIMITS,
) -> TargetShaper:
    return TargetShaper(
        "kepler",
        TARGET_LABELS if target_labels is None else target_labels,
        FILL_LABELS if fill_labels is None else fill_labels,
        limits,
    )


def as_dict(out: ShapedScrape) -> dict[Labels, float]:
    return dict(zip(out.labels, out.values, strict=True))


def by_name(out: ShapedScrape, name: str) -> list[tuple[Labels, float]]:
    return [(lab, v) for lab, v in zip(out.labels, out.values, strict=True) if dict(lab)["__name__"] == name]


def synthetic_value(out: ShapedScrape, name: str) -> float:
    (item,) = by_name(out, name)
    return item[1]


def stale(out: ShapedScrape) -> set[Labels]:
    return {lab for lab, v in zip(out.labels, out.values, strict=True) if is_stale(v)}


def samples(*items: tuple[Labels, float]) -> list[ParsedSample]:
    return [(lab, v, None) for lab, v in items]


def assert_encodable(out: ShapedScrape) -> None:
    batch = to_batch("c1", "edge-1", [out])
    batch.seq = 1
    codec.decode_batch(codec.encode_batch(batch))


# --------------------------------------------------------------------------------------------------
# Labels


def test_target_labels_are_added_and_sorted() -> None:
    out = shaper().shape(1000, samples((L("kepler_node_joules_total", mode="dynamic"), 12.5)), 0.01)
    assert out.labels[0] == decorated("kepler_node_joules_total", mode="dynamic")
    assert out.values[0] == 12.5
    for labels in out.labels:
        names = [n for n, _ in labels]
        assert names == sorted(names)
        assert len(set(names)) == len(names)
    assert out.target == "kepler"
    assert out.timestamp_ms == 1000
    assert out.timestamps is None


def test_target_labels_override_exposed_and_keep_them_as_exported() -> None:
    exposed = L("m", job="exporter-job", instance="10.0.0.5:9100", x="1")
    out = shaper().shape(1000, samples((exposed, 1.0)), 0.0)
    labels = dict(out.labels[0])
    assert labels["job"] == "kepler"
    assert labels["instance"] == "edge-1:28282"
    assert labels["exported_job"] == "exporter-job"
    assert labels["exported_instance"] == "10.0.0.5:9100"
    assert labels["x"] == "1"
    names = [n for n, _ in out.labels[0]]
    assert names == sorted(names)


def test_configured_target_labels_override_too() -> None:
    sh = shaper(target_labels={**TARGET_LABELS, "rack": "r7"})
    out = sh.shape(1000, samples((L("m", rack="exposed"), 1.0), (L("n"), 2.0)), 0.0)
    first, second = (dict(lab) for lab in out.labels[:2])
    assert (first["rack"], first["exported_rack"]) == ("r7", "exposed")
    assert second["rack"] == "r7" and "exported_rack" not in second
    # The synthetic series carry the target labels as well.
    assert dict(by_name(out, "up")[0][0])["rack"] == "r7"


def test_fill_labels_only_fill_gaps() -> None:
    sh = shaper(fill_labels={"cluster": "c1", "node": "edge-1", "region": "eu"})
    out = sh.shape(1000, samples((L("m", node="gpu-3", region="us"), 1.0), (L("n"), 2.0)), 0.0)
    first, second = (dict(lab) for lab in out.labels[:2])
    assert first["node"] == "gpu-3" and first["region"] == "us" and first["cluster"] == "c1"
    assert "exported_node" not in first and "exported_region" not in first
    assert (second["node"], second["region"], second["cluster"]) == ("edge-1", "eu", "c1")


def test_target_labels_win_over_fill_labels() -> None:
    sh = shaper(target_labels={"job": "j", "node": "from-target"}, fill_labels={"node": "from-fill"})
    out = sh.shape(1000, samples((L("m"), 1.0)), 0.0)
    for labels in out.labels:
        assert dict(labels)["node"] == "from-target"


def test_existing_exported_label_is_not_clobbered() -> None:
    a = L("m", job="a", exported_job="b")
    b = L("m", job="a", exported_job="c")
    out = shaper().shape(1000, samples((a, 1.0), (b, 2.0)), 0.0)
    assert out.duplicates == 0
    assert len(set(out.labels[:2])) == 2
    # Prometheus (resolveConflictingExposedLabels): the conflicting exposed value goes to the first
    # free exported_* name; an exposed exported_job stays where it is.
    assert dict(out.labels[0])["exported_job"] == "b"
    assert dict(out.labels[0])["exported_exported_job"] == "a"


def test_fill_labels_for() -> None:
    assert fill_labels_for("c", "n", True, {}) == {"cluster": "c", "node": "n"}
    assert fill_labels_for("c", "n", False, {"region": "eu"}) == {"region": "eu"}
    # An external label of the same name wins over the node labels.
    assert fill_labels_for("c", "n", True, {"node": "x"}) == {"node": "x", "cluster": "c"}


def test_decorate_is_cached_and_bounded() -> None:
    sh = shaper()
    labels = L("m", a="1")
    first = sh.decorate(labels)
    assert first is sh.decorate(labels)
    bound = 4 * 50_000
    largest = 0
    for i in range(bound + 50):
        sh.decorate((("__name__", "m"), ("i", str(i))))
        if i % 1000 == 0 or i >= bound - 2:
            largest = max(largest, len(sh._decorated))
    assert largest <= bound + 1
    assert len(sh._decorated) < bound
    # Still correct after the cache was cleared.
    assert sh.decorate(labels) == first


def test_decorate_cache_forgets_churned_series_after_two_generations() -> None:
    """Under series churn the decoration cache holds the live series plus two generations of churn
    (``DECORATE_GENERATION`` scrapes each), not every series the target had up to its hard bound."""
    sh = shaper()
    live = [L("m", i=str(i)) for i in range(20)]
    first = [sh.decorate(labels) for labels in live]
    for scrape in range(10 * DECORATE_GENERATION):
        churn = [L("pod_cpu", pod=f"p{scrape}-{j}") for j in range(5)]
        sh.shape(1000 + scrape, samples(*((labels, 1.0) for labels in live + churn)), 0.0)
        assert len(sh._decorated) + len(sh._decorated_old) <= len(live) + 2 * DECORATE_GENERATION * 5
    # A live series is never dropped, and a cached result is the same object.
    assert all(sh.decorate(labels) is got for labels, got in zip(live, first, strict=True))


def test_a_stable_target_keeps_its_decorations_while_the_shortcut_takes_its_scrapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Scrapes of the very same series take the shortcut and do not age the decoration cache: after
    many quiet scrapes a single new series is the only one decorated and checked again."""
    sh = shaper()
    live = [L("m", i=str(i)) for i in range(20)]
    for scrape in range(4 * DECORATE_GENERATION):
        sh.shape(1000 + scrape, samples(*((labels, float(scrape)) for labels in live)), 0.0)
    checked: list[Labels] = []
    real = SeriesChecker.labels_error

    def counting(self: SeriesChecker, labels: Labels) -> str | None:
        checked.append(labels)
        return real(self, labels)

    monkeypatch.setattr(SeriesChecker, "labels_error", counting)
    new = L("m", i="new")
    out = sh.shape(9000, samples(*((labels, 1.0) for labels in [*live, new])), 0.0)
    assert [dict(x).get("i") for x in checked] == ["new"]
    assert len(out) == len(live) + 1 + 3  # the synthetic up, duration and samples scraped


# --------------------------------------------------------------------------------------------------
# Synthetic series


def test_synthetic_series_for_a_good_scrape() -> None:
    items = [(L("m", i=str(i)), float(i)) for i in range(5)]
    out = shaper().shape(1000, samples(*items), 0.25)
    assert len(out) == 5 + 3
    assert [dict(lab)["__name__"] for lab in out.labels[-3:]] == list(SYNTHETIC)
    assert synthetic_value(out, "up") == 1.0
    assert synthetic_value(out, "scrape_duration_seconds") == 0.25
    assert synthetic_value(out, "scrape_samples_scraped") == 5.0
    assert by_name(out, "up")[0][0] == decorated("up")
    assert out.stale_markers == 0


def test_synthetic_series_for_a_failed_scrape() -> None:
    out = shaper().shape(1000, None, 1.5)
    assert len(out) == 3
    assert synthetic_value(out, "up") == 0.0
    assert synthetic_value(out, "scrape_duration_seconds") == 1.5
    assert synthetic_value(out, "scrape_samples_scraped") == 0.0


def test_empty_scrape_is_up() -> None:
    out = shaper().shape(1000, [], 0.1)
    assert synthetic_value(out, "up") == 1.0
    assert synthetic_value(out, "scrape_samples_scraped") == 0.0


def test_scrape_samples_scraped_counts_what_was_exposed() -> None:
    items = [(L("m"), 1.0), (L("m"), 2.0), (L("big", v="x" * 5000), 3.0), (L("n"), 4.0)]
    out = shaper().shape(1000, samples(*items), 0.0)
    assert synthetic_value(out, "scrape_samples_scraped") == 4.0


# --------------------------------------------------------------------------------------------------
# Staleness


def test_stale_markers_for_vanished_series() -> None:
    sh = shaper()
    a, b, c = L("m", i="a"), L("m", i="b"), L("m", i="c")
    first = sh.shape(1000, samples((a, 1.0), (b, 2.0), (c, 3.0)), 0.0)
    assert first.stale_markers == 0 and not stale(first)
    second = sh.shape(2000, samples((a, 1.5)), 0.0)
    assert second.stale_markers == 2
    assert stale(second) == {sh.decorate(b), sh.decorate(c)}
    for labels, value in zip(second.labels, second.values, strict=True):
        if labels in stale(second):
            assert math.isnan(value) and float_bits(value) == STALE_NAN_BITS
    assert as_dict(second)[sh.decorate(a)] == 1.5
    assert synthetic_value(second, "up") == 1.0
    # Not marked again on the next scrape.
    third = sh.shape(3000, samples((a, 2.0)), 0.0)
    assert third.stale_markers == 0 and not stale(third)


def test_reappearing_series_is_not_stale() -> None:
    sh = shaper()
    a = L("m", i="a")
    sh.shape(1000, samples((a, 1.0)), 0.0)
    sh.shape(2000, [], 0.0)
    out = sh.shape(3000, samples((a, 3.0)), 0.0)
    assert out.stale_markers == 0
    assert as_dict(out)[sh.decorate(a)] == 3.0


def test_failed_scrape_marks_every_previous_series_once() -> None:
    sh = shaper()
    items = [(L("m", i=str(i)), float(i)) for i in range(10)]
    sh.shape(1000, samples(*items), 0.0)
    failed = sh.shape(2000, None, 0.5)
    assert failed.stale_markers == 10
    assert stale(failed) == {sh.decorate(lab) for lab, _ in items}
    assert all(
        float_bits(v) == STALE_NAN_BITS
        for lab, v in zip(failed.labels, failed.values, strict=True)
        if lab in stale(failed)
    )
    assert synthetic_value(failed, "up") == 0.0
    assert not is_stale(synthetic_value(failed, "up"))
    again = sh.shape(3000, None, 0.5)
    assert again.stale_markers == 0 and not stale(again)
    assert len(again) == 3


def test_stale_markers_are_encodable() -> None:
    sh = shaper()
    sh.shape(1000, samples((L("m", i="a"), 1.0), (L("m", i="b"), 2.0)), 0.0)
    out = sh.shape(2000, None, 0.0)
    batch = to_batch("c1", "edge-1", [out])
    batch.seq = 3
    decoded = codec.decode_batch(codec.encode_batch(batch))
    values = decoded.scrapes[0].values
    assert sum(1 for v in values if is_stale(v)) == 2


def test_duplicates_dropped_and_counted() -> None:
    sh = shaper()
    a, b = L("m", i="a"), L("m", i="b")
    out = sh.shape(1000, samples((a, 1.0), (b, 2.0), (a, 3.0), (a, 4.0)), 0.0)
    assert out.duplicates == 2
    assert as_dict(out)[sh.decorate(a)] == 1.0  # the first one is kept
    assert len(out) == 2 + 3
    assert_encodable(out)


def test_series_equal_after_decoration_are_duplicates() -> None:
    # Different exposed label sets that decorate to the same final labels.
    sh = shaper(target_labels={"job": "kepler"}, fill_labels={"node": "edge-1"})
    out = sh.shape(1000, samples((L("m", node="edge-1"), 1.0), (L("m"), 2.0)), 0.0)
    assert out.duplicates == 1
    assert_encodable(out)


def test_explicit_timestamps_are_kept() -> None:
    sh = shaper()
    a, b = L("m", i="a"), L("m", i="b")
    parsed: list[ParsedSample] = [(a, 1.0, 900), (b, 2.0, None)]
    out = sh.shape(1000, parsed, 0.0)
    assert out.timestamps is not None
    assert len(out.timestamps) == len(out.values)
    ts = dict(zip(out.labels, out.timestamps, strict=True))
    assert ts[sh.decorate(a)] == 900
    assert ts[sh.decorate(b)] == 1000
    assert all(ts[lab] == 1000 for lab, _ in by_name(out, "up"))
    batch = to_batch("c1", "edge-1", [out])
    batch.seq = 1
    decoded = codec.decode_batch(codec.encode_batch(batch))
    assert decoded.first_timestamp_ms == 900
    assert decoded.last_timestamp_ms == 1000


def test_no_timestamps_list_without_explicit_timestamps() -> None:
    out = shaper().shape(1000, samples((L("m"), 1.0)), 0.0)
    assert out.timestamps is None


def test_series_with_explicit_timestamps_get_no_stale_marker() -> None:
    sh = shaper()
    a, b = L("m", i="a"), L("m", i="b")
    sh.shape(1000, [(a, 1.0, 900), (b, 2.0, None)], 0.0)
    out = sh.shape(2000, [], 0.0)
    assert stale(out) == {sh.decorate(b)}
    failed = sh.shape(3000, None, 0.0)
    assert failed.stale_markers == 0


def test_explicit_timestamp_duplicates_do_not_break_encoding() -> None:
    sh = shaper()
    out = sh.shape(3000, [(L("m"), 1.0, 1000), (L("m"), 2.0, 2000)], 0.0)
    assert len(set(out.labels)) == len(out.labels)
    assert_encodable(out)


def test_series_switching_to_explicit_timestamp_is_not_doubled() -> None:
    sh = shaper()
    a = L("m")
    sh.shape(1000, [(a, 1.0, None)], 0.0)
    out = sh.shape(2000, [(a, 2.0, 1900)], 0.0)
    assert len(set(out.labels)) == len(out.labels)
    assert_encodable(out)


def test_exposed_series_colliding_with_synthetic_is_not_doubled() -> None:
    out = shaper().shape(1000, samples((L("up"), 1.0)), 0.0)
    assert len(set(out.labels)) == len(out.labels)
    assert_encodable(out)


# --------------------------------------------------------------------------------------------------
# Label limits


@pytest.mark.parametrize(
    "labels",
    [
        pytest.param(L("m", big="x" * 5000), id="long-value"),
        pytest.param(L("m", **{f"l{i:02d}": "v" for i in range(70)}), id="70-labels"),
        pytest.param(L("m", **{"n" * 300: "v"}), id="long-name"),
        pytest.param(L("m", big="é" * 2100), id="long-utf8-value"),
    ],
)
def test_series_over_label_limits_are_dropped(labels: Labels) -> None:
    sh = shaper()
    good = L("m", ok="1")
    out = sh.shape(1000, samples((labels, 1.0), (good, 2.0), (labels, 3.0)), 0.0)
    assert out.over_label_limits == 2
    assert sh.decorate(labels) is None
    assert out.labels == [sh.decorate(good), *(decorated(name) for name in SYNTHETIC)]
    assert synthetic_value(out, "scrape_samples_scraped") == 3.0
    assert_encodable(out)
    # A dropped series is not tracked, so it never gets a stale marker either.
    nxt = sh.shape(2000, samples((good, 2.0)), 0.0)
    assert nxt.stale_markers == 0


def test_label_limit_counts_decorated_labels() -> None:
    # 60 exposed labels + __name__ fit the wire limit of 64, but not with the 4 decoration labels.
    limits = DEFAULT_LIMITS
    exposed = L("m", **{f"l{i:02d}": "v" for i in range(limits.max_labels_per_series - 4)})
    assert len(exposed) == limits.max_labels_per_series - 3
    out = shaper().shape(1000, samples((exposed, 1.0)), 0.0)
    assert out.over_label_limits == 1
    just_fits = L("m", **{f"l{i:02d}": "v" for i in range(limits.max_labels_per_series - 5)})
    out = shaper().shape(1000, samples((just_fits, 1.0)), 0.0)
    assert out.over_label_limits == 0
    assert len(out.labels[0]) == limits.max_labels_per_series
    assert_encodable(out)


def test_value_exactly_at_the_limit_is_kept() -> None:
    out = shaper().shape(1000, samples((L("m", v="x" * DEFAULT_LIMITS.max_label_value_bytes), 1.0)), 0.0)
    assert out.over_label_limits == 0
    assert_encodable(out)


def test_custom_limits() -> None:
    sh = shaper(target_labels={"job": "k"}, fill_labels={}, limits=Limits(max_label_value_bytes=8))
    out = sh.shape(1000, samples((L("m", v="123456789"), 1.0), (L("m", v="12345678"), 2.0)), 0.0)
    assert out.over_label_limits == 1
    assert len(out) == 1 + 3


def test_total_samples() -> None:
    sh = shaper()
    outs: Sequence[ShapedScrape] = [sh.shape(1000, samples((L("m"), 1.0)), 0.0), sh.shape(2000, None, 0.0)]
    assert total_samples(outs) == 4 + 4


# --------------------------------------------------------------------------------------------------
# Samples the wire would refuse, dropped one by one (issue 12 item 1)


def test_a_negative_own_timestamp_drops_that_sample_alone() -> None:
    sh = shaper()
    before, bad, after = L("ok_before"), L("bad_metric"), L("ok_after", a="b")
    out = sh.shape(1000, [(before, 1.0, None), (bad, 1.0, -1), (after, 3.0, 900)], 0.0)
    assert out.invalid_timestamps == 1
    assert out.labels == [sh.decorate(before), sh.decorate(after), *(decorated(n) for n in SYNTHETIC)]
    assert out.timestamps == [1000, 900, 1000, 1000, 1000]
    assert synthetic_value(out, "scrape_samples_scraped") == 3.0  # exposed, as Prometheus counts them
    assert synthetic_value(out, "up") == 1.0
    assert_encodable(out)


def test_a_series_whose_timestamp_turns_bad_gets_its_stale_marker() -> None:
    sh = shaper()
    m = L("m")
    sh.shape(1000, samples((m, 1.0)), 0.0)
    out = sh.shape(2000, [(m, 2.0, -1)], 0.0)
    assert out.invalid_timestamps == 1
    assert stale(out) == {sh.decorate(m)}
    assert_encodable(out)


@pytest.mark.parametrize("ts", [-(2**63), -1, 0, 1, 2**63 - 1])
def test_the_timestamp_rule_is_the_codecs(ts: int) -> None:
    """The shape stage drops exactly the samples the codec would refuse."""
    out = shaper().shape(1000, [(L("m"), 1.0, ts)], 0.0)
    raw = ShapedScrape("kepler", 1000, [decorated("m")], array("d", [1.0]), [ts])
    batch = to_batch("c1", "edge-1", [raw])
    batch.seq = 1
    try:
        codec.validate_batch(batch)
        refused = False
    except codec.EncodeError as e:
        assert e.reason == "bad_timestamp"
        refused = True
    assert out.invalid_timestamps == int(refused)
    assert_encodable(out)


def test_labels_the_codec_refuses_for_any_reason_are_dropped() -> None:
    # The parser never produces this name; the shape stage asks the codec, not a copy of its limits.
    sh = shaper()
    bad = L("m", **{"bad-name": "v"})
    out = sh.shape(1000, samples((bad, 1.0), (L("m", ok="1"), 2.0)), 0.0)
    assert out.over_label_limits == 1
    assert sh.decorate(bad) is None
    assert_encodable(out)


class _EveryTimeShaper(TargetShaper):
    """The reference: every scrape decorated sample by sample (the repeat shortcut never taken)."""

    def _again(self, timestamp_ms: int, samples: Sequence[ParsedSample], duration_s: float) -> None:
        return None


def _comparable(out: ShapedScrape) -> tuple[object, ...]:
    return (
        out.labels,
        out.values.tobytes(),
        out.timestamps,
        out.stale_markers,
        out.duplicates,
        out.over_label_limits,
        out.invalid_timestamps,
        out.relabel_dropped,
        out.relabel_error,
    )


_POOL = [
    L("gpu_temp", gpu="0"),
    L("gpu_temp", gpu="1"),
    L("gpu_power", gpu="0"),
    L("go_gc_duration_seconds", quantile="0.5"),  # dropped by the relabel rule below
    L("too_long", v="x" * 300),  # over the label value limit below
    L("job_info", job="exposed"),  # becomes exported_job
]


@settings(max_examples=150, deadline=None)
@given(
    scrapes=st.lists(
        st.one_of(
            st.none(),  # a failed scrape
            st.just("again"),  # the very samples of the last scrape, new values
            st.lists(
                st.tuples(
                    st.sampled_from(range(len(_POOL))),
                    st.floats(allow_nan=True, allow_infinity=True),
                    st.one_of(st.none(), st.none(), st.integers(min_value=-5, max_value=2**40)),
                ),
                max_size=8,
            ),
        ),
        min_size=1,
        max_size=30,
    )
)
def test_a_repeated_scrape_shapes_as_if_decorated_sample_by_sample(scrapes: list[object]) -> None:
    """The shortcut for a scrape of the same series as the last one gives exactly what the sample by
    sample path gives: labels, value bits, stale markers, drop counts, own timestamps, across failed
    scrapes, duplicates, relabel drops, label limits, bad timestamps and the cache's generations."""
    rules = relabel.compile_rules(
        [{"source_labels": ["__name__"], "regex": "go_.*", "action": "drop"}], "metric_relabel_configs"
    )
    limits = Limits(max_label_value_bytes=200)
    fast = TargetShaper("kepler", TARGET_LABELS, FILL_LABELS, limits, rules)
    reference = _EveryTimeShaper("kepler", TARGET_LABELS, FILL_LABELS, limits, rules)
    last: list[ParsedSample] = []
    for tick, scrape in enumerate(scrapes * 3):  # long enough to cross generations of the cache
        if scrape == "again":
            samples: list[ParsedSample] | None = [(lab, v + 1.0, ts) for lab, v, ts in last]
        elif scrape is None:
            samples = None
        else:
            assert isinstance(scrape, list)
            samples = [(_POOL[i], v, ts) for i, v, ts in scrape]
        if samples is not None:
            last = samples
        ts_ms = 1_700_000_000_000 + tick * 5000
        assert _comparable(fast.shape(ts_ms, samples, 0.01)) == _comparable(
            reference.shape(ts_ms, samples, 0.01)
        )


def test_a_repeated_scrape_takes_the_shortcut() -> None:
    """The same series in the same order: no step per sample (decorate is not called)."""
    s = shaper()
    samples: list[ParsedSample] = [(L("gpu_temp", gpu=str(g)), 40.0 + g, None) for g in range(5)]
    first = s.shape(1000, samples, 0.01)
    calls = []
    s.decorate = lambda labels: calls.append(labels)  # type: ignore[method-assign,assignment,return-value]
    again = s.shape(6000, [(lab, v + 1, ts) for lab, v, ts in samples], 0.01)
    assert calls == []
    assert again.labels == first.labels
    assert list(again.values)[:5] == [41.0 + g for g in range(5)]
