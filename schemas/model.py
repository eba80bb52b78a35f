"""In-memory data model shared by the edge relay and the cloud ingester.

A *label set* is a tuple of ``(name, value)`` pairs sorted by name (byte order, as Prometheus and
remote-write require), ``__name__`` included.  Parsed label sets are interned by the parser cache,
so equal label sets are usually the same object and hash cheaply.

A *scrape block* is every sample of one scrape of one target: one shared timestamp, a column of
series indices into the batch's label-set table and a column of float64 values.  Values are kept in
``array('d')`` so NaN payloads (the Prometheus stale marker) survive bit-exact end to end.
"""

from __future__ import annotations

import math
import struct
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

Labels = tuple[tuple[str, str], ...]

# Prometheus' staleness marker: a NaN with this exact bit pattern (model/value.StaleNaN).
STALE_NAN_BITS = 0x7FF0000000000002
STALE_NAN: float = struct.unpack("<d", struct.pack("<Q", STALE_NAN_BITS))[0]


def float_bits(value: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", value))[0]


def is_stale(value: float) -> bool:
    return math.isnan(value) and float_bits(value) == STALE_NAN_BITS


# Prometheus' naming conventions for cumulative series: a counter, or a histogram's or summary's parts.
COUNTER_SUFFIXES = ("_total", "_count", "_sum", "_bucket")


def is_counter(name: str, extra_counters: frozenset[str] = frozenset()) -> bool:
    """A metric name that only goes up (resets aside): by its suffix, or named in ``extra_counters``
    (exporters' counters without a counter suffix; the vendor registry lists them)."""
    return name.endswith(COUNTER_SUFFIXES) or name in extra_counters


def metric_name(labels: Labels) -> str:
    for name, value in labels:
        if name == "__name__":
            return value
    return ""


@dataclass(slots=True)
class ScrapeBlock:
    """All samples of one scrape of one target."""

    timestamp_ms: int
    series: array = field(default_factory=lambda: array("I"))  # indices into Batch.labelsets
    values: array = field(default_factory=lambda: array("d"))
    # Per-sample timestamps, only when the exposition carried explicit ones; else all = timestamp_ms.
    timestamps: array | None = None

    def sample_timestamp(self, i: int) -> int:
        return self.timestamp_ms if self.timestamps is None else self.timestamps[i]

    def slice(self, lo: int, hi: int) -> ScrapeBlock:
        """Samples ``lo:hi`` of this block, with their own timestamps if it has them."""
        stamps = None if self.timestamps is None else self.timestamps[lo:hi]
        return ScrapeBlock(self.timestamp_ms, self.series[lo:hi], self.values[lo:hi], stamps)


@dataclass(slots=True)
class Batch:
    """One encoded unit on the wire and one row in the spool."""

    cluster: str
    node: str
    seq: int
    labelsets: list[Labels]
    scrapes: list[ScrapeBlock]
    # The identity of the spool file the batch was stored in (0: none given). Seqs count per spool
    # file, so (incarnation, seq) names a batch across a spool that was recreated.
    incarnation: int = 0

    @classmethod
    def of_blocks(
        cls, cluster: str, node: str, blocks: Sequence[ScrapeBlock], table: Sequence[Labels]
    ) -> Batch:
        """A batch (seq 0) of only ``blocks``, whose series index ``table``, carrying only the label
        sets they use (renumbered in the order they first appear)."""
        remap: dict[int, int] = {}
        labelsets: list[Labels] = []
        out: list[ScrapeBlock] = []
        for block in blocks:
            ids = array("I")
            for idx in block.series:
                new = remap.get(idx)
                if new is None:
                    new = remap[idx] = len(labelsets)
                    labelsets.append(table[idx])
                ids.append(new)
            out.append(ScrapeBlock(block.timestamp_ms, ids, block.values, block.timestamps))
        return cls(cluster, node, 0, labelsets, out)

    @property
    def sample_count(self) -> int:
        return sum(len(s.values) for s in self.scrapes)

    @property
    def first_timestamp_ms(self) -> int:
        return min((_min_ts(s) for s in self.scrapes), default=0)

    @property
    def last_timestamp_ms(self) -> int:
        return max((_max_ts(s) for s in self.scrapes), default=0)


def _min_ts(block: ScrapeBlock) -> int:
    if block.timestamps:
        return min(block.timestamps)
    return block.timestamp_ms


def _max_ts(block: ScrapeBlock) -> int:
    if block.timestamps:
        return max(block.timestamps)
    return block.timestamp_ms
