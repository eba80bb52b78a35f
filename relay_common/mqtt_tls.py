"""MQTT TLS settings, shared by the relay and the ingester."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt


@dataclass(frozen=True, slots=True)
class TLS:
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    insecure_skip_verify: bool


def tls_from(raw: dict[str, Any] | None) -> TLS | None:
    """From the validated `mqtt.tls` config section (absent = plain TCP)."""
    if raw is None:
        return None
    return TLS(raw.get("ca_file"), raw.get("cert_file"), raw.get("key_file"), raw["insecure_skip_verify"])


def tls_configure(client: mqtt.Client, tls: TLS | None) -> None:
    if tls is None:
        return
    client.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file, keyfile=tls.key_file)
    if tls.insecure_skip_verify:
        client.tls_insecure_set(True)
