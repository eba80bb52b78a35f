"""Cut shaped scrapes into batches and encode them with the shared codec.

Without a batch window a batch holds whole scrapes of one cycle; only a scrape that alone is over
``max_bytes`` is split by series (every part keeps the scrape's timestamp), so that no MQTT message
exceeds what brokers take.

With a batch window (bandwidth budget) a batch holds every scrape of the window, which is what makes
the columnar v2 format small: each label set is written once per batch, values as deltas over time.
A window too large for one message is split by *series* (each part keeps every scrape of its series),
not by scrapes, so no label set is written twice. Until the window closes, each cycle's scrapes wait
in the spool's staging table in the cheap ``stage`` form below (msgpack + zstd level 1).
"""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zstandard

from edge_relay.collect.shape import ShapedScrape
from schemas import codec
from schemas.model import Batch, Labels, ScrapeBlock

# The size check encodes with this seq: msgpack never writes a real seq in more bytes.
WIDEST_SEQ = 2**62


@dataclass(slots=True)
class NumberedBatch(Batch):
    """A batch as ``to_batch`` made it, with the table that numbered its series. A set made from the
    table reuses the hashes the dict stores, so ``encode_checked`` hands the codec's checks and
    RecentLabels their set without hashing each label set twice more (about 0.45 us a sample at 2,000
    series). The table describes the ``labelsets`` list it was made with, and only that list: a batch
    whose list was replaced afterwards is checked in full."""

    table: dict[Labels, int] = field(default_factory=dict, repr=False, compare=False)
    numbered: list[Labels] | None = field(default=None, repr=False, compare=False)

    def distinct_labelsets(self) -> set[Labels] | None:
        if self.numbered is not self.labelsets or len(self.table) != len(self.labelsets):
            return None
        return set(self.table)


def to_batch(cluster: str, node: str, scrapes: Sequence[ShapedScrape]) -> NumberedBatch:
    table: dict[Labels, int] = {}
    number = table.setdefault  # a new label set gets the next id: one C call a sample, not a loop body
    blocks: list[ScrapeBlock] = []
    for scrape in scrapes:
        ids = array("I", [number(labels, len(table)) for labels in scrape.labels])
        timestamps = array("q", scrape.timestamps) if scrape.timestamps is not None else None
        blocks.append(ScrapeBlock(scrape.timestamp_ms, ids, array("d", scrape.values), timestamps))
    labelsets = list(table)
    return NumberedBatch(
        cluster=cluster,
        node=node,
        seq=0,
        labelsets=labelsets,
        scrapes=blocks,
        table=table,
        numbered=labelsets,
    )


class RecentLabels(set[Labels]):
    """Label sets that passed the codec's checks lately: a cycle's series are mostly the last cycle's,
    so only new ones need checking. Every ``generation`` batches it starts again from the batch at
    hand, so what it holds is bounded by the live series plus a few cycles of churn, not by every
    series the node ever had (at 20,000 series the simulator replaces about 260 a cycle; a set never
    emptied would hold every one of them, ~750 B each). A set, so that the codec's ``in`` stays C."""

    def __init__(self, generation: int = 16) -> None:
        super().__init__()
        self.generation = generation
        self._batches = 0

    def remember(self, labelsets: Sequence[Labels]) -> None:
        self._batches += 1
        if self._batches >= self.generation:
            self.clear()
            self._batches = 0
        self.update(labelsets)


def encode_checked(batch: Batch, valid: RecentLabels, **options: Any) -> bytes:
    """``codec.encode_batch`` checking only the label sets not in ``valid``, then remembering this
    batch's."""
    distinct = batch.distinct_labelsets() if isinstance(batch, NumberedBatch) else None
    payload = codec.encode_batch(batch, known=valid, distinct=distinct, **options)
    valid.remember(batch.labelsets if distinct is None else distinct)
    return payload


def _halves(scrape: ShapedScrape) -> tuple[ShapedScrape, ShapedScrape]:
    mid = len(scrape) // 2

    def part(lo: int, hi: int) -> ShapedScrape:
        ts = scrape.timestamps[lo:hi] if scrape.timestamps is not None else None
        return ShapedScrape(
            scrape.target, scrape.timestamp_ms, scrape.labels[lo:hi], scrape.values[lo:hi], ts
        )

    return part(0, mid), part(mid, len(scrape))


_STAGE_VERSION = 1
_stage_compressor = zstandard.ZstdCompressor(level=1)
# Staged cycles are our own, CRC-checked rows; the cap only guards against a corrupt length field.
_STAGE_MAX_BYTES = 512 << 20


def encode_stage(scrapes: Sequence[ShapedScrape]) -> bytes:
    """One cycle's shaped scrapes in the staging form: cheap to write (about 0.7 us a sample)."""
    rows = [[s.target, s.timestamp_ms, s.labels, s.values.tobytes(), s.timestamps] for s in scrapes if len(s)]
    return _stage_compressor.compress(msgpack.packb([_STAGE_VERSION, rows], use_bin_type=True))


def decode_stage(payload: bytes) -> list[ShapedScrape]:
    """Inverse of ``encode_stage``; raises ValueError for anything else."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=_STAGE_MAX_BYTES)
        version, rows = msgpack.unpackb(raw, use_list=False, raw=False)
    except (zstandard.ZstdError, ValueError, TypeError) as e:
        raise ValueError(f"not a staged cycle: {e}") from None
    if version != _STAGE_VERSION:
        raise ValueError(f"staged cycle of version {version!r}, this relay reads {_STAGE_VERSION}")
    out: list[ShapedScrape] = []
    for target, ts, labels, values, timestamps in rows:
        column = array("d")
        column.frombytes(values)
        # Label sets must be tuples of tuples again: they are dict keys all the way down the pipeline.
        label_sets: list[Any] = [tuple(tuple(pair) for pair in ls) for ls in labels]
        stamps = list(timestamps) if timestamps is not None else None
        out.append(ShapedScrape(target, ts, label_sets, column, stamps))
    return out


def dedupe_window(scrapes: Sequence[ShapedScrape]) -> tuple[list[ShapedScrape], Counter[str]]:
    """``scrapes`` without a second sample of a series at the same timestamp (the first one stays);
    returns them and how many were dropped, by target. A target's own scrape never holds a series twice (the
    shaper sees to it), so only explicit exporter timestamps, or two scrapes stamped in the same
    millisecond with label sets in common (two targets whose labels coincide), can collide: anything
    else passes through untouched, without a look at its samples."""
    explicit = any(s.timestamps is not None for s in scrapes)
    starts = Counter(s.timestamp_ms for s in scrapes)
    if not explicit and len(starts) == len(scrapes):
        return list(scrapes), Counter()
    seen: set[tuple[Labels, int]] = set()
    out: list[ShapedScrape] = []
    dropped: Counter[str] = Counter()
    for s in scrapes:
        if not explicit and starts[s.timestamp_ms] == 1:
            out.append(s)  # no other scrape has its timestamp: none of its samples can collide
            continue
        keep: list[int] = []
        for i, labels in enumerate(s.labels):
            key = (labels, s.timestamp_ms if s.timestamps is None else s.timestamps[i])
            if key in seen:
                dropped[s.target] += 1
            else:
                seen.add(key)
                keep.append(i)
        if len(keep) == len(s):
            out.append(s)
            continue
        stamps = None if s.timestamps is None else [s.timestamps[i] for i in keep]
        values = array("d", (s.values[i] for i in keep))
        out.append(ShapedScrape(s.target, s.timestamp_ms, [s.labels[i] for i in keep], values, stamps))
    return out, dropped


def _entity_first(labels: Labels) -> tuple[Labels, Labels]:
    return tuple(pair for pair in labels if pair[0] != "__name__"), labels


def series_parts(scrapes: Sequence[ShapedScrape], parts: int) -> list[list[ShapedScrape]]:
    """``scrapes`` cut into ``parts`` groups of disjoint series, all timestamps kept.

    Series are ordered by their labels other than the metric name first, so one container's (pod's,
    GPU's) series land in the same part: every part is a self-contained batch that spells out the
    label values it uses, and in exposition order (metric by metric) each part would repeat every
    container's strings. On the simulator's workload this makes a split window ~20% smaller."""
    seen: dict[Labels, None] = {}
    for scrape in scrapes:
        seen.update(dict.fromkeys(scrape.labels))
    order = {labels: i for i, labels in enumerate(sorted(seen, key=_entity_first))}
    per_part = -(-len(order) // parts)
    groups: list[list[ShapedScrape]] = [[] for _ in range(parts)]
    for scrape in scrapes:
        picks: list[list[int]] = [[] for _ in range(parts)]
        for i, labels in enumerate(scrape.labels):
            picks[order[labels] // per_part].append(i)
        for part, idx in zip(groups, picks, strict=True):
            if not idx:
                continue
            ts = [scrape.timestamps[i] for i in idx] if scrape.timestamps is not None else None
            part.append(
                ShapedScrape(
                    scrape.target,
                    scrape.timestamp_ms,
                    [scrape.labels[i] for i in idx],
                    array("d", (scrape.values[i] for i in idx)),
                    ts,
                )
            )
    return [g for g in groups if g]


class BatchEncoder:
    def __init__(
        self,
        cluster: str,
        node: str,
        *,
        max_bytes: int,
        zstd_level: int = 3,
        version: int = codec.CURRENT_FORMAT_VERSION,
        incarnation: int = 0,
    ) -> None:
        self.cluster = cluster
        self.node = node
        self.max_bytes = max_bytes
        self.zstd_level = zstd_level
        self.version = version
        self.incarnation = incarnation  # the spool's: every batch names the spool file it is stored in
        self._last_batch: Batch | None = None
        self._last_version = version
        self._last_payload: bytes | None = None
        self._valid = RecentLabels()

    def encode(self, batch: Batch, seq: int, version: int | None = None) -> bytes:
        """``batch`` as a wire envelope of ``version`` (default: the configured format version)."""
        version = self.version if version is None else version
        batch.incarnation = self.incarnation
        if batch is self._last_batch and version == self._last_version and self._last_payload is not None:
            # Sized a moment ago with a placeholder seq: only the header changes.
            batch.seq = seq
            return codec.with_seq(self._last_payload, seq)
        batch.seq = seq
        payload = encode_checked(batch, self._valid, level=self.zstd_level, version=version)
        self._last_batch, self._last_version, self._last_payload = batch, version, payload
        return payload

    def fit(self, batch: Batch, *, keep_oversized: bool = False) -> list[Batch]:
        """``batch`` in parts that each encode to at most ``max_bytes``: by scrape blocks, then by the
        samples of one block (a flight recorder block holds ``recorder.block_seconds`` of cycles, larger
        than a wire batch may be). A single sample over ``max_bytes`` raises ``ValueError``, or with
        ``keep_oversized`` stays a part of its own (what is already in the spool stays sendable)."""
        if len(self.encode(batch, WIDEST_SEQ)) <= self.max_bytes:
            return [batch]
        blocks = batch.scrapes

        def fit_part(part: Sequence[ScrapeBlock]) -> list[Batch]:
            subset = Batch.of_blocks(batch.cluster, batch.node, part, batch.labelsets)
            return self.fit(subset, keep_oversized=keep_oversized)

        if len(blocks) > 1:
            mid = len(blocks) // 2
            return fit_part(blocks[:mid]) + fit_part(blocks[mid:])
        block = blocks[0]
        n = len(block.values)
        if n <= 1:
            if keep_oversized:
                return [batch]
            raise ValueError(f"a single sample encodes to more than batch.max_bytes={self.max_bytes}")
        return fit_part([block.slice(0, n // 2)]) + fit_part([block.slice(n // 2, n)])

    def build_window(self, scrapes: Sequence[ShapedScrape]) -> list[Batch]:
        """One batch for every scrape of a window; a batch over ``max_bytes`` is cut in two by series
        (each half keeps every scrape of its series), and only the halves still too big are cut again:
        series compress very differently (counters as short decimals vs full-precision floats), so
        equal series counts would not give equal sizes, and re-encoding what already fits is waste."""
        scrapes = [s for s in scrapes if len(s)]
        if not scrapes:
            return []
        done: list[Batch] = []
        todo: list[list[ShapedScrape]] = [scrapes]
        while todo:
            group = todo.pop()
            batch = to_batch(self.cluster, self.node, group)
            if len(self.encode(batch, WIDEST_SEQ)) <= self.max_bytes:
                done.append(batch)
            elif len(batch.labelsets) > 1:
                first, second = series_parts(group, 2)
                todo += [second, first]  # popped first-half first: batches stay in series order
            else:
                # One series' window alone is too big (a huge label set): cut it by scrape instead.
                done += self.build(group)
        return done

    def build(self, scrapes: Sequence[ShapedScrape], version: int | None = None) -> list[Batch]:
        """Batches, each of which encodes (as ``version``) to at most ``max_bytes``."""
        scrapes = [s for s in scrapes if len(s)]
        if not scrapes:
            return []
        batch = to_batch(self.cluster, self.node, scrapes)
        if len(self.encode(batch, WIDEST_SEQ, version)) <= self.max_bytes:
            return [batch]
        if len(scrapes) > 1:
            mid = len(scrapes) // 2
            return self.build(scrapes[:mid], version) + self.build(scrapes[mid:], version)
        if len(scrapes[0]) <= 1:
            raise ValueError(f"a single sample encodes to more than batch.max_bytes={self.max_bytes}")
        first, second = _halves(scrapes[0])
        return self.build([first], version) + self.build([second], version)

    def build_each(
        self, scrapes: Sequence[ShapedScrape], version: int | None = None
    ) -> tuple[list[Batch], list[tuple[ShapedScrape, str]]]:
        """``build`` scrape by scrape, for scrapes the codec refused together (``build`` or
        ``build_window`` raised): one scrape it refuses must not take the others with it. Returns the
        batches and each refused scrape with the codec's error."""
        batches: list[Batch] = []
        refused: list[tuple[ShapedScrape, str]] = []
        for scrape in scrapes:
            try:
                batches += self.build([scrape], version)
            except ValueError as e:
                refused.append((scrape, str(e)))
        return batches, refused
