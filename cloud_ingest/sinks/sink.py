"""The seam between the pipeline and the places batches are written to: the ``Sink`` protocol."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas.model import Batch


@dataclass(frozen=True, slots=True)
class SinkResult:
    """What a sink made of one batch.

    ``done``: final. ``written`` samples were taken; ``refused`` holds the samples the receiver refused
    for good (a batch of its own, to dead-letter; None when it took everything), ``reasons`` why
    (distinct, in the order they came). ``retry_later``: not final (the receiver did not answer, or
    not in time, or the ingester is stopping; ``retry_reason`` says which): nothing may be told to the
    edge, which keeps the batch and publishes it again. What was written of it stays written, so a
    sink must write idempotently (remote-write does: the same sample again changes nothing).
    """

    status: Literal["done", "retry_later"]
    written: int = 0
    refused: Batch | None = None
    reasons: list[str] = field(default_factory=list)
    retry_reason: str = ""


class Sink(Protocol):
    """Where the pipeline hands a decoded, validated batch. Thread-safe: every worker writes through it."""

    def write(self, batch: Batch) -> SinkResult:
        """Write ``batch`` until its outcome is final or worth retrying later; never raises for the
        receiver's or the network's failures."""
        ...

    def request_bound(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int:
        """An upper bound of the bytes ``batch`` becomes on the way out (within ``cap`` the bound may
        stop being tight); the decode stage refuses a batch whose bound is far over its own size."""
        ...

    def close(self) -> None: ...
