"""The intake's worker threads: the batches of one node are handled one at a time, in arrival order, on
the same thread; different nodes in parallel.

A node's batches must be written in order (a receiver without an out-of-order window refuses an older
sample after a newer one), so each node is pinned to one thread by a hash of its key; the threads share
nothing else. Any intake hands its jobs here; what a job does (run the pipeline, settle the message) is
the intake's, and so are its errors: a job never raises (one that did would end its thread).
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable

Job = Callable[[], object]


class Workers:
    """``count`` threads, each with its unbounded queue (the intake bounds what it submits)."""

    def __init__(self, count: int) -> None:
        self.queues: list[queue.Queue[Job | None]] = [queue.Queue() for _ in range(count)]
        self.threads = [
            threading.Thread(target=self._work, args=(q,), name=f"ingest-{i}", daemon=True)
            for i, q in enumerate(self.queues)
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Let each thread finish the jobs queued before this call, then end."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join(timeout)

    def submit(self, node_key: bytes, job: Job) -> None:
        """Queue ``job`` on the thread of the node ``node_key`` names; never blocks."""
        self.queues[zlib.crc32(node_key) % len(self.queues)].put(job)

    def _work(self, q: queue.Queue[Job | None]) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            job()
