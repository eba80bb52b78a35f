"""Stage 1 (cloud): receive batches from the broker.

MQTT v5 shared subscription (``$share/<group>/<prefix>/v1/+/+/batch``) so replicas split the load;
stable client id and a persistent session so nothing is lost while a replica restarts; manual PUBACK,
sent by the ack stage only once the outcome of a batch is final. Retained status messages of the
nodes are subscribed too (not shared: every replica keeps the fleet view).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relay_common.mqtt_tls import tls_configure
from schemas import topics

log = logging.getLogger("cloud_ingest.subscribe")

MessageHandler = Callable[[mqtt.MQTTMessage], None]


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
