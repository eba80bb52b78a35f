"""The follow path of the MQTT intake: every v3 frame of every node, to advance the stream state.

With a share group and ``mqtt.follow``, the subscriber also subscribes the batches without ``$share``
(QoS 0, subscription identifier ``FOLLOW_ID``: ``subscriber.py``), so every replica gets every frame of
every node besides its share. Those follow copies come here, never to the pipeline: they are decoded
only for the state they leave (``StreamState.advance``), never written, never acked.

Follow copies are decoded on ``Follower`` threads in arrival order per node (sharded by node, FIFO),
never on paho's network thread and never on the workers: a worker may be waiting in
``StreamState.decode`` for exactly the follow copy that would be queued behind it. ``submit`` never
blocks: when the follow queues hold ``max_queued_bytes`` a copy is dropped (a QoS 0 copy may be lost
anyway; it costs a ``need_state``). A copy that is not v3 is ignored after a look at its version byte.
"""

from __future__ import annotations

import logging
import queue
import threading
import zlib
from typing import Final

import paho.mqtt.client as mqtt

from cloud_ingest.pipeline.stream_state import StreamState, is_v3
from cloud_ingest.selfmetrics import IngestMetrics
from schemas import topics

log = logging.getLogger("cloud_ingest.follow")

DEFAULT_MAX_QUEUED_BYTES: Final = 64 << 20


class Follower:
    """Threads that decode follow copies in arrival order per node; ``submit`` never blocks."""

    def __init__(
        self,
        state: StreamState,
        prefix: str,
        *,
        threads: int = 1,
        max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.state = state
        self.prefix = prefix
        self.metrics = metrics
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue[tuple[str, str, bytes] | None]] = [
            queue.SimpleQueue() for _ in range(max(1, threads))
        ]
        self._threads = [
            threading.Thread(target=self._run, args=(q,), name=f"follow-{i}", daemon=True)
            for i, q in enumerate(self._queues)
        ]
        self.outcomes: dict[str, int] = {}

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self, timeout: float = 10.0) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            if t.is_alive():
                t.join(timeout)

    def following(self, on: bool) -> None:
        """The follow subscription is live (or was refused, or not made): the stream state waits for
        follow copies only while they come."""
        self.state.set_following(on)

    def submit(self, message: mqtt.MQTTMessage) -> None:
        """A follow copy (paho's network thread): queue it for its node's thread, or drop it."""
        payload = message.payload
        if not is_v3(payload):
            self._count("ignored")
            return
        try:
            cluster, node, kind = topics.parse_topic(self.prefix, message.topic)
        except ValueError:
            kind = ""
        if kind != "batch":
            self._count("invalid")
            return
        size = len(payload)
        with self._lock:
            if self._queued_bytes + size > self.max_queued_bytes:
                full = True
            else:
                full = False
                self._queued_bytes += size
        if full:
            self._count("dropped")
            return
        shard = zlib.crc32(f"{cluster}/{node}".encode()) % len(self._queues)
        self._queues[shard].put((cluster, node, bytes(payload)))

    def _run(self, q: queue.SimpleQueue[tuple[str, str, bytes] | None]) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            cluster, node, payload = item
            try:
                outcome = self.state.advance(cluster, node, payload)
            except Exception:  # never let one frame stop the follow path
                log.exception("unexpected error following a frame of %s/%s", cluster, node)
                outcome = "invalid"
            finally:
                with self._lock:
                    self._queued_bytes -= len(payload)
            self._count(outcome)

    def _count(self, outcome: str) -> None:
        with self._lock:
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if self.metrics is not None:
            self.metrics.frames_followed.labels(outcome).inc()
