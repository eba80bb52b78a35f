"""Tests of cloud_ingest/pipeline/decode.py: topic checks, codec refusals, node spoofing and clock skew."""

from __future__ import annotations

from array import array

import msgpack
import pytest

from cloud_ingest.pipeline.decode import Decoded, Refused, decode, pin_identity
from schemas import codec, topics
from schemas.model import STALE_NAN, Batch, ScrapeBlock, float_bits

PREFIX = "edgemetrics"
CLUSTER, NODE = "factory-north", "edge-gpu-01"
NOW_MS = 1_700_000_000_000
LIMITS = codec.DEFAULT_LIMITS
MAX_FUTURE_S = 600.0


def make_batch(
    *,
    cluster: str = CLUSTER,
    node: str = NODE,
    seq: int = 17,
    ts: int = NOW_MS - 5000,
    timestamps: list[int] | None = None,
) -> Batch:
    labelsets = [
        (("__name__", "kepler_node_joules_total"), ("instance", f"{node}:28282"), ("job", "kepler")),
        (("__name__", "up"), ("instance", f"{node}:28282"), ("job", "kepler")),
    ]
    block = ScrapeBlock(
        ts,
        array("I", [0, 1]),
        array("d", [123.5, STALE_NAN]),
        None if timestamps is None else array("q", timestamps),
    )
    return Batch(cluster, node, seq, labelsets, [block])


def payload(batch: Batch | None = None) -> bytes:
    return codec.encode_batch(batch or make_batch())


def run(topic: str, data: bytes, *, now_ms: int = NOW_MS, prefix: str = PREFIX) -> Decoded:
    return decode(topic, data, prefix=prefix, limits=LIMITS, max_future_seconds=MAX_FUTURE_S, now_ms=now_ms)


def refused(topic: str, data: bytes, **kwargs: int) -> Refused:
    with pytest.raises(Refused) as info:
        run(topic, data, **kwargs)
    return info.value


TOPIC = topics.batch_topic(PREFIX, CLUSTER, NODE)


def test_valid_batch_decodes() -> None:
    out = run(TOPIC, payload())
    assert (out.cluster, out.node) == (CLUSTER, NODE)
    assert out.batch.seq == 17
    assert out.batch.sample_count == 2
    # Series without cluster and node labels (add_node_labels: false) are written as sent.
    assert out.batch.labelsets == make_batch().labelsets
    assert out.identity_overridden == 0
    values = out.batch.scrapes[0].values
    assert values[0] == 123.5
    assert float_bits(values[1]) == float_bits(STALE_NAN)


def test_multi_level_prefix() -> None:
    topic = topics.batch_topic("fleet/metrics", CLUSTER, NODE)
    assert run(topic, payload(), prefix="fleet/metrics").node == NODE
    assert refused(topic, payload()).reason == "bad_topic"


def test_uses_the_clock_when_now_is_not_given() -> None:
    out = decode(TOPIC, payload(), prefix=PREFIX, limits=LIMITS, max_future_seconds=MAX_FUTURE_S)
    assert out.batch.seq == 17


@pytest.mark.parametrize(
    "topic",
    [
        "other/v1/factory-north/edge-gpu-01/batch",
        "edgemetrics/v2/factory-north/edge-gpu-01/batch",
        "edgemetrics/v1/factory-north/batch",
        "edgemetrics/v1/factory-north/edge-gpu-01/batch/extra",
        "edgemetrics/v1/factory-north/edge-gpu-01/bogus",
        "edgemetrics/v1//edge-gpu-01/batch",
        "edgemetricsx/v1/factory-north/edge-gpu-01/batch",
        "",
    ],
)
def test_topic_not_ours(topic: str) -> None:
    err = refused(topic, payload())
    assert err.reason == "bad_topic"
    assert err.seq is None


@pytest.mark.parametrize("kind", ["ack", "status"])
def test_wrong_kind(kind: str) -> None:
    err = refused(f"{PREFIX}/v1/{CLUSTER}/{NODE}/{kind}", payload())
    assert err.reason == "bad_topic"
    assert (err.cluster, err.node, err.seq) == (CLUSTER, NODE, None)


def test_node_mismatch() -> None:
    err = refused(topics.batch_topic(PREFIX, CLUSTER, "edge-other"), payload())
    assert err.reason == "node_mismatch"
    assert (err.cluster, err.node, err.seq) == (CLUSTER, "edge-other", 17)
    assert NODE in str(err)


def test_cluster_mismatch() -> None:
    err = refused(topics.batch_topic(PREFIX, "factory-south", NODE), payload(make_batch(seq=3)))
    assert err.reason == "node_mismatch"
    assert (err.cluster, err.node, err.seq) == ("factory-south", NODE, 3)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "truncated"),
        (b"ER", "truncated"),
        (b"hello, this is not a batch", "bad_magic"),
        (b"\x00" * 64, "bad_magic"),
        (b'{"v":1,"node":"edge-gpu-01"}', "bad_magic"),
        (b"ERB\x09" + b"\x80", "unknown_version"),
        (b"ERB\x01" + b"\xc1", "malformed"),
    ],
)
def test_garbage_payload(data: bytes, reason: str) -> None:
    err = refused(TOPIC, data)
    assert err.reason == reason
    assert err.reason in codec.REASONS
    assert (err.cluster, err.node, err.seq) == (CLUSTER, NODE, None)


@pytest.mark.parametrize("keep", [4, 10, 30, -20, -1])
def test_truncated_payload(keep: int) -> None:
    data = payload()
    err = refused(TOPIC, data[:keep])
    assert err.reason == "truncated"
    assert err.seq is None


def test_corrupted_body_refused_with_seq() -> None:
    envelope = msgpack.unpackb(codec.encode_batch(make_batch(seq=99), version=codec.FORMAT_V1)[4:], raw=False)
    envelope["body"] = envelope["body"][:4] + b"\x00" * 40  # zstd magic, then junk
    data = codec.MAGIC + bytes((codec.FORMAT_V1,)) + msgpack.packb(envelope, use_bin_type=True)
    err = refused(TOPIC, data)
    assert err.reason == "bad_compression"
    assert (err.cluster, err.node, err.seq) == (CLUSTER, NODE, 99)


def test_header_body_mismatch_refused_with_seq() -> None:
    envelope = msgpack.unpackb(codec.encode_batch(make_batch(seq=12), version=codec.FORMAT_V1)[4:], raw=False)
    envelope["n"] = 3
    data = codec.MAGIC + bytes((codec.FORMAT_V1,)) + msgpack.packb(envelope, use_bin_type=True)
    err = refused(TOPIC, data)
    assert err.reason == "header_mismatch"
    assert err.seq == 12


def test_oversized_payload() -> None:
    limits = codec.Limits(max_payload_bytes=64)
    with pytest.raises(Refused) as info:
        decode(TOPIC, payload(), prefix=PREFIX, limits=limits, max_future_seconds=MAX_FUTURE_S, now_ms=NOW_MS)
    assert info.value.reason == "oversized"


def test_limits_apply_to_the_body() -> None:
    limits = codec.Limits(max_labels_per_series=2)
    with pytest.raises(Refused) as info:
        decode(TOPIC, payload(), prefix=PREFIX, limits=limits, max_future_seconds=MAX_FUTURE_S, now_ms=NOW_MS)
    assert info.value.reason == "too_many_labels"
    assert info.value.seq == 17


def test_future_timestamp_refused() -> None:
    data = payload(make_batch(seq=5, ts=NOW_MS + 3_600_000))
    err = refused(TOPIC, data)
    assert err.reason == "future_timestamp"
    assert (err.cluster, err.node, err.seq) == (CLUSTER, NODE, 5)


def test_future_sample_is_split_off_and_the_rest_kept() -> None:
    # One series an hour ahead (its own explicit timestamp) must not cost the other of the scrape.
    data = payload(make_batch(seq=6, ts=NOW_MS, timestamps=[NOW_MS - 1000, NOW_MS + 10_000_000]))
    out = run(TOPIC, data)
    assert out.batch.seq == 6 and out.batch.sample_count == 1
    assert out.batch.labelsets[out.batch.scrapes[0].series[0]][0] == ("__name__", "kepler_node_joules_total")
    assert [b.sample_timestamp(0) for b in out.batch.scrapes] == [NOW_MS - 1000]
    assert out.refused is not None and out.refused.seq == 6
    assert out.refused_reason.startswith("future_timestamp: 1 sample(s)")
    # The refused part is a batch of its own, its labels as sent (no node label added), that encodes and
    # decodes again (the dead letter is replayable), the stale marker's bits intact.
    again = codec.decode_batch(codec.encode_batch(out.refused))
    assert [dict(ls)["__name__"] for ls in again.labelsets] == ["up"]
    assert "node" not in dict(again.labelsets[0])
    assert [float_bits(v) for v in again.scrapes[0].values] == [float_bits(STALE_NAN)]
    assert again.last_timestamp_ms == NOW_MS + 10_000_000


def test_all_future_samples_refuse_the_batch() -> None:
    data = payload(make_batch(seq=6, ts=NOW_MS, timestamps=[NOW_MS + 10_000_000, NOW_MS + 10_000_001]))
    err = refused(TOPIC, data)
    assert err.reason == "future_timestamp"
    assert err.seq == 6


def test_future_tolerance_boundary() -> None:
    limit_ms = NOW_MS + int(MAX_FUTURE_S * 1000)
    assert run(TOPIC, payload(make_batch(ts=limit_ms))).batch.last_timestamp_ms == limit_ms
    assert refused(TOPIC, payload(make_batch(ts=limit_ms + 1))).reason == "future_timestamp"


def test_old_samples_are_accepted() -> None:
    assert run(TOPIC, payload(make_batch(ts=1))).batch.first_timestamp_ms == 1


# -- every series carries the topic's cluster and node ------------------------------------------------


def L(**pairs: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(pairs.items()))


def test_series_of_another_node_are_written_under_the_topic_node() -> None:
    """Only the header was compared with the topic: a node could write series labelled as another."""
    labelsets = [
        L(__name__="a", cluster=CLUSTER, node=NODE),  # honest: unchanged
        L(__name__="b", cluster="other-cluster", node="other-node"),  # both overridden
        L(__name__="c"),  # without them (add_node_labels: false): left as sent
        L(__name__="d", cluster=CLUSTER, node="other-node", exported_node="x"),  # prefixed again
    ]
    block = ScrapeBlock(NOW_MS - 5000, array("I", [0, 1, 2, 3]), array("d", [1, 2, 3, 4]))
    batch = Batch(CLUSTER, NODE, 3, labelsets, [block])
    out = run(TOPIC, payload(batch))
    assert out.batch.labelsets == [
        L(__name__="a", cluster=CLUSTER, node=NODE),
        L(
            __name__="b",
            cluster=CLUSTER,
            node=NODE,
            exported_cluster="other-cluster",
            exported_node="other-node",
        ),
        L(__name__="c"),
        L(__name__="d", cluster=CLUSTER, node=NODE, exported_node="x", exported_exported_node="other-node"),
    ]
    assert out.identity_overridden == 2
    # The samples still point at the same rows of the label table.
    assert list(out.batch.scrapes[0].series) == [0, 1, 2, 3]


def test_pin_identity_leaves_an_honest_batch_alone() -> None:
    labelsets = [L(__name__="a", cluster="c", node="n", zone=str(i)) for i in range(3)]
    out, overridden = pin_identity(labelsets, "c", "n")
    assert out is labelsets and overridden == 0  # no copy: the fast path is one membership test each
