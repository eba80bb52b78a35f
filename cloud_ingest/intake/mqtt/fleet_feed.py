"""What the broker tells this replica about the fleet besides batches: the nodes' retained statuses, and
the application acks of every replica. Both go into the fleet view (``outcome/fleet.py``).

The ack view: a replica of a share group handles only some of a node's batches, so on its own it cannot
tell a seq another replica finished from a lost one. It therefore reads every replica's acks (QoS 0,
nothing queued for it): which seqs of a node are finished (``ok``, ``partial``) or were rejected
(``need_state`` is not: the relay sends that seq again). Seq gaps are only exported while that view is
complete: without a share group (every replica gets every batch), or once an ack has come back through
that subscription (the broker may refuse it: the ingester then needs read access to the ack topics).
"""

from __future__ import annotations

import logging
from typing import Any

import paho.mqtt.client as mqtt

from cloud_ingest.outcome.fleet import Fleet
from schemas import codec, topics

log = logging.getLogger("cloud_ingest")


class StatusFeed:
    """Retained status messages (``<prefix>/v1/<cluster>/<node>/status``) into the fleet view."""

    def __init__(self, fleet: Fleet, prefix: str) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self._malformed_logged = False

    def status(self, message: mqtt.MQTTMessage) -> None:
        try:
            cluster, node, _ = topics.parse_topic(self.prefix, message.topic)
            if not message.payload:
                return  # a cleared retained message
            status = codec.decode_status(message.payload)
        except (ValueError, codec.DecodeError) as e:
            if not self._malformed_logged:
                self._malformed_logged = True
                log.error(
                    "ignoring malformed status on %s: %s (further bad_status refusals from this node are "
                    "only counted)",
                    message.topic,
                    e,
                )
            return
        self.fleet.observe_status(cluster, node, status, retained=bool(message.retain))


class AckView:
    """Every replica's application acks (``filter``) into the fleet view's seq tracking."""

    def __init__(self, fleet: Fleet, prefix: str, *, share_group: str | None) -> None:
        self.fleet = fleet
        self.prefix = prefix
        self.filter = f"{prefix}/{topics.TOPIC_VERSION}/+/+/ack"
        # Without a share group every replica gets every batch, so it sees every seq by itself.
        self._alone = share_group is None
        self._complete = False  # an ack came back through the subscription (and it was not refused since)
        self._malformed_logged = False
        fleet.set_complete_view(self._alone)

    def reconnected(self) -> None:
        """Acks published while this replica was away are not queued for it: count gaps afresh."""
        self.fleet.reset_seq_tracking()

    def refused(self, reason_code: Any) -> None:
        """The broker refused the subscription to ``filter``."""
        log.warning(
            "the broker refused the subscription to %s (%s): seq gaps are only exported without a "
            "share group; give the ingester read access to the ack topics",
            self.filter,
            reason_code,
        )
        self._complete = False
        self.fleet.set_complete_view(self._alone)

    def ack(self, message: mqtt.MQTTMessage) -> None:
        """An application ack of any replica (this one included): which seqs of a node are finished."""
        try:
            cluster, node, _ = topics.parse_topic(self.prefix, message.topic)
            ack = codec.decode_ack(message.payload)
        except (ValueError, codec.DecodeError) as e:
            if not self._malformed_logged:
                self._malformed_logged = True
                log.warning("ignoring a malformed ack on %s: %s (logged once)", message.topic, e)
            return
        if ack.node != node:
            return
        self.fleet.observe_acks(
            cluster,
            node,
            # partial: finished too; need_state: not finished (the relay sends that seq again)
            ok=[r.seq for r in ack.results if r.result in ("ok", "partial")],
            rejected=[r.seq for r in ack.results if r.result == "rejected"],
            incarnation=ack.incarnation,
        )
        if not self._complete:
            self._complete = True
            self.fleet.set_complete_view(True)
