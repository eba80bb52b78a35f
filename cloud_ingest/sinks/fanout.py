"""Several targets behind one ``Sink``: each batch goes to every target, each target has its own queue and
writer threads, and the batch is final only when every required target has it.

Why a queue per target: a target that is slow or down must not stall the others. Each target's writes run
on its own threads; the pipeline's worker waits only for the required targets. An optional target never
holds the acknowledgement: its copy is queued (at most ``queue_batches`` of them; a batch beyond is
dropped for it, logged and counted) and the worker goes on.

What an acknowledgement means with several targets: when target A has written a batch and required target
B must retry it, the batch's result is ``retry_later``; the edge keeps it and publishes it again. A
remembers the batches it wrote (``WrittenMemo``: cluster, node, incarnation, seq, sample count; bounded),
so the republished batch is not sent to A again; where the memo has forgotten it, rewriting it changes
nothing stored (remote write is idempotent). What the first required target refused for good is the
batch's refused part (dead-lettered; a replay writes to the first target); what another target refused is
logged with its name.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from cloud_ingest.sinks.sink import Sink, SinkResult
from schemas.model import Batch

log = logging.getLogger("cloud_ingest")

BatchKey = tuple[str, str, int, int, int]


def batch_key(batch: Batch) -> BatchKey:
    return (batch.cluster, batch.node, batch.incarnation or 0, batch.seq, batch.sample_count)


class WrittenMemo:
    """The batches a target has written, the newest ``size`` of them. Thread-safe."""

    def __init__(self, size: int = 100_000) -> None:
        self._size = size
        self._keys: OrderedDict[BatchKey, SinkResult] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: BatchKey) -> SinkResult | None:
        with self._lock:
            return self._keys.get(key)

    def add(self, key: BatchKey, result: SinkResult) -> None:
        with self._lock:
            self._keys[key] = result
            self._keys.move_to_end(key)
            while len(self._keys) > self._size:
                self._keys.popitem(last=False)


@dataclass
class Target:
    """One target: its sink, whether it holds the acknowledgement, its queue bound."""

    name: str
    sink: Sink
    required: bool = True
    queue_batches: int = 64


class _Lane:
    """A target's queue and writer threads."""

    def __init__(self, target: Target, threads: int) -> None:
        self.target = target
        self.memo = WrittenMemo()
        self.executor = ThreadPoolExecutor(max(1, threads), thread_name_prefix=f"rw-{target.name}")
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, batch: Batch) -> Future[SinkResult] | None:
        """The target's write of ``batch`` (None: an optional target's queue is full)."""
        with self._lock:
            if not self.target.required and self._pending >= self.target.queue_batches:
                return None
            self._pending += 1
        return self.executor.submit(self._write, batch)

    def _write(self, batch: Batch) -> SinkResult:
        try:
            key = batch_key(batch)
            done = self.memo.get(key)
            if done is not None:
                return done
            result = self.target.sink.write(batch)
            if result.status == "done":
                self.memo.add(key, result)
            elif not self.target.required:
                log.warning(
                    "optional remote-write target %s did not take batch %s seq=%d: %s",
                    self.target.name,
                    batch.node,
                    batch.seq,
                    result.retry_reason,
                )
            return result
        finally:
            with self._lock:
                self._pending -= 1


class FanOutSink:
    """Writes every batch to each target on the target's own threads (``threads`` per target);
    ``on_dropped(name)`` when an optional target's queue is full."""

    def __init__(
        self, targets: list[Target], *, threads: int, on_dropped: Callable[[str], object] | None = None
    ) -> None:
        if not any(t.required for t in targets):
            raise ValueError("at least one remote-write target must be required")
        self.lanes = [_Lane(t, threads) for t in targets]
        self._on_dropped = on_dropped

    def request_bound(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int:
        return max(
            lane.target.sink.request_bound(batch, cap, max_pair_bytes=max_pair_bytes) for lane in self.lanes
        )

    def write(self, batch: Batch) -> SinkResult:
        waiting: list[tuple[_Lane, Future[SinkResult]]] = []
        for lane in self.lanes:
            future = lane.submit(batch)
            if future is None:
                if self._on_dropped is not None:
                    self._on_dropped(lane.target.name)
                log.warning(
                    "optional remote-write target %s: %d batches queued, batch %s seq=%d dropped for it",
                    lane.target.name,
                    lane.target.queue_batches,
                    batch.node,
                    batch.seq,
                )
            elif lane.target.required:
                waiting.append((lane, future))
        results = [(lane.target.name, future.result()) for lane, future in waiting]
        behind = [f"{name}: {r.retry_reason}" for name, r in results if r.status == "retry_later"]
        if behind:
            return SinkResult("retry_later", retry_reason="; ".join(behind))
        _, first = results[0]
        for name, result in results[1:]:
            if result.refused is not None:
                log.error(
                    "remote-write target %s refused %d samples of batch %s seq=%d: %s",
                    name,
                    result.refused.sample_count,
                    batch.node,
                    batch.seq,
                    "; ".join(result.reasons),
                )
        return first

    def close(self) -> None:
        for lane in self.lanes:
            lane.executor.shutdown(wait=True)
            lane.target.sink.close()
