"""The broker connection of the one-shot commands (``fleet``, ``backfill``): the ingester's identity and
TLS, a client id and a clean session of their own."""

from __future__ import annotations

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from cloud_ingest.settings import Settings
from relay_common.mqtt_tls import tls_configure


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
