"""The MQTT connection of the intake: one MQTT 5 client with a persistent session and manual PUBACK,
used by the subscriber (what comes in) and the acker (what goes out).

Stable client id and a persistent session (``clean_start`` false, ``session_expiry_seconds``), so nothing
is lost while a replica restarts; manual PUBACK, sent only once the outcome of a batch is final. The
Receive Maximum announced here is what ``Admission`` holds the intake to. paho's thread connects, and
reconnects after a loss (between ``reconnect_min_seconds`` and ``reconnect_max_seconds``).
"""

from __future__ import annotations

from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from relay_common.mqtt_tls import tls_configure


class MqttSession:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        client_id: str,
        keepalive_seconds: int,
        session_expiry_seconds: int,
        receive_maximum: int,
        reconnect_min_seconds: float,
        reconnect_max_seconds: float,
        username: str | None = None,
        password: str | None = None,
        tls: Any = None,
    ) -> None:
        self.host, self.port = host, port
        self.keepalive_seconds = keepalive_seconds
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
