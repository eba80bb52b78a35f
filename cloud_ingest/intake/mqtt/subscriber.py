"""What the MQTT intake subscribes, and where each delivery goes.

Subscriptions, made at every connect (the session is persistent, but a broker may have lost it):

- the batches, as an MQTT v5 shared subscription (``$share/<group>/<prefix>/v1/+/+/batch``) so replicas
  split the load, and the retained status messages of the nodes (not shared: every replica keeps the
  fleet view); QoS 1, subscription identifier ``SHARED_ID``;
- following (wire format v3): with a share group and ``follow``, the batches again without ``$share``
  (QoS 0: a lost follow copy costs a ``need_state``, nothing else, and none is queued while the replica
  is away; identifier ``FOLLOW_ID``). Every replica then gets two deliveries of each frame it is handed;
  the subscription identifiers tell them apart (mosquitto 2 supports them). The follow subscription is
  sent first, in its own SUBSCRIBE packet (a packet carries one identifier), so it is live once the
  status subscription delivers. A persistent session keeps the follow subscription of an earlier run
  that followed: one that does not follow unsubscribes it;
- with an ``AckView``, the application acks of every replica (``<prefix>/v1/+/+/ack``, QoS 0: nothing is
  queued for it), after the others.

Routing, on paho's network thread: a status goes to the ``StatusFeed`` (and is PUBACKed at once), a
follow copy to the ``Follower`` (before anything else sees it: it takes no place in ``Admission`` and
is not a QoS 0 batch to refuse), an ack to the ``AckView``, every other delivery to ``BatchIntake``.
Refused subscriptions are told to the part that depends on them: the follower (no follow copies will
come, so the stream state stops waiting for them) and the ack view (the fleet view's seqs are
incomplete). Data only flows forward: nothing here is called back by the parts it feeds.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_ingest.intake.mqtt.batches import BatchIntake
from cloud_ingest.intake.mqtt.fleet_feed import AckView, StatusFeed
from cloud_ingest.intake.mqtt.follow import Follower
from cloud_ingest.intake.mqtt.session import MqttSession
from cloud_ingest.selfmetrics import IngestMetrics
from schemas import topics

log = logging.getLogger("cloud_ingest.subscribe")

SHARED_ID = 1  # subscription identifier of the batch (shared, or plain without a group) + status filters
FOLLOW_ID = 2  # ... of the follow filter


class Subscriber:
    def __init__(
        self,
        session: MqttSession,
        *,
        prefix: str,
        share_group: str | None,
        batches: BatchIntake,
        statuses: StatusFeed,
        acks: AckView | None = None,
        follow: bool = False,
        follower: Follower | None = None,
        metrics: IngestMetrics | None = None,
    ) -> None:
        self.session = session
        self.client = session.client
        self.batch_filter = topics.batch_subscription(prefix, share_group)
        self.status_filter = topics.status_subscription(prefix)
        # Only a shared batch subscription has a twin to follow; without a group it *is* that filter.
        grouped = share_group is not None
        self.follow_filter = topics.batch_subscription(prefix) if grouped and follow else None
        self.unfollow_filter = topics.batch_subscription(prefix) if grouped and not follow else None
        self.batches, self.statuses, self.acks, self.follower = batches, statuses, acks, follower
        self.metrics = metrics
        self.following = False  # follow subscription requested (and not refused) on this connection
        self._follow_mid: int | None = None
        self._ack_mid: int | None = None
        self.connected = threading.Event()
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        s = self.session
        if reason_code.is_failure:
            log.error("MQTT broker %s:%d refused the connection: %s", s.host, s.port, reason_code)
            return
        log.info(
            "connected to MQTT %s:%d (session present: %s); subscribing %s",
            s.host,
            s.port,
            flags.session_present,
            self.batch_filter,
        )
        self._subscribe_follow(client, properties)
        props = Properties(PacketTypes.SUBSCRIBE)
        props.SubscriptionIdentifier = SHARED_ID
        client.subscribe([(self.batch_filter, 1), (self.status_filter, 1)], properties=props)
        self.connected.set()
        self._connection(True)
        if self.acks is not None:
            # Before any message of the new connection is handled: acks published while this replica
            # was away are not queued for it (QoS 0), so the view's seq gaps are counted afresh.
            self.acks.reconnected()
            _, self._ack_mid = client.subscribe(self.acks.filter, qos=0)

    def _subscribe_follow(self, client: mqtt.Client, connack: Any) -> None:
        self.following, self._follow_mid = False, None
        if self.follow_filter is None:
            if self.unfollow_filter is not None:
                # A persistent session keeps the follow subscription of an earlier run that followed.
                client.unsubscribe(self.unfollow_filter)
        elif getattr(connack, "SubscriptionIdentifierAvailable", 1) == 0:
            log.warning(
                "the broker does not support subscription identifiers: not following %s (delta frames "
                "of other replicas' turns will be acked need_state)",
                self.follow_filter,
            )
            client.unsubscribe(self.follow_filter)
        else:
            props = Properties(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = FOLLOW_ID
            _, self._follow_mid = client.subscribe(self.follow_filter, qos=0, properties=props)
            self.following = True
        if self.follower is not None:
            self.follower.following(self.following)

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        if not any(rc.is_failure for rc in reason_codes):
            return
        if mid == self._follow_mid:
            log.warning(
                "the broker refused the follow subscription %s (%s): delta frames of other replicas' "
                "turns will be acked need_state; give the ingester read access to the batch topics",
                self.follow_filter,
                reason_codes[0],
            )
            self.following = False
            if self.follower is not None:
                self.follower.following(False)
        elif mid == self._ack_mid and self.acks is not None:
            self.acks.refused(reason_codes[0])

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        log.warning("disconnected from MQTT broker: %s", reason_code)
        self.connected.clear()
        self._connection(False)

    def _connection(self, up: bool) -> None:
        if self.metrics is not None:
            self.metrics.mqtt_connected.set(1 if up else 0)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic.endswith("/status"):
            try:
                self.statuses.status(message)
            finally:
                self.session.puback(message)
            return
        if self.follower is not None:
            ids = getattr(getattr(message, "properties", None), "SubscriptionIdentifier", None) or ()
            if FOLLOW_ID in ids and SHARED_ID not in ids:
                self.follower.submit(message)  # QoS 0: nothing to PUBACK
                return
        if message.topic.endswith("/ack"):
            if self.acks is not None:
                self.acks.ack(message)  # QoS 0: nothing to PUBACK
            return
        self.batches.offer(message)
