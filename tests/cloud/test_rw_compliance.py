"""Remote-write 1.0 client compliance (issue 5): what ``tests/cloud/test_write.py`` does not already pin.

``tests/cloud/test_write.py`` checks the protobuf encoding against the message classes (property test
included), the snappy block format with cramjam, the retry policy against a scripted receiver
(500/502/503/504/408 with capped exponential backoff and jitter, 429/503 Retry-After, no retry on a
400/409/422 naming bad samples, retries of configuration errors (3xx, 401, 403, 404, 405, 413, a 400
naming no sample), connection refused, timeouts, garbage and 10 MB bodies) and a round trip through a
real Prometheus; ``tests/cloud/test_write_too_old.py`` the "too old sample" 500. This file
adds:

- the headers a *configured* ingester sends (YAML -> settings -> ``Ingester.writer``), as a set: the
  protocol ones exact, the custom ones passed on, nothing else but HTTP's own;
- the body read with an independent, pure-Python snappy *block* decoder (not cramjam);
- whatever the ingester's decoder lets through from an untrusted payload becomes a valid WriteRequest:
  ``__name__`` present, valid metric and label names, names sorted by bytes and unique, no empty
  values, one TimeSeries per label set, timestamps strictly increasing per series (property test);
- 429 with an HTTP-date Retry-After;
- one client going through every kind of failure in a row and still writing afterwards;
- an error body trickled byte by byte must not hold the writer (read1 with a deadline);
- real Prometheus: every special value (0, -0, negatives, +-Inf, NaNs with payloads, the stale
  marker) stored bit-exact, read back raw through Prometheus' remote-read API (PromQL hides stale
  markers; remote read loses the sign of -0, so that one is read through PromQL), written to a
  Prometheus *without* an out-of-order window (so per-series order is what the receiver enforces); a
  corrupt body is a 400 naming no sample: a configuration error, retried and never rejected; a restarted
  Prometheus is written to again by the same client;
- real VictoriaMetrics: the special values, timestamps and labels, with VM's storage model (decimals
  of about 12 significant digits, plain NaN dropped, stale markers kept, no negative zero); its 400
  for a corrupt body is retried like Prometheus'.
"""

from __future__ import annotations

import email.utils
import itertools
import math
import re
import socket
import struct
import threading
import time
from array import array
from pathlib import Path

import cramjam
import pytest
import requests
from hypothesis import given, settings
from hypothesis import strategies as st

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.sinks.remote_write.client import DEFAULT_USER_AGENT, RemoteWriteClient, WriteOutcome
from cloud_ingest.sinks.remote_write.request import build_write_request, encode_body
from relay_common.backoff import Backoff
from schemas import codec
from schemas import remote_write_pb as pb
from schemas.model import STALE_NAN, STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits
from testkit.rw_mock import FakeTime, MaxRng, MockReceiver, Reply

# Fixtures, asked for by their pytest names: receiver.
from testkit.rw_mock import receiver_fixture as receiver_fixture
from testkit.rw_wire import bits_to_float, read_varint, snappy_block_decode, wire_fields, wire_timeseries
from testkit.services import Prometheus, ServiceFactory, VictoriaMetrics, free_port, wait_until
from testkit.stack import ingest_config

LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


SPECIAL_BITS = [
    0x0000000000000000,  # 0
    0x8000000000000000,  # -0
    float_bits(-1.5),
    float_bits(-1e300),
    float_bits(math.inf),
    float_bits(-math.inf),
    0x7FF8000000000000,  # Python's NaN
    0x7FF8000000000001,  # Go's math.NaN()
    0xFFF8000000000001,  # negative NaN with a payload
    STALE_NAN_BITS,
    0x0000000000000001,  # smallest subnormal
    float_bits(1.7976931348623157e308),
    float_bits(0.1),
    float_bits(12345.678),
]


def labels(**pairs: str) -> Labels:
    return tuple(sorted(pairs.items()))


def block(ts: int, values: list[float], series: list[int] | None = None) -> ScrapeBlock:
    col = array("d")
    col.frombytes(b"".join(struct.pack("<d", v) for v in values))  # NaN payloads kept
    return ScrapeBlock(ts, array("I", range(len(values)) if series is None else series), col)


def small_batch(ts_ms: int = 1_700_000_000_123, seq: int = 1) -> Batch:
    sets = [labels(__name__="rw_c", job="kepler", idx=str(i)) for i in range(3)]
    return Batch("c", "n", seq, sets, [block(ts_ms, [1.0, -2.5, STALE_NAN])])


# -- headers ----------------------------------------------------------------------------------------------


def test_configured_ingester_sends_exactly_the_remote_write_headers(
    receiver: MockReceiver, tmp_path: Path
) -> None:
    path = ingest_config(
        tmp_path,
        mqtt_port=1,  # never connected: only the writer is used
        remote_write_url=receiver.url,
        remote_write__headers={"X-Scope-OrgID": "tenant-7", "Authorization": "Bearer s3cret"},
    )
    ingester = Ingester(settings_mod.load(str(path)))
    try:
        batch = small_batch()
        assert ingester.writer.write(batch).status == "written"
    finally:
        ingester.writer.close()
        ingester.dead_letters.close()
    [seen] = receiver.received
    assert seen.path == "/api/v1/write"
    names = [name.lower() for name, _ in seen.header_items]
    assert len(names) == len(set(names)), f"a header sent twice: {seen.header_items}"
    got = {name.lower(): value for name, value in seen.header_items}
    assert got.pop("content-encoding") == "snappy"
    assert got.pop("content-type") == "application/x-protobuf"
    assert got.pop("x-prometheus-remote-write-version") == "0.1.0"
    assert got.pop("user-agent") == DEFAULT_USER_AGENT
    assert got.pop("x-scope-orgid") == "tenant-7"
    assert got.pop("authorization") == "Bearer s3cret"
    assert int(got.pop("content-length")) == len(seen.body)
    assert got.pop("host") == f"127.0.0.1:{receiver.port}"
    # What is left is HTTP's own (requests' defaults); no Transfer-Encoding, no Content-Encoding twist.
    assert set(got) <= {"accept", "accept-encoding", "connection"}, got
    assert seen.body == encode_body(batch)


# -- snappy block format, read by an independent decoder ----------------------------------------------------


def many_series_batch(n: int) -> Batch:
    sets = [
        labels(__name__="kepler_container_joules_total", container_id=f"{i:064x}", pod=f"pod-{i % 97}")
        for i in range(n)
    ]
    return Batch("c", "n", 1, sets, [block(1_700_000_000_000, [i * 0.5 for i in range(n)])])


@pytest.mark.parametrize("n_series", [1, 3, 2_000])
def test_body_is_snappy_block_format_by_an_independent_decoder(n_series: int) -> None:
    batch = many_series_batch(n_series)
    body = encode_body(batch)
    raw = build_write_request(batch)
    assert snappy_block_decode(body) == raw
    # The preamble is the uncompressed length; no framing-format stream identifier (0xff chunk).
    length, _ = read_varint(body, 0)
    assert length == len(raw)
    assert body[0] != 0xFF
    if n_series > 100:
        assert len(body) < len(raw) / 3, "label sets repeat: a real snappy block compresses them"


# -- whatever the decoder accepts is a valid WriteRequest --------------------------------------------------

_GOOD_NAMES = ["job", "instance", "Zone", "_x", "le", "a1", "__meta_x"]
_BAD_NAMES = ["0a", "a-b", "", "ü", "a.b"]
_GOOD_METRICS = ["up", "a:b", "node_cpu_seconds_total", "_m", "Kepler_W"]
_BAD_METRICS = ["0bad", "bad-name", "", "ü"]
_values = st.text(alphabet='aZ0-_ üé漢"\\', min_size=1, max_size=3)
# About one in _FLAW_ODDS label sets (and scrapes) gets a flaw; most payloads are valid.
_FLAW_ODDS = 12
_FLAWS = ["unsorted", "duplicate_name", "empty_value", "bad_name", "bad_metric", "no_metric", "dup_series"]


@st.composite
def untrusted_payloads(draw: st.DrawFn) -> bytes:
    """Payloads as an untrusted edge could send them: mostly valid, some with one flaw the encoder's
    validation would have caught (encoded with ``validate=False``)."""
    n_series = draw(st.integers(1, 5))
    labelsets: list[Labels] = []
    for i in range(n_series):
        names = draw(st.lists(st.sampled_from(_GOOD_NAMES), unique=True, max_size=4))
        pairs = [("__name__", draw(st.sampled_from(_GOOD_METRICS))), ("idx", str(i))]
        pairs += [(n, draw(_values)) for n in names]
        flaw = draw(st.sampled_from(_FLAWS)) if draw(st.integers(0, _FLAW_ODDS)) == _FLAW_ODDS // 2 else None
        if flaw == "duplicate_name":
            pairs.append(pairs[-1])
        elif flaw == "empty_value":
            pairs.append(("zz_empty", ""))
        elif flaw == "bad_name":
            pairs.append((draw(st.sampled_from(_BAD_NAMES)), "v"))
        elif flaw == "bad_metric":
            pairs[0] = ("__name__", draw(st.sampled_from(_BAD_METRICS)))
        elif flaw == "no_metric":
            pairs.pop(0)
        elif flaw == "dup_series" and labelsets:
            pairs = list(labelsets[-1])
        pairs.sort()
        if flaw == "unsorted" and len(pairs) > 1:
            pairs.reverse()
        labelsets.append(tuple(pairs))
    scrapes = []
    for _ in range(draw(st.integers(1, 3))):
        idx = draw(st.lists(st.integers(0, n_series - 1), unique=True, min_size=1))
        if draw(st.integers(0, _FLAW_ODDS)) == _FLAW_ODDS // 2:
            idx.append(idx[0])  # the same series twice in one scrape
        values = array("d", [bits_to_float(draw(st.sampled_from(SPECIAL_BITS))) for _ in idx])
        stamps = None
        if draw(st.booleans()):  # explicit per-sample timestamps, possibly equal across scrapes
            low = -1 if draw(st.integers(0, _FLAW_ODDS)) == _FLAW_ODDS // 2 else 0
            stamps = array("q", [draw(st.integers(low, 3)) * 1000 for _ in idx])
        scrapes.append(ScrapeBlock(draw(st.integers(0, 3)) * 1000, array("I", idx), values, stamps))
    batch = Batch("c", "n", 1, labelsets, scrapes)
    # v1 carries every flaw as is; v2's transforms refuse some (a series twice in one scrape).
    return codec.encode_batch(batch, validate=False, version=codec.FORMAT_V1)


@settings(max_examples=250, deadline=None)
@given(untrusted_payloads())
def test_whatever_the_decoder_accepts_becomes_a_valid_write_request(payload: bytes) -> None:
    try:
        batch = codec.decode_batch(payload)
    except codec.DecodeError:
        return  # refused: dead-lettered and acked "rejected", never written
    raw = build_write_request(batch)
    request = pb.WriteRequest()
    request.ParseFromString(raw)  # protobuf parses
    seen: set[Labels] = set()
    for ts_bytes in (value for _, value in wire_fields(raw)):
        assert isinstance(ts_bytes, bytes)
        lset, samples = wire_timeseries(ts_bytes)
        names = [n for n, _ in lset]
        assert "__name__" in names
        assert [n.encode() for n in names] == sorted({n.encode() for n in names}), names  # sorted, unique
        assert all(LABEL_NAME_RE.fullmatch(n) for n in names), names
        assert METRIC_NAME_RE.fullmatch(dict(lset)["__name__"]), lset
        assert all(v for _, v in lset), lset
        assert lset not in seen, f"{lset} sent as two TimeSeries"
        seen.add(lset)
        stamps = [t for t, _ in samples]
        assert samples and stamps[0] >= 0, stamps  # int64 ms, never negative from the codec
        assert all(a < b for a, b in itertools.pairwise(stamps)), stamps


# -- retries: 429 with an HTTP-date ------------------------------------------------------------------------


def test_429_retry_after_http_date_honoured(receiver: MockReceiver) -> None:
    fake = FakeTime()
    receiver.script.append(
        Reply(429, b"", {"Retry-After": email.utils.formatdate(time.time() + 12, usegmt=True)})
    )
    client = RemoteWriteClient(
        receiver.url, backoff=Backoff(0.1, 60.0, rng=MaxRng()), sleep=fake.sleep, clock=fake.clock
    )
    outcome = client.write(small_batch())
    assert (outcome.status, outcome.attempts) == ("written", 2)
    [delay] = fake.sleeps
    assert 9.0 <= delay <= 12.0


# -- the sender keeps going ----------------------------------------------------------------------------


def test_one_client_survives_every_kind_of_failure_in_a_row() -> None:
    fake = FakeTime()
    receiver = MockReceiver(port=free_port())  # not started yet: connection refused
    client = RemoteWriteClient(
        receiver.url,
        backoff=Backoff(1.0, 4.0, rng=MaxRng()),
        max_retry_s=10.0,
        timeout_s=0.3,
        sleep=fake.sleep,
        clock=fake.clock,
    )
    outcomes = []
    try:
        outcomes.append(client.write(small_batch(seq=1)))  # connection refused until it gives up
        receiver.start()
        receiver.script.extend([Reply(500, b"boom")] * 4)  # 5xx until it gives up
        outcomes.append(client.write(small_batch(seq=2)))
        receiver.script.append(Reply(400, b"out of order sample"))
        outcomes.append(client.write(small_batch(seq=3)))
        receiver.script.extend([Reply(413, b"E" * 2_000_000)] * 4)  # huge error body, until it gives up
        outcomes.append(client.write(small_batch(seq=4)))
        receiver.script.extend([Reply(503), Reply(204, delay_s=1.0), Reply(502, b""), Reply(200, b"{}")])
        outcomes.append(client.write(small_batch(seq=5)))  # empty 503, timeout, empty 502, then 200
        outcomes.append(client.write(small_batch(seq=6)))  # and the next batch just goes through
    finally:
        client.close()
        receiver.stop()
    got = [(o.status, o.http_status, o.attempts) for o in outcomes]
    assert got == [
        ("retry_later", None, 4),  # sleeps 1, 2, 4; another 4 s would end after 10 s
        ("retry_later", 500, 4),
        ("rejected", 400, 1),
        ("retry_later", 413, 4),  # a configuration error: retried like a 5xx, never rejected
        ("written", 200, 4),
        ("written", 204, 1),
    ]
    assert "ConnectionError" in outcomes[0].reason
    assert outcomes[3].reason.startswith("HTTP 413: " + "E" * 512 + " (gave up after")


class TrickleReceiver:
    """Answers the first POST with a status line and a 1 MB Content-Length, then sends the body one
    byte every 0.1 s (each socket read succeeds well within any read timeout) until stopped."""

    def __init__(self, status: int) -> None:
        self.status = status
        self.stopped = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/api/v1/write"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(body) < length:
                body += conn.recv(65536)
            conn.sendall(f"HTTP/1.1 {self.status} Whatever\r\nContent-Length: 1000000\r\n\r\n".encode())
            while not self.stopped.wait(0.1):
                try:
                    conn.sendall(b"x")
                except OSError:
                    return

    def stop(self) -> None:
        self.stopped.set()
        self._listener.close()


def test_a_trickled_error_body_does_not_block_the_writer() -> None:
    trickle = TrickleReceiver(500)
    client = RemoteWriteClient(trickle.url, timeout_s=0.5, backoff=Backoff(0.1, 0.1), max_retry_s=0.0)
    outcomes: list[WriteOutcome] = []
    writer = threading.Thread(target=lambda: outcomes.append(client.write(small_batch())), daemon=True)
    try:
        writer.start()
        writer.join(3.0)  # six read timeouts
        assert outcomes, "the write is still reading the error body after 3 s (timeout_s=0.5)"
        assert outcomes[0].status == "retry_later"
    finally:
        trickle.stop()  # the server closes the connection: the blocked read ends
        writer.join(10)
        client.close()


# -- real Prometheus ---------------------------------------------------------------------------------------


def special_values_batch(t0: int) -> tuple[Batch, dict[Labels, list[tuple[int, int]]]]:
    """One series per special value: 1.0 at t0, then the value at t0+15.001 s and t0+30.002 s.
    Blocks go out newest first, so the writer must order each series; label names include an
    upper-case one ("Zone" < "__name__" < "idx" in byte order)."""
    sets = [
        labels(__name__="rw_compliance_value", idx=f"{i:02d}", Zone="pkg", job="kepler")
        for i in range(len(SPECIAL_BITS))
    ]
    special = [bits_to_float(b) for b in SPECIAL_BITS]
    t1, t2 = t0 + 15_001, t0 + 30_002
    batch = Batch("c", "n", 1, sets, [block(t2, special), block(t0, [1.0] * len(sets)), block(t1, special)])
    one = float_bits(1.0)
    expected = {
        lset: [(t0, one), (t1, bits), (t2, bits)] for lset, bits in zip(sets, SPECIAL_BITS, strict=True)
    }
    return batch, expected


def remote_read(
    prom: Prometheus, metric: str, start_ms: int, end_ms: int
) -> dict[Labels, list[tuple[int, int]]]:
    """Raw stored samples through /api/v1/read (SAMPLES response), stale markers and NaN bits included."""

    def bytes_field(number: int, payload: bytes) -> bytes:
        out = bytearray([(number << 3) | 2])
        n = len(payload)
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
        return bytes(out) + payload

    def varint_field(number: int, value: int) -> bytes:
        out = bytearray([number << 3])
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
        return bytes(out)

    matcher = varint_field(1, 0) + bytes_field(2, b"__name__") + bytes_field(3, metric.encode())  # type EQ
    query = varint_field(1, start_ms) + varint_field(2, end_ms) + bytes_field(3, matcher)
    body = bytes(cramjam.snappy.compress_raw(bytes_field(1, query)))
    resp = requests.post(
        f"{prom.url}/api/v1/read",
        data=body,
        headers={
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Read-Version": "0.1.0",
        },
        timeout=30,
    )
    assert resp.status_code == 200, resp.text[:500]
    out: dict[Labels, list[tuple[int, int]]] = {}
    for n, result in wire_fields(snappy_block_decode(resp.content)):  # ReadResponse.results
        assert n == 1 and isinstance(result, bytes)
        for m, ts in wire_fields(result):  # QueryResult.timeseries
            assert m == 1 and isinstance(ts, bytes)
            lset, samples = wire_timeseries(ts)
            out[lset] = samples
    return out


@pytest.mark.timeout(120)
def test_prometheus_stores_every_special_value_bit_exact(make_service: ServiceFactory) -> None:
    prom = make_service(Prometheus, ooo_window=None)  # per-series order is enforced by the receiver
    t0 = (int(time.time()) - 300) * 1000 + 7
    batch, expected = special_values_batch(t0)
    with RemoteWriteClient(prom.remote_write_url, max_retry_s=5.0) as client:
        outcome = client.write(batch)
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 1), outcome
    stored = remote_read(prom, "rw_compliance_value", t0 - 1, t0 + 60_000)
    assert set(stored) == set(expected), "label sets differ (names, order or values)"
    neg_zero = next(lset for lset, samples in expected.items() if samples[1][1] == 0x8000000000000000)
    wrong = [
        (dict(lset)["idx"], [(t - t0, hex(b)) for t, b in stored[lset]])
        for lset, samples in expected.items()
        if stored[lset] != samples and lset != neg_zero
    ]
    assert not wrong, wrong
    # Prometheus' remote-read encoder (gogo protobuf) omits a value that compares equal to 0, so -0
    # reads back as +0 there; the query API formats it as "-0": stored with its sign.
    assert stored[neg_zero] == [(t, b & 0x7FFFFFFFFFFFFFFF) for t, b in expected[neg_zero]]
    selector = "{" + ",".join(f'{k}="{v}"' for k, v in neg_zero) + "}"
    [(_, via_promql)] = prom.raw_samples(selector, lookback="1h", at=(t0 + 30_002) / 1000 + 1).items()
    assert [(t, float_bits(v)) for t, v in via_promql] == expected[neg_zero]
    # And PromQL sees the stale marker as the end of the series, the NaNs as NaN.
    at = (t0 + 30_002) / 1000 + 1
    live = {r["metric"]["idx"]: r["value"][1] for r in prom.query("rw_compliance_value", at=at)["result"]}
    stale_idx = f"{SPECIAL_BITS.index(STALE_NAN_BITS):02d}"
    assert stale_idx not in live and len(live) == len(SPECIAL_BITS) - 1
    assert live[f"{SPECIAL_BITS.index(0x7FF8000000000001):02d}"] == "NaN"


@pytest.mark.timeout(120)
def test_prometheus_restarted_is_written_to_again_by_the_same_client(make_service: ServiceFactory) -> None:
    prom = make_service(Prometheus)
    t0 = (int(time.time()) - 120) * 1000
    client = RemoteWriteClient(prom.remote_write_url, backoff=Backoff(0.05, 0.2), max_retry_s=1.0)
    try:
        assert client.write(small_batch(t0, seq=1)).status == "written"
        prom.stop()
        down = client.write(small_batch(t0 + 1000, seq=2))
        assert (down.status, down.http_status) == ("retry_later", None), down
        assert down.attempts >= 2
        prom.restart()  # same port and data: the pooled keep-alive connection is dead
        assert client.write(small_batch(t0 + 1000, seq=2)).status == "written"
        assert client.write(small_batch(t0 + 2000, seq=3)).status == "written"
    finally:
        client.close()
    stored = prom.raw_samples('{__name__="rw_c",idx="1"}', lookback="10m")
    assert [t for t, _ in next(iter(stored.values()))] == [t0, t0 + 1000, t0 + 2000]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["prometheus", "victoriametrics"])
def test_real_receiver_400_for_a_corrupt_body_is_retried_never_rejected(
    make_service: ServiceFactory, kind: str
) -> None:
    """A body the receiver cannot decode says nothing about the samples: deleting them would lose data
    to our own bug. A configuration error: retried, counted, and the sender keeps going."""
    service = make_service(Prometheus) if kind == "prometheus" else make_service(VictoriaMetrics)
    config_errors: list[int] = []
    client = RemoteWriteClient(
        service.remote_write_url,
        backoff=Backoff(0.05, 0.2),
        max_retry_s=0.5,
        on_config_error=config_errors.append,
    )
    try:
        corrupt = client.write_body(b"this is not snappy at all")
        assert (corrupt.status, corrupt.http_status) == ("retry_later", 400), corrupt
        assert corrupt.attempts > 1 and config_errors == [400] * corrupt.attempts
        not_protobuf = client.write_body(bytes(cramjam.snappy.compress_raw(b"\xff\xff\xff garbage")))
        assert (not_protobuf.status, not_protobuf.http_status) == ("retry_later", 400), not_protobuf
        assert client.write(small_batch((int(time.time()) - 60) * 1000)).status == "written"
    finally:
        client.close()


# -- real VictoriaMetrics ----------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_victoriametrics_stores_values_timestamps_and_labels(victoria_metrics: VictoriaMetrics) -> None:
    t0 = (int(time.time()) - 300) * 1000 + 7
    t1, t2 = t0 + 15_001, t0 + 30_002
    # VM stores a block of one series as decimals with a shared exponent: magnitudes far apart in one
    # series lose the small ones, so each series keeps one magnitude here.
    cases: list[tuple[str, float, float | None]] = [  # name, value written, value expected (None: dropped)
        ("zero", 0.0, 0.0),
        ("negative_zero", -0.0, 0.0),  # decimals have no negative zero
        ("negative", -1.5, -1.5),
        ("huge", 1.7976931348623157e308, 1.7976931348623157e308),
        ("tiny", 1e-300, 1e-300),
        ("plus_inf", math.inf, math.inf),
        ("minus_inf", -math.inf, -math.inf),
        ("nan", math.nan, None),
        ("go_nan", bits_to_float(0x7FF8000000000001), None),
        ("stale", STALE_NAN, STALE_NAN),
        ("third", 1 / 3, 1 / 3),
        ("decimal", 12345.678, 12345.678),
    ]
    sets = [labels(__name__="rw_compliance_vm", case=name, Zone="pkg", pod="ü-漢字") for name, _, _ in cases]
    first = [(v if math.isfinite(v) and v != 0 else 1.0) for _, v, _ in cases]
    written = [v for _, v, _ in cases]
    batch = Batch("c", "n", 1, sets, [block(t2, written), block(t0, first), block(t1, written)])
    with RemoteWriteClient(victoria_metrics.remote_write_url, max_retry_s=5.0) as client:
        outcome = client.write(batch)
    assert (outcome.status, outcome.http_status, outcome.attempts) == ("written", 204, 1), outcome
    victoria_metrics.flush()
    stored = wait_until(
        lambda: (
            (s := victoria_metrics.raw_samples('{__name__="rw_compliance_vm"}'))
            and len(s) == len(cases)
            and s
        ),
        timeout=30,
        message="all series in VictoriaMetrics",
    )
    for lset, (name, _, want), head in zip(sets, cases, first, strict=True):
        got = stored[frozenset(lset)]
        expected = [(t0, head)] + ([] if want is None else [(t1, want), (t2, want)])
        assert [t for t, _ in got] == [t for t, _ in expected], (name, got)
        for (_, g), (_, w) in zip(got, expected, strict=True):
            if math.isnan(w):
                assert float_bits(g) == STALE_NAN_BITS, (name, g)
            elif math.isinf(w) or w == 0:
                assert g == w, (name, g)
            else:
                assert math.isclose(g, w, rel_tol=1e-11), (name, g, w)
