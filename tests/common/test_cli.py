"""Tests of the ``edge-relay`` and ``cloud-ingest`` command lines, run as subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cloud_ingest.outcome.deadletters import DeadLetterStore

ROOT = Path(__file__).resolve().parents[2]
EDGE_EXAMPLE = ROOT / "deploy" / "examples" / "edge-relay.yaml"
CLOUD_EXAMPLE = ROOT / "deploy" / "examples" / "cloud-ingest.yaml"
OVERRIDES = (
    "EDGE_RELAY_NODE",
    "NODE_NAME",
    "EDGE_RELAY_SCRAPE_INTERVAL",
    "EDGE_RELAY_MQTT_PASSWORD",
    "CLOUD_INGEST_CLIENT_ID",
    "CLOUD_INGEST_MQTT_PASSWORD",
    "CLOUD_INGEST_REMOTE_WRITE_URL",
)


def cli(program: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    module = {"edge-relay": "edge_relay.cli", "cloud-ingest": "cloud_ingest.cli"}[program]
    full_env = {k: v for k, v in os.environ.items() if k not in OVERRIDES}
    full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def cloud_config(tmp_path: Path, db: Path) -> Path:
    path = tmp_path / "cloud-ingest.yaml"
    path.write_text(
        yaml.safe_dump(
            {"remote_write": {"url": "http://127.0.0.1:9/api/v1/write"}, "dead_letter": {"path": str(db)}}
        ),
        encoding="utf-8",
    )
    return path


# --------------------------------------------------------------------------------------------------
# edge-relay


def test_edge_relay_help() -> None:
    r = cli("edge-relay", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: edge-relay" in r.stdout
    for command in ("run", "simulate", "check-config"):
        assert command in r.stdout


def test_edge_relay_run_help() -> None:
    r = cli("edge-relay", "run", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: edge-relay run" in r.stdout
    assert "--config" in r.stdout


def test_edge_relay_simulate_help() -> None:
    r = cli("edge-relay", "simulate", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: edge-relay simulate" in r.stdout


def test_edge_relay_without_command_is_a_usage_error() -> None:
    r = cli("edge-relay")
    assert r.returncode == 2
    assert "usage: edge-relay" in r.stderr


def test_edge_relay_check_config_example() -> None:
    # --config-only: the example's spool directory (/var/lib/...) is the node's, not this machine's.
    r = cli("edge-relay", "check-config", "--config-only", "--config", "deploy/examples/edge-relay.yaml")
    assert r.returncode == 0, r.stderr
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("# OK")
    assert "3 target(s)" in last and "edge-gpu-01" in last and "factory-north" in last
    shown = yaml.safe_load(r.stdout)
    assert shown["scrape"]["interval_seconds"] == 5
    assert shown["batch"]["max_bytes"] == 1_000_000  # defaults filled in
    assert "tls" not in shown["mqtt"]


def test_edge_relay_check_config_honours_env() -> None:
    r = cli(
        "edge-relay",
        "check-config",
        "--config-only",
        "--config",
        str(EDGE_EXAMPLE),
        env={"NODE_NAME": "from-env"},
    )
    assert r.returncode == 0, r.stderr
    assert "node from-env" in r.stdout


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("targets:\n  - name: a\n    url: http://x/\nmqtt:\n  hots: broker\n", "mqtt"),
        (
            "targets:\n  - name: a\n    url: http://x/\nscrape:\n  interval_seconds: fast\n",
            "scrape.interval_seconds",
        ),
        ("node: n1\n", "targets"),
    ],
)
def test_edge_relay_bad_config_exits_2(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text, encoding="utf-8")
    r = cli("edge-relay", "check-config", "--config", str(path))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "configuration error" in r.stderr
    assert str(path) in r.stderr and key in r.stderr
    assert "Traceback" not in r.stderr
    assert "# OK" not in r.stdout


def test_edge_relay_bad_env_exits_2() -> None:
    r = cli(
        "edge-relay", "check-config", "--config", str(EDGE_EXAMPLE), env={"EDGE_RELAY_SCRAPE_INTERVAL": "abc"}
    )
    assert r.returncode == 2
    assert "EDGE_RELAY_SCRAPE_INTERVAL" in r.stderr
    assert "Traceback" not in r.stderr


def test_edge_relay_missing_config_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    r = cli("edge-relay", "run", "--config", str(missing))
    assert r.returncode == 2
    assert str(missing) in r.stderr and "cannot read" in r.stderr


# --------------------------------------------------------------------------------------------------
# cloud-ingest


def test_cloud_ingest_help() -> None:
    r = cli("cloud-ingest", "--help")
    assert r.returncode == 0, r.stderr
    assert "usage: cloud-ingest" in r.stdout
    for command in ("run", "dead-letters", "check-config"):
        assert command in r.stdout


def test_cloud_ingest_run_help() -> None:
    r = cli("cloud-ingest", "run", "--help")
    assert r.returncode == 0, r.stderr
    assert "--config" in r.stdout


def test_cloud_ingest_check_config_example() -> None:
    r = cli("cloud-ingest", "check-config", "--config-only", "--config", "deploy/examples/cloud-ingest.yaml")
    assert r.returncode == 0, r.stderr
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith("# OK")
    assert "http://prometheus:9090/api/v1/write" in last
    shown = yaml.safe_load(r.stdout)
    assert shown["limits"]["max_future_seconds"] == 600


def test_cloud_ingest_bad_config_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("remote_write:\n  url: http://x/\nworkers: 0\n", encoding="utf-8")
    r = cli("cloud-ingest", "check-config", "--config", str(path))
    assert r.returncode == 2
    assert str(path) in r.stderr and "workers" in r.stderr
    assert "Traceback" not in r.stderr


def test_cloud_ingest_dead_letters_empty(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "dead.db"
    r = cli("cloud-ingest", "dead-letters", "--config", str(cloud_config(tmp_path, db)))
    assert r.returncode == 0, r.stderr
    assert "no dead letters" in r.stdout
    assert str(db) in r.stdout


def test_cloud_ingest_dead_letters_lists(tmp_path: Path) -> None:
    db = tmp_path / "dead.db"
    store = DeadLetterStore(db)
    try:
        store.put("edgemetrics/v1/c1/n1/batch", b"x" * 123, "bad_magic", cluster="c1", node="n1", seq=None)
        store.put("edgemetrics/v1/c1/n2/batch", b"y" * 7, "future_timestamp", cluster="c1", node="n2", seq=42)
    finally:
        store.close()
    r = cli("cloud-ingest", "dead-letters", "--config", str(cloud_config(tmp_path, db)))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3
    assert "reason" in lines[0]
    assert "c1/n1" in lines[1] and "123" in lines[1] and "bad_magic" in lines[1]
    assert "c1/n2" in lines[2] and "42" in lines[2] and "future_timestamp" in lines[2]
    r = cli("cloud-ingest", "dead-letters", "--config", str(cloud_config(tmp_path, db)), "--limit", "1")
    assert len(r.stdout.strip().splitlines()) == 2


# --------------------------------------------------------------------------------------------------
# cloud_ingest/outcome/deadletters.py


def test_dead_letter_round_trip(tmp_path: Path) -> None:
    store = DeadLetterStore(tmp_path / "nested" / "dir" / "dl.db")
    try:
        assert store.list() == []
        payload = bytes(range(256)) * 3
        first = store.put("t/1", payload, "bad_magic", cluster=None, node=None, seq=None)
        second = store.put("t/2", b"", "node_mismatch", cluster="c", node="n", seq=9)
        assert second > first
        letters = store.list()
        assert [d.id for d in letters] == [first, second]
        a, b = letters
        assert (a.topic, a.cluster, a.node, a.seq, a.reason, a.payload_bytes) == (
            "t/1",
            None,
            None,
            None,
            "bad_magic",
            len(payload),
        )
        assert (b.topic, b.cluster, b.node, b.seq, b.reason, b.payload_bytes) == (
            "t/2",
            "c",
            "n",
            9,
            "node_mismatch",
            0,
        )
        assert a.received_ms > 1_600_000_000_000
        assert store.payload(first) == ("t/1", payload)
        assert store.payload(second) == ("t/2", b"")
        assert store.payload(12345) is None
        assert [d.id for d in store.list(limit=1)] == [first]
        store.delete(first)
        assert store.payload(first) is None
        assert [d.id for d in store.list()] == [second]
        store.delete(12345)  # deleting a missing id is harmless
    finally:
        store.close()


def test_dead_letters_survive_reopen(tmp_path: Path) -> None:
    path = tmp_path / "dl.db"
    store = DeadLetterStore(path)
    letter = store.put("t", b"abc", "truncated", cluster="c", node="n", seq=1)
    store.close()
    store = DeadLetterStore(path)
    try:
        assert store.payload(letter) == ("t", b"abc")
        assert len(store.list()) == 1
    finally:
        store.close()
