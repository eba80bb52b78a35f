"""The relay's uplink in process, for the tests of the uplink and of what the cloud answers it.

``mqtt_settings``: the relay's MQTT settings for a broker on loopback (no TLS, no credentials, a client
id of its own, quick reconnects); ``spool_uplink``: an ``Uplink`` that sends a spool's batches, wired
as the relay's app wires it (send queue, in-flight table, status from the spool and its loss ledger),
not started.
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from edge_relay.ledger import LossLedger
from edge_relay.recorder.backfill import CommandInbox
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import MQTT
from edge_relay.store.spool import InFlight, SendQueue, Spool
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.status import StatusReport
from testkit.services import LOOPBACK


def mqtt_settings(port: int, **overrides: Any) -> MQTT:
    """Settings for the broker on ``127.0.0.1:port``; ``overrides`` replace any field."""
    cfg = MQTT(
        host=LOOPBACK,
        port=port,
        protocol="v5",
        client_id=f"edge-relay-{uuid.uuid4().hex[:8]}",
        username=None,
        password=None,
        tls=None,
        keepalive_seconds=5,
        session_expiry_seconds=300,
        topic_prefix="edgemetrics",
        inflight_batches=10,
        ack_timeout_seconds=30.0,
        reconnect_min_seconds=0.1,
        reconnect_max_seconds=0.5,
        status_interval_seconds=60.0,
    )
    return replace(cfg, **overrides)


def spool_uplink(
    cfg: MQTT,
    spool: Spool,
    *,
    cluster: str,
    node: str,
    live_window_s: float = 0.0,
    metrics: RelayMetrics | None = None,
    commands: CommandInbox | None = None,
) -> Uplink:
    """An uplink sending ``spool``'s batches (``live_window_s`` 0: no row counts as live, so the
    backlog goes oldest first), not started."""
    return Uplink(
        cfg,
        cluster=cluster,
        node=node,
        queue=SendQueue(
            spool.batches, order=cfg.order, inflight_limit=cfg.inflight_batches, live_window_s=live_window_s
        ),
        inflight=InFlight(),
        metrics=RelayMetrics() if metrics is None else metrics,
        status=StatusReport(spool, LossLedger(spool.losses), None),
        commands=commands,
    )
