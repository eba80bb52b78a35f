"""A cycle's shaped scrapes into the spool, by one of two lanes.

- **Live**: the cycle's scrapes become batches of their own (``BatchEncoder.build``), appended through
  the sink and published at once. A series two targets share, scraped in the same millisecond, keeps
  one sample (Prometheus keeps one per series and timestamp; the other is ledgered as
  ``duplicate_sample`` for its target). A cycle the codec refuses as a whole goes scrape by scrape, and
  a scrape refused alone is ledgered as ``encode_error``: the cycle's other scrapes still go out.
- **Windowed** (a budget whose batch window is longer than an interval): the budget's ``latency: live``
  classes take the live lane, the rest is staged in the open ``BatchWindow`` and packed when the window
  closes.

Cycles staged under a windowed budget no longer in force (a restart without one, a window reloaded down
to one interval) are packed before the next cycle, so they go out first and are never stranded. Every
encoded byte the spool gets is counted as demand for the budget's controller (``BudgetRuntime.produced``).
"""

from __future__ import annotations

import logging
import time

from edge_relay.budget.runtime import BudgetRuntime
from edge_relay.collect.shape import ShapedScrape
from edge_relay.encode.batches import BatchEncoder, dedupe_window
from edge_relay.encode.window import BatchWindow
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.store.sink import SpoolSink
from edge_relay.store.spool import SpoolError
from schemas import codec
from schemas.model import Batch

log = logging.getLogger("edge_relay")


class Lanes:
    def __init__(
        self,
        encoder: BatchEncoder,
        window: BatchWindow,
        sink: SpoolSink,
        ledger: LossLedger,
        budget: BudgetRuntime | None,
    ) -> None:
        self._encoder = encoder
        self._window = window
        self._sink = sink
        self._ledger = ledger
        self._budget = budget

    def spool(self, shaped: list[ShapedScrape], *, at_once: bool = False) -> tuple[int, list[bytes]]:
        """One cycle's scrapes into the spool: staged in the open batch window, or as batches of their
        own. ``at_once``: a row spooled now is published at once, stream-coded (the uplink knows), so
        the live lane writes the quickest format. Returns the samples spooled and, when every scrape
        went out as live batches, their payloads (the flight recorder keeps those bytes rather than
        encoding the cycle again)."""
        budget, window = self._budget, self._window
        if budget is not None and budget.windowed:
            window.window_ms = budget.window_ms  # a reload may have changed it
            live, shaped = budget.split_live(shaped)
            spooled = self._append_cycle(live, at_once)[0] if live else 0
            try:
                staged, packed = window.add(shaped)
                packed += window.close_if_due(int(time.time() * 1000))
            except SpoolError as e:
                log.error("cannot stage this cycle: %s", e)
                return spooled, []
            budget.produced(packed)
            return spooled + staged, []
        if window.open:
            # Staged under a windowed budget no longer in force: pack them now, before this cycle.
            try:
                packed = window.pack()
            except SpoolError as e:
                log.error("cannot pack the staged cycles now (%s): trying again next cycle", e)
            else:
                if budget is not None:
                    budget.produced(packed)
        return self._append_cycle(shaped, at_once)

    def _live_version(self, at_once: bool) -> int:
        """The format the live lane spools a cycle in. A row that goes out at once is re-coded as a
        v3 frame and deleted on its ack: v1 is the quickest to write (about half v2's CPU) and, like
        every spooled row, self-contained. A row that will wait is decoded later anyway, and v2 is
        half v1's size on disk: the configured format."""
        return codec.FORMAT_V1 if at_once else self._encoder.version

    def _append_cycle(self, shaped: list[ShapedScrape], at_once: bool) -> tuple[int, list[bytes]]:
        """Scrapes as batches of their own (the live lane). Returns the samples spooled and, when they
        are all of ``shaped``, the payloads."""
        spooled, payloads = 0, []
        version = self._live_version(at_once)
        unique, duplicates = dedupe_window(shaped)
        for target, samples in sorted(duplicates.items()):
            ts = min(s.timestamp_ms for s in shaped if s.target == target)
            self._ledger.record(LossReason.DUPLICATE_SAMPLE, f'{{job="{target}"}}', ts, ts, samples)
        for batch in self._build(unique, version):
            payload = self._sink.append(batch, version)
            if payload is not None:
                spooled += batch.sample_count
                payloads.append(payload)
                if self._budget is not None:
                    self._budget.produced(len(payload), version)
        whole = spooled == sum(len(s) for s in shaped)
        return spooled, payloads if whole else []

    def _build(self, shaped: list[ShapedScrape], version: int) -> list[Batch]:
        try:
            return self._encoder.build(shaped, version)
        except ValueError as e:
            log.error("cannot encode this cycle as one batch (%s): spooling it scrape by scrape", e)
        batches, refused = self._encoder.build_each(shaped, version)
        for scrape, error in refused:
            log.error(
                "dropping %d samples of %s that cannot be encoded: %s", len(scrape), scrape.target, error
            )
            ts = scrape.timestamp_ms
            self._ledger.record(LossReason.ENCODE_ERROR, f'{{job="{scrape.target}"}}', ts, ts, len(scrape))
        return batches
