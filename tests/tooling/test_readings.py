"""testkit.readings' histogram quantile, which the bandwidth bench's latency-by-stage line relies on."""

from __future__ import annotations

import bisect
import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from testkit.readings import bucket_quantile, histogram_buckets

BOUNDS = (0.1, 0.5, 1.0, 2.0, 5.0)


def page(observations: list[float]) -> list[tuple[str, dict[str, str], float]]:
    registry = CollectorRegistry()
    h = Histogram("x_seconds", "x", ["stage"], buckets=BOUNDS, registry=registry)
    for i, v in enumerate(observations):
        h.labels(f"s{i % 2}").observe(v)  # two label sets, summed by histogram_buckets
    text = generate_latest(registry).decode()
    return [
        (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
    ]


@given(
    st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=200),
    st.sampled_from([0.5, 0.9, 0.99]),
)
def test_the_quantile_lies_in_the_bucket_of_the_true_one(observations: list[float], q: float) -> None:
    buckets = histogram_buckets(page(observations), "x_seconds")
    assert buckets[math.inf] == len(observations)
    got = bucket_quantile(q, buckets)
    assert got is not None
    # Prometheus' rank: q * count, the smallest observation with at least that many at or below it.
    ordered = sorted(observations)
    true = ordered[max(0, math.ceil(q * len(ordered)) - 1)]
    i = bisect.bisect_left(BOUNDS, true)
    lower = BOUNDS[i - 1] if i > 0 else 0.0
    upper = BOUNDS[i] if i < len(BOUNDS) else BOUNDS[-1]  # in +Inf: the highest finite bound
    assert lower <= got <= upper


def test_no_observations_no_quantile() -> None:
    assert bucket_quantile(0.5, histogram_buckets(page([]), "x_seconds")) is None
    assert bucket_quantile(0.5, {}) is None


def test_interpolates_inside_the_bucket() -> None:
    # 10 observations in (1, 2]: the median is halfway through that bucket.
    assert bucket_quantile(0.5, {1.0: 0, 2.0: 10, math.inf: 10}) == 1.5
