"""The MQTT intake's settling: tell the edge the outcome, then release the MQTT message.

The application ack goes to ``<prefix>/v1/<cluster>/<node>/ack`` (QoS 1); only after that is the MQTT
PUBACK sent, so a replica that dies before this point leaves the message in its session at the broker:
mosquitto 2.0 redelivers it when that client id reconnects (it does not hand it to another member of
the share group), and in any case the edge publishes the batch again after its ack timeout. Ingester
replicas therefore need stable client ids (a StatefulSet, or CLOUD_INGEST_CLIENT_ID set per replica).
"""

from __future__ import annotations

from typing import Protocol

import paho.mqtt.client as mqtt

from cloud_ingest.outcome.answer import Answer
from schemas import topics


class Connection(Protocol):
    def publish(self, topic: str, payload: bytes, *, qos: int = 1) -> None: ...

    def puback(self, message: mqtt.MQTTMessage) -> None: ...


class Acker:
    def __init__(self, connection: Connection, prefix: str) -> None:
        self.connection = connection
        self.prefix = prefix

    def ack(self, message: mqtt.MQTTMessage, answer: Answer) -> None:
        """Tell the edge ``answer`` (on its node's ack topic), then PUBACK."""
        topic = topics.ack_topic(self.prefix, answer.cluster, answer.node)
        self.connection.publish(topic, answer.encode(), qos=1)
        self.connection.puback(message)

    def release(self, message: mqtt.MQTTMessage) -> None:
        """PUBACK without an application ack: the edge will publish the batch again later."""
        self.connection.puback(message)
