"""Prometheus remote-write 1.0 output: batch -> protobuf -> snappy -> HTTP POST, with retries.

Works against Prometheus (``--web.enable-remote-write-receiver``), VictoriaMetrics and Mimir.
The outcome drives the MQTT ack: only ``written`` and ``rejected`` are acked; ``retry_later`` is not,
so the edge keeps the batch in its spool and re-publishes it.

Re-sending a batch that was already written changes nothing stored, but the answer depends on the
receiver: VictoriaMetrics accepts it; Prometheus 2.x (no out-of-order window) answers 400 "out of order
sample" for every series with more than one sample in the batch, and this client reports that as
``rejected``, like every 400 that names samples (a 400 that does not is a configuration error, retried).
"""

from __future__ import annotations

import http.client
import importlib.metadata
import logging
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import chain
from operator import itemgetter
from typing import Literal

import cramjam
import requests
import requests.adapters
import urllib3.exceptions

from cloud_ingest.answers import PERMANENT_5XX_MARKERS, RETRY_4XX, RETRY_AFTER_STATUSES, refuses_samples
from relay_common.backoff import Backoff, parse_retry_after
from relay_common.ratelimit import RateLimitedLog
from schemas.model import Batch, Labels

__all__ = [
    "DEFAULT_USER_AGENT",
    "PROTOCOL_HEADERS",
    "RemoteWriteClient",
    "WriteOutcome",
    "build_write_request",
    "check_headers",
    "encode_body",
]

log = logging.getLogger(__name__)


def _package_version() -> str:
    try:
        return importlib.metadata.version("kepler-edge-relay")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


DEFAULT_USER_AGENT = f"kepler-edge-relay-cloud-ingest/{_package_version()}"

# ---------------------------------------------------------------------------------------------------
# Protobuf encoding
#
# WriteRequest is encoded by hand rather than through the message classes in schemas.remote_write_pb:
# building Label/Sample sub-messages through the protobuf API (upb) measured ~2.5x slower (7.2 vs
# 2.9 us/sample for 20k series x 9 labels x 1 scrape), and this runs for every batch.  The wire format
# used is tiny (length-delimited sub-messages, one fixed64 double, one varint int64) and
# tests/test_write.py checks the output is byte-identical to what the message classes serialize, then
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


def request_size_bound(batch: Batch, cap: int | None = None, *, max_pair_bytes: int | None = None) -> int:
    """An upper bound of ``len(build_write_request(batch))``, without building the request.

    A batch names each label string once (v2: once per batch, in a dictionary), the request once per
    series, so a small batch can stand for a huge request; the ingester refuses one whose bound is over
    its limit before building it (``cloud_ingest.decode``). With a ``cap``, the first of three bounds
    that is within it is returned, each dearer and tighter than the one before: every pair at
    ``max_pair_bytes`` (the codec's name + value limits; one step per series), every label character
    at 4 bytes (the most UTF-8 takes; one step per string, ~20 ns), and the exact labels (every
    distinct pair encoded once to measure it, a dict lookup per pair).
    """
    labelsets = batch.labelsets
    fixed = _MAX_SERIES_HEAD_BYTES * len(labelsets) + _MAX_SAMPLE_BYTES * batch.sample_count
    if cap is not None:
        pairs = sum(map(len, labelsets))
        if max_pair_bytes is not None:
            loose = fixed + (max_pair_bytes + _MAX_LABEL_HEAD_BYTES) * pairs
            if loose <= cap:
                return loose
        chars = sum(map(len, chain.from_iterable(chain.from_iterable(labelsets))))
        quick = fixed + 4 * chars + _MAX_LABEL_HEAD_BYTES * pairs
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
            if hit is None or hit[0] is not labels:
                return None
            self._keep(key, hit)
        elif hit[0] is not labels:
            return None
        return hit[1]

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
    # 1.5 GiB; now the request and a list of references (tests/test_ingest_bounds.py measures it).
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


# ---------------------------------------------------------------------------------------------------
# HTTP client
# ---------------------------------------------------------------------------------------------------

WriteStatus = Literal["written", "retry_later", "rejected"]


@dataclass(frozen=True, slots=True)
class WriteOutcome:
    """Result of :meth:`RemoteWriteClient.write`.

    ``written``: 2xx, ack the batch.  ``rejected``: a definitive, sample-level refusal (a 400/409/422
    whose body names out-of-order, out-of-bounds, duplicate, too-old or too-far-in-the-future samples, or
    ``permanent_after`` identical 5xx naming such a cause); retrying the same bytes cannot help; ack and
    dead-letter, ``reason`` says why.  ``retry_later``: still failing after ``max_retry_s`` (or
    stopping); do not ack, the edge re-publishes.  Configuration errors (any other 3xx/4xx but 408/429:
    a redirect, 401, 403, 404, 405, 413, a 400 that names no sample ...) end as ``retry_later`` too:
    they say the receiver or our configuration is wrong, not the data, so the data must stay at the edge.
    """

    status: WriteStatus
    http_status: int | None = None
    attempts: int = 0
    reason: str = ""
    elapsed_s: float = 0.0


REASON_BODY_BYTES = 512
# Error bodies are drained up to this size so the keep-alive connection can be reused; anything
# bigger is abandoned (the connection is closed) rather than downloaded.
_MAX_DRAIN_BYTES = 64 * 1024
_POOL_MAXSIZE = 32
# Encoded labels kept across requests (LabelBytes): 20,000 live series take about 10 MiB.
LABEL_CACHE_BYTES = 64 << 20
# Set by this client on every request; a configured header of the same name (any case) is refused.
PROTOCOL_HEADERS = (
    "Content-Type",
    "Content-Encoding",
    "Content-Length",
    "X-Prometheus-Remote-Write-Version",
    "User-Agent",
)
_PROTOCOL_HEADERS = frozenset(h.lower() for h in PROTOCOL_HEADERS)
# RFC 9110 field-name (a token).
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_NETWORK_ERRORS = (
    requests.RequestException,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse extra headers this client cannot send: ValueError naming the first bad header.

    Protocol headers (``PROTOCOL_HEADERS``, any case) are the client's own; names must be HTTP tokens,
    values ASCII without control characters or leading/trailing blanks. requests and http.client
    would otherwise fail at send time, on every retry, or send something else than configured.
    """
    seen: dict[str, str] = {}
    for name, value in headers.items():
        if not isinstance(name, str) or not isinstance(value, str):
            raise ValueError(f"header {name!r}: name and value must be strings")
        if name.lower() in _PROTOCOL_HEADERS:
            raise ValueError(
                f"header {name!r} is set by the remote-write client itself and cannot be configured "
                f"(reserved: {', '.join(PROTOCOL_HEADERS)})"
            )
        if not _HEADER_NAME_RE.fullmatch(name):
            raise ValueError(f"header {name!r}: not a valid HTTP header name (letters, digits, -, _ ...)")
        if not value.isascii() or any(not c.isprintable() for c in value) or value != value.strip():
            raise ValueError(
                f"header {name!r}: the value must be printable ASCII without line breaks or "
                "leading/trailing blanks"
            )
        if name.lower() in seen:
            raise ValueError(f"header {name!r} is given twice (also as {seen[name.lower()]!r})")
        seen[name.lower()] = name


@dataclass(frozen=True, slots=True)
class _Attempt:
    kind: WriteStatus  # "retry_later" here means "retryable"
    http_status: int | None
    reason: str
    retry_after_s: float | None = None
    config_error: bool = False  # a 3xx/4xx that says the receiver or our configuration is wrong


def _printable(data: bytes) -> str:
    text = data.decode("utf-8", errors="replace")
    # Bodies end up in logs and in quarantine reasons: no raw control characters or newlines.
    return "".join(c if c.isprintable() else " " for c in text).strip()


def _shorten(text: str, limit: int = REASON_BODY_BYTES) -> str:
    text = _printable(text.encode("utf-8", errors="replace"))
    return text if len(text) <= limit else text[:limit] + "..."


class RemoteWriteClient:
    """POSTs remote-write bodies over one keep-alive ``requests.Session``.

    Never raises for HTTP or network failures; every call returns a :class:`WriteOutcome`.
    Retries 5xx, 408, 429, configuration errors (3xx/4xx that are not a sample-level rejection; each
    one is passed to ``on_config_error`` with its status and logged at ERROR, at most once per
    ``warn_interval_s``), connection errors, timeouts and unparseable responses with capped,
    jittered exponential backoff (a fresh clone of ``backoff`` per call) until ``max_retry_s`` has
    elapsed or ``stop_event`` is set (the first attempt is always made; a set event ends retries).
    For 429 and 503 a ``Retry-After`` header sets a floor on the delay, but the delay never exceeds
    ``backoff.max_s``: a server asking for an hour must not stall the ingester beyond our own retry
    ceiling (the edge keeps the data anyway).  The next attempt is not made if it would start after
    ``max_retry_s``.

    ``timeout_s`` applies to connecting and to each socket read (requests semantics), not to the whole
    exchange.  Thread-safe: worker threads may share one client (and its connection pool).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        headers: Mapping[str, str] | None = None,
        user_agent: str = DEFAULT_USER_AGENT,
        backoff: Backoff | None = None,
        max_retry_s: float = 300.0,
        session: requests.Session | None = None,
        sleep: Callable[[float], object] = time.sleep,
        stop_event: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        warn_interval_s: float = 30.0,
        permanent_after: int = 3,
        on_config_error: Callable[[int], object] | None = None,
        label_cache_bytes: int = LABEL_CACHE_BYTES,
    ) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"remote-write URL must be http(s)://host[:port]/path, got {url!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not max_retry_s >= 0:
            raise ValueError(f"max_retry_s must be >= 0, got {max_retry_s!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self.max_retry_s = float(max_retry_s)
        self.permanent_after = permanent_after
        self._headers = {
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
            "User-Agent": user_agent,
        }
        headers = headers or {}
        check_headers(headers)
        self._headers.update(headers)
        self._backoff = backoff if backoff is not None else Backoff(0.5, 30.0)
        self._owns_session = session is None
        if session is None:
            session = requests.Session()
            # Enough pooled keep-alive connections for several writer threads sharing this client.
            adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_MAXSIZE)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
        self._session = session
        self._stop_event = stop_event
        if stop_event is not None and sleep is time.sleep:
            # Sleep on the event so shutdown does not wait out a 30 s backoff.
            self._sleep: Callable[[float], object] = stop_event.wait
        else:
            self._sleep = sleep
        self._clock = clock
        self._warn = RateLimitedLog(log, warn_interval_s, clock)
        self._config_error = RateLimitedLog(log, warn_interval_s, clock, logging.ERROR)
        self._on_config_error = on_config_error
        self._labels = LabelBytes(label_cache_bytes) if label_cache_bytes else None

    @property
    def headers(self) -> dict[str, str]:
        """Headers sent with every request (a copy)."""
        return dict(self._headers)

    def close(self) -> None:
        if self._owns_session:
            self._session.close()

    def __enter__(self) -> RemoteWriteClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def write(self, batch: Batch, *, permanent_after: int | None = None) -> WriteOutcome:
        body = encode_body(batch, self._labels)
        return self.write_body(body, batch.sample_count, permanent_after=permanent_after)

    def write_body(
        self, body: bytes, samples: int = 0, *, permanent_after: int | None = None
    ) -> WriteOutcome:
        """POST an already snappy-compressed WriteRequest; ``samples`` is only used in log lines.
        ``permanent_after`` overrides the client's count of identical "never" 5xx answers (1 for the
        parts of a batch whose whole already got that answer)."""
        permanent_after = self.permanent_after if permanent_after is None else permanent_after
        backoff = self._backoff.clone()
        start = self._clock()
        attempts = 0
        permanent = 0
        while True:
            attempts += 1
            result = self._attempt(body)
            elapsed = self._clock() - start
            if result.kind == "written":
                if attempts > 1:
                    log.info("remote write to %s succeeded after %d attempts", self.url, attempts)
                return WriteOutcome("written", result.http_status, attempts, "", elapsed)
            if result.kind == "rejected":
                log.error(
                    "remote write of %d samples to %s rejected, not retrying: %s",
                    samples,
                    self.url,
                    result.reason,
                )
                return WriteOutcome("rejected", result.http_status, attempts, result.reason, elapsed)

            status = result.http_status or 0
            if result.config_error and self._on_config_error is not None:
                self._on_config_error(status)
            if status >= 500 and any(m in result.reason.lower() for m in PERMANENT_5XX_MARKERS):
                permanent += 1
                if permanent >= permanent_after:
                    reason = f"{result.reason} (answered {permanent} times: the receiver will not take it)"
                    log.error(
                        "remote write of %d samples to %s refused for good: %s", samples, self.url, reason
                    )
                    return WriteOutcome("rejected", result.http_status, attempts, reason, elapsed)
            delay = backoff.next_delay()
            if result.retry_after_s is not None:
                delay = max(delay, result.retry_after_s)
            delay = min(delay, backoff.max_s)
            if self._stopping():
                return self._give_up(result, attempts, elapsed, "stopping")
            if elapsed + delay > self.max_retry_s:
                return self._give_up(result, attempts, elapsed, f"gave up after {elapsed:.1f}s")
            if result.config_error:
                self._config_error(
                    "remote write of %d samples to %s failed (attempt %d): %s; the receiver's URL, "
                    "credentials or size limit is wrong, not the data: keeping the batch, retrying in %.2fs",
                    samples,
                    self.url,
                    attempts,
                    result.reason,
                    delay,
                )
            else:
                self._warn(
                    "remote write of %d samples to %s failed (attempt %d): %s; retrying in %.2fs",
                    samples,
                    self.url,
                    attempts,
                    result.reason,
                    delay,
                )
            self._sleep(delay)
            if self._stopping():
                return self._give_up(result, attempts, self._clock() - start, "stopping")

    def _stopping(self) -> bool:
        return self._stop_event is not None and self._stop_event.is_set()

    def _give_up(self, result: _Attempt, attempts: int, elapsed: float, why: str) -> WriteOutcome:
        reason = f"{result.reason} ({why}, {attempts} attempts)"
        log.warning("remote write to %s deferred: %s", self.url, reason)
        return WriteOutcome("retry_later", result.http_status, attempts, reason, elapsed)

    def _attempt(self, body: bytes) -> _Attempt:
        try:
            resp = self._session.post(
                self.url,
                data=body,
                headers=self._headers,
                timeout=(self.timeout_s, self.timeout_s),
                stream=True,  # read error bodies ourselves, bounded
                allow_redirects=False,  # a redirected POST silently becomes a GET
            )
        except requests.Timeout as exc:
            return _Attempt("retry_later", None, f"timeout: {_shorten(str(exc))}")
        except _NETWORK_ERRORS as exc:
            # The message can quote whatever garbage the peer sent: keep it short.
            return _Attempt("retry_later", None, f"{type(exc).__name__}: {_shorten(str(exc))}")
        try:
            code = resp.status_code
            head = self._drain(resp, self.timeout_s)
            retry_after = resp.headers.get("Retry-After")
        finally:
            resp.close()
        reason = f"HTTP {code}: {_printable(head[:REASON_BODY_BYTES])}"
        if 200 <= code < 300:
            return _Attempt("written", code, "")
        if 500 <= code < 600 or code in RETRY_4XX:
            after = parse_retry_after(retry_after) if code in RETRY_AFTER_STATUSES else None
            return _Attempt("retry_later", code, reason, after)
        if 300 <= code < 500:
            if refuses_samples(code, head):
                return _Attempt("rejected", code, reason)
            # The same answer for every batch of every node (cloud_ingest.answers): rejecting would
            # empty the fleet's spools. Retried like a 5xx, counted, alerted; the edge keeps the data.
            return _Attempt("retry_later", code, reason, config_error=True)
        # 1xx as a final status or >= 600: not a remote-write receiver speaking HTTP properly (a
        # proxy or load balancer in a bad state); treat like a network error.
        return _Attempt("retry_later", code, f"unexpected {reason}")

    @staticmethod
    def _drain(resp: requests.Response, timeout_s: float) -> bytes:
        """Up to ``_MAX_DRAIN_BYTES`` of the body, read within ``timeout_s``.  Reading to EOF lets requests
        put the connection back in the pool; stopping early makes ``close()`` drop it instead.

        ``read1`` returns whatever has arrived, so a peer trickling a body a byte at a time (each read
        succeeding within the socket timeout) cannot hold the writer beyond the deadline.
        """
        buf = bytearray()
        deadline = time.monotonic() + timeout_s
        raw = resp.raw
        try:
            while len(buf) <= _MAX_DRAIN_BYTES and time.monotonic() < deadline:
                chunk = raw.read1(16 * 1024, decode_content=True)
                if not chunk:
                    break
                buf += chunk
        except _NETWORK_ERRORS:
            # A truncated or undecodable body does not change the status we already have.
            pass
        return bytes(buf)
