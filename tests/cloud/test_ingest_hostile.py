"""Hostile input at the ingester level (issue 5): what any MQTT client may put on a batch topic.

The ingester calls ``cloud_ingest.pipeline.decode.decode(topic, payload, ...)`` once per MQTT message.
Whatever the bytes, that call must either return a batch the rest of the pipeline can trust, or raise
``Refused`` with a reason slug from ``codec.REASONS`` or one of the ingester's own
(``INGESTER_REASONS``: the topic, the node named in the payload, the clock) -- never another exception,
never unbounded memory, never a hang.

Property tests (hypothesis) feed it arbitrary bytes, mutated valid payloads (bit flips, truncation,
splices of two payloads, insertions, overwrites, trailing data), envelopes with huge length prefixes,
zstd bombs, and well-formed envelopes around hostile bodies. Only the public API is used: valid
payloads come from ``codec.encode_batch`` in every format version it offers (``version=``, when it has
it), hostile envelopes are built by hand after ``schemas/wire-format.md`` version 1, which stays
decodable whatever versions are added.

* **No other exception**: ``checked_decode`` lets anything but ``Refused`` propagate (a test failure),
  and a refusal must not come from the codec's safety net (``malformed: unhandled <Exception>``),
  which would mean the codec failed on the input rather than refusing it.
* **Bounded memory**: tracemalloc's peak over one decode stays under ``MEMORY_BOUND`` (below).
* **No hang**: every example runs under hypothesis' ``deadline`` (``DEADLINE``, far above the
  ~20 ms the largest legal batch takes here), so a slow path fails the example that found it.

The integration test at the end floods a real ``Ingester`` on a real mosquitto with a few hundred bad
payloads from one node while another node publishes valid batches into a real Prometheus.
"""

from __future__ import annotations

import inspect
import logging
import os
import random
import re
import struct
import time
import tracemalloc
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgpack
import paho.mqtt.client as mqtt
import pytest
import yaml
import zstandard
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.outcome.deadletters import REFUSED_KEPT_PER_NODE_REASON, DeadLetterStore
from cloud_ingest.pipeline.decode import Decoded, Refused, decode, pin_identity
from schemas import codec, topics
from schemas.model import Batch, Labels, ScrapeBlock
from testkit.batches import CLUSTER as INGEST_CLUSTER
from testkit.batches import METRIC, make_batch
from testkit.ingest_harness import Edge, Ingesters, as_expected, expected_samples, sample
from testkit.services import Prometheus, now_ms, wait_until

PREFIX = "edgemetrics"
CLUSTER = "c1"
NODE = "n1"
TOPIC = topics.batch_topic(PREFIX, CLUSTER, NODE)
NOW_MS = 1_700_000_000_000
MAX_FUTURE_S = 600.0

# Refusals the ingester adds to the codec's (cloud_ingest/pipeline/decode.py): a topic that is not a batch
# topic of ours, a payload naming another node/cluster than its topic, samples beyond max_future_seconds.
INGESTER_REASONS = frozenset({"bad_topic", "node_mismatch", "future_timestamp"})
ALL_REASONS = codec.REASONS | INGESTER_REASONS

# Small caps so hypothesis reaches them; the ratio body cap : payload cap is 4 (production: 32).
LIMITS = codec.Limits(
    max_payload_bytes=64 << 10,
    max_decompressed_bytes=256 << 10,
    max_series=512,
    max_samples=8192,
    max_labels_per_series=16,
    max_label_name_bytes=64,
    max_label_value_bytes=256,
    max_label_pairs=2048,
    max_scrapes=64,
)
P, D = LIMITS.max_payload_bytes, LIMITS.max_decompressed_bytes

# Peak memory of one decode (tracemalloc: what is allocated during the call; the payload itself is the
# caller's). What a decode may legitimately hold at once, each bounded by a cap: the envelope's copy of
# the compressed body (<= P); the decompressed body (<= D, plus one feed step of zstd output before the
# streaming decoder compares with the cap); msgpack's buffer holding the object being unpacked and that
# object (each <= D: one bin column may be the whole body); columns turn into arrays while the body is
# released. That is about 3 x (P + D) (test_a_bomb_at_production_limits... shows 3 x D is reached).
# Label strings are the exception to "bytes in, bytes held": a 3-byte msgpack string is a ~50-byte str,
# so they are bounded by max_label_pairs (~256 B a pair: two strs, the pair tuple, its slot in the
# label-set tuple and in the de-duplication dict), not by the byte caps. 512 KiB for the zstd context
# and interpreter noise. With LIMITS: 1.9 MiB, ~7x the body cap. The payload cap alone is the wrong
# yardstick (a legal 2 KiB payload inflates to D); the worst input found so far peaks at ~1.0 MiB
# (a stream-mode zstd bomb), a valid batch at the caps at ~0.5 MiB.
MEMORY_BOUND = 3 * (P + D) + 256 * LIMITS.max_label_pairs + (512 << 10)

# Exceptions the codec's safety net may turn into "malformed: unhandled <name>": none (msgpack's
# BufferFull for a body cut inside a map header was one, see test_a_body_cut_inside_a_map_header_...).
KNOWN_SAFETY_NET_CATCHES: frozenset[str] = frozenset()

# Generous: the largest legal batch under LIMITS decodes in ~20 ms (x3 under tracemalloc).
DEADLINE = timedelta(seconds=3)
# HOSTILE_EXAMPLES=20000 for a deeper hunt than the default run's.
PROPERTY = settings(
    deadline=DEADLINE,
    max_examples=int(os.environ.get("HOSTILE_EXAMPLES", "150")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# -- the decode call under test ------------------------------------------------------------------------


def checked_decode(payload: bytes, topic: str = TOPIC, *, limits: codec.Limits = LIMITS) -> Decoded | Refused:
    """decode() as the service calls it, returning the refusal instead of raising it.

    Any exception but ``Refused`` propagates and fails the test. Asserts the memory bound and, for an
    accepted batch, that it is what the rest of the pipeline may rely on.
    """
    tracemalloc.start()
    try:
        try:
            result: Decoded | Refused = decode(
                topic, payload, prefix=PREFIX, limits=limits, max_future_seconds=MAX_FUTURE_S, now_ms=NOW_MS
            )
        except Refused as r:
            result = r
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    if limits is LIMITS:
        assert peak <= MEMORY_BOUND, f"decode of {len(payload)} bytes peaked at {peak} B > {MEMORY_BOUND} B"
    if isinstance(result, Refused):
        assert result.reason in ALL_REASONS, f"unknown reason {result.reason!r}: {result}"
        caught = re.search(r"unhandled (\w+)", str(result))
        assert caught is None or caught.group(1) in KNOWN_SAFETY_NET_CATCHES, (
            f"the codec's safety net caught a bug: {result}"
        )
    else:
        assert_trustworthy(result, topic)
    return result


def assert_trustworthy(decoded: Decoded, topic: str) -> None:
    """An accepted batch: the topic's node, every decoder rule holds, nothing from the future."""
    cluster, node, _ = topics.parse_topic(PREFIX, topic)
    assert (decoded.cluster, decoded.node) == (cluster, node)
    batch = decoded.batch
    assert (batch.cluster, batch.node) == (cluster, node)
    codec.validate_batch(batch, LIMITS)  # raises EncodeError if any rule is broken
    assert batch.last_timestamp_ms <= NOW_MS + MAX_FUTURE_S * 1000


def refusal(payload: bytes, topic: str = TOPIC, *, limits: codec.Limits = LIMITS) -> Refused:
    result = checked_decode(payload, topic, limits=limits)
    assert isinstance(result, Refused), f"accepted a payload that should be refused: {result}"
    return result


# -- valid batches ---------------------------------------------------------------------------------------

_names = st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True).filter(lambda s: s != "__name__")
_values = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=20)
_metric = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
_value_bits = st.integers(0, 2**64 - 1)


@st.composite
def batches(draw: st.DrawFn, node: str = NODE) -> Batch:
    """Valid batches, with at most one value per series and timestamp: v1 carries duplicates (the
    writer keeps the last), v2's encoder refuses them (duplicate_sample), so they are no control."""
    labelsets: list[Labels] = []
    for _ in range(draw(st.integers(1, 6))):
        labels = draw(st.dictionaries(_names, _values, max_size=4))
        labels["__name__"] = draw(_metric)
        labelsets.append(tuple(sorted(labels.items())))
    labelsets = list(dict.fromkeys(labelsets))
    seen: set[tuple[int, int]] = set()
    blocks = []
    _stamp = st.integers(NOW_MS - 7_200_000, NOW_MS)
    for _ in range(draw(st.integers(0, 4))):
        ts = draw(_stamp)
        series = draw(st.lists(st.integers(0, len(labelsets) - 1), unique=True, max_size=len(labelsets)))
        stamps = [draw(_stamp) for _ in series] if series and draw(st.booleans()) else None
        keep = [i for i, s in enumerate(series) if (s, ts if stamps is None else stamps[i]) not in seen]
        series = [series[i] for i in keep]
        if stamps is not None:
            stamps = [stamps[i] for i in keep]
        seen |= {(s, ts if stamps is None else stamps[i]) for i, s in enumerate(series)}
        values = array("d", struct.pack(f"<{len(series)}Q", *[draw(_value_bits) for _ in series]))
        blocks.append(ScrapeBlock(ts, array("I", series), values, None if not stamps else array("q", stamps)))
    return Batch(CLUSTER, node, draw(st.integers(1, 2**63 - 1)), labelsets, blocks)


def _format_versions() -> list[int | None]:
    """Every batch format the public encoder can write (``version=``), or just its default."""
    if "version" not in inspect.signature(codec.encode_batch).parameters:
        return [None]
    return sorted({getattr(codec, f"FORMAT_V{n}") for n in range(1, 10) if hasattr(codec, f"FORMAT_V{n}")})


FORMAT_VERSIONS = _format_versions()


def encode(batch: Batch, version: int | None = None) -> bytes:
    if version is None:
        return codec.encode_batch(batch, limits=LIMITS)
    return codec.encode_batch(batch, limits=LIMITS, version=version)  # type: ignore[call-arg]


def samples_of(batch: Batch) -> list[tuple[Labels, int, bytes]]:
    """Every sample as (labels, timestamp, value bits): formats may regroup the scrape blocks."""
    return sorted(
        (batch.labelsets[s], block.sample_timestamp(i), block.values[i : i + 1].tobytes())
        for block in batch.scrapes
        for i, s in enumerate(block.series)
    )


payloads = st.builds(encode, batches(), st.sampled_from(FORMAT_VERSIONS))


@PROPERTY
@given(batches(), st.sampled_from(FORMAT_VERSIONS))
def test_valid_batches_decode_unchanged(batch: Batch, version: int | None) -> None:
    """The control: what the encoder writes (in every format it has), the ingester takes back."""
    result = checked_decode(encode(batch, version))
    assert isinstance(result, Decoded), result
    got = result.batch
    assert (got.cluster, got.node, got.seq) == (batch.cluster, batch.node, batch.seq)
    # Unchanged but for the topic's cluster and node on every series (pinned by the ingester).
    pinned, _ = pin_identity(list(batch.labelsets), CLUSTER, NODE)
    assert samples_of(got) == samples_of(Batch(batch.cluster, batch.node, batch.seq, pinned, batch.scrapes))


# -- arbitrary bytes -------------------------------------------------------------------------------------


@PROPERTY
@given(st.binary(max_size=4096))
@example(b"")
@example(codec.MAGIC)
@example(codec.MAGIC + b"\x01")
@example(codec.MAGIC + b"\x01\xc0")
@example(b"\x00" * (P + 1))
def test_arbitrary_bytes_are_refused(data: bytes) -> None:
    refusal(data)


@PROPERTY
@given(st.sampled_from([1, 2, 0, 3, 255]), st.binary(max_size=4096))
def test_arbitrary_bytes_behind_the_magic_are_refused(version: int, data: bytes) -> None:
    """Past the magic and a version byte, into the envelope (and the v2 decoder, if there is one)."""
    refusal(codec.MAGIC + bytes((version,)) + data)


@PROPERTY
@given(st.text(max_size=200), st.binary(max_size=512))
@example("edgemetrics/v1/c1/n1/status", b"")
@example("edgemetrics/v1/c1/n1/ack", b"")
@example("edgemetrics/v1/c1/n1/batch/x", b"")
@example("edgemetrics/v1//n1/batch", b"")
@example("edgemetrics/v1/c1/" + "n" * 200 + "/batch", b"")
@example("edgemetrics/v2/c1/n1/batch", b"")
@example("$share/ingest/edgemetrics/v1/c1/n1/batch", b"")
def test_any_topic_is_parsed_or_refused(topic: str, data: bytes) -> None:
    result = checked_decode(data, topic)
    if not topic.startswith(f"{PREFIX}/v1/"):
        assert isinstance(result, Refused) and result.reason == "bad_topic"


@PROPERTY
@given(payloads, st.text(max_size=40))
def test_a_valid_payload_on_a_foreign_or_broken_topic_is_refused(payload: bytes, level: str) -> None:
    topic = f"{PREFIX}/v1/{CLUSTER}/{level}/batch"
    result = checked_decode(payload, topic)
    if level != NODE:
        assert isinstance(result, Refused) and result.reason in {"bad_topic", "node_mismatch"}


# -- mutated valid payloads ------------------------------------------------------------------------------


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    payload = draw(payloads)
    kind = draw(st.sampled_from(["flip", "truncate", "splice", "insert", "overwrite", "delete", "append"]))
    data = bytearray(payload)
    if kind == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
    elif kind == "truncate":
        del data[draw(st.integers(0, len(data) - 1)) :]
    elif kind == "splice":
        other = draw(payloads)
        data = data[: draw(st.integers(0, len(data)))] + other[draw(st.integers(0, len(other))) :]
    elif kind == "insert":
        i = draw(st.integers(0, len(data)))
        data[i:i] = draw(st.binary(min_size=1, max_size=64))
    elif kind == "overwrite":
        i = draw(st.integers(0, len(data) - 1))
        chunk = draw(st.binary(min_size=1, max_size=64))
        data[i : i + len(chunk)] = chunk
    elif kind == "delete":
        i = draw(st.integers(0, len(data) - 1))
        del data[i : i + draw(st.integers(1, 64))]
    else:
        data += draw(st.one_of(st.binary(min_size=1, max_size=64), st.just(payload)))
    return bytes(data)


@PROPERTY
@given(mutated())
def test_mutated_payloads_are_refused_or_still_trustworthy(data: bytes) -> None:
    """Some mutations leave a valid batch (a flipped bit in seq); then it must pass every rule."""
    checked_decode(data)


@PROPERTY
@given(payloads, st.data())
def test_every_truncation_is_refused(payload: bytes, data: st.DataObject) -> None:
    refusal(payload[: data.draw(st.integers(0, len(payload) - 1))])


@PROPERTY
@given(payloads, payloads)
def test_two_payloads_back_to_back_are_refused(a: bytes, b: bytes) -> None:
    refusal(a + b)


# -- hand-built version-1 envelopes (schemas/wire-format.md) --------------------------------------------


def zstd_frame(raw: bytes, *, content_size: bool = True, checksum: bool = True, window_log: int = 0) -> bytes:
    """One zstd frame. With ``content_size`` it is compressed in one shot like the encoder does (size
    in the header, window fitted to it); without, in streaming mode (no size, the level's window)."""
    params = zstandard.ZstdCompressionParameters.from_level(
        3, window_log=window_log, write_content_size=content_size, write_checksum=checksum
    )
    compressor = zstandard.ZstdCompressor(compression_params=params)
    if content_size:
        return compressor.compress(raw)
    cobj = compressor.compressobj()
    return cobj.compress(raw) + cobj.flush()


def envelope(
    body: bytes,
    *,
    n: Any = 0,
    t0: Any = 0,
    t1: Any = 0,
    cluster: Any = CLUSTER,
    node: Any = NODE,
    seq: Any = 1,
    codec_name: Any = codec.CODEC_V1,
    version: int = 1,
    **extra: Any,
) -> bytes:
    header = {"cluster": cluster, "node": node, "seq": seq, "t0": t0, "t1": t1, "n": n}
    header |= {"codec": codec_name, "body": body, **extra}
    return codec.MAGIC + bytes((version,)) + msgpack.packb(header, use_bin_type=True)


def column(fmt: str, items: list[int] | list[float]) -> bytes:
    return struct.pack(f"<{len(items)}{fmt}", *items)


def scrape(t: Any, series: list[int], values: list[float] | None = None, ts: list[int] | None = None) -> dict:
    out: dict[str, Any] = {"t": t, "s": column("I", series), "v": column("d", values or [1.0] * len(series))}
    if ts is not None:
        out["ts"] = column("q", ts)
    return out


def body_envelope(labelsets: list[list[Any]], scrapes: list[dict], **header: Any) -> bytes:
    """A well-formed envelope around a (possibly hostile) body, with a header that agrees with it
    (n, t0, t1 computed like the model does) unless given, so the body's own checks are reached."""
    n = sum(len(s["v"]) // 8 for s in scrapes if isinstance(s.get("v"), bytes))
    stamps: list[int] = []
    for s in scrapes:
        ts = s.get("ts")
        if isinstance(ts, bytes) and ts and len(ts) % 8 == 0:
            stamps += struct.unpack(f"<{len(ts) // 8}q", ts)
        elif isinstance(s.get("t"), int) and not isinstance(s.get("t"), bool):
            stamps.append(s["t"])
    in_range = [t for t in stamps if 0 <= t < 2**63]
    header.setdefault("n", n)
    header.setdefault("t0", min(in_range, default=0))
    header.setdefault("t1", max(in_range, default=0))
    raw = msgpack.packb({"labelsets": labelsets, "scrapes": scrapes}, use_bin_type=True)
    return envelope(zstd_frame(raw), **header)


def flat(labels: dict[str, str]) -> list[str]:
    return [part for pair in sorted(labels.items()) for part in pair]


M = ["__name__", "m"]
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
T = NOW_MS - 60_000
FAR_FUTURE = NOW_MS + int(MAX_FUTURE_S * 1000) + 1


def _too_many_pairs() -> bytes:
    sets = [flat({"__name__": "m", **{f"l{j}": f"{i}" for j in range(14)}}) for i in range(150)]
    return body_envelope(sets, [])


# (payload builder, expected reason): one example of every refusal the ingester can give.
HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    # envelope
    "empty": (lambda: b"", "truncated"),
    "magic only": (lambda: codec.MAGIC, "truncated"),
    "bad magic": (lambda: b"ERX\x01" + b"\x80", "bad_magic"),
    "unknown version": (lambda: codec.MAGIC + b"\x09\x80", "unknown_version"),
    "oversized": (lambda: codec.MAGIC + b"\x01" + b"\x00" * P, "oversized"),
    "header not a map": (lambda: codec.MAGIC + b"\x01" + msgpack.packb([1, 2]), "malformed"),
    "header lacks body": (lambda: codec.MAGIC + b"\x01" + msgpack.packb({"cluster": CLUSTER}), "malformed"),
    "duplicate header key": (
        lambda: codec.MAGIC + b"\x01\x82\xa3seq\x01\xa3seq\x02",
        "malformed",
    ),
    "trailing bytes": (lambda: envelope(zstd_frame(msgpack.packb({}))) + b"\x00", "malformed"),
    "seq 0": (lambda: body_envelope([M], [], seq=0), "bad_header"),
    "seq as bool": (lambda: body_envelope([M], [], seq=True), "malformed"),
    "seq as float": (lambda: body_envelope([M], [], seq=1.0), "malformed"),
    "seq above int64": (lambda: body_envelope([M], [], seq=2**64 - 1), "bad_header"),
    "node with a slash": (lambda: body_envelope([M], [], node="a/b"), "bad_header"),
    "node as bytes": (lambda: body_envelope([M], [], node=b"n1"), "malformed"),
    "t1 before t0": (lambda: body_envelope([M], [], t0=5, t1=4), "bad_header"),
    "negative n": (lambda: body_envelope([M], [], n=-1), "bad_header"),
    "n beyond max_samples": (lambda: body_envelope([M], [], n=LIMITS.max_samples + 1), "too_many_samples"),
    "unknown codec": (lambda: body_envelope([M], [], codec_name="msgpack+gzip"), "unknown_codec"),
    "body as str": (lambda: envelope("x" * 10), "malformed"),  # type: ignore[arg-type]
    # huge length prefixes: a length announced, not sent (msgpack asks for the data first)
    "bin32 body of 4 GiB": (
        lambda: codec.MAGIC + b"\x01\x81\xa4body\xc6\xff\xff\xff\xff" + _ZSTD_MAGIC,
        "truncated",
    ),
    "str32 node of 4 GiB": (
        lambda: codec.MAGIC + b"\x01\x81\xa4node\xdb\xff\xff\xff\xff" + b"n",
        "truncated",
    ),
    "array32 of 4G items": (
        lambda: codec.MAGIC + b"\x01\x81\xa3seq\xdd\xff\xff\xff\xff\x01",
        "limit_exceeded",
    ),
    "map32 of 4G keys": (lambda: codec.MAGIC + b"\x01\xdf\xff\xff\xff\xff\xa3seq\x01", "limit_exceeded"),
    "labelsets array of 4G": (
        lambda: envelope(zstd_frame(b"\x82\xa9labelsets\xdd\xff\xff\xff\xff")),
        "too_many_series",
    ),
    "scrapes array of 4G": (
        lambda: envelope(zstd_frame(b"\x82\xa9labelsets\x90\xa7scrapes\xdd\xff\xff\xff\xff")),
        "too_many_scrapes",
    ),
    "one label set of 4G strings": (
        lambda: envelope(zstd_frame(b"\x82\xa9labelsets\x91\xdd\xff\xff\xff\xff")),
        "limit_exceeded",
    ),
    "bin32 column of 4 GiB": (
        lambda: envelope(
            zstd_frame(b"\x82\xa9labelsets\x90\xa7scrapes\x91\x83\xa1t\x01\xa1s\xc6\xff\xff\xff\xff")
        ),
        "malformed",
    ),
    "body map of 4G keys": (lambda: envelope(zstd_frame(b"\xdf\xff\xff\xff\xff")), "malformed"),
    # compression
    "body not zstd": (lambda: envelope(b"\x00" * 64), "bad_compression"),
    "zstd frame cut short": (lambda: envelope(zstd_frame(msgpack.packb({}) * 100)[:-5]), "bad_compression"),
    "two zstd frames": (
        lambda: envelope(zstd_frame(msgpack.packb({"labelsets": [], "scrapes": []})) * 2),
        "bad_compression",
    ),
    # Frame header: single segment, 1-byte Dictionary_ID 7, content size 1; one raw block b"\x80".
    "zstd with a dictionary": (
        lambda: envelope(_ZSTD_MAGIC + bytes([0b00100001, 7, 1]) + b"\x09\x00\x00\x80"),
        "bad_compression",
    ),
    "bomb: declared size beyond the cap": (
        lambda: envelope(zstd_frame(b"\x00" * (D + 1), content_size=True)),
        "decompression_limit",
    ),
    "bomb: stream mode, 64x the cap": (
        lambda: envelope(zstd_frame(b"\x00" * (64 * D), content_size=False, window_log=17)),
        "decompression_limit",
    ),
    "bomb: window larger than the cap": (
        lambda: envelope(zstd_frame(b"\x00" * (2 * D), content_size=False, window_log=24)),
        "decompression_limit",
    ),
    "bomb: msgpack bin inflating past the cap": (
        lambda: envelope(
            zstd_frame(
                msgpack.packb({"labelsets": [M], "scrapes": [{"t": 1, "s": b"\0" * (D + 8), "v": b""}]}),
                content_size=False,
                window_log=17,
            )
        ),
        "decompression_limit",
    ),
    # body structure
    "body not a map": (lambda: envelope(zstd_frame(msgpack.packb([1]))), "malformed"),
    "body with an extra key": (
        lambda: envelope(zstd_frame(msgpack.packb({"labelsets": [], "scrapes": [], "x": 1}))),
        "malformed",
    ),
    "body lacks scrapes": (lambda: envelope(zstd_frame(msgpack.packb({"labelsets": []}))), "malformed"),
    "scrape with an extra key": (
        lambda: body_envelope([M], [{**scrape(T, [0]), "x": b""}]),
        "malformed",
    ),
    "column as list": (lambda: body_envelope([M], [{"t": T, "s": [0], "v": [1.0]}], n=1), "malformed"),
    "label set as map": (lambda: body_envelope([{"__name__": "m"}], []), "malformed"),  # type: ignore[list-item]
    "label as int": (lambda: body_envelope([["__name__", 5]], []), "malformed"),
    "odd label set": (lambda: body_envelope([["__name__", "m", "a"]], []), "malformed"),
    # labels
    "too many series": (
        lambda: body_envelope(
            [flat({"__name__": "m", "i": str(i)}) for i in range(LIMITS.max_series + 1)], []
        ),
        "too_many_series",
    ),
    "too many labels": (
        lambda: body_envelope([flat({"__name__": "m", **{f"l{j:02}": "v" for j in range(16)}})], []),
        "too_many_labels",
    ),
    "too many label pairs": (_too_many_pairs, "too_many_label_pairs"),
    "label value too long": (
        lambda: body_envelope([flat({"__name__": "m", "a": "x" * 257})], []),
        "label_too_long",
    ),
    "multi-byte label value too long": (
        lambda: body_envelope([flat({"__name__": "m", "a": "é" * 129})], []),
        "label_too_long",
    ),
    "label name too long": (
        lambda: body_envelope([flat({"__name__": "m", "a" * 65: "v"})], []),
        "label_too_long",
    ),
    "label name with a dash": (
        lambda: body_envelope([flat({"__name__": "m", "a-b": "v"})], []),
        "invalid_label_name",
    ),
    "label name with a digit first": (
        lambda: body_envelope([flat({"__name__": "m", "1a": "v"})], []),
        "invalid_label_name",
    ),
    "empty label name": (lambda: body_envelope([["", "v", "__name__", "m"]], []), "invalid_label_name"),
    "label name with NUL": (
        lambda: body_envelope([["__name__", "m", "a\x00", "v"]], []),
        "invalid_label_name",
    ),
    "metric name with a space": (lambda: body_envelope([["__name__", "m x"]], []), "invalid_metric_name"),
    "no metric name": (lambda: body_envelope([["a", "v"]], []), "missing_metric_name"),
    "empty label value": (lambda: body_envelope([["__name__", "m", "a", ""]], []), "empty_label_value"),
    "unsorted labels": (
        lambda: body_envelope([["b", "v", "a", "v", "__name__", "m"]], []),
        "unsorted_labels",
    ),
    "duplicate label name": (
        lambda: body_envelope([["__name__", "m", "a", "v", "a", "w"]], []),
        "duplicate_label_name",
    ),
    "duplicate series": (lambda: body_envelope([M, M], []), "duplicate_series"),
    # samples
    "duplicate sample": (lambda: body_envelope([M], [scrape(T, [0, 0])]), "duplicate_sample"),
    "series index out of range": (lambda: body_envelope([M], [scrape(T, [1])]), "bad_index"),
    "series index 2^32-1": (lambda: body_envelope([M], [scrape(T, [2**32 - 1])]), "bad_index"),
    "columns of different lengths": (
        lambda: body_envelope([M], [{"t": T, "s": column("I", [0]), "v": column("d", [1.0, 2.0])}]),
        "length_mismatch",
    ),
    "ts column of another length": (
        lambda: body_envelope([M], [scrape(T, [0], ts=[T, T])]),
        "length_mismatch",
    ),
    "column not a multiple of its item": (
        lambda: body_envelope([M], [{"t": T, "s": b"\x00" * 5, "v": b"\x00" * 8}], n=1),
        "length_mismatch",
    ),
    "too many samples": (
        lambda: body_envelope(
            [flat({"__name__": "m", "i": str(i)}) for i in range(512)],
            [scrape(T + k, list(range(512))) for k in range(17)],
        ),
        "too_many_samples",
    ),
    "too many scrapes": (
        lambda: body_envelope([M], [scrape(T + k, []) for k in range(65)]),
        "too_many_scrapes",
    ),
    "header n disagrees": (lambda: body_envelope([M], [scrape(T, [0])], n=2), "header_mismatch"),
    "header t1 disagrees": (lambda: body_envelope([M], [scrape(T, [0])], t1=T + 1), "header_mismatch"),
    # timestamps
    "NaN timestamp": (lambda: body_envelope([M], [scrape(float("nan"), [0])], t0=0, t1=0), "malformed"),
    "float timestamp": (lambda: body_envelope([M], [scrape(float(T), [0])], t0=T, t1=T), "malformed"),
    "bool timestamp": (lambda: body_envelope([M], [scrape(True, [0])], t0=1, t1=1), "malformed"),
    "negative timestamp": (lambda: body_envelope([M], [scrape(-1, [0])], t0=0, t1=0), "bad_timestamp"),
    "timestamp 2^63": (lambda: body_envelope([M], [scrape(2**63, [0])], t0=0, t1=0), "bad_timestamp"),
    "negative per-sample timestamp": (
        lambda: body_envelope([M], [scrape(T, [0], ts=[-5])], t0=T, t1=T),
        "bad_timestamp",
    ),
    "far-future scrape": (lambda: body_envelope([M], [scrape(FAR_FUTURE, [0])]), "future_timestamp"),
    "far-future per-sample timestamp": (
        lambda: body_envelope([M], [scrape(T, [0], ts=[2**63 - 1])]),
        "future_timestamp",
    ),
    "far-future empty scrape": (lambda: body_envelope([M], [scrape(2**63 - 1, [])]), "future_timestamp"),
    # whose batch it is
    "another node's name": (lambda: body_envelope([M], [scrape(T, [0])], node="victim"), "node_mismatch"),
    "another cluster's name": (lambda: body_envelope([M], [scrape(T, [0])], cluster="c2"), "node_mismatch"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_every_kind_of_hostile_payload_is_refused_with_its_reason(case: str) -> None:
    build, reason = HOSTILE[case]
    payload = build()
    started = time.perf_counter()
    got = refusal(payload)
    assert time.perf_counter() - started < DEADLINE.total_seconds()
    assert got.reason == reason, f"{case}: {got.reason}: {got}"


# Every refusal a version-1 payload can get (codec.REASONS when this was written, and the ingester's).
V1_REASONS = frozenset(
    {
        "truncated", "bad_magic", "unknown_version", "oversized", "limit_exceeded", "malformed",
        "bad_header", "unknown_codec", "bad_compression", "decompression_limit", "header_mismatch",
        "too_many_series", "too_many_samples", "too_many_scrapes", "too_many_labels",
        "too_many_label_pairs", "label_too_long", "invalid_label_name", "invalid_metric_name",
        "missing_metric_name", "empty_label_value", "unsorted_labels", "duplicate_label_name",
        "duplicate_series", "duplicate_sample", "bad_index", "length_mismatch", "bad_timestamp",
    }
)  # fmt: skip


def test_hostile_table_covers_every_reason() -> None:
    """Every v1 slug and every ingester reason is produced by some input above (bad_topic: the topic
    tests). Reasons a newer format adds are not required here."""
    covered = {reason for _, reason in HOSTILE.values()}
    assert V1_REASONS <= codec.REASONS
    assert covered == (V1_REASONS | INGESTER_REASONS) - {"bad_topic"}


def test_a_refusal_says_whom_to_tell() -> None:
    """A refusal after the header carries cluster, node (the topic's) and seq: the edge gets a
    "rejected" ack and stops resending; one before it carries no seq (the message is only released)."""
    r = refusal(body_envelope([M, M], [], seq=42))
    assert (r.reason, r.cluster, r.node, r.seq) == ("duplicate_series", CLUSTER, NODE, 42)
    r = refusal(body_envelope([M], [], node="victim", seq=7))
    assert (r.reason, r.cluster, r.node, r.seq) == ("node_mismatch", CLUSTER, NODE, 7)
    r = refusal(b"garbage")
    assert (r.cluster, r.node, r.seq) == (CLUSTER, NODE, None)
    r = refusal(b"garbage", "edgemetrics/v1/c1/n1/ack")
    assert (r.reason, r.seq) == ("bad_topic", None)


@pytest.mark.parametrize("raw", [b"\xde", b"\xde\x00", b"\xdf", b"\xdf\x00\x00\x00"])
def test_a_body_cut_inside_a_map_header_is_refused_by_the_codec_not_its_safety_net(raw: bytes) -> None:
    for frame in (zstd_frame(raw), zstd_frame(raw, content_size=False, checksum=False, window_log=10)):
        got = refusal(envelope(frame))
        assert got.reason == "malformed"
        assert "unhandled" not in str(got), str(got)


def test_a_bomb_at_production_limits_stays_near_the_body_cap() -> None:
    """With the shipped limits (1 MiB payload, 32 MiB body): an 8 KiB frame that inflates to 256 MiB is
    refused after at most the cap plus one feed step, and a 1 KiB payload inflating to exactly the cap
    (one 32 MiB bin) costs the body, msgpack's buffer and the object: 3 x the cap, never more."""
    limits = codec.DEFAULT_LIMITS
    cap = limits.max_decompressed_bytes
    bomb = envelope(zstd_frame(b"\x00" * (8 * cap), content_size=False, window_log=20))
    at_cap = envelope(
        zstd_frame(
            msgpack.packb(
                {"labelsets": [M], "scrapes": [{"t": 1, "s": b"", "v": b"", "x": b"\0" * (cap - 64)}]}
            )
        )
    )
    for payload, bound in ((bomb, cap + (8 << 20)), (at_cap, 3 * cap + (4 << 20))):
        assert len(payload) < 16 << 10
        tracemalloc.start()
        try:
            got = refusal(payload, limits=limits)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert got.reason in {"decompression_limit", "malformed"}
        assert peak <= bound, f"{got.reason}: peak {peak} > {bound}"


# -- properties over hostile envelopes -------------------------------------------------------------------

_huge = st.sampled_from([2**16, 2**31 - 1, 2**31, 2**32 - 1])


@PROPERTY
@given(
    st.sampled_from([b"\xc6", b"\xdb", b"\xdd", b"\xdf", b"\xc5", b"\xda", b"\xdc", b"\xde", b"\xc9"]),
    _huge,
    st.sampled_from(["envelope", "header value", "body", "label set", "scrape", "column"]),
    st.binary(max_size=64),
)
def test_huge_length_prefixes_are_refused_before_allocation(
    marker: bytes, length: int, where: str, tail: bytes
) -> None:
    """A container or string announcing up to 4G entries/bytes, wherever it may sit."""
    width = {b"\xc5": 2, b"\xda": 2, b"\xdc": 2, b"\xde": 2}.get(marker, 4)
    if marker == b"\xc9":  # ext32: length then type byte
        prefix = marker + struct.pack(">I", length) + b"\x01"
    else:
        prefix = marker + (length % (1 << (8 * width))).to_bytes(width, "big")
    hostile = prefix + tail
    if where == "envelope":
        payload = codec.MAGIC + b"\x01" + hostile
    elif where == "header value":
        payload = codec.MAGIC + b"\x01\x82\xa4node\xa2n1\xa3seq" + hostile
    else:
        raw = {
            "body": hostile,
            "label set": b"\x82\xa9labelsets\x91" + hostile,
            "scrape": b"\x82\xa9labelsets\x90\xa7scrapes\x91" + hostile,
            "column": b"\x82\xa9labelsets\x90\xa7scrapes\x91\x83\xa1t\x01\xa1v" + hostile,
        }[where]
        payload = envelope(zstd_frame(raw))
    refusal(payload)


@PROPERTY
@given(
    raw=st.binary(max_size=256),
    size=st.one_of(st.integers(0, 2 * D), st.sampled_from([D - 1, D, D + 1, 4 * D, 16 * D])),
    content_size=st.booleans(),
    checksum=st.booleans(),
    window_log=st.sampled_from([0, 10, 17, 20, 23, 27]),
    cut=st.integers(0, 8),
    compressible=st.booleans(),
)
def test_zstd_frames_of_any_shape_are_bounded(
    raw: bytes, size: int, content_size: bool, checksum: bool, window_log: int, cut: int, compressible: bool
) -> None:
    """Frames up to 16x the body cap, with or without a declared size, any window, maybe cut short."""
    content = (raw or b"\0") * (size // max(len(raw), 1)) if compressible else raw
    frame = zstd_frame(content, content_size=content_size, checksum=checksum, window_log=window_log)
    assume(len(frame) < P - 200)
    if cut:
        frame = frame[:-cut]
    refusal(envelope(frame))


_label_names = st.one_of(
    st.sampled_from(["__name__", "a", "b", "job", "node", "", "1x", "a-b", "a" * 65, "é", "a\x00"]),
    st.text(max_size=8),
)
_label_values = st.one_of(
    st.sampled_from(["m", "", "x" * 257, "é" * 200, "m x", "1m"]),
    st.text(max_size=12),
)
_msgpack_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.binary(max_size=32),
)


@st.composite
def hostile_scrapes(draw: st.DrawFn, n_labelsets: int) -> dict:
    count = draw(st.integers(0, 6))
    series = draw(
        st.lists(
            st.integers(0, max(n_labelsets + 1, 2**32 - 1 if draw(st.booleans()) else 3)), max_size=count
        )
    )
    out: dict[str, Any] = {
        "t": draw(
            st.one_of(
                st.integers(NOW_MS - 3_600_000, NOW_MS),
                st.sampled_from([-1, 0, 2**63 - 1, 2**63, 2**64 - 1, FAR_FUTURE]),
                st.floats(allow_nan=True),
                st.booleans(),
            )
        ),
        "s": column("I", [s % 2**32 for s in series]),
        "v": column(
            "d", [1.0] * draw(st.sampled_from([len(series), len(series) + 1, max(len(series) - 1, 0)]))
        ),
    }
    if draw(st.booleans()):
        out["ts"] = column(
            "q",
            [
                draw(
                    st.one_of(
                        st.integers(NOW_MS - 3_600_000, NOW_MS), st.sampled_from([-1, 2**63 - 1, FAR_FUTURE])
                    )
                )
                for _ in range(len(series))
            ],
        )
    if draw(st.integers(0, 9)) == 0:
        out[draw(st.sampled_from(["s", "v", "ts", "t", "x"]))] = draw(_msgpack_scalars)
    return out


@st.composite
def hostile_bodies(draw: st.DrawFn) -> bytes:
    labelsets: list[Any] = []
    for _ in range(draw(st.integers(0, 5))):
        pairs = draw(st.lists(st.tuples(_label_names, _label_values), max_size=5))
        if draw(st.booleans()):
            pairs.append(("__name__", draw(_metric)))
        if draw(st.booleans()):
            pairs.sort()
        labelsets.append([part for pair in pairs for part in pair])
    if labelsets and draw(st.integers(0, 4)) == 0:
        labelsets.append(list(draw(st.sampled_from(labelsets))))  # a duplicate series
    scrapes = [draw(hostile_scrapes(len(labelsets))) for _ in range(draw(st.integers(0, 4)))]
    header: dict[str, Any] = {}
    if draw(st.integers(0, 4)) == 0:
        header[draw(st.sampled_from(["node", "cluster", "seq", "n", "t0", "t1", "codec_name"]))] = draw(
            st.one_of(_msgpack_scalars, st.sampled_from(["victim", "c2", NODE, CLUSTER]))
        )
    return body_envelope(labelsets, scrapes, **header)


@PROPERTY
@given(hostile_bodies())
def test_hostile_bodies_in_valid_envelopes(payload: bytes) -> None:
    """Near-valid bodies with any mix of label, index, column, timestamp and header faults. Most are
    refused; the few that happen to be legal must pass every rule (checked_decode does)."""
    checked_decode(payload)


_objects = st.recursive(
    _msgpack_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@PROPERTY
@given(
    st.dictionaries(
        st.sampled_from(["labelsets", "scrapes", "x"]),
        _objects,
        max_size=3,
    ),
    st.dictionaries(
        st.sampled_from(["cluster", "node", "seq", "t0", "t1", "n", "codec", "body", "extra"]),
        _objects,
        max_size=4,
    ),
)
def test_arbitrary_msgpack_bodies_and_headers(body: dict, header_overrides: dict) -> None:
    raw = msgpack.packb(body, use_bin_type=True)
    header: dict[str, Any] = {"cluster": CLUSTER, "node": NODE, "seq": 1, "t0": 0, "t1": 0, "n": 0}
    header |= {"codec": codec.CODEC_V1, "body": zstd_frame(raw)} | header_overrides
    checked_decode(codec.MAGIC + b"\x01" + msgpack.packb(header, use_bin_type=True))


# -- integration: a flood from a hostile node next to a good node ------------------------------------------

GOOD = "good-node"
HOSTILE_NODE = "hostile-node"
# A topic level the broker accepts and the ingester refuses (longer than topics.MAX_NAME_BYTES).
BAD_TOPIC = f"{PREFIX}/v1/{INGEST_CLUSTER}/{'x' * (topics.MAX_NAME_BYTES + 1)}/batch"


def _garbage(rng: random.Random, base_ms: int) -> Iterator[tuple[str, bytes]]:
    """(topic, payload) of many kinds; all on the hostile node's batch topic but the bad-topic ones."""
    topic = topics.batch_topic(PREFIX, INGEST_CLUSTER, HOSTILE_NODE)

    def valid(seq: int, ts: int = base_ms, node: str = HOSTILE_NODE) -> bytes:
        return encode(make_batch(node, seq, ts, series=rng.randint(1, 6)), rng.choice(FORMAT_VERSIONS))

    for _ in range(40):
        yield topic, rng.randbytes(rng.randint(0, 2000))
    for _ in range(40):
        yield topic, codec.MAGIC + bytes((rng.choice([1, 2, 7]),)) + rng.randbytes(rng.randint(0, 600))
    for i in range(40):
        p = valid(1000 + i)
        yield topic, p[: rng.randint(0, len(p) - 1)]
    for i in range(40):
        p = bytearray(valid(2000 + i))
        for _ in range(rng.randint(1, 6)):
            p[rng.randrange(len(p))] ^= 1 << rng.randrange(8)
        yield topic, bytes(p)
    for i in range(30):
        a, b = valid(3000 + i), valid(4000 + i)
        yield topic, a[: rng.randrange(len(a))] + b[rng.randrange(len(b)) :]
    for i in range(20):  # impersonation: the good node's name, on the hostile node's topic
        yield topic, valid(5000 + i, node=GOOD)
    for i in range(20):
        yield topic, valid(6000 + i, ts=int(time.time() * 1000) + 3_600_000)
    for i in range(6):
        cap = codec.DEFAULT_LIMITS.max_decompressed_bytes
        yield (
            topic,
            envelope(
                zstd_frame(b"\0" * (2 * cap), content_size=i % 2 == 0, window_log=20),
                node=HOSTILE_NODE,
                cluster=INGEST_CLUSTER,
            ),
        )
    for _ in range(3):
        yield topic, codec.MAGIC + b"\x01" + rng.randbytes(codec.DEFAULT_LIMITS.max_payload_bytes)
    for name in HOSTILE:
        # The table's payloads are for node n1 in cluster c1: re-home them by swapping the names.
        payload = HOSTILE[name][0]()
        yield (
            topic,
            payload.replace(b"\xa2c1", b"\xa4test").replace(b"\xa2n1", b"\xac" + HOSTILE_NODE.encode()),
        )
    for i in range(10):
        yield BAD_TOPIC, valid(7000 + i)


def test_a_flood_of_garbage_does_not_disturb_a_good_node(
    prometheus: Prometheus, edge: Edge, ingesters: Ingesters, caplog: pytest.LogCaptureFixture
) -> None:
    """Real mosquitto, the real ingester (in-process, shipped defaults: 2 workers, 1 MiB payloads), real
    Prometheus. One node publishes ~320 bad payloads of ~25 kinds (random bytes, mutated and spliced
    batches of both formats, another node's batches, future samples, zstd bombs, oversized payloads,
    every hostile body of HOSTILE, a topic the ingester refuses), another node 20 valid batches in
    between. What the ingester must make of each bad payload is computed first with the same decode().

    Every valid sample of the good node is in Prometheus and acknowledged; nothing of the hostile node
    is; refusals are counted by reason exactly (cloud_ingest_batches_refused_total, and per node); the
    hostile node gets its "rejected" acks; the ingester logs each (node, reason) once, not per message.
    """
    caplog.set_level(logging.INFO, logger="cloud_ingest")
    ingester = ingesters.start(prometheus.remote_write_url, "hostile")
    s = ingester.settings
    rng = random.Random(20240505)
    base = now_ms() - 15 * 60_000

    # What the ingester should make of each bad payload: the same decode, run here first.
    garbage: list[tuple[str, bytes, Refused]] = []
    for topic, payload in _garbage(rng, base):
        try:
            decode(
                topic,
                payload,
                prefix=s.topic_prefix,
                limits=s.limits,
                max_future_seconds=s.max_future_seconds,
            )
        except Refused as r:
            garbage.append((topic, payload, r))
    assert len(garbage) >= 300
    expected_reasons = Counter(r.reason for _, _, r in garbage)
    assert len(expected_reasons) >= 15, expected_reasons

    good = [make_batch(GOOD, seq, base + 5_000 * seq, series=4) for seq in range(1, 21)]
    every = len(garbage) // len(good)
    for i, (topic, payload, _) in enumerate(garbage):
        if i % every == 0 and i // every < len(good):
            edge.publish_batch(good[i // every])
        edge.publish(topic, payload)
    for batch in good[len(garbage) // every :]:
        edge.publish_batch(batch)

    for batch in good:
        assert edge.wait_result(GOOD, batch.seq, timeout=60).result == "ok"
    wait_until(
        lambda: sample(ingester, "cloud_ingest_messages_total", outcome="refused") >= len(garbage),
        60,
        message="every bad payload handled",
    )

    # Every valid sample of the good node is in Prometheus, nothing of the hostile node is.
    stored = as_expected(prometheus.raw_samples(f'{{__name__="{METRIC}",node="{GOOD}"}}'))
    assert stored == expected_samples(*good)
    assert prometheus.raw_samples(f'{{node="{HOSTILE_NODE}"}}') == {}
    assert sample(ingester, "cloud_ingest_samples_written_total", node=GOOD) == sum(
        b.sample_count for b in good
    )
    assert sample(ingester, "cloud_ingest_samples_written_total", node=HOSTILE_NODE) == 0

    # Refusals counted by reason, exactly.
    assert sample(ingester, "cloud_ingest_messages_total", outcome="refused") == len(garbage)
    for reason, count in expected_reasons.items():
        assert sample(ingester, "cloud_ingest_batches_refused_total", reason=reason) == count, reason
    hostile_count = sum(1 for _, _, r in garbage if r.node == HOSTILE_NODE)
    assert (
        sample(ingester, "cloud_ingest_node_batches_refused_total", cluster=INGEST_CLUSTER, node=HOSTILE_NODE)
        == hostile_count
    )
    # Refusals with a seq were answered "rejected" on the hostile node's ack topic (so it stops resending).
    # The counter moves before the ack is published: the last acks may still be on their way.
    expected_rejected = sum(1 for _, _, r in garbage if r.seq is not None and r.node == HOSTILE_NODE)

    def rejected() -> int:
        return sum(1 for r in edge.results(HOSTILE_NODE) if r.result == "rejected")

    wait_until(lambda: rejected() >= expected_rejected, 30, message="every rejected ack received")
    assert rejected() == expected_rejected
    assert edge.results(GOOD) == [codec.AckResult(b.seq, "ok") for b in good]

    # Logged once per node and reason, not once per message; no unexpected exception.
    records = [rec for rec in caplog.records if rec.name == "cloud_ingest"]
    assert not [rec for rec in records if "unexpected error" in rec.getMessage()]
    refusal_logs = Counter(
        (m.group(1), m.group(2))
        for rec in records
        if (m := re.match(r"refused batch on (\S+): .*further (\S+) refusals", rec.getMessage(), re.S))
    )
    topic_node = {topic: r.node for topic, _, r in garbage}
    logged = Counter((topic_node[topic], reason) for (topic, reason) in refusal_logs.elements())
    expected_keys = {(r.node, r.reason) for _, _, r in garbage}
    assert set(logged) == expected_keys
    assert all(count == 1 for count in logged.values()), logged
    assert len(records) < len(garbage) // 4, "the ingester logs per message"


def test_a_flooding_node_cannot_grow_the_dead_letter_store_without_bound(tmp_path: Path) -> None:
    config = tmp_path / "ingest.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "remote_write": {"url": "http://127.0.0.1:9/api/v1/write"},
                "dead_letter": {"path": str(tmp_path / "dead.db")},
                "metrics": {"listen": ""},
            }
        )
    )
    ingester = Ingester(settings_mod.load(str(config)))  # not started: handle() is what a worker runs
    flood = 300
    rng = random.Random(7)
    try:
        for mid in range(1, flood + 1):
            message = mqtt.MQTTMessage(mid=mid, topic=topics.batch_topic(PREFIX, CLUSTER, "flooder").encode())
            message.qos = 1
            message.payload = rng.randbytes(64 << 10)
            assert ingester.batches.handle(message) == "refused"
        assert sample(ingester, "cloud_ingest_batches_refused_total", reason="bad_magic") == flood
        kept = ingester.dead_letters.list(limit=10 * flood)
        assert len(kept) == REFUSED_KEPT_PER_NODE_REASON, f"{len(kept)} dead letters kept"
        assert all(
            d.reason.startswith("bad_magic: ") and "bad_magic: bad_magic" not in d.reason for d in kept
        )
        # the cap survives a restart of the store (it counts what is already there)
        ingester.dead_letters.close()
        ingester.dead_letters = DeadLetterStore(tmp_path / "dead.db")
        assert not ingester.dead_letters.keep_refused("flooder", "bad_magic")
        assert ingester.dead_letters.keep_refused("other-node", "bad_magic")
    finally:
        ingester.dead_letters.close()
        ingester.writer.close()


def test_batches_all_in_the_future_are_kept_every_one_and_held_when_the_store_is_full(tmp_path: Path) -> None:
    """A relay whose clock runs hours fast: every sample of its batches is beyond ``max_future_seconds``.
    They are valid data (replayable once their time has come), not garbage: every batch is
    dead-lettered, beyond the few kept of an invalid payload's kind; once the store is full, a batch
    is not acknowledged (the edge keeps its copy) rather than acked ``rejected`` into nothing."""
    config = tmp_path / "ingest.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "remote_write": {"url": "http://127.0.0.1:9/api/v1/write"},
                "dead_letter": {"path": str(tmp_path / "dead.db"), "max_bytes": 256 * 1024},
                "metrics": {"listen": ""},
            }
        )
    )
    ingester = Ingester(settings_mod.load(str(config)))  # not started: handle() is what a worker runs
    ahead_ms = now_ms() + 3 * 3_600_000
    topic = topics.batch_topic(PREFIX, INGEST_CLUSTER, "fast-clock").encode()

    def message(seq: int, blob_bytes: int = 0) -> mqtt.MQTTMessage:
        m = mqtt.MQTTMessage(mid=seq, topic=topic)
        m.qos = 1
        batch = make_batch("fast-clock", seq, ahead_ms, cluster=INGEST_CLUSTER, blob_bytes=blob_bytes)
        m.payload = codec.encode_batch(batch, version=codec.FORMAT_V2)
        return m

    acked: list[int] = []
    released: list[int] = []
    ingester.acker.ack = lambda msg, answer: acked.append(answer.seq)  # type: ignore[method-assign]
    ingester.acker.release = lambda msg: released.append(msg.mid)  # type: ignore[method-assign]
    try:
        many = 2 * REFUSED_KEPT_PER_NODE_REASON + 5
        assert [ingester.batches.handle(message(seq)) for seq in range(1, many + 1)] == ["refused"] * many
        kept = ingester.dead_letters.list(limit=10 * many)
        assert sorted(d.seq for d in kept) == list(range(1, many + 1))
        assert all(d.reason.startswith("future_timestamp: ") for d in kept)
        assert acked == list(range(1, many + 1)) and released == []
        # The store full (incompressible labels fill it): held, not acked.
        outcomes = [
            ingester.batches.handle(message(seq, blob_bytes=1000)) for seq in range(many + 1, many + 80)
        ]
        assert "dead_letter_full" in outcomes
        full = [many + 1 + i for i, o in enumerate(outcomes) if o == "dead_letter_full"]
        assert released == full and not set(full) & set(acked)
        assert sample(ingester, "cloud_ingest_dead_letter_overflow_total", reason="future_timestamp") == len(
            full
        )
    finally:
        ingester.dead_letters.close()
        ingester.writer.close()
