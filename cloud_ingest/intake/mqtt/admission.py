"""Flow control of the MQTT intake: what a replica holds in memory is bounded here, not by the broker.

``Admission`` admits at most the Receive Maximum the session announces of batches received and not
finished, and while that many are held it keeps paho's network thread waiting, so nothing more is read
from the socket (TCP backpressure up to the broker). A broker that honours Receive Maximum never makes
it wait; mosquitto 2.0.11 was seen releasing 64 more messages per PUBACK. QoS 0 batches, which no flow
control covers at all, are refused before they take a place (``batches.py``).
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("cloud_ingest.subscribe")


class Admission:
    """At most ``limit`` batches held (received and not finished); ``admit`` waits for a place.

    ``admit`` runs on paho's network thread: while it waits, that thread reads nothing more, and also
    sends nothing (PUBACKs queued by workers, pings). The wait ends as soon as a worker finishes a
    batch (``done``); should one batch take longer than 1.5 x the keepalive, the broker drops the
    connection and later redelivers what was not PUBACKed, which costs duplicates (writes are
    idempotent), never data. Returns False, without a place, once ``stop`` is set.
    """

    def __init__(self, limit: int, stop: threading.Event, *, log_interval_s: float = 60.0) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._stop = stop
        self._places = threading.BoundedSemaphore(limit)
        self._held = 0
        self._lock = threading.Lock()
        self._log_interval_s = log_interval_s
        self._logged_at = -float("inf")
        self.waits = 0  # how often a batch had to wait for a place

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def admit(self) -> bool:
        if not self._places.acquire(blocking=False):
            self.waits += 1
            now = time.monotonic()
            if now - self._logged_at >= self._log_interval_s:
                self._logged_at = now
                log.warning(
                    "holding %d batches (mqtt.receive_maximum), more than the broker should send: not "
                    "reading from it until one is finished (logged at most every %gs)",
                    self.limit,
                    self._log_interval_s,
                )
            while not self._places.acquire(timeout=0.5):
                if self._stop.is_set():
                    return False
        with self._lock:
            self._held += 1
        return True

    def done(self) -> None:
        with self._lock:
            self._held -= 1
        self._places.release()
