"""Stage 1 (cloud): receive batches from the broker.

MQTT v5 shared subscription (``$share/<group>/<prefix>/v1/+/+/batch``) so replicas split the load;
stable client id and a persistent session so nothing is lost while a replica restarts; manual PUBACK,
sent by the ack stage only once the outcome of a batch is final. Retained status messages of the
nodes are subscribed too (not shared: every replica keeps the fleet view).

What a replica holds in memory is bounded here, not by the broker: ``Admission`` admits at most the
Receive Maximum we announce of batches received and not finished, and while that many are held it
keeps paho's network thread waiting, so nothing more is read from the socket (TCP backpressure up
to the broker). A broker that honours Receive Maximum never makes it wait; mosquitto 2.0.11 was seen
releasing 64 more messages per PUBACK. QoS 0 batches, which no flow control covers at all, are
refused by the service before they take a place.

Following (wire format v3, ``cloud_ingest/follow.py``): with a share group and ``follow``, the batches
are also subscribed without ``$share`` (QoS 0: a lost follow copy costs a ``need_state``, nothing
else, and none is queued while the replica is away). Every replica then gets two deliveries of each
frame it is handed; MQTT 5 subscription identifiers tell them apart (``SHARED_ID`` on the shared
batch and status subscription, ``FOLLOW_ID`` on the follow one; mosquitto 2 supports them). Follow
copies go to ``on_follow`` before anything else sees them: they take no place in ``Admission`` and
are not QoS 0 batches to refuse. The follow subscription is sent first, in its own SUBSCRIBE packet
(a packet carries one identifier), so it is live once the status subscription delivers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relay_common.mqtt_tls import tls_configure
from schemas import topics

if TYPE_CHECKING:
    from cloud_ingest.settings import Settings

log = logging.getLogger("cloud_ingest.subscribe")

MessageHandler = Callable[[mqtt.MQTTMessage], None]

SHARED_ID = 1  # subscription identifier of the batch (shared, or plain without a group) + status filters
FOLLOW_ID = 2  # ... of the follow filter


class Admission:
    """At most ``limit`` batches held (received and not finished); ``admit`` waits for a place.

    ``admit`` runs on paho's network thread: while it waits, that thread reads nothing more, and also
    sends nothing (PUBACKs queued by workers, pings). The wait ends as soon as a worker finishes a
    batch (``done``); should one batch take longer than 1.5 x the keepalive, the broker drops the
    connection and later redelivers what was not PUBACKed, which costs duplicates (writes are
    idempotent), never data. Returns False, without a place, once ``stop`` is set.
    """

    def __init__(self, limit: int, stop: threading.Event, *, log_interval_s: float = 60.0) -> None:
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self._stop = stop
        self._places = threading.BoundedSemaphore(limit)
        self._held = 0
        self._lock = threading.Lock()
        self._log_interval_s = log_interval_s
        self._logged_at = -float("inf")
        self.waits = 0  # how often a batch had to wait for a place

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def admit(self) -> bool:
        if not self._places.acquire(blocking=False):
            self.waits += 1
            now = time.monotonic()
            if now - self._logged_at >= self._log_interval_s:
                self._logged_at = now
                log.warning(
                    "holding %d batches (mqtt.receive_maximum), more than the broker should send: not "
                    "reading from it until one is finished (logged at most every %gs)",
                    self.limit,
                    self._log_interval_s,
                )
            while not self._places.acquire(timeout=0.5):
                if self._stop.is_set():
                    return False
        with self._lock:
            self._held += 1
        return True

    def done(self) -> None:
        with self._lock:
            self._held -= 1
        self._places.release()


class Subscriber:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        client_id: str,
        prefix: str,
        share_group: str | None,
        keepalive_seconds: int,
        session_expiry_seconds: int,
        receive_maximum: int,
        reconnect_min_seconds: float,
        reconnect_max_seconds: float,
        on_batch: MessageHandler,
        on_status: MessageHandler,
        on_connection: Callable[[bool], None] = lambda up: None,
        username: str | None = None,
        password: str | None = None,
        tls: Any = None,
        follow: bool = False,
        on_follow: MessageHandler | None = None,
        on_following: Callable[[bool], None] = lambda following: None,
    ) -> None:
        self.host, self.port = host, port
        self.keepalive_seconds = keepalive_seconds
        self.batch_filter = topics.batch_subscription(prefix, share_group)
        self.status_filter = topics.status_subscription(prefix)
        # Only a shared batch subscription has a twin to follow; without a group it *is* that filter.
        grouped = share_group is not None
        self.follow_filter = topics.batch_subscription(prefix) if grouped and follow else None
        self.unfollow_filter = topics.batch_subscription(prefix) if grouped and not follow else None
        self.on_follow, self.on_following = on_follow, on_following
        self.following = False  # follow subscription requested (and not refused) on this connection
        self._follow_mid: int | None = None
        self.on_batch, self.on_status, self.on_connection = on_batch, on_status, on_connection
        self.session_expiry_seconds = session_expiry_seconds
        self.receive_maximum = receive_maximum
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=mqtt.MQTTv5,
            manual_ack=True,
        )
        self.client.reconnect_delay_set(
            max(1, int(reconnect_min_seconds)), max(1, int(reconnect_max_seconds))
        )
        self.client.max_inflight_messages_set(64)
        if username is not None:
            self.client.username_pw_set(username, password)
        tls_configure(self.client, tls)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.client.on_message = self._on_message
        self.client.on_subscribe = self._on_subscribe
        self.connected = threading.Event()

    def start(self) -> None:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = self.session_expiry_seconds
        props.ReceiveMaximum = self.receive_maximum
        # connect_async + loop_start: paho's thread connects, and reconnects after a loss.
        self.client.connect_async(
            self.host, self.port, self.keepalive_seconds, clean_start=False, properties=props
        )
        self.client.loop_start()

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def publish(self, topic: str, payload: bytes, *, qos: int = 1) -> None:
        self.client.publish(topic, payload, qos=qos)

    def puback(self, message: mqtt.MQTTMessage) -> None:
        if message.qos > 0:
            self.client.ack(message.mid, message.qos)

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker %s:%d refused the connection: %s", self.host, self.port, reason_code)
            return
        log.info(
            "connected to MQTT %s:%d (session present: %s); subscribing %s",
            self.host,
            self.port,
            flags.session_present,
            self.batch_filter,
        )
        self._subscribe_follow(client, properties)
        props = Properties(PacketTypes.SUBSCRIBE)
        props.SubscriptionIdentifier = SHARED_ID
        client.subscribe([(self.batch_filter, 1), (self.status_filter, 1)], properties=props)
        self.connected.set()
        self.on_connection(True)

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
        self.on_following(self.following)

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        if mid == self._follow_mid and any(rc.is_failure for rc in reason_codes):
            log.warning(
                "the broker refused the follow subscription %s (%s): delta frames of other replicas' "
                "turns will be acked need_state; give the ingester read access to the batch topics",
                self.follow_filter,
                reason_codes[0],
            )
            self.following = False
            self.on_following(False)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        log.warning("disconnected from MQTT broker: %s", reason_code)
        self.connected.clear()
        self.on_connection(False)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic.endswith("/status"):
            try:
                self.on_status(message)
            finally:
                self.puback(message)
            return
        if self.on_follow is not None:
            ids = getattr(getattr(message, "properties", None), "SubscriptionIdentifier", None) or ()
            if FOLLOW_ID in ids and SHARED_ID not in ids:
                self.on_follow(message)  # QoS 0: nothing to PUBACK
                return
        self.on_batch(message)


def tool_client(s: Settings, client_id: str) -> mqtt.Client:
    """An MQTT 5 client with the ingester's identity and TLS, for the one-shot commands (``fleet``,
    ``backfill``); connect it with ``tool_connect``."""
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
    )
    if s.username is not None:
        client.username_pw_set(s.username, s.password)
    tls_configure(client, s.tls)
    return client


def tool_connect(client: mqtt.Client, s: Settings) -> None:
    """Connect with a clean session that expires at once: a command leaves nothing behind at the
    broker, and never takes over the running ingester's session. Raises OSError / ValueError."""
    props = Properties(PacketTypes.CONNECT)
    props.SessionExpiryInterval = 0
    client.connect(s.mqtt_host, s.mqtt_port, s.keepalive_seconds, clean_start=True, properties=props)
