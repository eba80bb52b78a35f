"""A target's ``write_relabel_configs``: its copy of each batch relabeled (Prometheus semantics,
``relay_common.relabel``) before its sink writes it.

Each target has its own rules and its own copy, so one target's relabeling never changes what another
gets. A series the rules drop counts as written (as Prometheus' remote write counts it): the batch is
done for this target when everything it kept is written. What the receiver refuses is the relabeled
samples (dead-lettered as this target saw them). The relabeled label set of each distinct input is
cached (bounded), so a stable fleet costs one dict lookup per series and batch.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Final

from cloud_ingest.sinks.sink import Sink, SinkResult
from relay_common.relabel import Rule, relabel
from schemas.model import Batch, Labels, ScrapeBlock

# Distinct label sets whose relabeled form is kept; past this the cache starts over.
CACHE_SERIES: Final = 200_000


class WriteRelabelSink:
    """``inner`` fed with each batch relabeled by ``rules``."""

    def __init__(self, inner: Sink, rules: Sequence[Rule]) -> None:
        self.inner = inner
        self.rules = tuple(rules)
        self._cache: dict[Labels, Labels | None] = {}

    def _relabeled(self, labels: Labels) -> Labels | None:
        try:
            return self._cache[labels]
        except KeyError:
            pass
        out = relabel(self.rules, dict(labels))
        result = tuple(sorted(out.items())) if out else None  # no labels left: dropped, as Prometheus does
        if len(self._cache) >= CACHE_SERIES:
            self._cache.clear()
        self._cache[labels] = result
        return result

    def relabeled(self, batch: Batch) -> tuple[Batch | None, int]:
        """``batch`` as this target gets it (None: nothing left), and how many samples the rules dropped."""
        remap: list[int] = []
        labelsets: list[Labels] = []
        for labels in batch.labelsets:
            new = self._relabeled(labels)
            remap.append(-1 if new is None else len(labelsets))
            if new is not None:
                labelsets.append(new)
        if len(labelsets) == len(batch.labelsets) and all(
            new == old for new, old in zip(labelsets, batch.labelsets, strict=True)
        ):
            return batch, 0
        dropped = 0
        blocks: list[ScrapeBlock] = []
        for block in batch.scrapes:
            keep = [i for i, s in enumerate(block.series) if remap[s] >= 0]
            dropped += len(block.series) - len(keep)
            if not keep:
                continue
            blocks.append(
                ScrapeBlock(
                    block.timestamp_ms,
                    array("I", (remap[block.series[i]] for i in keep)),
                    array("d", (block.values[i] for i in keep)),
                    None if block.timestamps is None else array("q", (block.timestamps[i] for i in keep)),
                )
            )
        if not blocks:
            return None, dropped
        return Batch(batch.cluster, batch.node, batch.seq, labelsets, blocks, batch.incarnation), dropped

    def request_bound(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int:
        relabeled, _ = self.relabeled(batch)
        return self.inner.request_bound(relabeled or batch, cap, max_pair_bytes=max_pair_bytes)

    def write(self, batch: Batch) -> SinkResult:
        relabeled, dropped = self.relabeled(batch)
        if relabeled is None:
            return SinkResult("done", dropped)
        result = self.inner.write(relabeled)
        if result.status != "done":
            return result
        return SinkResult("done", result.written + dropped, result.refused, result.reasons)

    def close(self) -> None:
        self.inner.close()
