"""The batches just spooled, kept decoded for a moment, so that the uplink need not decode their rows.

The sink puts every batch it spools here (the relay loop); the uplink's stream coder takes a row's
batch from here when it codes the row as a v3 frame, and decodes the row only when the batch is gone
(the backlog, after a restart). Bounded: the oldest go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from schemas.model import Batch


class RecentBatches:
    """The batches just spooled, by seq, so the uplink codes them without decoding their rows.

    Bounded (``keep`` batches, the oldest go first): a row not found here is decoded from the spool.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._batches: OrderedDict[int, Batch] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, batch: Batch) -> None:
        with self._lock:
            self._batches[batch.seq] = batch
            while len(self._batches) > self.keep:
                self._batches.popitem(last=False)

    def get(self, seq: int) -> Batch | None:
        with self._lock:
            return self._batches.get(seq)

    def discard(self, seq: int) -> None:
        with self._lock:
            self._batches.pop(seq, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._batches)
