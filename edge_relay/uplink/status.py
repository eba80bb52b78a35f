"""The node's retained status message body: spool depth, oldest unsent sample, losses, budget state.

Built once from the parts it reports on and handed to the uplink, which publishes it on connect and
every ``mqtt.status_interval_seconds`` (adding what only it knows, such as the batches in flight). The
loss ledger's totals travel with it, so the cloud can tell "offline, data safe" from "data lost".
"""

from __future__ import annotations

from typing import Any, Protocol

from edge_relay.ledger import LossLedger
from edge_relay.store.spool import Spool


class StatusSource(Protocol):
    """A part that adds fields of its own (the budget in force: its state, its anomaly detector)."""

    def status_fields(self) -> dict[str, Any]: ...


class StatusReport:
    def __init__(self, spool: Spool, ledger: LossLedger, budget: StatusSource | None) -> None:
        self._spool = spool
        self._ledger = ledger
        self._budget = budget

    def fields(self) -> dict[str, Any]:
        st = self._spool.stats()
        totals = self._ledger.totals()
        status: dict[str, Any] = {
            "spool_rows": st.rows,
            "spool_bytes": st.bytes,
            "spool_samples": st.samples,
            "oldest_unsent_ms": st.oldest_first_ts_ms,
            "quarantined_rows": st.quarantined_rows,
            "lost_samples": sum(totals.values()),
        }
        if st.staged_rows:
            status["staged_samples"] = st.staged_samples
        # The flight recorder's span: how far back the node can answer at full resolution.
        rec = self._spool.recorder.stats()
        if rec.blocks:
            status["recorder_bytes"] = rec.bytes
            status["recorder_oldest_ms"] = rec.oldest_ts_ms
        for reason, samples in totals.items():
            status[f"lost_{reason}"] = samples
        if self._budget is not None:
            status.update(self._budget.status_fields())
        return status
