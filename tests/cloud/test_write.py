"""Remote-write output: protobuf encoding, snappy framing, HTTP client retry policy, real Prometheus."""

from __future__ import annotations

import email.utils
import itertools
import json
import logging
import math
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import cramjam
import pytest
import requests
from google.protobuf import descriptor_pb2, text_format
from google.protobuf.internal import api_implementation
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_ingest.sinks.remote_write.client import DEFAULT_USER_AGENT, RemoteWriteClient, WriteOutcome
from cloud_ingest.sinks.remote_write.request import (
    LabelBytes,
    build_write_request,
    encode_body,
    request_size_bound,
)
from relay_common.backoff import Backoff
from schemas import remote_write_pb as pb
from schemas.model import STALE_NAN, STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits
from testkit.rw_mock import FakeTime, MaxRng, MockReceiver, Reply

# Fixtures, asked for by their pytest names: receiver, fake_time.
from testkit.rw_mock import fake_time_fixture as fake_time_fixture
from testkit.rw_mock import receiver_fixture as receiver_fixture
from testkit.rw_wire import bits_to_float, wire_samples

REPO = Path(__file__).resolve().parents[2]
NOW_MS = 1_700_000_000_000


SPECIAL_VALUES = [
    STALE_NAN,
    math.nan,
    bits_to_float(0xFFF8000000000001),  # negative NaN with a payload
    bits_to_float(0x7FF4000000000000),  # signalling NaN
    math.inf,
    -math.inf,
    -0.0,
    0.0,
    5e-324,  # smallest subnormal
    1.7976931348623157e308,
    -1.0,
    0.1,
    12345.678,
]


def labels(name: str, **extra: str) -> Labels:
    return tuple(sorted({"__name__": name, **extra}.items()))


def block(ts: int, samples: list[tuple[int, float]], timestamps: list[int] | None = None) -> ScrapeBlock:
    values = array("d")
    # frombytes, not array("d", floats): keeps NaN payloads independent of float conversions.
    values.frombytes(b"".join(struct.pack("<d", v) for _, v in samples))
    return ScrapeBlock(
        timestamp_ms=ts,
        series=array("I", [s for s, _ in samples]),
        values=values,
        timestamps=None if timestamps is None else array("q", timestamps),
    )


def special_batch() -> Batch:
    sets = [
        labels(f"m_{i}", job="kepler", instance="edge-1:9102", idx=str(i)) for i in range(len(SPECIAL_VALUES))
    ]
    return Batch(
        "c1",
        "n1",
        7,
        sets,
        [
            block(NOW_MS, list(enumerate(SPECIAL_VALUES))),
            block(NOW_MS + 15_000, list(enumerate(SPECIAL_VALUES))),
        ],
    )


def decode_request(raw: bytes) -> pb.WriteRequest:  # type: ignore[name-defined]
    req = pb.WriteRequest()
    req.ParseFromString(raw)
    return req


def unsnappy(body: bytes) -> bytes:
    return bytes(cramjam.snappy.decompress_raw(body))


# The pure-Python protobuf backend (PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python) turns every NaN
# it parses into the canonical quiet NaN, and 5.x serializes -0.0 as +0.0 (by omitting it).  upb,
# the default everywhere wheels exist, is exact.  So the message classes are the oracle for structure
# everywhere, and for value bits and byte-equality only on upb/cpp; value bits are also read straight
# off the wire by rw_mock.wire_samples, which no protobuf runtime can alter.
EXACT_RUNTIME = api_implementation.Type() != "python"


def expected_series(batch: Batch) -> dict[Labels, list[tuple[int, int]]]:
    """Reference model: per label set, (timestamp, value bits) sorted, last in batch order wins."""
    per: dict[int, dict[int, int]] = {}
    for b in batch.scrapes:
        raw = b.values.tobytes()
        for i, s in enumerate(b.series):
            per.setdefault(s, {})[b.sample_timestamp(i)] = struct.unpack_from("<Q", raw, 8 * i)[0]
    return {batch.labelsets[s]: sorted(samples.items()) for s, samples in sorted(per.items())}


def actual_series(raw: bytes) -> dict[Labels, list[tuple[int, int]]]:
    """Decoded WriteRequest: per label set, (timestamp, value bits).  Also checks well-formedness."""
    req = decode_request(raw)
    assert_well_formed(req)
    wire = wire_samples(raw)
    assert len(wire) == len(req.timeseries)
    out: dict[Labels, list[tuple[int, int]]] = {}
    for ts, wire_ts in zip(req.timeseries, wire, strict=True):
        key = tuple((lab.name, lab.value) for lab in ts.labels)
        assert key not in out, f"series {key} sent twice"
        decoded = [(s.timestamp, float_bits(s.value)) for s in ts.samples]
        assert [t for t, _ in decoded] == [t for t, _ in wire_ts]
        if EXACT_RUNTIME:
            assert decoded == wire_ts
        out[key] = wire_ts
    return out


def assert_same_as_message_classes(batch: Batch, raw: bytes) -> None:
    if EXACT_RUNTIME:
        assert raw == reference_serialization(batch)


def reference_serialization(batch: Batch) -> bytes:
    """The same WriteRequest built through the protobuf message classes."""
    req = pb.WriteRequest()
    for lset, samples in expected_series(batch).items():
        ts = req.timeseries.add()
        for name, value in lset:
            ts.labels.add(name=name, value=value)
        for t, bits in samples:
            ts.samples.add(value=bits_to_float(bits), timestamp=t)
    return req.SerializeToString()


def assert_well_formed(req: pb.WriteRequest) -> None:  # type: ignore[name-defined]
    for ts in req.timeseries:
        names = [lab.name for lab in ts.labels]
        assert names == sorted(names), names
        assert len(set(names)) == len(names), names
        assert "__name__" in names
        assert all(lab.value for lab in ts.labels)
        stamps = [s.timestamp for s in ts.samples]
        assert all(a < b for a, b in itertools.pairwise(stamps)), stamps


# -- descriptor vs .proto ----------------------------------------------------------------------------


def test_python_descriptor_matches_proto_file(tmp_path: Path) -> None:
    protoc = shutil.which("protoc")
    if protoc is None:
        if os.environ.get("CI"):
            pytest.fail("protoc is required in CI (apt-get install protobuf-compiler)")
        pytest.skip("protoc not installed")
    out = tmp_path / "remote_write.pb"
    subprocess.run(
        [
            protoc,
            f"--proto_path={REPO / 'schemas'}",
            f"--descriptor_set_out={out}",
            str(REPO / "schemas" / "remote_write.proto"),
        ],
        check=True,
    )
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    assert len(fds.file) == 1
    from_protoc = text_format.MessageToString(fds.file[0])
    ours = text_format.MessageToString(pb.FILE_DESCRIPTOR_PROTO)
    assert ours == from_protoc
    assert fds.file[0] == pb.FILE_DESCRIPTOR_PROTO


def test_upstream_field_numbers() -> None:
    # Pinned independently of the .proto: these numbers are the wire contract with every receiver.
    def numbers(message: str) -> dict[str, int]:
        desc = getattr(pb, message).DESCRIPTOR
        return {f.name: f.number for f in desc.fields}

    assert numbers("WriteRequest") == {"timeseries": 1, "metadata": 3}
    assert numbers("TimeSeries") == {"labels": 1, "samples": 2}
    assert numbers("Label") == {"name": 1, "value": 2}
    assert numbers("Sample") == {"value": 1, "timestamp": 2}
    assert numbers("MetricMetadata") == {"type": 1, "metric_family_name": 2, "help": 4, "unit": 5}
    assert pb.MetricMetadata.STATESET == 7
    assert (
        pb.Sample.DESCRIPTOR.fields_by_name["value"].type == descriptor_pb2.FieldDescriptorProto.TYPE_DOUBLE
    )
    assert (
        pb.Sample.DESCRIPTOR.fields_by_name["timestamp"].type
        == descriptor_pb2.FieldDescriptorProto.TYPE_INT64
    )


# -- build_write_request ---------------------------------------------------------------------------


def test_special_values_survive_bit_exact() -> None:
    batch = special_batch()
    raw = unsnappy(encode_body(batch))
    got = actual_series(raw)
    assert got == expected_series(batch)
    by_name = {dict(lset)["__name__"]: samples for lset, samples in got.items()}
    assert by_name["m_0"] == [(NOW_MS, STALE_NAN_BITS), (NOW_MS + 15_000, STALE_NAN_BITS)]
    assert by_name["m_6"][0][1] == float_bits(-0.0) == 0x8000000000000000
    assert by_name["m_4"][0][1] == float_bits(math.inf)
    assert by_name["m_5"][0][1] == float_bits(-math.inf)
    if EXACT_RUNTIME:  # and straight from the message classes
        first = decode_request(raw).timeseries[0]
        assert [float_bits(s.value) for s in first.samples] == [STALE_NAN_BITS, STALE_NAN_BITS]


def test_bytes_identical_to_message_classes() -> None:
    if not EXACT_RUNTIME:
        pytest.skip("the pure-Python protobuf backend drops -0.0 when serializing")
    batch = special_batch()
    assert build_write_request(batch) == reference_serialization(batch)


def test_samples_sorted_across_blocks_and_last_duplicate_wins() -> None:
    sets = [labels("a"), labels("b", x="1"), labels("unused"), labels("c")]
    batch = Batch(
        "c",
        "n",
        1,
        sets,
        [
            block(NOW_MS + 30_000, [(0, 3.0), (1, 30.0)]),
            block(NOW_MS, [(0, 1.0), (3, 100.0)]),
            block(NOW_MS + 15_000, [(0, 2.0), (1, 20.0)]),
            block(NOW_MS, [(0, 1.5)]),  # same series and timestamp as an earlier block: this one wins
            block(NOW_MS + 30_000, [(1, 31.0), (1, 32.0)]),  # duplicate inside one block: last wins
        ],
    )
    raw = build_write_request(batch)
    actual_series(raw)  # well-formed
    req = decode_request(raw)
    got = {ts.labels[0].value: [(s.timestamp, s.value) for s in ts.samples] for ts in req.timeseries}
    assert got == {
        "a": [(NOW_MS, 1.5), (NOW_MS + 15_000, 2.0), (NOW_MS + 30_000, 3.0)],
        "b": [(NOW_MS + 15_000, 20.0), (NOW_MS + 30_000, 32.0)],
        "c": [(NOW_MS, 100.0)],
    }
    assert [ts.labels[0].value for ts in req.timeseries] == ["a", "b", "c"]  # "unused" not sent
    assert_same_as_message_classes(batch, raw)


def test_explicit_per_sample_timestamps() -> None:
    sets = [labels("a"), labels("b")]
    batch = Batch(
        "c",
        "n",
        1,
        sets,
        [
            block(NOW_MS, [(0, 1.0), (1, 2.0), (0, 0.5)], timestamps=[NOW_MS - 5, NOW_MS - 9, NOW_MS - 10]),
            block(NOW_MS + 15_000, [(0, 3.0), (1, 4.0)]),
        ],
    )
    raw = build_write_request(batch)
    assert actual_series(raw) == expected_series(batch)
    assert [t for t, _ in wire_samples(raw)[0]] == [NOW_MS - 10, NOW_MS - 5, NOW_MS + 15_000]


def test_zero_and_negative_timestamps_and_zero_values() -> None:
    # proto3 omits default-valued fields: +0.0 and timestamp 0 must still decode as such.
    sets = [labels("a"), labels("b")]
    batch = Batch(
        "c",
        "n",
        1,
        sets,
        [block(0, [(0, 0.0), (1, -0.0)]), block(-1, [(0, 1.0), (1, 0.0)], timestamps=[-1, -(2**62)])],
    )
    raw = build_write_request(batch)
    assert_same_as_message_classes(batch, raw)
    assert actual_series(raw) == expected_series(batch)


def test_unicode_and_long_labels() -> None:
    sets = [labels("a", pod="ü-ß-漢字", long="x" * 300, exactly127="v" * 127)]
    batch = Batch("c", "n", 1, sets, [block(NOW_MS, [(0, 1.0)])])
    raw = build_write_request(batch)
    assert_same_as_message_classes(batch, raw)
    assert actual_series(raw) == expected_series(batch)


def test_empty_batch() -> None:
    batch = Batch("c", "n", 1, [labels("a")], [])
    assert build_write_request(batch) == b""
    assert len(decode_request(unsnappy(encode_body(batch))).timeseries) == 0


def test_mismatched_columns_raise() -> None:
    bad = ScrapeBlock(NOW_MS, array("I", [0, 0]), array("d", [1.0]))
    with pytest.raises(ValueError):
        build_write_request(Batch("c", "n", 1, [labels("a")], [bad]))


def test_body_is_snappy_block_format_not_framed() -> None:
    batch = special_batch()
    body = encode_body(batch)
    assert not body.startswith(b"\xff\x06\x00\x00sNaPpY")  # framing-format stream identifier
    assert bytes(cramjam.snappy.decompress_raw(body)) == build_write_request(batch)


_value_bits = st.one_of(
    st.sampled_from([float_bits(v) for v in SPECIAL_VALUES]),
    st.integers(min_value=0, max_value=2**64 - 1),
)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    n_series = draw(st.integers(1, 6))
    sets = [labels(f"m{i}", k=draw(st.text(min_size=1, max_size=5))) for i in range(n_series)]
    scrapes = []
    for _ in range(draw(st.integers(0, 4))):
        rows = draw(st.lists(st.tuples(st.integers(0, n_series - 1), _value_bits), max_size=8))
        ts = draw(st.integers(-(2**40), 2**42))
        explicit = draw(st.booleans())
        stamps = [draw(st.integers(-(2**63), 2**63 - 1)) for _ in rows] if explicit else None
        scrapes.append(block(ts, [(s, bits_to_float(b)) for s, b in rows], timestamps=stamps))
    return Batch("c", "n", 1, sets, scrapes)


@settings(max_examples=300, deadline=None)
@given(batches())
def test_property_matches_reference_model(batch: Batch) -> None:
    raw = build_write_request(batch)
    assert_same_as_message_classes(batch, raw)
    assert actual_series(raw) == expected_series(batch)


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(1, 2000))
def test_the_label_cache_never_changes_the_bytes(batch: Batch, cache_bytes: int) -> None:
    cache = LabelBytes(cache_bytes, max_entry_bytes=64)
    expected = build_write_request(batch)
    # The same label-set objects again (a v3 node's next frame), then equal ones decoded afresh.
    assert build_write_request(batch, cache) == expected
    assert build_write_request(batch, cache) == expected
    afresh = [tuple(map(tuple, ls)) for ls in batch.labelsets]
    assert build_write_request(Batch("c", "n", 1, afresh, batch.scrapes), cache) == expected


@settings(max_examples=200, deadline=None)
@given(batches(), st.integers(1, 2000), st.integers(0, 6))
def test_the_size_bound_with_the_label_cache_stays_an_upper_bound(
    batch: Batch, cache_bytes: int, new_series: int
) -> None:
    """The ingester's expansion check measures a request with the writer's cache: cached label sets at
    their encoded size, the others (new series, entries the cache let go) by their characters."""
    cache = LabelBytes(cache_bytes, max_entry_bytes=64)
    build_write_request(batch, cache)  # the frame before: the cache holds what fitted
    sets = batch.labelsets + [labels(f"new_{i}", k="v") for i in range(new_series)]
    blocks = [
        *batch.scrapes,
        block(1_700_000_000_000, [(len(batch.labelsets) + i, 1.0) for i in range(new_series)]),
    ]
    grown = Batch("c", "n", 1, sets, blocks)
    actual = len(build_write_request(grown))
    huge = 1 << 62
    with_cache = request_size_bound(grown, huge, labels_cache=cache)
    assert actual <= with_cache <= request_size_bound(grown, huge)
    if new_series == 0 and all(cache.get(ls) is not None for ls in batch.labelsets):
        assert with_cache == request_size_bound(grown)  # every label set cached: the labels exactly


def test_the_label_cache_holds_recent_label_sets_by_identity_within_its_bytes() -> None:
    cache = LabelBytes(20_000, max_entry_bytes=100)
    live = [labels(f"m_{i}", job="kepler") for i in range(10)]
    for ls in live:
        cache.put(ls, b"x" * 50)
    assert all(cache.get(ls) == b"x" * 50 for ls in live)
    assert cache.get(tuple(map(tuple, live[0]))) is None  # equal, not the same object
    cache.put(labels("big"), b"x" * 101)  # over max_entry_bytes: never kept
    assert cache.get(labels("big")) is None
    # A stream of new label sets (a churning node, v2 batches) stays within the bytes, and the live
    # set, hit in between, survives it.
    churn = []
    for i in range(1000):
        ls = labels(f"churn_{i}")
        churn.append(ls)
        cache.put(ls, b"y" * 50)
        if i % 20 == 0:
            assert all(cache.get(ls) is not None for ls in live)
    assert len(cache) * (50 + LabelBytes.ENTRY_OVERHEAD) <= 20_000 + 200
    assert cache.get(churn[0]) is None


# -- the client under test, against rw_mock.MockReceiver --------------------------------------------


def make_client(url: str, fake_time: FakeTime, **kwargs: object) -> RemoteWriteClient:
    opts: dict[str, object] = {
        "backoff": Backoff(1.0, 8.0, rng=MaxRng()),
        "max_retry_s": 60.0,
        "sleep": fake_time.sleep,
        "clock": fake_time.clock,
        "timeout_s": 5.0,
    }
    opts.update(kwargs)
    return RemoteWriteClient(url, **opts)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- HTTP: success, headers, keep-alive ----------------------------------------------------------------


def test_write_posts_exact_headers_and_decodable_body(receiver: MockReceiver, fake_time: FakeTime) -> None:
    batch = special_batch()
    client = make_client(
        receiver.url, fake_time, headers={"X-Scope-OrgID": "tenant-1", "Authorization": "Bearer t"}
    )
    outcome = client.write(batch)
    assert outcome == WriteOutcome("written", 204, 1, "", outcome.elapsed_s)
    [got] = receiver.received
    assert got.path == "/api/v1/write"
    assert got.headers["Content-Encoding"] == "snappy"
    assert got.headers["Content-Type"] == "application/x-protobuf"
    assert got.headers["X-Prometheus-Remote-Write-Version"] == "0.1.0"
    assert got.headers["User-Agent"] == DEFAULT_USER_AGENT
    assert DEFAULT_USER_AGENT.startswith("kepler-edge-relay-cloud-ingest/")
    assert got.headers["X-Scope-OrgID"] == "tenant-1"
    assert got.headers["Authorization"] == "Bearer t"
    assert int(got.headers["Content-Length"]) == len(got.body)
    assert actual_series(unsnappy(got.body)) == expected_series(batch)
    assert fake_time.sleeps == []


def test_custom_user_agent_and_200_with_body(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(200, b'{"status":"ok"}')
    client = make_client(receiver.url, fake_time, user_agent="custom/1")
    assert client.write(special_batch()).status == "written"
    assert receiver.received[0].headers["User-Agent"] == "custom/1"


def test_keep_alive_reuses_one_connection(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.extend([Reply(204), Reply(400, b"out of order sample"), Reply(200, b"x" * 1000)])
    client = make_client(receiver.url, fake_time)
    outcomes = [client.write(special_batch()).status for _ in range(4)]
    assert outcomes == ["written", "rejected", "written", "written"]
    assert len({r.client_port for r in receiver.received}) == 1


@pytest.mark.parametrize(
    "headers",
    [
        {"Content-Type": "x"},
        {"content-encoding": "gzip"},
        {"X-Prometheus-Remote-Write-Version": "2.0.0"},
        {"User-Agent": "x"},
        {"X-Evil": "a\r\nInjected: 1"},
        {"X-Tenant": "ümlaut"},
    ],
)
def test_protocol_headers_cannot_be_overridden(headers: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        RemoteWriteClient("http://127.0.0.1:1/api/v1/write", headers=headers)


@pytest.mark.parametrize("url", ["", "127.0.0.1:9090/api/v1/write", "ftp://127.0.0.1/x", "http:///x"])
def test_bad_url_rejected_at_construction(url: str) -> None:
    with pytest.raises(ValueError):
        RemoteWriteClient(url)


# -- HTTP: retries ----------------------------------------------------------------------------------


def test_transient_statuses_retried_with_capped_backoff(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.extend(Reply(code, b"busy") for code in (500, 502, 503, 504, 408))
    batch = special_batch()
    outcome = make_client(receiver.url, fake_time).write(batch)
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 6)
    assert fake_time.sleeps == [1.0, 2.0, 4.0, 8.0, 8.0]  # ceiling doubles, capped at max_s
    bodies = {r.body for r in receiver.received}
    assert len(bodies) == 1  # every retry re-sends the identical body
    assert actual_series(unsnappy(bodies.pop())) == expected_series(batch)


def test_retry_delays_are_jittered(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.extend(Reply(500) for _ in range(6))

    class HalfRng:
        def random(self) -> float:
            return 0.5

    client = make_client(receiver.url, fake_time, backoff=Backoff(1.0, 8.0, rng=HalfRng()))
    assert client.write(special_batch()).status == "written"
    assert fake_time.sleeps == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_backoff_not_shared_between_writes(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.extend([Reply(500), Reply(500), Reply(204), Reply(500), Reply(204)])
    client = make_client(receiver.url, fake_time)
    assert client.write(special_batch()).attempts == 3
    assert client.write(special_batch()).attempts == 2
    assert fake_time.sleeps == [1.0, 2.0, 1.0]  # second write starts from initial_s again


def test_429_retry_after_seconds_honoured(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.append(Reply(429, b"slow down", {"Retry-After": "7"}))
    client = make_client(receiver.url, fake_time, backoff=Backoff(0.1, 30.0, rng=MaxRng()))
    outcome = client.write(special_batch())
    assert (outcome.status, outcome.attempts) == ("written", 2)
    assert fake_time.sleeps == [7.0]


def test_503_retry_after_http_date_honoured(receiver: MockReceiver, fake_time: FakeTime) -> None:
    retry_at = email.utils.formatdate(time.time() + 20, usegmt=True)
    receiver.script.append(Reply(503, b"", {"Retry-After": retry_at}))
    client = make_client(receiver.url, fake_time, backoff=Backoff(0.1, 60.0, rng=MaxRng()))
    assert client.write(special_batch()).status == "written"
    [delay] = fake_time.sleeps
    assert 17.0 <= delay <= 20.0


def test_retry_after_capped_by_backoff_max(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.append(Reply(429, b"", {"Retry-After": "3600"}))
    client = make_client(receiver.url, fake_time, backoff=Backoff(0.1, 5.0, rng=MaxRng()))
    assert client.write(special_batch()).status == "written"
    assert fake_time.sleeps == [5.0]


def test_retry_after_is_a_floor_not_a_ceiling(receiver: MockReceiver, fake_time: FakeTime) -> None:
    # Retry-After: 0 must not turn into a hot loop: the backoff delay still applies.
    receiver.script.extend(
        [Reply(429, b"", {"Retry-After": "0"})] * 3 + [Reply(429, b"", {"Retry-After": "x"})]
    )
    assert make_client(receiver.url, fake_time).write(special_batch()).status == "written"
    assert fake_time.sleeps == [1.0, 2.0, 4.0, 8.0]


def test_retry_after_ignored_on_other_5xx(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.append(Reply(500, b"", {"Retry-After": "7"}))
    assert make_client(receiver.url, fake_time).write(special_batch()).status == "written"
    assert fake_time.sleeps == [1.0]


def test_gives_up_after_max_retry_s(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(503, b"overloaded\n")
    outcome = make_client(receiver.url, fake_time, max_retry_s=30.0).write(special_batch())
    assert outcome.status == "retry_later"
    assert outcome.http_status == 503
    # Sleeps 1+2+4+8+8 = 23 s; another 8 s would start the next attempt after 30 s.
    assert fake_time.sleeps == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert outcome.attempts == 6 == len(receiver.received)
    assert outcome.reason.startswith("HTTP 503: overloaded (gave up after 23.0s, 6 attempts)")


def test_max_retry_zero_means_single_attempt(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(500)
    outcome = make_client(receiver.url, fake_time, max_retry_s=0.0).write(special_batch())
    assert (outcome.status, outcome.attempts, fake_time.sleeps) == ("retry_later", 1, [])


def test_stop_event_ends_retries(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(500)
    stop = threading.Event()

    def sleep_then_stop(seconds: float) -> None:
        fake_time.sleep(seconds)
        if len(fake_time.sleeps) == 2:
            stop.set()

    client = make_client(receiver.url, fake_time, stop_event=stop, sleep=sleep_then_stop)
    outcome = client.write(special_batch())
    assert (outcome.status, outcome.attempts) == ("retry_later", 2)
    assert "stopping" in outcome.reason


def test_stop_event_interrupts_a_real_backoff_sleep(receiver: MockReceiver) -> None:
    # With the default sleep, the client waits on the event: shutdown does not wait out the backoff.
    receiver.default = Reply(500)
    stop = threading.Event()
    client = RemoteWriteClient(
        receiver.url, backoff=Backoff(60.0, 60.0, rng=MaxRng()), max_retry_s=600.0, stop_event=stop
    )
    timer = threading.Timer(0.3, stop.set)
    timer.start()
    started = time.monotonic()
    outcome = client.write(special_batch())
    timer.join()
    assert outcome.status == "retry_later"
    assert time.monotonic() - started < 10.0


def test_connection_refused_is_retried_then_deferred(fake_time: FakeTime) -> None:
    url = f"http://127.0.0.1:{free_port()}/api/v1/write"  # nothing listens there any more
    outcome = make_client(url, fake_time, max_retry_s=10.0).write(special_batch())
    assert outcome.status == "retry_later"
    assert outcome.http_status is None
    assert outcome.attempts == 4  # sleeps 1, 2, 4 = 7 s; the next 8 s would end after 10 s
    assert "ConnectionError" in outcome.reason


def test_timeout_is_retried(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.extend([Reply(204, delay_s=1.0), Reply(204, delay_s=1.0)])
    client = make_client(receiver.url, fake_time, timeout_s=0.2)
    outcome = client.write(special_batch())
    assert (outcome.status, outcome.attempts) == ("written", 3)
    assert fake_time.sleeps == [1.0, 2.0]


def test_persistent_timeout_gives_up(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(204, delay_s=1.0)
    outcome = make_client(receiver.url, fake_time, timeout_s=0.1, max_retry_s=2.0).write(special_batch())
    assert (outcome.status, outcome.attempts) == ("retry_later", 2)
    assert outcome.reason.startswith("timeout")


@pytest.mark.parametrize(
    "reply",
    [
        Reply(raw=b"NOT HTTP AT ALL\r\n\r\n"),
        Reply(raw=b""),  # connection closed without a response
        Reply(raw=b"HTTP/1.1 2OO OK\r\n\r\n"),
        Reply(raw=b"\x00\xff" * 100),
        Reply(799, b"weird status"),
        Reply(500, b"x" * 10_000_000),
    ],
    ids=["not-http", "closed", "bad-status", "binary", "status-799", "500-10MB"],
)
def test_garbage_responses_are_retried(receiver: MockReceiver, fake_time: FakeTime, reply: Reply) -> None:
    receiver.script.append(reply)
    outcome = make_client(receiver.url, fake_time).write(special_batch())
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 2)
    assert fake_time.sleeps == [1.0]


def test_truncated_2xx_body_still_counts_as_written(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.script.append(Reply(200, b"partial", content_length=1000))
    outcome = make_client(receiver.url, fake_time).write(special_batch())
    assert (outcome.status, outcome.attempts) == ("written", 1)


# -- HTTP: sample-level rejections, and configuration errors that are never rejections --------------


SAMPLE_REJECTIONS = [
    (400, b"out of order sample\n"),  # Prometheus without an out-of-order window
    (400, b"out of bounds"),
    (400, b"duplicate sample for timestamp"),
    (400, b'too old sample: series {__name__="x"}'),
    (400, b"err-mimir-sample-out-of-order: the sample has been rejected"),
    (400, b"err-mimir-sample-timestamp-too-old"),
    (400, b"err-mimir-sample-duplicate-timestamp"),
    (400, b"err-mimir-too-far-in-future"),
    (409, b"OUT_OF_ORDER sample"),
    (422, b"samples out of bounds"),
]


@pytest.mark.parametrize(("code", "body"), SAMPLE_REJECTIONS)
def test_sample_level_4xx_rejected_without_retry(
    receiver: MockReceiver, fake_time: FakeTime, code: int, body: bytes
) -> None:
    receiver.default = Reply(code, body)
    config_errors: list[int] = []
    client = make_client(receiver.url, fake_time, on_config_error=config_errors.append)
    outcome = client.write(special_batch())
    reason = f"HTTP {code}: " + body.decode().strip()
    assert outcome == WriteOutcome("rejected", code, 1, reason, outcome.elapsed_s)
    assert len(receiver.received) == 1
    assert fake_time.sleeps == [] and config_errors == []


CONFIG_ERRORS = [
    (301, b""),
    (302, b""),
    (307, b""),
    (308, b""),
    (400, b"snappy: corrupt input"),  # a body the receiver cannot decode: our bug, not bad samples
    (400, b""),
    (401, b"out of order sample"),  # the status decides first: credentials, whatever the body says
    (403, b"forbidden"),
    (404, b"404 page not found"),
    (405, b"method not allowed"),
    (409, b"conflict"),
    (413, b"request entity too large"),
    (415, b"unsupported media type"),
    (422, b""),
]


@pytest.mark.parametrize(("code", "body"), CONFIG_ERRORS)
def test_configuration_errors_are_retried_counted_and_never_rejected(
    receiver: MockReceiver, fake_time: FakeTime, code: int, body: bytes
) -> None:
    """A redirect, expired credentials, a wrong URL or a size limit answer every batch of every node
    the same: rejecting would empty the fleet's spools. Retried like a 5xx, then left to the edge."""
    receiver.default = Reply(code, body, {"Location": "/elsewhere"} if code < 400 else {})
    config_errors: list[int] = []
    client = make_client(receiver.url, fake_time, max_retry_s=10.0, on_config_error=config_errors.append)
    outcome = client.write(special_batch())
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("retry_later", code, 4)
    assert outcome.reason.startswith(f"HTTP {code}: ")
    assert fake_time.sleeps == [1.0, 2.0, 4.0]  # the 5xx backoff; another 8 s would end after 10 s
    assert config_errors == [code] * 4
    # Never followed: a redirected POST silently becomes a GET.
    assert [r.path for r in receiver.received] == ["/api/v1/write"] * 4


@pytest.mark.parametrize("code", [302, 401, 404, 413])
def test_configuration_error_then_fixed_writes_the_same_body(
    receiver: MockReceiver, fake_time: FakeTime, code: int
) -> None:
    receiver.script.extend([Reply(code), Reply(code), Reply(204)])
    config_errors: list[int] = []
    client = make_client(receiver.url, fake_time, on_config_error=config_errors.append)
    outcome = client.write(special_batch())
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 3)
    assert config_errors == [code, code]
    bodies = {r.body for r in receiver.received}
    assert len(bodies) == 1


def test_configuration_errors_are_logged_as_errors_rate_limited(
    receiver: MockReceiver, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.script.extend(Reply(401, b"token expired") for _ in range(8))
    client = make_client(
        receiver.url, fake_time, backoff=Backoff(4.0, 4.0, rng=MaxRng()), warn_interval_s=10.0
    )
    with caplog.at_level(logging.DEBUG, logger="cloud_ingest.write"):
        assert client.write(special_batch()).status == "written"
    errors = [r for r in caplog.records if r.name == "cloud_ingest.write" and r.levelno == logging.ERROR]
    assert len(errors) == 3  # at t=0, 12 and 24 of 8 answers 4 s apart
    assert "HTTP 401: token expired" in errors[0].getMessage()
    assert "credentials or size limit is wrong, not the data" in errors[0].getMessage()
    assert "(2 similar warnings suppressed)" in errors[1].getMessage()


def test_configuration_error_with_empty_body(receiver: MockReceiver, fake_time: FakeTime) -> None:
    receiver.default = Reply(401)
    outcome = make_client(receiver.url, fake_time, max_retry_s=0.0).write(special_batch())
    assert outcome.status == "retry_later"
    assert outcome.reason.startswith("HTTP 401:  (gave up after")


def test_configuration_error_with_10mb_body_reads_a_bounded_prefix(
    receiver: MockReceiver, fake_time: FakeTime
) -> None:
    receiver.default = Reply(413, b"A" * 10_000_000)
    started = time.monotonic()
    outcome = make_client(receiver.url, fake_time, max_retry_s=0.0).write(special_batch())
    assert outcome.status == "retry_later"
    assert outcome.reason.startswith("HTTP 413: " + "A" * 512 + " (gave up after")
    assert time.monotonic() - started < 5.0


def test_rejection_reason_decoded_safely(receiver: MockReceiver, fake_time: FakeTime) -> None:
    prefix = b"bad\xff\xfe label \xe6\xbc\xa2\r\nInjected: 1\x00  "
    # The cause (past the 512 bytes the reason keeps) makes it a sample-level rejection.
    body = prefix + "ü".encode() * 300 + b" out of order sample"
    receiver.default = Reply(400, body)
    outcome = make_client(receiver.url, fake_time).write(special_batch())
    assert outcome.reason.startswith("HTTP 400: bad\ufffd\ufffd label 漢  Injected: 1   üü")
    assert "\n" not in outcome.reason and "\r" not in outcome.reason and "\x00" not in outcome.reason
    # 512 bytes: 31 bytes of prefix, 240 two-byte "ü" and the first byte of the next one.
    assert len(prefix) == 31
    assert outcome.reason.endswith("   " + "ü" * 240 + "\ufffd")


# -- logging ---------------------------------------------------------------------------------------------


def test_retry_warnings_are_rate_limited(
    receiver: MockReceiver, fake_time: FakeTime, caplog: pytest.LogCaptureFixture
) -> None:
    receiver.script.extend(Reply(500, b"boom") for _ in range(8))
    client = make_client(
        receiver.url, fake_time, backoff=Backoff(4.0, 4.0, rng=MaxRng()), warn_interval_s=10.0
    )
    with caplog.at_level(logging.DEBUG, logger="cloud_ingest.write"):
        assert client.write(special_batch()).status == "written"
    retry_logs = [
        r for r in caplog.records if r.name == "cloud_ingest.write" and "retrying in" in r.getMessage()
    ]
    assert len(retry_logs) == 8  # every retry is logged ...
    warnings = [r for r in retry_logs if r.levelno == logging.WARNING]
    # ... but only one WARNING per 10 s: at t=0, 12 and 24 (retries every 4 s).
    assert len(warnings) == 3
    assert "HTTP 500: boom" in warnings[0].getMessage()
    assert "(2 similar warnings suppressed)" in warnings[1].getMessage()


# -- real Prometheus -------------------------------------------------------------------------------------

PROMETHEUS = "/usr/bin/prometheus"


class PrometheusProcess:
    """A throwaway Prometheus with the remote-write receiver, on a free 127.0.0.1 port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        config.write_text("global:\n  scrape_interval: 1m\nscrape_configs: []\n")
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-remote-write-receiver",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"prometheus not ready after {timeout_s}s:\n{self.log_path.read_text()[-4000:]}")

    def query_range_vector(self, lset: Labels, at_ms: int) -> list[tuple[int, str]]:
        selector = ",".join(f"{name}={json.dumps(value)}" for name, value in lset)
        resp = requests.get(
            f"{self.url}/api/v1/query",
            params={"query": f"{{{selector}}}[1h]", "time": f"{at_ms / 1000:.3f}"},
            timeout=10,
        )
        resp.raise_for_status()
        result = resp.json()["data"]["result"]
        if not result:
            return []
        [series] = result
        assert series["metric"] == dict(lset)
        return [(round(float(t) * 1000), v) for t, v in series["values"]]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[PrometheusProcess]:
    if not os.access(PROMETHEUS, os.X_OK):
        pytest.skip(f"{PROMETHEUS} not installed")
    prom = PrometheusProcess(tmp_path)
    try:
        prom.wait_ready()
        yield prom
    finally:
        prom.stop()


@pytest.mark.integration
def test_real_prometheus_round_trip(prometheus: PrometheusProcess) -> None:
    now_ms = (int(time.time()) - 120) * 1000 + 123  # recent (head block) and not on a second boundary
    values = [math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1.7976931348623157e308, 0.1, 12345.678, -1.5]
    sets = [
        labels("rw_test_value", idx=str(i), job="kepler", instance="edge-1:9102") for i in range(len(values))
    ]
    sets.append(labels("rw_test_stale", job="kepler", note='quote " and \\ backslash'))
    stale_idx = len(values)
    batch = Batch(
        "c",
        "n",
        1,
        sets,
        [
            block(now_ms + 30_000, [*enumerate(values), (stale_idx, STALE_NAN)]),
            block(now_ms, [*((i, v + 1.0) for i, v in enumerate(values)), (stale_idx, 1.0)]),
            block(now_ms + 15_000, [*enumerate(values), (stale_idx, 2.0)]),
        ],
    )
    client = RemoteWriteClient(f"{prometheus.url}/api/v1/write", max_retry_s=10.0)
    outcome = client.write(batch)
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 1), outcome

    # Re-delivery of the same batch (the edge re-publishes when an ack is lost).  Prometheus 2.x without
    # an out-of-order window answers 400 "out of order sample" for the older samples of each series and
    # rolls the whole request back; newer receivers may accept it as duplicates.  Either way nothing
    # stored changes (checked below), but with Prometheus the caller sees "rejected" for a re-delivery.
    again = client.write(batch)
    assert again.attempts == 1
    assert again.status == "written" or (
        again.status == "rejected" and again.http_status == 400 and "out of order" in again.reason
    ), again

    at_ms = now_ms + 60_000
    for i, value in enumerate(values):
        got = prometheus.query_range_vector(sets[i], at_ms)
        expected = [(now_ms, value + 1.0), (now_ms + 15_000, value), (now_ms + 30_000, value)]
        assert [t for t, _ in got] == [t for t, _ in expected], sets[i]
        for (_, got_text), (_, want) in zip(got, expected, strict=True):
            got_value = float(got_text)
            if math.isnan(want):
                assert math.isnan(got_value)
            else:
                assert float_bits(got_value) == float_bits(want), (sets[i], got_text, want)
    # Range selectors drop stale markers; the marker ends the series for instant queries.
    assert prometheus.query_range_vector(sets[stale_idx], at_ms) == [(now_ms, "1"), (now_ms + 15_000, "2")]
    resp = requests.get(
        f"{prometheus.url}/api/v1/query",
        params={"query": "rw_test_stale", "time": f"{(now_ms + 31_000) / 1000:.3f}"},
        timeout=10,
    )
    assert resp.json()["data"]["result"] == []

    # A conflicting value for an existing timestamp is a permanent error: rejected, not retried.
    conflict = Batch("c", "n", 2, [sets[7]], [block(now_ms + 30_000, [(0, 99.0)])])
    outcome = client.write(conflict)
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("rejected", 400, 1)
    assert outcome.reason.startswith("HTTP 400: ")
    client.close()
