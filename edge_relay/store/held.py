"""Samples held in open aggregation windows, so that a kill -9 cannot lose them without a trace.

A stateful budget class folds a series' samples into a window of its resolution and sends one
aggregate when the window closes; until then the samples exist only in the shaper's memory. A clean
stop closes and sends every window; a SIGKILL (or the OOM killer, a power cut) loses them. Keeping
every open window durable would cost a spool write per sample; what the ledger needs is cheap: after
each cycle the relay stores how many samples its open windows hold and the span they cover (one small
row in the spool's meta table, only when it changed), and clears it after a clean stop. A relay that
starts and finds a count records it in the loss ledger as ``open_window_at_kill``, once.

The record is written right after the cycle's spool write, not in the same transaction: a kill
between the two (a few milliseconds a cycle) makes the entry one cycle off.
"""

from __future__ import annotations

import logging

from edge_relay.ledger import LossLedger, LossReason
from edge_relay.store.spool import MetaTable

log = logging.getLogger("edge_relay")

_SAMPLES, _FIRST, _LAST = "held_samples", "held_first_ms", "held_last_ms"


class HeldWindows:
    def __init__(self, meta: MetaTable, ledger: LossLedger) -> None:
        self._meta = meta
        self._ledger = ledger
        self._stored = (meta.get(_SAMPLES, 0), meta.get(_FIRST, 0), meta.get(_LAST, 0))

    def recover(self, jobs: list[str]) -> int:
        """At start: record what the last run held when it was killed (0 after a clean stop). ``jobs``
        names the series (the relay's targets; which of them held windows is not kept)."""
        samples, first_ms, last_ms = self._stored
        if samples <= 0:
            return 0
        series = "{job=~" + '"' + "|".join(jobs) + '"}' if jobs else "{}"
        self._ledger.record(LossReason.OPEN_WINDOW_AT_KILL, series, first_ms, last_ms, samples)
        log.warning(
            "the last run stopped without closing its aggregation windows (killed?): %d samples they "
            "held are in the loss ledger as %s",
            samples,
            LossReason.OPEN_WINDOW_AT_KILL,
        )
        self.update(0, 0, 0)
        return samples

    def update(self, samples: int, first_ms: int, last_ms: int) -> None:
        """After each cycle's spool write: what the open windows hold now."""
        value = (samples, first_ms, last_ms) if samples > 0 else (0, 0, 0)
        if value == self._stored:
            return
        self._meta.set({_SAMPLES: value[0], _FIRST: value[1], _LAST: value[2]})
        self._stored = value
