"""Tests of config loading: relay_common/config.py, both settings modules, configdoc and the JSON Schemas."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from cloud_ingest import settings as cloud_settings
from edge_relay import budget as relay_budget
from edge_relay import settings as edge_settings
from relay_common import config as config_loader
from relay_common import configdoc
from relay_common.config import ConfigError
from relay_common.mqtt_tls import TLS

ROOT = Path(__file__).resolve().parents[2]
EDGE_EXAMPLE = ROOT / "deploy" / "examples" / "edge-relay.yaml"
CLOUD_EXAMPLE = ROOT / "deploy" / "examples" / "cloud-ingest.yaml"
EDGE_SCHEMA = edge_settings.SCHEMA
CLOUD_SCHEMA = cloud_settings.SCHEMA
BUDGET_SCHEMA = relay_budget.SCHEMA

MINIMAL_EDGE = """\
node: n1
targets:
  - name: kepler
    url: http://127.0.0.1:28282/metrics
"""

MINIMAL_CLOUD = """\
remote_write:
  url: http://127.0.0.1:9090/api/v1/write
"""


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def edge_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        edge_settings.load(path)
    message = str(info.value)
    assert path in message, f"error does not name the file: {message}"
    return message


def cloud_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        cloud_settings.load(path)
    message = str(info.value)
    assert path in message, f"error does not name the file: {message}"
    return message


def schema_properties(schema: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(dotted key, sub-schema) for every property, list items spelled ``key[]``."""
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        yield key, sub
        yield from schema_properties(sub, f"{key}.")
        items = sub.get("items")
        if isinstance(items, Mapping):
            yield from schema_properties(items, f"{key}[].")


# --------------------------------------------------------------------------------------------------
# Example configs and defaults


def test_edge_example_loads_with_defaults() -> None:
    s = edge_settings.load(str(EDGE_EXAMPLE))
    assert s.source == str(EDGE_EXAMPLE)
    assert s.node == "edge-gpu-01"
    assert s.cluster == "factory-north"
    assert [t.name for t in s.targets] == ["kepler", "dcgm", "node"]
    assert [t.job for t in s.targets] == ["kepler", "dcgm", "node"]
    assert [t.instance for t in s.targets] == ["edge-gpu-01:28282", "edge-gpu-01:9400", "edge-gpu-01:9100"]
    assert all(t.format == "auto" and t.labels == {} for t in s.targets)
    assert s.interval_seconds == 5.0
    assert s.timeout_seconds == 4.0
    assert s.sample_limit == 200_000
    assert s.spool_path == "/var/lib/edge-relay/spool.db"
    assert s.mqtt.host == "mosquitto.kubeedge.svc"
    assert s.mqtt.port == 1883
    assert s.mqtt.topic_prefix == "edgemetrics"
    assert s.mqtt.tls is None
    assert s.mqtt.password is None
    assert s.mqtt.client_id == "edge-relay-factory-north-edge-gpu-01"
    assert s.metrics_listen == "0.0.0.0:9901"


def test_cloud_example_loads_with_defaults() -> None:
    s = cloud_settings.load(str(CLOUD_EXAMPLE))
    assert s.mqtt_host == "mqtt.example.internal"
    assert s.mqtt_port == 1883
    assert s.topic_prefix == "edgemetrics"
    assert s.share_group == "ingest"
    assert s.remote_write_url == "http://prometheus:9090/api/v1/write"
    assert s.remote_write_headers == {}
    assert s.workers == 2
    assert s.tls is None
    assert s.dead_letter_path == "/var/lib/cloud-ingest/dead-letter.db"
    assert s.metrics_listen == "0.0.0.0:9902"
    assert s.max_future_seconds == 600.0
    assert s.limits.max_payload_bytes == 1 << 20
    assert s.limits.max_labels_per_series == 64


def test_edge_minimal_config_gets_every_default(tmp_path: Path) -> None:
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    assert s.cluster == "default"
    assert s.add_node_labels is True
    assert s.external_labels == {}
    assert s.log_level == "INFO"
    assert s.interval_seconds == 5.0
    assert s.timeout_seconds == 4.0
    assert s.body_limit_bytes == 64 << 20
    assert s.sample_limit == 200_000
    assert s.spool_synchronous == "FULL"
    assert s.spool_max_bytes == 0
    assert s.batch_max_bytes == 1_000_000
    assert s.zstd_level == 3
    m = s.mqtt
    assert (m.host, m.port, m.protocol) == ("127.0.0.1", 1883, "auto")
    assert m.tls is None
    assert m.username is None and m.password is None
    assert m.keepalive_seconds == 30
    assert m.session_expiry_seconds == 604_800
    assert m.inflight_batches == 16
    assert m.ack_timeout_seconds == 60.0
    assert (m.reconnect_min_seconds, m.reconnect_max_seconds) == (1.0, 60.0)
    assert m.client_id == "edge-relay-default-n1"
    assert s.metrics_listen == "127.0.0.1:9901"
    # An optional section without a default stays absent: "not configured" remains visible.
    assert "tls" not in s.raw["mqtt"]
    assert s.raw["scrape"]["interval_seconds"] == 5


def test_cloud_minimal_config_gets_every_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cloud_settings.socket, "gethostname", lambda: "ingest-host")
    s = cloud_settings.load(write(tmp_path, MINIMAL_CLOUD))
    assert s.client_id == "cloud-ingest-ingest-host"
    assert (s.mqtt_host, s.mqtt_port) == ("127.0.0.1", 1883)
    assert s.tls is None
    assert s.share_group == "ingest"
    assert s.receive_maximum == 64
    assert s.remote_write_timeout_seconds == 30.0
    assert (s.retry_min_seconds, s.retry_max_seconds, s.max_retry_seconds) == (0.5, 30.0, 300.0)
    assert s.workers == 2
    assert s.metrics_listen == "127.0.0.1:9902"
    assert "tls" not in s.raw["mqtt"]


def test_cloud_empty_share_group_means_plain_subscription(tmp_path: Path) -> None:
    s = cloud_settings.load(write(tmp_path, MINIMAL_CLOUD + "mqtt:\n  share_group: ''\n"))
    assert s.share_group is None


@pytest.mark.parametrize(
    ("schema_name", "text"), [(EDGE_SCHEMA, MINIMAL_EDGE), (CLOUD_SCHEMA, MINIMAL_CLOUD)]
)
def test_every_schema_default_is_filled(schema_name: str, text: str) -> None:
    raw = config_loader.validate(yaml.safe_load(text), schema_name, "x.yaml")

    def check(schema: Mapping[str, Any], value: Any, where: str) -> None:
        for name, sub in schema.get("properties", {}).items():
            if "default" in sub:
                assert name in value, f"default of {where}{name} not filled"
            if name in value and isinstance(value[name], dict):
                check(sub, value[name], f"{where}{name}.")

    check(config_loader.load_schema(schema_name), raw, "")
    # And the filled-in config is itself valid.
    jsonschema.validate(raw, config_loader.load_schema(schema_name))


def test_defaults_are_not_shared_between_loads(tmp_path: Path) -> None:
    a = edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    a.raw["external_labels"]["x"] = "y"
    a.raw["scrape"]["interval_seconds"] = 99
    b = edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    assert b.raw["external_labels"] == {}
    assert b.raw["scrape"]["interval_seconds"] == 5
    assert "default" in config_loader.load_schema(EDGE_SCHEMA)["properties"]["external_labels"]
    assert config_loader.load_schema(EDGE_SCHEMA)["properties"]["external_labels"]["default"] == {}


def test_timeout_is_capped_at_the_interval(tmp_path: Path) -> None:
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE + "scrape:\n  interval_seconds: 2\n"))
    assert s.interval_seconds == 2.0
    assert s.timeout_seconds == 2.0


def test_tls_section(tmp_path: Path) -> None:
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE + "mqtt:\n  tls:\n    ca_file: /etc/ca.pem\n"))
    assert s.mqtt.tls == TLS(ca_file="/etc/ca.pem", cert_file=None, key_file=None, insecure_skip_verify=False)
    c = cloud_settings.load(write(tmp_path, MINIMAL_CLOUD + "mqtt:\n  tls: {}\n", "c.yaml"))
    assert c.tls == TLS(None, None, None, False)


def test_node_defaults_to_host_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(edge_settings.socket, "gethostname", lambda: "edge-host-7")
    s = edge_settings.load(write(tmp_path, "targets:\n  - name: a\n    url: http://127.0.0.1:9100/m\n"))
    assert s.node == "edge-host-7"
    assert s.targets[0].instance == "edge-host-7:9100"
    assert s.mqtt.client_id == "edge-relay-default-edge-host-7"


# --------------------------------------------------------------------------------------------------
# Target defaults


@pytest.mark.parametrize(
    ("url", "instance"),
    [
        ("http://127.0.0.1:9100/metrics", "n1:9100"),
        ("http://exporter/metrics", "n1:80"),
        ("https://exporter/metrics", "n1:443"),
        ("https://exporter:8443/metrics", "n1:8443"),
        ("http://[::1]:9400/metrics", "n1:9400"),
    ],
)
def test_target_instance_default(tmp_path: Path, url: str, instance: str) -> None:
    s = edge_settings.load(write(tmp_path, f"node: n1\ntargets:\n  - name: exp\n    url: '{url}'\n"))
    (t,) = s.targets
    assert t.job == "exp"
    assert t.instance == instance
    assert t.url == url


def test_target_explicit_job_instance_labels(tmp_path: Path) -> None:
    text = """\
node: n1
targets:
  - name: kepler
    url: http://127.0.0.1:28282/metrics
    job: power
    instance: gpu-box
    format: openmetrics
    labels: {rack: r7}
"""
    (t,) = edge_settings.load(write(tmp_path, text)).targets
    assert (t.name, t.job, t.instance, t.format, t.labels) == (
        "kepler",
        "power",
        "gpu-box",
        "openmetrics",
        {"rack": "r7"},
    )


@pytest.mark.parametrize("url", ["http://127.0.0.1:99999/metrics", "http://exporter:abc/metrics"])
def test_target_url_with_bad_port_is_a_config_error(tmp_path: Path, url: str) -> None:
    message = edge_error(tmp_path, f"node: n1\ntargets:\n  - name: exp\n    url: '{url}'\n")
    assert "targets[0].url" in message


# --------------------------------------------------------------------------------------------------
# Errors: file, dotted key, expectation

T = "targets:\n  - name: a\n    url: http://127.0.0.1:9100/metrics\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(
            T + "foo: 1\n",
            ["unknown key `foo`", "expected one of", "targets", "mqtt", "scrape"],
            id="unknown-top-level",
        ),
        pytest.param(
            T + "mqtt:\n  hots: broker\n",
            ["unknown key `hots`", "under `mqtt`", "host", "port", "topic_prefix", "password"],
            id="unknown-nested",
        ),
        pytest.param(
            T + "mqtt:\n  tls:\n    ca: x\n",
            ["unknown key `ca`", "under `mqtt.tls`", "ca_file"],
            id="unknown-deeply-nested",
        ),
        pytest.param(
            "targets:\n  - name: a\n    url: http://x/\n    bogus: 1\n",
            ["unknown key `bogus`", "targets[0]", "url", "labels"],
            id="unknown-in-target",
        ),
        pytest.param(
            T + "scrape:\n  interval_seconds: fast\n",
            ["scrape.interval_seconds", "'fast'", "number"],
            id="wrong-type",
        ),
        pytest.param(T + "mqtt:\n  port: true\n", ["mqtt.port", "integer"], id="bool-is-not-int"),
        pytest.param(T + "mqtt:\n  port: '1883'\n", ["mqtt.port", "integer"], id="string-is-not-int"),
        pytest.param(
            T + "scrape:\n  interval_seconds: 0\n", ["scrape.interval_seconds", "minimum of 0"], id="zero"
        ),
        pytest.param(
            T + "scrape:\n  interval_seconds: -5\n",
            ["scrape.interval_seconds", "minimum of 0"],
            id="negative",
        ),
        pytest.param(
            T + "scrape:\n  interval_seconds: 7200\n",
            ["scrape.interval_seconds", "maximum of 3600"],
            id="huge",
        ),
        pytest.param(T + "mqtt:\n  port: -1\n", ["mqtt.port", "minimum of 1"], id="negative-port"),
        pytest.param(T + "mqtt:\n  port: 70000\n", ["mqtt.port", "maximum of 65535"], id="port-too-big"),
        pytest.param(
            T + "batch:\n  max_bytes: 100\n", ["batch.max_bytes", "minimum of 4096"], id="batch-small"
        ),
        pytest.param(
            T + "log_level: LOUD\n", ["log_level", "'LOUD'", "DEBUG", "INFO", "WARNING", "ERROR"], id="enum"
        ),
        pytest.param(
            T + "spool:\n  synchronous: OFF_\n", ["spool.synchronous", "FULL", "NORMAL"], id="enum-2"
        ),
        pytest.param(
            "targets:\n  - name: a\n    url: http://x/\n    format: json\n",
            ["targets[0].format", "'json'", "openmetrics"],
            id="enum-in-target",
        ),
        pytest.param(T + "mqtt:\n  protocol: v4\n", ["mqtt.protocol", "v5", "v311"], id="enum-protocol"),
        pytest.param("node: n1\n", ["targets", "required"], id="missing-targets"),
        pytest.param("", ["targets", "required"], id="empty-file"),
        pytest.param("targets: []\n", ["targets", "non-empty"], id="no-targets"),
        pytest.param("targets:\n  - name: a\n", ["targets[0]", "'url' is a required property"], id="no-url"),
        pytest.param(
            "targets:\n  - name: a\n    url: ftp://x/\n",
            ["targets[0].url", "ftp://x/", "https?"],
            id="url-scheme",
        ),
        pytest.param(
            "targets:\n  - name: 'a b'\n    url: http://x/\n", ["targets[0].name", "'a b'"], id="target-name"
        ),
        pytest.param(T + "external_labels:\n  1abc: x\n", ["external_labels", "1abc"], id="label-name"),
        pytest.param(T + "external_labels:\n  region: ''\n", ["external_labels.region"], id="empty-label"),
        pytest.param(
            "targets:\n  - name: a\n    url: http://x:1/\n  - name: a\n    url: http://y:2/\n",
            ["targets", "unique", "'a'"],
            id="duplicate-target-names",
        ),
        pytest.param(
            T + "mqtt:\n  reconnect_min_seconds: 10\n  reconnect_max_seconds: 5\n",
            ["mqtt.reconnect_max_seconds", "reconnect_min_seconds"],
            id="reconnect-max-below-min",
        ),
        pytest.param("node: a/b\n" + T, ["node", "'a/b'"], id="node-slash"),
        pytest.param("node: a+b\n" + T, ["node", "'a+b'"], id="node-plus"),
        pytest.param("node: 'a#'\n" + T, ["node", "'a#'"], id="node-hash"),
        pytest.param("node: $SYS\n" + T, ["node", "$SYS"], id="node-dollar"),
        pytest.param("node: ''\n" + T, ["node"], id="node-empty"),
        pytest.param('node: "a\\x01"\n' + T, ["node", "not allowed"], id="node-control-char"),
        pytest.param("node: " + "x" * 129 + "\n" + T, ["node"], id="node-too-long"),
        pytest.param("cluster: c/d\n" + T, ["cluster", "'c/d'"], id="cluster-slash"),
        pytest.param("cluster: c+\n" + T, ["cluster", "'c+'"], id="cluster-plus"),
        pytest.param(T + "mqtt:\n  topic_prefix: $sys\n", ["$sys", "not allowed"], id="prefix-dollar"),
        pytest.param(T + "mqtt:\n  topic_prefix: a/+/b\n", ["a/+/b", "not allowed"], id="prefix-plus"),
        pytest.param(T + "mqtt:\n  topic_prefix: a//b\n", ["a//b", "empty"], id="prefix-empty-level"),
        pytest.param(T + "mqtt:\n  topic_prefix: x/user\n", ["x/user", "KubeEdge"], id="prefix-kubeedge"),
        pytest.param(T + "metrics:\n  listen: localhost\n", ["metrics.listen", "localhost"], id="listen"),
    ],
)
def test_edge_config_errors(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = edge_error(tmp_path, text)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_edge_bad_topic_prefix_error_names_the_key(tmp_path: Path) -> None:
    message = edge_error(tmp_path, T + "mqtt:\n  topic_prefix: $sys\n")
    assert "mqtt.topic_prefix" in message


def test_error_lists_several_problems_at_once(tmp_path: Path) -> None:
    message = edge_error(tmp_path, T + "log_level: LOUD\nmqtt:\n  port: 0\n")
    assert "log_level" in message and "mqtt.port" in message


def test_invalid_yaml_reports_line_and_column(tmp_path: Path) -> None:
    message = edge_error(tmp_path, "targets:\n  - name: a\n   url: x\n")
    assert "not valid YAML" in message
    assert re.search(r"line 3, column \d+", message), message


def test_invalid_yaml_tab(tmp_path: Path) -> None:
    message = edge_error(tmp_path, "node: n1\n\tcluster: c\n")
    assert "not valid YAML" in message and "line 2" in message


@pytest.mark.parametrize(
    ("text", "kind"), [("- a\n- b\n", "list"), ("just a string\n", "str"), ("42\n", "int")]
)
def test_non_mapping_top_level(tmp_path: Path, text: str, kind: str) -> None:
    message = edge_error(tmp_path, text)
    assert "mapping" in message and kind in message


def test_unreadable_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        edge_settings.load(missing)
    assert missing in str(info.value) and "cannot read" in str(info.value)
    with pytest.raises(ConfigError) as info:
        cloud_settings.load(str(tmp_path))  # a directory
    assert str(tmp_path) in str(info.value) and "cannot read" in str(info.value)


def test_not_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"node: n\xe9\n" + T.encode())
    with pytest.raises(ConfigError) as info:
        edge_settings.load(str(path))
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param("mqtt:\n  host: broker\n", ["remote_write", "required"], id="missing-remote-write"),
        pytest.param(
            "remote_write: {}\n", ["remote_write", "'url' is a required property"], id="missing-url"
        ),
        pytest.param(
            "remote_write:\n  url: prometheus:9090\n",
            ["remote_write.url", "prometheus:9090"],
            id="url-scheme",
        ),
        pytest.param(
            MINIMAL_CLOUD + "bogus: 1\n", ["unknown key `bogus`", "remote_write", "workers"], id="unknown"
        ),
        pytest.param(
            MINIMAL_CLOUD + "mqtt:\n  hots: x\n",
            ["unknown key `hots`", "under `mqtt`", "host"],
            id="unknown-nested",
        ),
        pytest.param(MINIMAL_CLOUD + "workers: 0\n", ["workers", "minimum of 1"], id="workers-zero"),
        pytest.param(MINIMAL_CLOUD + "workers: two\n", ["workers", "'two'", "integer"], id="workers-type"),
        pytest.param(MINIMAL_CLOUD + "log_level: trace\n", ["log_level", "'trace'"], id="enum"),
        pytest.param(
            MINIMAL_CLOUD + "limits:\n  max_future_seconds: -1\n",
            ["limits.max_future_seconds", "minimum of 0"],
            id="negative",
        ),
        pytest.param(
            MINIMAL_CLOUD + "mqtt:\n  share_group: a/b\n",
            ["mqtt.share_group", "'a/b'"],
            id="share-group-slash",
        ),
        pytest.param(
            MINIMAL_CLOUD + "mqtt:\n  topic_prefix: $share\n",
            ["mqtt.topic_prefix", "$share", "not allowed"],
            id="prefix-dollar",
        ),
        pytest.param(
            MINIMAL_CLOUD + "mqtt:\n  topic_prefix: a/#\n",
            ["mqtt.topic_prefix", "not allowed"],
            id="prefix-hash",
        ),
        pytest.param("[1, 2]\n", ["mapping", "list"], id="not-a-mapping"),
    ],
)
def test_cloud_config_errors(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = cloud_error(tmp_path, text)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_cloud_retry_max_below_min_is_refused(tmp_path: Path) -> None:
    message = cloud_error(tmp_path, MINIMAL_CLOUD + "  retry_min_seconds: 60\n")
    assert "remote_write.retry_max_seconds" in message


def test_nan_interval_in_file_is_refused(tmp_path: Path) -> None:
    message = edge_error(tmp_path, T + "scrape:\n  interval_seconds: .nan\n")
    assert "scrape.interval_seconds" in message


# --------------------------------------------------------------------------------------------------
# Environment overrides


def test_env_scrape_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_RELAY_SCRAPE_INTERVAL", "2.5")
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE + "scrape:\n  interval_seconds: 10\n"))
    assert s.interval_seconds == 2.5
    assert s.timeout_seconds == 2.5  # capped at the overridden interval


def test_env_empty_value_is_ignored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_RELAY_SCRAPE_INTERVAL", "")
    monkeypatch.setenv("EDGE_RELAY_NODE", "")
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    assert s.interval_seconds == 5.0
    assert s.node == "n1"


@pytest.mark.parametrize(
    ("edge_relay_node", "node_name", "expected"),
    [
        (None, None, "n1"),
        (None, "from-downward-api", "from-downward-api"),
        ("explicit", None, "explicit"),
        ("explicit", "from-downward-api", "explicit"),
    ],
)
def test_env_node_precedence(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    edge_relay_node: str | None,
    node_name: str | None,
    expected: str,
) -> None:
    if edge_relay_node is not None:
        monkeypatch.setenv("EDGE_RELAY_NODE", edge_relay_node)
    if node_name is not None:
        monkeypatch.setenv("NODE_NAME", node_name)
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    assert s.node == expected
    assert s.targets[0].instance == f"{expected}:28282"
    assert s.mqtt.client_id == f"edge-relay-default-{expected}"


def test_env_node_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "bad/node")
    message = edge_error(tmp_path, MINIMAL_EDGE)
    assert "node" in message and "bad/node" in message


def test_env_mqtt_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_RELAY_MQTT_PASSWORD", "s3cret")
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE + "mqtt:\n  username: relay\n  password: in-file\n"))
    assert s.mqtt.password == "s3cret"
    assert s.mqtt.username == "relay"
    s = edge_settings.load(write(tmp_path, MINIMAL_EDGE, "no-mqtt.yaml"))
    assert s.mqtt.password == "s3cret"
    assert s.mqtt.host == "127.0.0.1"  # the created section still gets its defaults


@pytest.mark.parametrize("value", ["abc", "5s", "1,5"])
def test_env_interval_not_a_number(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EDGE_RELAY_SCRAPE_INTERVAL", value)
    with pytest.raises(ConfigError) as info:
        edge_settings.load(write(tmp_path, MINIMAL_EDGE))
    message = str(info.value)
    assert "EDGE_RELAY_SCRAPE_INTERVAL" in message and repr(value) in message and "float" in message


@pytest.mark.parametrize("value", ["0", "-1", "inf", "100000"])
def test_env_interval_out_of_range(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("EDGE_RELAY_SCRAPE_INTERVAL", value)
    message = edge_error(tmp_path, MINIMAL_EDGE)
    assert "scrape.interval_seconds" in message
    assert "EDGE_RELAY_SCRAPE_INTERVAL" in message  # via the key's description


def test_env_interval_nan_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_RELAY_SCRAPE_INTERVAL", "nan")
    edge_error(tmp_path, MINIMAL_EDGE)


def test_env_override_into_empty_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGE_RELAY_MQTT_PASSWORD", "s3cret")
    path = write(tmp_path, MINIMAL_EDGE + "mqtt:\n  # password: set EDGE_RELAY_MQTT_PASSWORD instead\n")
    try:
        s = edge_settings.load(path)
    except ConfigError as e:
        assert "mqtt" in str(e)
    else:
        assert s.mqtt.password == "s3cret"


def test_env_cloud_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_INGEST_REMOTE_WRITE_URL", "http://vm:8428/api/v1/write")
    monkeypatch.setenv("CLOUD_INGEST_CLIENT_ID", "ingest-pod-0")
    monkeypatch.setenv("CLOUD_INGEST_MQTT_PASSWORD", "pw")
    s = cloud_settings.load(write(tmp_path, MINIMAL_CLOUD + "mqtt:\n  client_id: in-file\n"))
    assert s.remote_write_url == "http://vm:8428/api/v1/write"
    assert s.client_id == "ingest-pod-0"
    assert s.password == "pw"


def test_env_cloud_remote_write_url_satisfies_required(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CLOUD_INGEST_REMOTE_WRITE_URL", "http://vm:8428/api/v1/write")
    s = cloud_settings.load(write(tmp_path, "workers: 3\n"))
    assert s.remote_write_url == "http://vm:8428/api/v1/write"
    assert s.remote_write_timeout_seconds == 30.0
    assert s.workers == 3


def test_env_cloud_remote_write_url_is_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_INGEST_REMOTE_WRITE_URL", "vm:8428")
    message = cloud_error(tmp_path, MINIMAL_CLOUD)
    assert "remote_write.url" in message and "vm:8428" in message


# --------------------------------------------------------------------------------------------------
# The JSON Schemas


@pytest.mark.parametrize("schema_name", [EDGE_SCHEMA, CLOUD_SCHEMA, BUDGET_SCHEMA])
def test_schema_is_valid_and_documented(schema_name: str) -> None:
    schema = config_loader.load_schema(schema_name)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is False
    for key, sub in schema_properties(schema):
        assert sub.get("description"), f"{key} has no description"
        if sub.get("type") == "object" and "properties" in sub:
            assert sub.get("additionalProperties") is False, f"{key} accepts unknown keys"
        if "default" in sub:
            errors = list(jsonschema.Draft202012Validator(sub).iter_errors(sub["default"]))
            assert not errors, f"default of {key} violates its own schema: {errors[0].message}"


@pytest.mark.parametrize(
    ("schema_name", "example"), [(EDGE_SCHEMA, EDGE_EXAMPLE), (CLOUD_SCHEMA, CLOUD_EXAMPLE)]
)
def test_examples_validate_against_schemas(schema_name: str, example: Path) -> None:
    data = yaml.safe_load(example.read_text(encoding="utf-8"))
    jsonschema.validate(data, config_loader.load_schema(schema_name))


# --------------------------------------------------------------------------------------------------
# configdoc and docs/configuration.md


@pytest.mark.parametrize(("program", "schema_name"), list(configdoc.SCHEMAS.items()))
def test_configdoc_documents_every_key(program: str, schema_name: str) -> None:
    text = configdoc.markdown(program)
    lines = text.splitlines()
    assert lines[0] == "| key | type | default | meaning |"
    assert lines[1] == "| --- | --- | --- | --- |"
    rows = {}
    for line in lines[2:]:
        m = re.match(r"\| `([^`]+)` \| (.*?) \| (.*?) \| (.*) \|$", line)
        assert m, f"malformed row {line!r}"
        rows[m.group(1)] = (m.group(2), m.group(3), m.group(4))
    keys = [key for key, _ in schema_properties(config_loader.load_schema(schema_name))]
    assert list(rows) == keys
    for key, sub in schema_properties(config_loader.load_schema(schema_name)):
        _, default, meaning = rows[key]
        if "default" in sub:
            assert default == f"`{json.dumps(sub['default'])}`"
        assert meaning  # every key explained


def test_configdoc_marks_required_keys() -> None:
    edge = configdoc.markdown("edge-relay")
    assert "| `targets` | list | `required` |" in edge
    assert "| `targets[].url` | string | `required` |" in edge
    assert "| `scrape.interval_seconds` | number | `5` |" in edge
    assert '| `log_level` | `DEBUG` \\| `INFO` \\| `WARNING` \\| `ERROR` | `"INFO"` |' in edge
    cloud = configdoc.markdown("cloud-ingest")
    assert "| `remote_write` | object | `required` |" in cloud
    assert "| `remote_write.url` | string | `required` |" in cloud
    assert "| `remote_write.headers` | map of string | `{}` |" in cloud


def test_configdoc_main_prints_both_sections(capsys: pytest.CaptureFixture[str]) -> None:
    configdoc.main()
    out = capsys.readouterr().out
    for program in configdoc.SCHEMAS:
        assert f"<!-- config:{program} -->\n{configdoc.markdown(program)}\n<!-- /config:{program} -->" in out


@pytest.mark.parametrize("program", list(configdoc.SCHEMAS))
def test_docs_config_reference_is_up_to_date(program: str) -> None:
    doc = ROOT / configdoc.DOCUMENT
    assert doc.is_file(), f"{configdoc.DOCUMENT} is missing"
    text = doc.read_text(encoding="utf-8")
    start, end = f"<!-- config:{program} -->", f"<!-- /config:{program} -->"
    assert start in text and end in text, f"{configdoc.DOCUMENT} lacks the {start} ... {end} section"
    section = text.split(start, 1)[1].split(end, 1)[0]
    assert section.strip("\n") == configdoc.markdown(program), (
        f"{configdoc.DOCUMENT} config reference for {program} is stale: "
        f"regenerate it with `python -m relay_common.configdoc --update {configdoc.DOCUMENT}`"
    )
