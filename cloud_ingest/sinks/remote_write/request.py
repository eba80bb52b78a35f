"""The remote-write 1.0 request of a batch: a hand-encoded ``prometheus.WriteRequest``, snappy block
format (``cloud_ingest/sinks/remote_write/client.py`` POSTs it).
"""

from __future__ import annotations

from itertools import chain
from operator import itemgetter

import cramjam

from schemas.model import Batch, Labels

# ---------------------------------------------------------------------------------------------------
# Protobuf encoding
#
# WriteRequest is encoded by hand rather than through the message classes in schemas.remote_write_pb:
# building Label/Sample sub-messages through the protobuf API (upb) measured ~2.5x slower (7.2 vs
# 2.9 us/sample for 20k series x 9 labels x 1 scrape), and this runs for every batch.  The wire format
# used is tiny (length-delimited sub-messages, one fixed64 double, one varint int64) and
# tests/cloud/test_write.py checks the output is byte-identical to what the message classes serialize, then
# decodes it with them.  Like the official serializer we omit proto3 fields equal to their default
# (empty string, 0 timestamp, +0.0 value by bit pattern, so -0.0 and every NaN payload are kept).
# ---------------------------------------------------------------------------------------------------

_VARINT1 = [bytes((i,)) for i in range(128)]
_ZERO8 = bytes(8)
_TAG_TIMESERIES = b"\x0a"  # WriteRequest.timeseries = 1, length-delimited
_TAG_LABEL = b"\x0a"  # TimeSeries.labels = 1
_TAG_SAMPLE = b"\x12"  # TimeSeries.samples = 2
_TAG_LABEL_NAME = b"\x0a"  # Label.name = 1
_TAG_LABEL_VALUE = b"\x12"  # Label.value = 2
_TAG_SAMPLE_VALUE = b"\x09"  # Sample.value = 1, fixed64
_TAG_SAMPLE_TS = b"\x10"  # Sample.timestamp = 2, varint


def _varint(n: int) -> bytes:
    if 0 <= n < 0x80:
        return _VARINT1[n]
    if n < 0:
        n += 1 << 64  # int64 on the wire: two's complement, always 10 bytes
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_bytes(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _encode_pair(pair: tuple[str, str]) -> bytes:
    name = pair[0].encode()
    value = pair[1].encode()
    label = (_field_bytes(_TAG_LABEL_NAME, name) if name else b"") + (
        _field_bytes(_TAG_LABEL_VALUE, value) if value else b""
    )
    return _field_bytes(_TAG_LABEL, label)


# A Sample is at most a tag and a one-byte length, the value (tag + fixed64) and the timestamp (tag +
# a 10-byte varint); a TimeSeries adds a tag and its length (5 bytes up to 32 GiB); a Label three tags
# and three lengths.
_MAX_SAMPLE_BYTES = 2 + 9 + 11
_MAX_SERIES_HEAD_BYTES = 1 + 5
_MAX_LABEL_HEAD_BYTES = 3 * (1 + 5)


def request_size_bound(
    batch: Batch,
    cap: int | None = None,
    *,
    max_pair_bytes: int | None = None,
    labels_cache: LabelBytes | None = None,
) -> int:
    """An upper bound of ``len(build_write_request(batch))``, without building the request.

    A batch names each label string once (v2: once per batch, in a dictionary), the request once per
    series, so a small batch can stand for a huge request; the ingester refuses one whose bound is over
    its limit before building it (``cloud_ingest.pipeline.decode``). With a ``cap``, the first of three bounds
    that is within it is returned, each dearer and tighter than the one before: every pair at
    ``max_pair_bytes`` (the codec's name + value limits; one step per series), every label character
    at 4 bytes (the most UTF-8 takes; one step per string, ~20 ns), and the exact labels (every
    distinct pair encoded once to measure it, a dict lookup per pair). With a ``labels_cache`` whose
    first label set is known (a v3 node's live series: ``LabelBytes``), the second bound takes the
    cached label sets at their encoded size, one lookup per series (19,000 Kepler-like series: about
    4 ms against 19 for every character).
    """
    labelsets = batch.labelsets
    fixed = _MAX_SERIES_HEAD_BYTES * len(labelsets) + _MAX_SAMPLE_BYTES * batch.sample_count
    if cap is not None:
        pairs = sum(map(len, labelsets))
        if max_pair_bytes is not None:
            loose = fixed + (max_pair_bytes + _MAX_LABEL_HEAD_BYTES) * pairs
            if loose <= cap:
                return loose
        if labels_cache is not None and labelsets and labels_cache.get(labelsets[0]) is not None:
            quick = fixed + _known_labels_bound(labelsets, labels_cache)
        else:
            quick = fixed + _chars_bound(labelsets, pairs)
        if quick <= cap:
            return quick
    sizes: dict[tuple[str, str], int] = {}
    get = sizes.get
    total = fixed
    for labels in labelsets:
        for pair in labels:
            size = get(pair)
            if size is None:
                size = sizes[pair] = len(_encode_pair(pair))
            total += size
    return total


def _chars_bound(labelsets: list[Labels], pairs: int) -> int:
    """The label sets' encoded size at most (``pairs``: their labels): 4 bytes a character, every
    label's tags and lengths."""
    chars = sum(map(len, chain.from_iterable(chain.from_iterable(labelsets))))
    return 4 * chars + _MAX_LABEL_HEAD_BYTES * pairs


def _known_labels_bound(labelsets: list[Labels], labels_cache: LabelBytes) -> int:
    """``_chars_bound``, with the label sets ``labels_cache`` holds at their exact encoded size."""
    get = labels_cache.get
    total = 0
    unknown: list[Labels] = []
    for labels in labelsets:
        known = get(labels)
        if known is None:
            unknown.append(labels)
        else:
            total += len(known)
    return total + _chars_bound(unknown, sum(map(len, unknown)))


def _sample_tail(timestamp_ms: int) -> bytes:
    return _TAG_SAMPLE_TS + _varint(timestamp_ms) if timestamp_ms else b""


_Entry = tuple[int, bytes]  # (timestamp, encoded TimeSeries.samples field)


class LabelBytes:
    """Encoded labels of recently written label sets, by identity.

    A v3 node's stream dictionary hands out the same label-set objects frame after frame, so with this
    cache a live series' labels are encoded once, not once per request: one dict hit by ``id`` instead
    of a lookup per pair (a request of 19,000 Kepler-like series took about 280 ms to build without
    it, 55 ms with it). A label set decoded afresh (v1, v2) is a new object and never hits. Bounded by bytes:
    two generations of at most ``max_bytes / 2`` each, a hit moves an entry to the newer one. Each entry
    holds its label set, so its ``id`` cannot be reused while it is here. Label sets that encode to
    more than ``max_entry_bytes`` are left out, so that a long value shared by many series is never
    copied once per series (see ``build_write_request``). Safe to share between threads: a race
    loses an entry at worst."""

    ENTRY_OVERHEAD = 150  # the dict slot, the tuple, the bytes object's header

    def __init__(self, max_bytes: int, max_entry_bytes: int = 1024) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._new: dict[int, tuple[Labels, bytes]] = {}
        self._old: dict[int, tuple[Labels, bytes]] = {}
        self._new_bytes = 0

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def get(self, labels: Labels) -> bytes | None:
        key = id(labels)
        hit = self._new.get(key)
        if hit is None:
            hit = self._old.pop(key, None)
            if hit is None:
                return None
            self._keep(key, hit)
        return hit[1] if hit[0] is labels else None

    def put(self, labels: Labels, encoded: bytes) -> None:
        if len(encoded) <= self.max_entry_bytes:
            self._keep(id(labels), (labels, encoded))

    def _keep(self, key: int, entry: tuple[Labels, bytes]) -> None:
        self._new[key] = entry
        self._new_bytes += len(entry[1]) + self.ENTRY_OVERHEAD
        if self._new_bytes > self.max_bytes // 2:
            self._old, self._new, self._new_bytes = self._new, {}, 0


def build_write_request(batch: Batch, labels_cache: LabelBytes | None = None) -> bytes:
    """Serialized ``prometheus.WriteRequest`` for ``batch``.

    One TimeSeries per label set that has samples, in label-set table order.  Samples of a series are
    gathered from all scrape blocks and sorted by timestamp; if a series has two samples with the same
    timestamp the later one in batch order wins (Prometheus would reject the pair otherwise).
    Values are copied as raw IEEE-754 bytes, so NaN payloads (the stale marker) survive bit-exact.
    Label sets are taken as the model guarantees them: sorted, unique names, no empty values.
    The bytes are the same with a ``labels_cache`` (``LabelBytes``) or without.
    """
    labelsets = batch.labelsets
    # Indexed by series: None, one _Entry (the common case, no list allocated) or a list of them in
    # batch order.
    slots: list[_Entry | list[_Entry] | None] = [None] * len(labelsets)
    tails: dict[int, bytes] = {}
    for block in batch.scrapes:
        values = block.values
        raw = values.tobytes()
        if len(block.series) != len(values):
            raise ValueError("scrape block series and values columns differ in length")
        timestamps = block.timestamps
        if timestamps is not None and len(timestamps) != len(values):
            raise ValueError("scrape block timestamps column has the wrong length")
        if timestamps is None:
            ts = block.timestamp_ms
            tail = _sample_tail(ts)
            # A Sample is at most 1 + 8 + 1 + 10 bytes: its length is a one-byte varint.
            prefix = _TAG_SAMPLE + _VARINT1[9 + len(tail)] + _TAG_SAMPLE_VALUE
            zero_entry = (ts, _TAG_SAMPLE + _VARINT1[len(tail)] + tail)
            for i, s in enumerate(block.series):
                v = raw[8 * i : 8 * i + 8]
                entry = zero_entry if v == _ZERO8 else (ts, prefix + v + tail)
                cur = slots[s]
                if cur is None:
                    slots[s] = entry
                elif type(cur) is list:
                    cur.append(entry)
                else:
                    slots[s] = [cur, entry]  # type: ignore[list-item]
            continue
        for i, s in enumerate(block.series):
            ts = timestamps[i]
            tail = tails.get(ts)  # type: ignore[assignment]
            if tail is None:
                tail = tails[ts] = _sample_tail(ts)
            v = raw[8 * i : 8 * i + 8]
            body = tail if v == _ZERO8 else _TAG_SAMPLE_VALUE + v + tail
            entry = (ts, _TAG_SAMPLE + _VARINT1[len(body)] + body)
            cur = slots[s]
            if cur is None:
                slots[s] = entry
            elif type(cur) is list:
                cur.append(entry)
            else:
                slots[s] = [cur, entry]  # type: ignore[list-item]

    # One join of a flat list of pieces: a label pair is encoded once per batch (most pairs -- job,
    # instance, namespace -- repeat across series; a dict hit is ~3x cheaper than encoding again) and
    # every series carrying it references that one bytes object. Building each TimeSeries as bytes of
    # its own first copied every shared label value once per series, three times over, before the final
    # join copied it again: 50,000 series sharing four 4,000-byte values (an 800 MB request) peaked at
    # 1.5 GiB; now the request and a list of references (tests/cloud/test_ingest_bounds.py measures it).
    pair_cache: dict[tuple[str, str], bytes] = {}
    get_pair = pair_cache.get
    pieces: list[bytes] = []
    add = pieces.append
    for s, cur in enumerate(slots):
        if cur is None:
            continue
        samples = b"".join([e[1] for e in _order_samples(cur)]) if type(cur) is list else cur[1]  # type: ignore[index]
        head = len(pieces)
        add(b"")  # the TimeSeries tag and length, once the labels are measured
        size = len(samples)
        labels = labelsets[s]
        known = labels_cache.get(labels) if labels_cache is not None else None
        if known is not None:
            add(known)
            size += len(known)
        else:
            first = len(pieces)
            for pair in labels:
                enc = get_pair(pair)
                if enc is None:
                    enc = pair_cache[pair] = _encode_pair(pair)
                add(enc)
                size += len(enc)
            if labels_cache is not None and size - len(samples) <= labels_cache.max_entry_bytes:
                labels_cache.put(labels, b"".join(pieces[first:]))
        add(samples)
        pieces[head] = _TAG_TIMESERIES + _varint(size)
    return b"".join(pieces)


def _order_samples(samples: list[_Entry]) -> list[_Entry]:
    prev = samples[0][0]
    for ts, _ in samples[1:]:
        if ts <= prev:
            break
        prev = ts
    else:
        return samples  # already strictly increasing, the common case
    # Stable sort keeps batch order among equal timestamps, so "last one wins" is the last of a run.
    ordered = sorted(samples, key=itemgetter(0))
    result = [ordered[0]]
    for entry in ordered[1:]:
        if entry[0] == result[-1][0]:
            result[-1] = entry
        else:
            result.append(entry)
    return result


def encode_body(batch: Batch, labels_cache: LabelBytes | None = None) -> bytes:
    """HTTP body: WriteRequest compressed with snappy *block* format (remote-write 1.0 requires it;
    the framed/stream format from ``cramjam.snappy.compress`` is rejected by receivers)."""
    return bytes(cramjam.snappy.compress_raw(build_write_request(batch, labels_cache)))


# Encoded labels kept across requests (LabelBytes): 20,000 live series take about 10 MiB.
LABEL_CACHE_BYTES = 64 << 20
