"""Keep one bad sample from costing its batch: split off what cannot be written, write the rest.

Two places refuse samples, so this module sits beside both stages rather than in one. The ingester
itself refuses a timestamp beyond ``max_future_seconds``; there the bad samples are known, and the
decode stage takes them out with :func:`split_future` before anything is written. The remote-write
receiver refuses a whole request for one sample: Prometheus answers 400 when one
sample is out of bounds (older than its head or out-of-order window) or a duplicate timestamp with
another value, and rolls the rest of the request back. There the bad samples are not named, so
:func:`isolate` (called by the remote-write sink) bisects the batch, by series first and then by the
samples of one series, writing each half, until the refused samples are found; each half the receiver
takes is written for good. :func:`joined` puts the two kinds of refused part of one batch together, as
one dead letter.

The number of writes is bounded (``max_writes``): what is still unresolved then is refused whole
(dead-lettered, replayable), so a batch of nothing but bad samples (a 6 h old backlog against a
Prometheus without out-of-order window) costs a few dozen refused requests, not one per sample.

Samples are carried as raw IEEE-754 bits throughout, so NaN payloads (the stale marker) survive.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from schemas.model import Batch, Labels, ScrapeBlock

DEFAULT_MAX_WRITES = 64
NOT_ISOLATED = "not isolated within {} writes"


@dataclass(slots=True)
class _Series:
    """The samples of one series of a batch (``index`` into its label-set table), in batch order."""

    index: int
    stamps: list[int]
    bits: list[int]


@dataclass(slots=True)
class Isolation:
    """What :func:`isolate` achieved. ``retry_later``: the receiver stopped answering mid-way (what was
    written stays written; the rest comes back with the batch)."""

    status: Literal["done", "retry_later"]
    written: int = 0
    refused: Batch | None = None
    reasons: list[str] = field(default_factory=list)
    writes: int = 0
    retry_reason: str = ""


class WriteResult(Protocol):
    """The part of a write outcome :func:`isolate` needs (the remote-write client's ``WriteOutcome``)."""

    @property
    def status(self) -> str: ...

    @property
    def reason(self) -> str: ...


def _series_of(batch: Batch) -> list[_Series]:
    by_index: dict[int, _Series] = {}
    for block in batch.scrapes:
        bits = array("Q")
        bits.frombytes(block.values.tobytes())
        stamps = block.timestamps
        for i, s in enumerate(block.series):
            entry = by_index.get(s)
            if entry is None:
                entry = by_index[s] = _Series(s, [], [])
            entry.stamps.append(block.timestamp_ms if stamps is None else stamps[i])
            entry.bits.append(bits[i])
    return [by_index[s] for s in sorted(by_index)]


def _sample_count(parts: Sequence[_Series]) -> int:
    return sum(len(p.stamps) for p in parts)


def _batch_of(batch: Batch, parts: Sequence[_Series], *, compact: bool = False) -> Batch:
    """A batch of ``parts`` with ``batch``'s identity, one block per distinct timestamp (a series appears
    at most once per block, as the codec requires). ``compact`` keeps only the label sets the parts
    use (for a batch that is encoded again)."""
    labelsets: list[Labels] = batch.labelsets
    remap: dict[int, int] | None = None
    if compact:
        remap = {p.index: i for i, p in enumerate(parts)}
        labelsets = [batch.labelsets[p.index] for p in parts]
    by_ts: dict[int, tuple[array, array]] = {}
    for p in parts:
        index = p.index if remap is None else remap[p.index]
        for ts, bits in zip(p.stamps, p.bits, strict=True):
            column = by_ts.get(ts)
            if column is None:
                column = by_ts[ts] = (array("I"), array("Q"))
            column[0].append(index)
            column[1].append(bits)
    blocks = []
    for ts in sorted(by_ts):
        series, bits = by_ts[ts]
        values = array("d")
        values.frombytes(bits.tobytes())
        blocks.append(ScrapeBlock(ts, series, values))
    return Batch(batch.cluster, batch.node, batch.seq, labelsets, blocks, batch.incarnation)


def split_future(batch: Batch, limit_ms: int) -> tuple[Batch | None, Batch | None]:
    """``batch`` as (samples at or before ``limit_ms``, samples after it); None for an empty part.
    Only called for a batch whose newest sample is beyond the limit (the common case costs nothing)."""
    good: list[_Series] = []
    bad: list[_Series] = []
    for part in _series_of(batch):
        keep = _Series(part.index, [], [])
        drop = _Series(part.index, [], [])
        for ts, bits in zip(part.stamps, part.bits, strict=True):
            side = keep if ts <= limit_ms else drop
            side.stamps.append(ts)
            side.bits.append(bits)
        if keep.stamps:
            good.append(keep)
        if drop.stamps:
            bad.append(drop)
    return (
        _batch_of(batch, good) if good else None,
        _batch_of(batch, bad, compact=True) if bad else None,
    )


def _halves(parts: list[_Series]) -> tuple[list[_Series], list[_Series]] | None:
    if len(parts) > 1:
        mid = len(parts) // 2
        return parts[:mid], parts[mid:]
    (one,) = parts
    if len(one.stamps) > 1:
        # Earlier samples first: a receiver without out-of-order window takes a series in time order.
        mid = len(one.stamps) // 2
        return (
            [_Series(one.index, one.stamps[:mid], one.bits[:mid])],
            [_Series(one.index, one.stamps[mid:], one.bits[mid:])],
        )
    return None


def isolate(
    batch: Batch,
    write: Callable[[Batch], WriteResult],
    reason: str,
    *,
    max_writes: int = DEFAULT_MAX_WRITES,
) -> Isolation:
    """Write what the receiver takes of ``batch``, which it refused whole with ``reason``.

    ``write`` is called with parts of the batch (one block each, explicit timestamps) in batch order;
    an outcome with status ``written`` takes the part, ``rejected`` refuses it, anything else stops.
    ``refused`` is a compact batch of the samples that were refused (or left unresolved), to be
    dead-lettered; ``reasons`` the distinct reasons, in the order they came.
    """
    result = Isolation("done")
    refused: list[_Series] = []
    reasons: dict[str, None] = {}
    everything = _series_of(batch)
    halves = _halves(everything) if everything else None
    if halves is None:  # a single sample: the refusal already names it
        refused, reasons[reason] = everything, None
    stack = [] if halves is None else [halves[1], halves[0]]
    while stack:
        part = stack.pop()
        if result.writes >= max_writes:
            refused.extend(part)
            reasons[NOT_ISOLATED.format(max_writes)] = None
            continue
        outcome = write(_batch_of(batch, part))
        result.writes += 1
        if outcome.status == "written":
            result.written += _sample_count(part)
        elif outcome.status == "rejected":
            split = _halves(part)
            if split is None:
                refused.extend(part)
                reasons[outcome.reason or reason] = None
            else:
                stack.extend((split[1], split[0]))
        else:
            result.status, result.retry_reason = "retry_later", outcome.reason
            break
    result.refused = _batch_of(batch, _merge(refused), compact=True) if refused else None
    result.reasons = list(reasons)
    return result


def _merge(parts: list[_Series]) -> list[_Series]:
    """Parts of the same series (halves refused one by one) as one, in time order."""
    by_index: dict[int, list[tuple[int, int]]] = {}
    for p in parts:
        by_index.setdefault(p.index, []).extend(zip(p.stamps, p.bits, strict=True))
    merged = []
    for index in sorted(by_index):
        pairs = sorted(by_index[index])
        merged.append(_Series(index, [ts for ts, _ in pairs], [bits for _, bits in pairs]))
    return merged


def joined(a: Batch | None, b: Batch | None) -> Batch | None:
    """Two refused parts of one batch (disjoint samples) as one batch to dead-letter."""
    if a is None or b is None:
        return a or b
    offset = len(a.labelsets)
    blocks = [*a.scrapes]
    for block in b.scrapes:
        shifted = array("I", (i + offset for i in block.series))
        blocks.append(ScrapeBlock(block.timestamp_ms, shifted, block.values, block.timestamps))
    return Batch(a.cluster, a.node, a.seq, [*a.labelsets, *b.labelsets], blocks, a.incarnation)
