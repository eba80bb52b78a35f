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
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relay_common.mqtt_tls import tls_configure
from schemas import topics

log = logging.getLogger("cloud_ingest.subscribe")

MessageHandler = Callable[[mqtt.MQTTMessage], None]


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
    ) -> None:
        self.host, self.port = host, port
        self.keepalive_seconds = keepalive_seconds
        self.batch_filter = topics.batch_subscription(prefix, share_group)
        self.status_filter = topics.status_subscription(prefix)
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
        client.subscribe([(self.batch_filter, 1), (self.status_filter, 1)])
        self.connected.set()
        self.on_connection(True)

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
        self.on_batch(message)
