"""Typed view of the ingester's configuration.

Keys, defaults and their documentation live in schemas/cloud-ingest-config.schema.json.
"""

from __future__ import annotations

import socket
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from cloud_ingest.sinks.remote_write.client import check_headers
from cloud_ingest.sinks.remote_write.connection import Connection, check_connection, connection_from
from relay_common import config as config_loader
from relay_common.config import ConfigError
from relay_common.mqtt_tls import TLS, tls_from
from relay_common.relabel import RelabelError, Rule, compile_rules
from schemas import topics
from schemas.codec import Limits

SCHEMA = "cloud-ingest-config.schema.json"
ENV_OVERRIDES: tuple[config_loader.EnvOverride, ...] = (
    ("mqtt.client_id", ("CLOUD_INGEST_CLIENT_ID",), str),
    ("mqtt.password", ("CLOUD_INGEST_MQTT_PASSWORD",), str),
    ("remote_write.url", ("CLOUD_INGEST_REMOTE_WRITE_URL",), str),
)


@dataclass(frozen=True, slots=True)
class RemoteWriteTarget:
    """One entry of ``remote_write`` (the section itself when it is a single mapping)."""

    name: str
    required: bool
    queue_batches: int
    url: str
    timeout_seconds: float
    headers: dict[str, str]
    connection: Connection  # credentials, TLS, proxy
    retry_min_seconds: float
    retry_max_seconds: float
    max_retry_seconds: float
    isolate_max_writes: int
    write_relabel: tuple[Rule, ...] = ()  # write_relabel_configs, compiled


@dataclass(frozen=True, slots=True)
class Settings:
    source: str
    log_level: str
    mqtt_host: str
    mqtt_port: int
    client_id: str
    username: str | None
    password: str | None
    tls: TLS | None
    keepalive_seconds: int
    session_expiry_seconds: int
    topic_prefix: str
    share_group: str | None
    receive_maximum: int
    reconnect_min_seconds: float
    reconnect_max_seconds: float
    follow: bool  # mqtt.follow: with a share group, follow every node's v3 frames (intake/mqtt/follow.py)
    stream_max_nodes: int
    stream_keep_states: int
    state_wait_seconds: float
    remote_write_targets: tuple[RemoteWriteTarget, ...]
    workers: int
    limits: Limits
    max_future_seconds: float
    dead_letter_path: str
    dead_letter_max_bytes: int
    metrics_listen: str
    raw: dict[str, Any] = field(repr=False, default_factory=dict)

    # The first target's settings under the names they had when there was one target only.
    @property
    def remote_write_url(self) -> str:
        return self.remote_write_targets[0].url

    @property
    def remote_write_timeout_seconds(self) -> float:
        return self.remote_write_targets[0].timeout_seconds

    @property
    def remote_write_headers(self) -> dict[str, str]:
        return self.remote_write_targets[0].headers

    @property
    def remote_write_connection(self) -> Connection:
        return self.remote_write_targets[0].connection

    @property
    def retry_min_seconds(self) -> float:
        return self.remote_write_targets[0].retry_min_seconds

    @property
    def retry_max_seconds(self) -> float:
        return self.remote_write_targets[0].retry_max_seconds

    @property
    def max_retry_seconds(self) -> float:
        return self.remote_write_targets[0].max_retry_seconds

    @property
    def isolate_max_writes(self) -> int:
        return self.remote_write_targets[0].isolate_max_writes


def load(path: str) -> Settings:
    return from_dict(config_loader.load(path, SCHEMA, ENV_OVERRIDES), path)


def from_dict(raw: dict[str, Any], source: str) -> Settings:
    mqtt, rw, lim = raw["mqtt"], raw["remote_write"], raw["limits"]
    try:
        topics.validate_prefix(mqtt["topic_prefix"])
    except ValueError as e:
        raise ConfigError(f"{source}: key `mqtt.topic_prefix`: {e}") from e
    config_loader.check_range(mqtt, "mqtt", "reconnect_min_seconds", "reconnect_max_seconds", source)
    return Settings(
        source=source,
        log_level=raw["log_level"],
        mqtt_host=mqtt["host"],
        mqtt_port=mqtt["port"],
        client_id=mqtt.get("client_id") or f"cloud-ingest-{socket.gethostname()}",
        username=mqtt.get("username"),
        password=mqtt.get("password"),
        tls=tls_from(mqtt.get("tls")),
        keepalive_seconds=mqtt["keepalive_seconds"],
        session_expiry_seconds=mqtt["session_expiry_seconds"],
        topic_prefix=mqtt["topic_prefix"],
        share_group=mqtt["share_group"] or None,
        receive_maximum=mqtt["receive_maximum"],
        reconnect_min_seconds=float(mqtt["reconnect_min_seconds"]),
        reconnect_max_seconds=float(mqtt["reconnect_max_seconds"]),
        follow=bool(mqtt["follow"]),
        stream_max_nodes=int(raw["stream"]["max_nodes"]),
        stream_keep_states=int(raw["stream"]["keep_states"]),
        state_wait_seconds=float(raw["stream"]["state_wait_seconds"]),
        remote_write_targets=remote_write_targets(rw, source),
        workers=raw["workers"],
        limits=Limits(
            max_payload_bytes=lim["max_payload_bytes"],
            max_decompressed_bytes=lim["max_decompressed_bytes"],
            max_series=lim["max_series"],
            max_samples=lim["max_samples"],
            max_labels_per_series=lim["max_labels_per_series"],
            max_label_value_bytes=lim["max_label_value_bytes"],
        ),
        max_future_seconds=float(lim["max_future_seconds"]),
        dead_letter_path=raw["dead_letter"]["path"],
        dead_letter_max_bytes=raw["dead_letter"]["max_bytes"],
        metrics_listen=raw["metrics"]["listen"],
        raw=raw,
    )


def remote_write_targets(
    rw: dict[str, Any] | list[dict[str, Any]], source: str
) -> tuple[RemoteWriteTarget, ...]:
    """The validated ``remote_write`` section (one mapping or a list) as targets, each checked; errors
    name the key (``remote_write.x`` for the single form, ``remote_write[i].x`` for a list)."""
    sections = (
        [(rw, "remote_write")]
        if isinstance(rw, dict)
        else [(t, f"remote_write[{i}]") for i, t in enumerate(rw)]
    )
    targets: list[RemoteWriteTarget] = []
    for i, (t, key) in enumerate(sections):
        config_loader.check_range(t, key, "retry_min_seconds", "retry_max_seconds", source)
        # One header at a time so the message names its key; then the whole map (a name given twice).
        for name, value in t["headers"].items():
            try:
                check_headers({name: value})
            except ValueError as e:
                raise ConfigError(f"{source}: key `{key}.headers.{name}`: {e}") from e
        try:
            check_headers(t["headers"])
        except ValueError as e:
            raise ConfigError(f"{source}: key `{key}.headers`: {e}") from e
        connection = connection_from(t, key)
        check_connection(t, connection, source)
        try:
            write_relabel = compile_rules(t["write_relabel_configs"], f"{key}.write_relabel_configs")
        except RelabelError as e:
            raise ConfigError(f"{source}: {e}") from e
        names = {target.name for target in targets}
        name = t.get("name")
        if name in names:
            raise ConfigError(f"{source}: key `{key}.name`: {name!r} is the name of another target")
        if name is None:
            name = urllib.parse.urlsplit(t["url"]).netloc
            name = f"{name}#{i}" if name in names else name
        targets.append(
            RemoteWriteTarget(
                name=name,
                required=bool(t["required"]),
                queue_batches=int(t["queue_batches"]),
                url=t["url"],
                timeout_seconds=float(t["timeout_seconds"]),
                headers=dict(t["headers"]),
                connection=connection,
                retry_min_seconds=float(t["retry_min_seconds"]),
                retry_max_seconds=float(t["retry_max_seconds"]),
                max_retry_seconds=float(t["max_retry_seconds"]),
                isolate_max_writes=int(t["isolate_max_writes"]),
                write_relabel=write_relabel,
            )
        )
    if not any(target.required for target in targets):
        raise ConfigError(f"{source}: key `remote_write`: no target is required; at least one must be")
    return tuple(targets)
