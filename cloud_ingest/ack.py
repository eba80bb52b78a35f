"""Stage 4 (cloud): tell the edge the outcome, then release the MQTT message.

The application ack goes to ``<prefix>/v1/<cluster>/<node>/ack`` (QoS 1); only after that is the
MQTT PUBACK is sent, so a replica that dies before this point leaves the message in its session at the
broker: mosquitto 2.0 redelivers it when that client id reconnects (it does not hand it to another member
of the share group), and in any case the edge publishes the batch again after its ack timeout. Ingester
replicas therefore need stable client ids (a StatefulSet, or CLOUD_INGEST_CLIENT_ID set per replica).
"""

from __future__ import annotations

from typing import Protocol

import paho.mqtt.client as mqtt

from schemas import codec, topics


class Connection(Protocol):
    def publish(self, topic: str, payload: bytes, *, qos: int = 1) -> None: ...

    def puback(self, message: mqtt.MQTTMessage) -> None: ...


class Acker:
    def __init__(self, connection: Connection, prefix: str) -> None:
        self.connection = connection
        self.prefix = prefix

    def ack(
        self,
        message: mqtt.MQTTMessage,
        *,
        cluster: str,
        node: str,
        seq: int,
        result: str,
        reason: str | None = None,
        incarnation: int = 0,
        written: int = 0,
        refused: int = 0,
    ) -> None:
        """Ack one batch; ``incarnation`` is the batch header's (0: it had none, nor will the ack);
        ``written`` and ``refused`` are the sample counts of a ``partial`` result. ``need_state`` (no
        reason, no counts) is only ever sent for a v3 frame: older relays refuse the key."""
        if reason is not None and len(reason) > codec.MAX_REASON_CHARS:
            # The full text is in the dead-letter store; the edge only needs to know why, briefly.
            reason = reason[: codec.MAX_REASON_CHARS - 3] + "..."
        payload = codec.encode_ack(
            node, [codec.AckResult(seq, result, reason or None, written, refused)], incarnation=incarnation
        )
        self.connection.publish(topics.ack_topic(self.prefix, cluster, node), payload, qos=1)
        self.connection.puback(message)

    def release(self, message: mqtt.MQTTMessage) -> None:
        """PUBACK without an application ack: the edge will publish the batch again later."""
        self.connection.puback(message)
