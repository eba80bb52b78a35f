"""Tests of edge_relay/encode/batches.py: label tables, batch building and splitting under max_bytes."""

from __future__ import annotations

import math
import random
import string
from array import array
from collections import Counter
from collections.abc import Iterable, Sequence

import pytest

from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import (
    BatchEncoder,
    RecentLabels,
    decode_stage,
    dedupe_window,
    encode_checked,
    encode_stage,
    to_batch,
)
from schemas import codec
from schemas.model import STALE_NAN, Batch, Labels, float_bits

CLUSTER, NODE = "factory-north", "edge-gpu-01"
MAX_BYTES = 4096

Sample = tuple[Labels, int, int]  # labels, value bits, timestamp


def scrape(
    target: str,
    n: int,
    ts: int,
    *,
    seed: int = 0,
    explicit: bool = False,
    first: int = 0,
) -> ShapedScrape:
    """A shaped scrape of ``n`` distinct series with hard-to-compress values."""
    rng = random.Random(f"{target}-{seed}")
    out = ShapedScrape(target, ts)
    for i in range(first, first + n):
        out.labels.append(
            (
                ("__name__", f"kepler_container_joules_total_{i % 13}"),
                ("container", f"c-{i}"),
                ("job", target),
            )
        )
        out.values.append(rng.random() * 1e9)
    if explicit:
        out.timestamps = [ts - rng.randrange(0, 10_000) for _ in range(n)]
    return out


def samples_of(scrapes: Iterable[ShapedScrape]) -> Counter[Sample]:
    out: Counter[Sample] = Counter()
    for s in scrapes:
        for i, (labels, value) in enumerate(zip(s.labels, s.values, strict=True)):
            ts = s.timestamp_ms if s.timestamps is None else s.timestamps[i]
            out[(labels, float_bits(value), ts)] += 1
    return out


def samples_of_batch(batch: Batch) -> Counter[Sample]:
    out: Counter[Sample] = Counter()
    for block in batch.scrapes:
        for i, (idx, value) in enumerate(zip(block.series, block.values, strict=True)):
            out[(batch.labelsets[idx], float_bits(value), block.sample_timestamp(i))] += 1
    return out


def encode_all(encoder: BatchEncoder, batches: Sequence[Batch]) -> list[bytes]:
    return [encoder.encode(batch, seq) for seq, batch in enumerate(batches, start=1)]


def check_round_trip(encoder: BatchEncoder, scrapes: Sequence[ShapedScrape]) -> list[Batch]:
    """Build, encode, decode; assert the size cap and that every sample arrives exactly once."""
    batches = encoder.build(scrapes)
    decoded: Counter[Sample] = Counter()
    decoded_batches = []
    for seq, payload in enumerate(encode_all(encoder, batches), start=1):
        assert len(payload) <= encoder.max_bytes
        batch = codec.decode_batch(payload)
        assert (batch.cluster, batch.node, batch.seq) == (CLUSTER, NODE, seq)
        assert batch.sample_count > 0
        decoded += samples_of_batch(batch)
        decoded_batches.append(batch)
    assert decoded == samples_of(scrapes)
    return decoded_batches


# --------------------------------------------------------------------------------------------------
# to_batch


def test_to_batch_shares_one_label_table_across_scrapes() -> None:
    a = scrape("kepler", 5, 1000)
    b = scrape("kepler", 5, 2000, seed=1, first=3)  # series 3, 4 also in a
    batch = to_batch(CLUSTER, NODE, [a, b])
    assert (batch.cluster, batch.node, batch.seq) == (CLUSTER, NODE, 0)
    assert len(batch.labelsets) == 8
    assert len(set(batch.labelsets)) == 8
    assert [blk.timestamp_ms for blk in batch.scrapes] == [1000, 2000]
    for blk, src in zip(batch.scrapes, (a, b), strict=True):
        assert [batch.labelsets[i] for i in blk.series] == src.labels
        assert blk.values.tolist() == src.values.tolist()
        assert blk.timestamps is None
    assert list(batch.scrapes[0].series) == [0, 1, 2, 3, 4]
    assert list(batch.scrapes[1].series) == [3, 4, 5, 6, 7]
    batch.seq = 1
    assert samples_of_batch(codec.decode_batch(codec.encode_batch(batch))) == samples_of([a, b])


def test_to_batch_keeps_explicit_timestamps() -> None:
    a = scrape("kepler", 4, 5000, explicit=True)
    b = scrape("dcgm", 2, 5000)
    batch = to_batch(CLUSTER, NODE, [a, b])
    ts = batch.scrapes[0].timestamps
    assert ts is not None and ts.typecode == "q" and ts.tolist() == a.timestamps
    assert batch.scrapes[1].timestamps is None
    assert batch.first_timestamp_ms == min(a.timestamps or [])
    assert batch.last_timestamp_ms == 5000


def test_to_batch_empty() -> None:
    batch = to_batch(CLUSTER, NODE, [])
    assert batch.labelsets == [] and batch.scrapes == []


# --------------------------------------------------------------------------------------------------
# BatchEncoder


def test_build_nothing() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    assert enc.build([]) == []
    assert enc.build([ShapedScrape("kepler", 1000)]) == []


def test_build_small_is_one_batch() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    scrapes = [scrape("kepler", 10, 1000), ShapedScrape("empty", 1000), scrape("dcgm", 10, 1000)]
    batches = enc.build(scrapes)
    assert len(batches) == 1
    assert len(batches[0].scrapes) == 2  # the empty scrape is left out
    check_round_trip(enc, scrapes)


def test_encode_sets_seq() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES, zstd_level=7)
    (batch,) = enc.build([scrape("kepler", 3, 1000)])
    payload = enc.encode(batch, 42)
    header = codec.peek_header(payload)
    assert (header.seq, header.cluster, header.node, header.sample_count) == (42, CLUSTER, NODE, 3)
    assert codec.decode_batch(payload).seq == 42
    assert enc.encode(batch, 2**63 - 1) != payload


def test_split_by_scrapes_keeps_scrapes_whole() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    scrapes = [scrape(f"t{i}", 60, 1000 + i, seed=i) for i in range(8)]
    # Each scrape fits alone, all of them together do not.
    for s in scrapes:
        assert len(enc.build([s])) == 1
    batches = check_round_trip(enc, scrapes)
    assert len(batches) > 1
    seen: Counter[int] = Counter()
    for batch in batches:
        for block in batch.scrapes:
            seen[block.timestamp_ms] += 1
            assert len(block.values) == 60  # never cut
    assert seen == Counter(s.timestamp_ms for s in scrapes)


def test_split_big_scrape_by_series() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    big = scrape("kepler", 3000, 1_700_000_000_000)
    batches = check_round_trip(enc, [big])
    assert len(batches) > 5
    for batch in batches:
        assert len(batch.scrapes) == 1
        assert batch.scrapes[0].timestamp_ms == big.timestamp_ms  # every part keeps the scrape's timestamp
        # Each part carries only the label sets it uses.
        assert len(batch.labelsets) == len(batch.scrapes[0].values)


def test_split_mixed_big_and_small_scrapes_with_timestamps_and_special_values() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    big = scrape("kepler", 2500, 10_000, explicit=True)
    for i, special in enumerate((STALE_NAN, math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324)):
        big.values[i * 300] = special
    small = [scrape(f"s{i}", 20, 10_000 + i, seed=i) for i in range(5)]
    same_series = scrape("kepler", 50, 11_000, seed=9)  # label sets shared with `big`
    scrapes = [small[0], big, *small[1:], same_series]
    batches = check_round_trip(enc, scrapes)
    assert len(batches) > 1
    decoded: Counter[Sample] = Counter()
    for b in batches:
        decoded += samples_of_batch(b)
    assert decoded[(big.labels[0], float_bits(STALE_NAN), (big.timestamps or [])[0])] == 1


def test_split_respects_other_max_bytes() -> None:
    # v1: v2 packs these 7,000 series into one 64 KiB batch, and the split is what is under test.
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=64 * 1024, zstd_level=1, version=codec.FORMAT_V1)
    scrapes = [scrape("kepler", 4000, 1000), scrape("dcgm", 3000, 1000, seed=3)]
    batches = check_round_trip(enc, scrapes)
    assert 1 < len(batches) < 20


def test_batches_fit_with_the_widest_seq() -> None:
    enc = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES)
    for batch in enc.build([scrape("kepler", 2000, 1000)]):
        assert len(enc.encode(batch, 2**63 - 1)) <= MAX_BYTES


def test_single_sample_over_max_bytes_raises() -> None:
    rng = random.Random(5)
    noise = "".join(rng.choice(string.ascii_letters) for _ in range(3000))
    s = ShapedScrape("kepler", 1000)
    s.labels.append((("__name__", "m"), ("a", noise), ("b", noise[::-1])))
    s.values.append(1.0)
    with pytest.raises(ValueError, match="max_bytes"):
        BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES).build([s])


def test_invalid_scrape_is_refused_by_the_codec() -> None:
    s = ShapedScrape("kepler", 1000)
    s.labels.extend([(("__name__", "m"),), (("__name__", "m"),)])
    s.values.extend(array("d", [1.0, 2.0]))
    with pytest.raises(codec.EncodeError) as info:
        BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES).build([s])
    assert info.value.reason == "duplicate_sample"


# --------------------------------------------------------------------------------------------------
# batch windows: the staging form and build_window


def window_scrapes(ticks: int, n: int, *, churn: bool = False) -> list[ShapedScrape]:
    """``ticks`` cycles of two targets; with ``churn`` some series vanish and others appear mid-window."""
    out = []
    for t in range(ticks):
        first = t if churn else 0
        out.append(scrape("kepler", n, 1_000 + 5_000 * t, seed=t, first=first))
        out.append(scrape("dcgm", 3, 1_000 + 5_000 * t, seed=t, explicit=(t == 1)))
    return out


def test_stage_round_trip_is_bit_exact() -> None:
    scrapes = window_scrapes(3, 20)
    scrapes[0].values[0] = STALE_NAN
    scrapes[0].values[1] = -0.0
    scrapes[0].values[2] = math.inf
    back = decode_stage(encode_stage(scrapes))
    assert samples_of(back) == samples_of(scrapes)
    assert [s.target for s in back] == [s.target for s in scrapes]
    # label sets come back hashable and equal to the originals (they are dict keys downstream)
    assert back[0].labels[0] == scrapes[0].labels[0] and isinstance(back[0].labels[0], tuple)


def test_stage_skips_empty_scrapes_and_refuses_garbage() -> None:
    assert decode_stage(encode_stage([ShapedScrape("kepler", 1)])) == []
    with pytest.raises(ValueError, match="staged cycle"):
        decode_stage(b"not zstd at all")


@pytest.mark.parametrize("version", [codec.FORMAT_V1, codec.FORMAT_V2])
def test_build_window_is_one_batch_with_each_label_set_once(version: int) -> None:
    encoder = BatchEncoder(CLUSTER, NODE, max_bytes=1 << 20, version=version)
    scrapes = window_scrapes(12, 30, churn=True)
    batches = encoder.build_window(scrapes)
    assert len(batches) == 1
    assert len(batches[0].labelsets) == len({ls for s in scrapes for ls in s.labels})
    decoded = codec.decode_batch(encoder.encode(batches[0], 7))
    assert samples_of_batch(decoded) == samples_of(scrapes)


def test_build_window_splits_by_series_not_by_scrape() -> None:
    encoder = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES, version=codec.FORMAT_V2)
    scrapes = window_scrapes(12, 60)
    batches = encoder.build_window(scrapes)
    assert len(batches) > 1
    seen: Counter[Sample] = Counter()
    label_sets: list[Labels] = []
    for payload in encode_all(encoder, batches):
        assert len(payload) <= encoder.max_bytes
        decoded = codec.decode_batch(payload)
        seen += samples_of_batch(decoded)
        label_sets += decoded.labelsets
    assert seen == samples_of(scrapes)
    # every series sits in exactly one part, with all of its timestamps
    assert len(label_sets) == len(set(label_sets))
    for batch in batches:
        assert {blk.timestamp_ms for blk in batch.scrapes} >= {1_000 + 5_000 * t for t in range(12)} - {6_000}


def test_build_window_keeps_each_containers_series_in_one_part() -> None:
    """Parts are self-contained, so each spells out the label values it uses: a container's metrics
    travel together and its id is written once, not once per part (exposition order is metric by
    metric, which would put every container in every part)."""
    encoder = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES, version=codec.FORMAT_V2)
    rng = random.Random(5)
    containers = [rng.randbytes(32).hex() for _ in range(120)]  # 64 incompressible hex digits each
    scrapes = []
    for t in range(4):
        s = ShapedScrape("kepler", 1_000 + 5_000 * t)
        for metric in ("joules_total", "cpu_seconds_total", "bytes", "packets_total"):
            for c in containers:
                s.labels.append(
                    (("__name__", f"kepler_container_{metric}"), ("container_id", c), ("job", "k"))
                )
                s.values.append(float(rng.randrange(1000)))
        scrapes.append(s)
    batches = encoder.build_window(scrapes)
    assert len(batches) > 1
    parts_of: dict[str, set[int]] = {}
    for i, batch in enumerate(batches):
        for labels in batch.labelsets:
            parts_of.setdefault(dict(labels)["container_id"], set()).add(i)
    split = [c for c, parts in parts_of.items() if len(parts) > 1]
    assert len(split) <= len(batches) - 1  # at most one container straddles each cut
    assert len(parts_of) == len(containers)


def test_build_window_falls_back_to_scrape_splits_for_one_huge_series() -> None:
    encoder = BatchEncoder(CLUSTER, NODE, max_bytes=MAX_BYTES, version=codec.FORMAT_V2)
    rng = random.Random(3)
    scrapes = []
    for t in range(1500):  # one series whose window alone (12 KB of random floats) exceeds the cap
        s = ShapedScrape("kepler", 1_000 + 5_000 * t)
        s.labels.append((("__name__", "x"), ("job", "kepler")))
        s.values.append(rng.random())
        scrapes.append(s)
    batches = encoder.build_window(scrapes)
    assert len(batches) > 1
    assert sum(b.sample_count for b in batches) == 1500
    assert all(len(encoder.encode(b, 1)) <= MAX_BYTES for b in batches)


def test_dedupe_window_keeps_the_first_sample_per_series_and_timestamp() -> None:
    a = scrape("kepler", 3, 1000, explicit=True)
    b = scrape("kepler", 3, 2000, seed=1)
    assert a.timestamps is not None
    b.timestamps = list(a.timestamps)  # the exporter's timestamps did not advance
    b.timestamps[2] += 1
    out, dropped = dedupe_window([a, b])
    assert dropped == {"kepler": 2}
    assert samples_of(out) == samples_of([a]) + Counter(
        {(b.labels[2], float_bits(b.values[2]), b.timestamps[2]): 1}
    )
    plain = [scrape("kepler", 3, 1000), scrape("kepler", 3, 2000)]
    assert dedupe_window(plain) == (plain, {})


@pytest.mark.parametrize("version", [codec.FORMAT_V1, codec.FORMAT_V2])
def test_encoding_again_with_the_real_seq_reuses_the_body_and_equals_a_fresh_encode(version: int) -> None:
    scrapes = window_scrapes(3, 10)
    encoder = BatchEncoder(CLUSTER, NODE, max_bytes=1 << 20, version=version)
    (batch,) = encoder.build_window(scrapes)  # sized with WIDEST_SEQ
    again = encoder.encode(batch, 42)
    fresh = BatchEncoder(CLUSTER, NODE, max_bytes=1 << 20, version=version).encode(
        to_batch(CLUSTER, NODE, scrapes), 42
    )
    assert again == fresh
    assert codec.decode_batch(again).seq == 42
    with pytest.raises(codec.WireError):
        codec.with_seq(again, -1)


def test_recent_labels_forget_series_gone_for_two_generations() -> None:
    """What the encoders remember as valid is bounded by the live series plus recent churn: a series
    replaced long ago is forgotten (and checked again if it ever comes back), a live one never is."""
    valid = RecentLabels(generation=4)
    live = [(("__name__", "up"), ("i", str(i))) for i in range(5)]
    churned: list[Labels] = []
    for cycle in range(40):
        new = [(("__name__", "pod_cpu"), ("pod", f"p{cycle}-{j}")) for j in range(3)]
        churned += new
        valid.remember(live + new)
        assert all(labels in valid for labels in live + new)
    assert not any(labels in valid for labels in churned[: 3 * 36])  # gone since the last fresh start
    held = sum(labels in valid for labels in churned)
    assert 3 <= held <= 3 * 4  # at most one generation of churn


def test_a_batch_whose_label_list_was_replaced_is_checked_in_full() -> None:
    """``encode_checked`` reuses the label table ``to_batch`` built only for that very list: a batch
    whose label sets were swapped afterwards (here for one with an invalid name) is checked again, and
    what it remembers as valid is what it checked."""
    ok = [(("__name__", "up"), ("i", str(i))) for i in range(3)]
    scrape = ShapedScrape("t", 1_700_000_000_000, list(ok), array("d", [1.0, 2.0, 3.0]))
    valid = RecentLabels()
    batch = to_batch("c", "n", [scrape])
    batch.seq = 1
    encode_checked(batch, valid, version=codec.FORMAT_V1)
    assert set(ok) <= valid
    batch2 = to_batch("c", "n", [scrape])
    batch2.seq = 2
    bad: Labels = (("__name__", "up"), ("0i", "x"))
    batch2.labelsets = [*batch2.labelsets[:2], bad]
    with pytest.raises(codec.EncodeError) as info:
        encode_checked(batch2, valid, version=codec.FORMAT_V1)
    assert info.value.reason == "invalid_label_name"
    assert bad not in valid


def test_the_label_table_travels_with_its_batch() -> None:
    """The table ``to_batch`` numbered a batch's series by belongs to that batch: building a second
    batch (another thread's, a split half's) leaves the first one's shortcut intact, and a batch whose
    label list was replaced or grown has none."""
    a = ShapedScrape(
        "t", 1_700_000_000_000, [(("__name__", "a"), ("i", str(i))) for i in range(3)], array("d", [1.0] * 3)
    )
    b = ShapedScrape("t", 1_700_000_000_000, [(("__name__", "b"),)], array("d", [2.0]))
    first = to_batch("c", "n", [a])
    second = to_batch("c", "n", [b])
    assert first.distinct_labelsets() == set(a.labels)
    assert second.distinct_labelsets() == set(b.labels)
    first.labelsets.append((("__name__", "c"),))
    assert first.distinct_labelsets() is None
    second.labelsets = list(second.labelsets)
    assert second.distinct_labelsets() is None


def test_two_scrapes_stamped_in_the_same_millisecond_keep_one_sample_per_series() -> None:
    """Two targets whose labels coincide (relabeling, or the same job and instance), scraped in the same
    millisecond: the same series twice at one timestamp. Prometheus keeps one; v1 would carry both and
    the receiver keep either. The first stays, the second is counted for its target; series of their own
    and scrapes of other timestamps pass untouched."""
    shared: Labels = (("__name__", "m"), ("job", "j"))
    a = ShapedScrape("a", 1000, [shared, (("__name__", "only_a"),)], array("d", [1.0, 2.0]))
    b = ShapedScrape("b", 1000, [shared, (("__name__", "only_b"),)], array("d", [3.0, 4.0]))
    c = ShapedScrape("c", 1001, [shared], array("d", [5.0]))
    out, dropped = dedupe_window([a, b, c])
    assert dropped == {"b": 1}
    assert [(s.target, s.labels, list(s.values)) for s in out] == [
        ("a", a.labels, [1.0, 2.0]),
        ("b", [(("__name__", "only_b"),)], [4.0]),
        ("c", [shared], [5.0]),
    ]
    assert out[0] is a and out[2] is c
