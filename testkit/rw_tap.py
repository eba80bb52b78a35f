"""``RemoteWriteTap``: a ``testkit.netfaults.RemoteWriteProxy`` that decodes what the receiver accepted.

Used by the benches to count duplicates and to time drains without querying the receiver:
``DrainWatch`` tells which served scrapes of a window a tap has seen accepted whole, and when;
``samples_stamped`` counts the samples it saw in a time range.  Bodies are decoded with cramjam and
the protobuf runtime (fast enough for a bench's stream of writes); the tests' own reader of the wire
format, independent of both, is ``testkit.rw_wire``.
"""

from __future__ import annotations

import bisect
import math
import queue
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import cramjam

from schemas.remote_write_pb import WriteRequest
from testkit.netfaults import RemoteWriteProxy
from testkit.oracle import SYNTHETIC

SeriesKey = tuple[tuple[str, str], ...]


def decode_write_request(body: bytes, content_encoding: str = "snappy") -> WriteRequest:
    """A remote-write body: snappy (block format, remote-write 1.0) or zstd (the VictoriaMetrics
    protocol: the same protobuf, zstd instead of snappy)."""
    if content_encoding.lower() == "zstd":
        raw = cramjam.zstd.decompress(body)
    else:
        raw = cramjam.snappy.decompress_raw(body)
    return WriteRequest.FromString(bytes(raw))


class RemoteWriteTap(RemoteWriteProxy):
    """HTTP reverse proxy in front of a remote-write receiver that decodes what the receiver accepted.

    For every request the receiver answered 2xx it decodes the body (snappy or zstd + protobuf) and
    records, per series, the timestamps of its samples (``SYNTHETIC`` series and NaNs -- stale markers --
    left out): a timestamp seen again for the same series is a *duplicate*: a sample the receiver was
    given more than once (Prometheus keeps one copy, so the receiver itself cannot show them).  It also
    keeps, per (job, timestamp) -- one scrape of one target -- the number of distinct samples and the
    monotonic time the last new one arrived, which is how drain times are measured without querying the
    receiver, and the scrapes the scraper reported as failed (``up`` 0: nothing to deliver).

    Every POST is counted by ``Content-Encoding`` and ``X-Prometheus-Remote-Write-Version``
    (``encodings``): which protocol the client spoke.  ``transparent=True`` (see ``RemoteWriteProxy``)
    for a tap behind a byte-counting proxy.  The proxy's fault modes work as well.
    """

    def __init__(
        self, upstream_url: str, name: str = "tap", *, transparent: bool = False, deferred: bool = False
    ) -> None:
        self.duplicates = 0
        self.decode_errors = 0
        self.encodings: Counter[str] = Counter()
        self._seen: dict[SeriesKey, set[int]] = {}
        self._scrapes: dict[tuple[str, int], int] = defaultdict(int)
        self._last_new: dict[tuple[str, int], float] = {}
        self._failed: set[tuple[str, int]] = set()
        # deferred: accounted on a thread of its own after the reply, so that decoding a large write
        # (about 1 s for 20,000 series) does not hold up the writer's next request; readers wait
        # for what is queued (``settle``). Arrival times (``scrapes``) are then the accounting's.
        self._backlog: queue.Queue[tuple[bytes, str] | None] | None = None
        if deferred:
            self._backlog = queue.Queue()
            threading.Thread(target=self._account_backlog, name=f"{name}-account", daemon=True).start()
        super().__init__(upstream_url, upstream_timeout_s=60.0, transparent=transparent, name=name)

    @property
    def requests_ok(self) -> int:
        """Writes the receiver accepted (2xx)."""
        return self.forwarded_ok()

    @property
    def requests_failed(self) -> int:
        """Writes answered otherwise (by the receiver, or 502 when it was unreachable)."""
        return sum(1 for e in self.history() if not 200 <= e.status < 300)

    def scrapes(
        self,
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], float], set[tuple[str, int]]]:
        """Snapshot: (job, timestamp) -> distinct samples accepted, -> when the last new one came, and
        the (job, timestamp) of failed scrapes."""
        self.settle()
        with self._lock:
            return dict(self._scrapes), dict(self._last_new), set(self._failed)

    def distinct_samples(self) -> int:
        self.settle()
        with self._lock:
            return sum(self._scrapes.values())

    # -- internals ------------------------------------------------------------------------------------

    def _received(self, headers: Mapping[str, str], body: bytes) -> None:
        encoding = (headers.get("Content-Encoding") or "identity").lower()
        version = headers.get("X-Prometheus-Remote-Write-Version")
        with self._lock:
            self.encodings[encoding + (f", remote-write {version}" if version else "")] += 1

    def settle(self) -> None:
        """Wait until every accepted write is accounted (at once unless ``deferred``)."""
        if self._backlog is not None:
            self._backlog.join()

    def close(self) -> None:
        if self._backlog is not None:
            self._backlog.put(None)
        super().close()

    def _accepted(self, n: int, headers: Mapping[str, str], body: bytes) -> None:
        encoding = headers.get("Content-Encoding") or "snappy"
        if self._backlog is not None:
            self._backlog.put((body, encoding))
        else:
            self._account(body, encoding)
        super()._accepted(n, headers, body)

    def _account_backlog(self) -> None:
        assert self._backlog is not None
        while (item := self._backlog.get()) is not None:
            try:
                self._account(*item)
            finally:
                self._backlog.task_done()
        self._backlog.task_done()

    def _account(self, body: bytes, encoding: str) -> None:
        now = time.monotonic()
        try:
            request = decode_write_request(body, encoding)
        except Exception:
            with self._lock:
                self.decode_errors += 1
            return
        batch: list[tuple[SeriesKey, str, list[int]]] = []
        failed: list[tuple[str, int]] = []
        for series in request.timeseries:
            labels = tuple(sorted((lab.name, lab.value) for lab in series.labels))
            names = dict(labels)
            name = names.get("__name__", "")
            if name == "up":
                failed += [(names.get("job", ""), s.timestamp) for s in series.samples if s.value == 0]
            if name in SYNTHETIC:
                continue
            stamps = [s.timestamp for s in series.samples if not math.isnan(s.value)]
            if stamps:
                batch.append((labels, names.get("job", ""), stamps))
        with self._lock:
            self._failed.update(failed)
            for key in failed:
                self._last_new.setdefault(key, now)
            for labels, job, stamps in batch:
                seen = self._seen.get(labels)
                if seen is None:
                    seen = self._seen[labels] = set()
                for t in stamps:
                    if t in seen:
                        self.duplicates += 1
                    else:
                        seen.add(t)
                        key = (job, t)
                        self._scrapes[key] += 1
                        self._last_new[key] = now


@dataclass
class DrainWatch:
    """Which served scrapes of a window the receiver has accepted whole, according to a tap."""

    tap: RemoteWriteTap
    wanted: list[tuple[str, int, int]]  # (job, served t_ms, samples)
    skew_before_ms: int
    skew_after_ms: int
    since: float  # monotonic time of the heal
    done_at: float | None = None  # monotonic time the last wanted sample arrived, once all are there
    last_progress: float | None = None  # monotonic time of the newest arrival of a window sample
    missing: int = 0  # wanted scrapes not yet complete

    def poll(self) -> bool:
        """Update; True once every wanted scrape is complete."""
        scrapes, last_new, failed = self.tap.scrapes()
        by_job: dict[str, list[int]] = defaultdict(list)
        for job, t in scrapes.keys() | failed:
            by_job[job].append(t)
        for stamps in by_job.values():
            stamps.sort()
        missing = 0
        newest: float | None = None
        for job, t_served, n in self.wanted:
            stamps = by_job.get(job, [])
            # The scrape a served request belongs to is the latest one stamped before it was served
            # (a relay restarted between grid points may scrape twice within one interval).
            i = bisect.bisect_right(stamps, t_served + self.skew_after_ms) - 1
            if i >= 0 and stamps[i] >= t_served - self.skew_before_ms:
                key = (job, stamps[i])
                at = last_new[key]
                newest = at if newest is None else max(newest, at)
                if key in failed or scrapes.get(key, 0) >= n:
                    continue
            missing += 1
        self.missing = missing
        self.last_progress = newest
        if missing == 0 and self.done_at is None:
            self.done_at = newest if newest is not None else self.since
        return missing == 0

    def drain_seconds(self) -> float | None:
        """Heal -> last window sample accepted (0 if none was outstanding at the heal)."""
        end = self.done_at if self.done_at is not None else self.last_progress
        return None if end is None else max(0.0, end - self.since)


def samples_stamped(tap: RemoteWriteTap, start_ms: int, end_ms: int | None = None) -> int:
    """Distinct exporter samples the tap saw accepted whose timestamp is in ``[start_ms, end_ms)``."""
    scrapes, _, _ = tap.scrapes()
    return sum(n for (_, t), n in scrapes.items() if t >= start_ms and (end_ms is None or t < end_ms))
