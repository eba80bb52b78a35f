"""Stage 4: cut shaped scrapes into batches and encode them with the shared codec.

A batch holds whole scrapes of one cycle; only a scrape that alone is over ``max_bytes`` is split by
series (every part keeps the scrape's timestamp), so that no MQTT message exceeds what brokers take.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from edge_relay.shape import ShapedScrape
from schemas import codec
from schemas.model import Batch, Labels, ScrapeBlock

# The size check encodes with this seq: msgpack never writes a real seq in more bytes.
WIDEST_SEQ = 2**62


def to_batch(cluster: str, node: str, scrapes: Sequence[ShapedScrape]) -> Batch:
    table: dict[Labels, int] = {}
    blocks: list[ScrapeBlock] = []
    for scrape in scrapes:
        ids = array("I")
        for labels in scrape.labels:
            idx = table.get(labels)
            if idx is None:
                idx = table[labels] = len(table)
            ids.append(idx)
        timestamps = array("q", scrape.timestamps) if scrape.timestamps is not None else None
        blocks.append(ScrapeBlock(scrape.timestamp_ms, ids, array("d", scrape.values), timestamps))
    return Batch(cluster=cluster, node=node, seq=0, labelsets=list(table), scrapes=blocks)


def _halves(scrape: ShapedScrape) -> tuple[ShapedScrape, ShapedScrape]:
    mid = len(scrape) // 2

    def part(lo: int, hi: int) -> ShapedScrape:
        ts = scrape.timestamps[lo:hi] if scrape.timestamps is not None else None
        return ShapedScrape(
            scrape.target, scrape.timestamp_ms, scrape.labels[lo:hi], scrape.values[lo:hi], ts
        )

    return part(0, mid), part(mid, len(scrape))


class BatchEncoder:
    def __init__(self, cluster: str, node: str, *, max_bytes: int, zstd_level: int = 3) -> None:
        self.cluster = cluster
        self.node = node
        self.max_bytes = max_bytes
        self.zstd_level = zstd_level

    def encode(self, batch: Batch, seq: int) -> bytes:
        batch.seq = seq
        return codec.encode_batch(batch, level=self.zstd_level)

    def build(self, scrapes: Sequence[ShapedScrape]) -> list[Batch]:
        """Batches, each of which encodes to at most ``max_bytes``."""
        scrapes = [s for s in scrapes if len(s)]
        if not scrapes:
            return []
        batch = to_batch(self.cluster, self.node, scrapes)
        if len(self.encode(batch, WIDEST_SEQ)) <= self.max_bytes:
            return [batch]
        if len(scrapes) > 1:
            mid = len(scrapes) // 2
            return self.build(scrapes[:mid]) + self.build(scrapes[mid:])
        if len(scrapes[0]) <= 1:
            raise ValueError(f"a single sample encodes to more than batch.max_bytes={self.max_bytes}")
        first, second = _halves(scrapes[0])
        return self.build([first]) + self.build([second])
