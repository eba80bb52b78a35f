"""Flow control of the MQTT intake: how many batches a replica works on at once, without ever making
paho's network thread wait.

``Admission`` lets at most the Receive Maximum the session announces of batches be at work (handed to
the workers and not finished). A broker that honours Receive Maximum never sends more; one that does
not (mosquitto 2.0.11 was seen releasing 64 more messages per PUBACK) gets its surplus queued here, in
arrival order, un-PUBACKed, and started as places free up. Nothing here blocks: paho's network thread
must keep reading and writing (PUBACKs queued by workers, acks, pings), or a batch slower than 1.5 x
the keepalive would make the broker drop the connection and redeliver everything un-PUBACKed (a
storm of duplicates under load). The price: memory beyond the Receive Maximum is whatever surplus the
broker sends (mosquitto 2.0.11 sent up to about six times the Receive Maximum in the tests), counted
in ``waits`` and ``most_queued`` and logged; a broker that honours it never makes anything queue. The
alternative, not reading the socket while full, is what stalled pings and PUBACKs. QoS 0 batches,
which no flow control covers at all, are refused before they get here (``batches.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger("cloud_ingest.subscribe")

Start = Callable[[], None]


class Admission:
    """At most ``limit`` batches at work; ``offer`` starts a batch now or queues it, and never waits.

    ``offer`` runs on paho's network thread, ``done`` on the worker that finished a batch: it starts
    the next queued one in its place. Once ``stop`` is set nothing more is started (what is queued
    stays un-PUBACKed, and the broker delivers it again).
    """

    def __init__(self, limit: int, stop: threading.Event, *, log_interval_s: float = 60.0) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._stop = stop
        self._queued: deque[Start] = deque()
        self._held = 0
        self._lock = threading.Lock()
        self._log_interval_s = log_interval_s
        self._logged_at = -float("inf")
        self.waits = 0  # how many batches came while ``limit`` were at work
        self.most_queued = 0

    @property
    def held(self) -> int:
        """Batches at work."""
        with self._lock:
            return self._held

    @property
    def queued(self) -> int:
        """Batches received beyond the limit, waiting for a place."""
        with self._lock:
            return len(self._queued)

    def offer(self, start: Start) -> None:
        with self._lock:
            if self._stop.is_set():
                return  # not PUBACKed: the broker delivers it again
            if self._held < self.limit:
                self._held += 1
            else:
                self._queued.append(start)
                self.waits += 1
                self.most_queued = max(self.most_queued, len(self._queued))
                self._log_surplus()
                return
        start()

    def done(self) -> None:
        with self._lock:
            if self._queued and not self._stop.is_set():
                start = self._queued.popleft()  # takes over the finished batch's place
            else:
                self._held -= 1
                return
        start()

    def _log_surplus(self) -> None:
        now = time.monotonic()
        if now - self._logged_at >= self._log_interval_s:
            self._logged_at = now
            log.warning(
                "the broker sent more than %d batches (mqtt.receive_maximum) not yet acknowledged: "
                "queued until one is finished (logged at most every %gs)",
                self.limit,
                self._log_interval_s,
            )
