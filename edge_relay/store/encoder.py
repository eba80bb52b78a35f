"""The encoder the store is handed (``edge_relay.encode.batches.BatchEncoder``), as the store uses it.

The spool numbers a batch inside the transaction that stores it, and the wire envelope carries that
seq, so the store encodes under the seq it allocates (the sink), and re-encodes what it degrades
(retention). It needs no more of the encode stage than this, so it does not import it.
"""

from __future__ import annotations

from typing import Protocol

from schemas.model import Batch


class Encoder(Protocol):
    cluster: str
    node: str
    max_bytes: int

    def encode(self, batch: Batch, seq: int, version: int | None = None) -> bytes:
        """``batch`` as a wire envelope numbered ``seq`` (``version``: the configured format if None)."""
        ...

    def fit(self, batch: Batch, *, keep_oversized: bool = False) -> list[Batch]:
        """``batch`` in parts that each encode within ``max_bytes``."""
        ...
