"""Spool caps: degrade before drop, and every sample given up is in the ledger (nothing lost silently)."""

from __future__ import annotations

import itertools
import math
import random
from array import array
from collections import Counter
from pathlib import Path

from edge_relay.encode.batches import BatchEncoder
from edge_relay.store.retention import Policy, Retention, describe, downsample
from edge_relay.store.spool import Spool
from schemas import codec
from schemas.model import STALE_NAN, Batch, Labels, ScrapeBlock, float_bits, is_stale

INTERVAL = 5000
T0 = 1_700_000_000_000


def L(name: str, **labels: str) -> Labels:
    return tuple(sorted({"__name__": name, **labels}.items()))


COUNTER = L("kepler_node_package_joules_total", job="kepler")
GAUGE = L("DCGM_FI_DEV_GPU_UTIL", job="dcgm", gpu="0")


def batch_of(points: dict[Labels, list[tuple[int, float]]], seq: int = 1) -> Batch:
    table = list(points)
    by_ts: dict[int, list[tuple[int, float]]] = {}
    for i, labels in enumerate(table):
        for ts, v in points[labels]:
            by_ts.setdefault(ts, []).append((i, v))
    blocks = [
        ScrapeBlock(ts, array("I", [i for i, _ in rows]), array("d", [v for _, v in rows]))
        for ts, rows in sorted(by_ts.items())
    ]
    return Batch("c", "n", seq, table, blocks)


def samples_of(batches: list[Batch]) -> set[tuple[Labels, int, int]]:
    out = set()
    for b in batches:
        for block in b.scrapes:
            for i, idx in enumerate(block.series):
                out.add((b.labelsets[idx], block.sample_timestamp(i), float_bits(block.values[i])))
    return out


def test_downsample_keeps_last_per_window_and_counter_resets() -> None:
    counter = [(T0 + k * INTERVAL, float(v)) for k, v in enumerate([10, 20, 30, 5, 15, 25, 35, 45])]
    gauge = [(T0 + k * INTERVAL, float(v)) for k, v in enumerate([1, 9, 2, 8, 3, 7, 4, 6])]
    blocks, table, merged = downsample([batch_of({COUNTER: counter, GAUGE: gauge})], 2, INTERVAL)
    kept = samples_of([Batch("c", "n", 1, table, blocks)])
    kept_counter = sorted((ts, v) for labels, ts, v in kept if labels == COUNTER)
    # Windows of 10 s: the first sample, the last of each window, and 30 (the sample before the reset).
    assert [t for t, _ in kept_counter] == [T0 + k * INTERVAL for k in (0, 1, 2, 3, 5, 7)]
    kept_gauge = sorted(ts for labels, ts, _ in kept if labels == GAUGE)
    assert kept_gauge == [T0 + k * INTERVAL for k in (0, 1, 3, 5, 7)]
    assert merged == 16 - len(kept)
    # Every kept sample is an original one, bit for bit.
    assert kept <= samples_of([batch_of({COUNTER: counter, GAUGE: gauge})])


def test_preset_counters_without_a_suffix_keep_the_sample_before_a_reset() -> None:
    # dcgm-exporter's energy counter has no _total suffix; the presets know it is a counter.
    energy = L("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", job="dcgm", gpu="0")
    pts = [(T0 + k * INTERVAL, float(v)) for k, v in enumerate([10, 20, 30, 5, 15, 25, 35, 45])]
    blocks, table, _ = downsample([batch_of({energy: pts})], 2, INTERVAL)
    kept = sorted(ts for labels, ts, _ in samples_of([Batch("c", "n", 1, table, blocks)]))
    assert T0 + 2 * INTERVAL in kept  # 30, the value before the reset to 5
    assert kept == [T0 + k * INTERVAL for k in (0, 1, 2, 3, 5, 7)]


def test_degraded_backlog_keeps_the_relays_wire_format_and_batch_cap(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    fill(spool, 48)
    size = spool.stats().bytes
    relay_encoder = BatchEncoder("c", "n", max_bytes=8192, version=codec.FORMAT_V2)
    Retention(spool, policy(cap_bytes=size // 2), encoder=relay_encoder).enforce(T0 + 10**6)
    rows = spool.batches.pending(10_000)
    degraded = set(spool.batches.resolution([r.seq for r in rows]).values()) - {1}
    assert degraded, "something must have been re-downsampled"
    for row in rows:
        assert codec.peek_header(row.payload).version == codec.FORMAT_V2
    factors = spool.batches.resolution([r.seq for r in rows])
    assert all(r.byte_size <= 8192 for r in rows if factors[r.seq] > 1)
    spool.close()


def test_downsampled_counter_keeps_its_increase() -> None:
    rng = random.Random(3)
    value, points = 0.0, []
    for k in range(240):
        value = 0.0 if k in (70, 150) else value + rng.uniform(0, 50)  # two resets
        points.append((T0 + k * INTERVAL, value))

    def increase(pts: list[tuple[int, float]]) -> float:
        total = 0.0
        for (_, a), (_, b) in itertools.pairwise(pts):
            total += b - a if b >= a else b
        return total

    for factor in (2, 4, 8):
        blocks, _, _ = downsample([batch_of({COUNTER: points})], factor, INTERVAL)
        kept = sorted(
            (ts, v)
            for block in blocks
            for ts, v in zip([block.timestamp_ms] * len(block.values), block.values, strict=True)
        )
        assert math.isclose(increase(kept), increase(points), rel_tol=1e-12)


def test_stale_markers_and_the_value_before_them_survive() -> None:
    pts = [(T0, 1.0), (T0 + INTERVAL, 2.0), (T0 + 2 * INTERVAL, STALE_NAN), (T0 + 3 * INTERVAL, 4.0)]
    blocks, _, _ = downsample([batch_of({GAUGE: pts})], 8, INTERVAL)
    values = [v for b in blocks for v in b.values]
    assert any(is_stale(v) for v in values)
    assert 2.0 in values


def fill(spool: Spool, batches: int, series: int = 200) -> set[tuple[Labels, int, int]]:
    rng = random.Random(1)
    labels = [L("kepler_container_joules_total", job="kepler", pod=f"p{i}") for i in range(series)]
    labels += [L("node_load1", job="node", cpu=str(i)) for i in range(series)]
    level = [0.0] * len(labels)
    everything: set[tuple[Labels, int, int]] = set()
    for b in range(batches):
        ts = T0 + b * INTERVAL
        points = {}
        for i, lab in enumerate(labels):
            level[i] = level[i] + rng.uniform(0, 3) if i < series else rng.uniform(0, 4)
            points[lab] = [(ts, round(level[i], 3))]
        batch = batch_of(points)
        everything |= samples_of([batch])

        def enc(seq: int, batch: Batch = batch) -> bytes:
            batch.seq = seq
            return codec.encode_batch(batch)

        spool.batches.append(enc, first_ts_ms=ts, last_ts_ms=ts, sample_count=batch.sample_count)
    return everything


def spooled_samples(spool: Spool) -> set[tuple[Labels, int, int]]:
    rows = spool.batches.pending(10_000, order="oldest_data")
    return samples_of([codec.decode_batch(r.payload) for r in rows])


def policy(**kw: int) -> Policy:
    base = {"cap_bytes": 0, "max_age_ms": 0, "max_factor": 8, "interval_ms": INTERVAL, "busy_ms": 60_000}
    base.update(kw)
    return Policy(**base)


def encoder() -> BatchEncoder:
    return BatchEncoder("c", "n", max_bytes=196_608)


def test_cap_degrades_before_it_evicts_and_the_ledger_accounts_for_every_sample(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    original = fill(spool, 96)
    size = spool.stats().bytes
    retention = Retention(spool, policy(cap_bytes=size // 3), encoder=encoder())
    for _ in range(40):
        retention.enforce(T0 + 10**6)
    left = spooled_samples(spool)
    totals = spool.losses.totals()
    assert spool.stats().bytes <= size // 3
    assert totals.get("downsampled", 0) > 0, "degrade must come first"
    # Nothing invented, nothing changed: what is left is a subset of what was scraped ...
    assert left <= original
    # ... and every sample that is gone is in the ledger.
    assert len(original) - len(left) == sum(totals.values())
    # The newest data is kept at full resolution until the oldest has degraded.
    newest = max(ts for _, ts, _ in original)
    assert any(ts == newest for _, ts, _ in left)
    spool.close()


def test_eviction_only_after_max_degrade_factor(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    original = fill(spool, 32)
    retention = Retention(spool, policy(cap_bytes=1, max_factor=1), encoder=encoder())
    retention.enforce(T0 + 10**6)
    totals = spool.losses.totals()
    assert "downsampled" not in totals  # max_degrade_factor 1: never downsample
    assert totals["cap_bytes"] == len(original) - len(spooled_samples(spool)) > 0
    spool.close()


def test_max_age_evicts_old_batches_with_ledger_entries(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    original = fill(spool, 10, series=10)
    now = T0 + 9 * INTERVAL
    Retention(spool, policy(max_age_ms=3 * INTERVAL), encoder=encoder()).enforce(now)
    left = spooled_samples(spool)
    assert {ts for _, ts, _ in left} == {T0 + k * INTERVAL for k in range(6, 10)}
    entries = spool.losses.entries()
    assert {e.reason for e in entries} == {"max_age"}
    assert sum(e.samples for e in entries) == len(original) - len(left)
    assert entries[0].series == '{job=~"kepler|node"}'
    spool.close()


def test_a_corrupt_time_range_does_not_evict_a_fresh_row_as_old(tmp_path: Path) -> None:
    """A fresh row whose last_ts_ms was altered on disk (a bit flip, a bad sector) is not evicted as
    max_age: its metadata checksum fails, so it goes to quarantine as corrupt_row (payload kept), and
    the rows around it are untouched."""
    import sqlite3

    spool = Spool(tmp_path / "spool.db")
    fill(spool, 10, series=10)
    rows = spool.batches.pending(10, order="oldest_data")
    victim = rows[-1]
    db = sqlite3.connect(tmp_path / "spool.db", isolation_level=None)
    db.execute("UPDATE batches SET last_ts_ms = 1 WHERE seq = ?", (victim.seq,))
    db.close()
    now = T0 + 9 * INTERVAL
    Retention(spool, policy(max_age_ms=60 * INTERVAL), encoder=encoder()).enforce(now)
    assert "max_age" not in spool.losses.totals()
    (quarantined,) = spool.batches.quarantined()
    assert quarantined.seq == victim.seq and quarantined.payload == victim.payload
    assert "metadata checksum mismatch" in quarantined.reason
    assert [r.seq for r in spool.batches.pending(10, order="oldest_data")] == [r.seq for r in rows[:-1]]
    spool.close()


def test_make_room_evicts_the_oldest_first(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    fill(spool, 6, series=5)
    rows = spool.batches.pending(10, order="oldest_data")
    Retention(spool, policy(), encoder=encoder()).make_room(T0, rows[0].byte_size + 1)
    assert [r.seq for r in spool.batches.pending(10)] == [r.seq for r in rows[2:]]
    assert Counter(e.reason for e in spool.losses.entries()) == {"spool_full": 1}  # one hour bucket, summed
    spool.close()


def test_rows_in_flight_are_left_alone(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    fill(spool, 4, series=5)
    seqs = [r.seq for r in spool.batches.pending(10)]
    spool.batches.mark_sent(seqs, T0)
    Retention(spool, policy(max_age_ms=1, busy_ms=60_000), encoder=encoder()).enforce(T0 + 1000)
    assert [r.seq for r in spool.batches.pending(10)] == seqs
    spool.close()


def test_describe_names_the_jobs() -> None:
    assert describe([batch_of({COUNTER: [(T0, 1.0)]})]) == '{job="kepler"}'
    assert describe([batch_of({COUNTER: [(T0, 1.0)], GAUGE: [(T0, 1.0)]})]) == '{job=~"dcgm|kepler"}'
