"""Typed view of the edge relay's configuration.

Keys, defaults and their documentation live in schemas/edge-relay-config.schema.json.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from relay_common import config as config_loader
from relay_common.config import ConfigError
from relay_common.mqtt_tls import TLS, tls_from
from relay_common.relabel import LABEL_NAME, RelabelError, Rule, compile_rules, relabel
from schemas import topics

log = logging.getLogger("edge_relay")
SCHEMA = "edge-relay-config.schema.json"
ENV_OVERRIDES: tuple[config_loader.EnvOverride, ...] = (
    ("node", ("EDGE_RELAY_NODE", "NODE_NAME"), str),
    ("scrape.interval_seconds", ("EDGE_RELAY_SCRAPE_INTERVAL",), float),
    ("mqtt.username", ("EDGE_RELAY_MQTT_USERNAME",), str),
    ("mqtt.password", ("EDGE_RELAY_MQTT_PASSWORD",), str),
)
# A target at this URL reads the node's NVIDIA GPUs through NVML (edge_relay.collect.nvml) instead of
# scraping an exporter: NVML sees only the GPUs of the machine it runs on, hence `local`.
NVML_URL = "nvml://local"


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    job: str
    instance: str
    format: str
    labels: dict[str, str]
    # scrape.metric_relabel_configs, then the target's own list (relay_common.relabel).
    metric_relabel: tuple[Rule, ...] = ()

    @property
    def kind(self) -> str:
        """``http`` (an exporter's page) or ``nvml`` (the node's GPUs, read through NVML)."""
        return "nvml" if self.url == NVML_URL else "http"


@dataclass(frozen=True, slots=True)
class MQTT:
    host: str
    port: int
    protocol: str
    client_id: str
    username: str | None
    password: str | None
    tls: TLS | None
    keepalive_seconds: int
    session_expiry_seconds: int
    topic_prefix: str
    inflight_batches: int
    ack_timeout_seconds: float
    reconnect_min_seconds: float
    reconnect_max_seconds: float
    status_interval_seconds: float
    order: str = "live_first"


@dataclass(frozen=True, slots=True)
class Settings:
    source: str
    node: str
    cluster: str
    add_node_labels: bool
    external_labels: dict[str, str]
    log_level: str
    interval_seconds: float
    timeout_seconds: float
    body_limit_bytes: int
    sample_limit: int
    targets: tuple[Target, ...]
    spool_path: str
    spool_synchronous: str
    spool_max_bytes: int
    spool_cap_bytes: int
    spool_max_age_seconds: float
    spool_max_degrade_factor: int
    batch_max_bytes: int
    zstd_level: int
    format_version: int
    mqtt: MQTT
    metrics_listen: str
    budget_file: str = ""  # resolved against the config file's directory; "" = no budget
    # The flight recorder (edge_relay.recorder.flight); max_bytes 0 disables it.
    recorder_max_bytes: int = 0
    recorder_max_age_seconds: float = 0.0
    recorder_block_seconds: float = 60.0
    # Stream coding at publication (edge_relay.uplink.stream): wire format v3 frames.
    stream_enabled: bool = False
    stream_keyframe_every: int = 360
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


def _instance_for(url: str, node: str, key: str, source: str) -> str:
    if url == NVML_URL:  # the schema admits no other nvml:// URL
        return f"{node}:nvml"
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:
        raise ConfigError(
            f"{source}: key `{key}`: expected a URL with a valid port, got {url!r} ({e})"
        ) from e
    if not parts.hostname:
        raise ConfigError(f"{source}: key `{key}`: expected a URL with a host, got {url!r}")
    return f"{node}:{port}"


def _rules(raw: list[dict[str, Any]], key: str, source: str) -> tuple[Rule, ...]:
    try:
        return compile_rules(raw, key)
    except RelabelError as e:
        raise ConfigError(f"{source}: {e}") from e


def _target(
    t: dict[str, Any], i: int, node: str, global_rules: tuple[Rule, ...], source: str
) -> Target | None:
    """One target, its labels relabeled by its ``relabel_configs``; None if they drop it."""
    instance = t.get("instance") or _instance_for(t["url"], node, f"targets[{i}].url", source)
    labels = {"job": t.get("job", t["name"]), "instance": instance, **t["labels"]}
    target_rules = _rules(t["relabel_configs"], f"targets[{i}].relabel_configs", source)
    if target_rules:
        url = urlsplit(t["url"])
        meta = {
            "__address__": url.netloc,
            "__scheme__": url.scheme,
            "__metrics_path__": url.path or "/",
            "__meta_edge_relay_target_name": t["name"],
            "__meta_edge_relay_node": node,
        }
        relabeled = relabel(target_rules, {**meta, **labels})
        if relabeled is None:
            log.info("target %s is dropped by its relabel_configs: not scraped", t["name"])
            return None
        # As in Prometheus: meta labels go, a removed instance comes back (here: its default).
        labels = {k: v for k, v in relabeled.items() if not k.startswith("__")}
        labels.setdefault("instance", instance)
        bad = sorted(k for k in labels if not LABEL_NAME.fullmatch(k))
        if bad:
            raise ConfigError(
                f"{source}: key `targets[{i}].relabel_configs`: expected label names, the rules make {bad}"
            )
    job, instance = labels.pop("job", ""), labels.pop("instance")
    own_rules = _rules(t["metric_relabel_configs"], f"targets[{i}].metric_relabel_configs", source)
    return Target(
        name=t["name"],
        url=t["url"],
        job=job,
        instance=instance,
        format=t["format"],
        labels=labels,
        metric_relabel=global_rules + own_rules,
    )


def _beside(source: str, path: str) -> str:
    """``path`` relative to the config file's directory (the budget ships next to the config)."""
    if not path:
        return ""
    return os.path.join(os.path.dirname(os.path.abspath(source)), os.path.expanduser(path))


def load(path: str) -> Settings:
    raw = config_loader.load(path, SCHEMA, ENV_OVERRIDES)
    return from_dict(raw, path)


def from_dict(raw: dict[str, Any], source: str) -> Settings:
    node = raw.get("node") or socket.gethostname()
    cluster = raw["cluster"]
    scrape, mqtt = raw["scrape"], raw["mqtt"]
    for key, check, value in (
        ("node", topics.validate_name, node),
        ("cluster", topics.validate_name, cluster),
        ("mqtt.topic_prefix", None, mqtt["topic_prefix"]),
    ):
        try:
            if check is None:
                topics.validate_prefix(value)
            else:
                check(key, value)
        except ValueError as e:
            raise ConfigError(f"{source}: key `{key}`: {e}") from e
    names = [t["name"] for t in raw["targets"]]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"{source}: key `targets`: target names must be unique, repeated: {duplicates}")
    config_loader.check_range(mqtt, "mqtt", "reconnect_min_seconds", "reconnect_max_seconds", source)
    tls = tls_from(mqtt.get("tls"))
    global_rules = _rules(scrape["metric_relabel_configs"], "scrape.metric_relabel_configs", source)
    targets = tuple(
        target
        for i, t in enumerate(raw["targets"])
        if (target := _target(t, i, node, global_rules, source)) is not None
    )
    return Settings(
        source=source,
        node=node,
        cluster=cluster,
        add_node_labels=raw["add_node_labels"],
        external_labels=dict(raw["external_labels"]),
        log_level=raw["log_level"],
        interval_seconds=float(scrape["interval_seconds"]),
        timeout_seconds=min(float(scrape["timeout_seconds"]), float(scrape["interval_seconds"])),
        body_limit_bytes=scrape["body_limit_bytes"],
        sample_limit=scrape["sample_limit"],
        targets=targets,
        spool_path=os.path.expanduser(raw["spool"]["path"]),
        spool_synchronous=raw["spool"]["synchronous"],
        spool_max_bytes=raw["spool"]["max_bytes"],
        spool_cap_bytes=raw["spool"]["cap_bytes"] or raw["spool"]["max_bytes"] * 4 // 5,
        spool_max_age_seconds=float(raw["spool"]["max_age_seconds"]),
        spool_max_degrade_factor=raw["spool"]["max_degrade_factor"],
        batch_max_bytes=raw["batch"]["max_bytes"],
        zstd_level=raw["batch"]["zstd_level"],
        format_version=raw["batch"]["format_version"],
        mqtt=MQTT(
            host=mqtt["host"],
            port=mqtt["port"],
            protocol=mqtt["protocol"],
            client_id=mqtt.get("client_id") or f"edge-relay-{cluster}-{node}",
            username=mqtt.get("username"),
            password=mqtt.get("password"),
            tls=tls,
            keepalive_seconds=mqtt["keepalive_seconds"],
            session_expiry_seconds=mqtt["session_expiry_seconds"],
            topic_prefix=mqtt["topic_prefix"],
            inflight_batches=mqtt["inflight_batches"],
            ack_timeout_seconds=float(mqtt["ack_timeout_seconds"]),
            reconnect_min_seconds=float(mqtt["reconnect_min_seconds"]),
            reconnect_max_seconds=float(mqtt["reconnect_max_seconds"]),
            status_interval_seconds=float(mqtt["status_interval_seconds"]),
            order=mqtt["order"],
        ),
        metrics_listen=raw["metrics"]["listen"],
        budget_file=_beside(source, raw["budget_file"]),
        recorder_max_bytes=raw["recorder"]["max_bytes"],
        recorder_max_age_seconds=float(raw["recorder"]["max_age_seconds"]),
        recorder_block_seconds=float(raw["recorder"]["block_seconds"]),
        stream_enabled=raw["stream"]["enabled"],
        stream_keyframe_every=raw["stream"]["keyframe_every"],
        raw=raw,
    )
