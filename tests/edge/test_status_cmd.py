"""``edge-relay status``: the spool read-only, the relay's /metrics, the text, ``--json`` and ``--watch``.

The last test runs it as a person would: ``status --watch`` in a real terminal (tmux), beside a real
relay, mosquitto and cloud-ingest, through a broker outage and the drain after it, reading the screen.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from edge_relay import cli, settings
from edge_relay.commands import status as status_cmd
from edge_relay.commands import statusview
from edge_relay.commands.status import Reading, SpoolView
from edge_relay.ledger import LossReason, LossRecord
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.spool import Spool
from testkit.rw_mock import MockReceiver, Reply
from testkit.services import Mosquitto, ServiceFactory, free_port
from testkit.stack import Program, ingest_config, program, relay_config

NOW = 1_800_000_000.0


def write_config(tmp_path: Path, listen: str = "127.0.0.1:1", **extra: Any) -> Path:
    cfg = {
        "node": "n1",
        "cluster": "c1",
        "targets": [{"name": "kepler", "url": "http://127.0.0.1:28282/metrics"}],
        "spool": {"path": str(tmp_path / "spool.db")},
        "mqtt": {"host": "127.0.0.1", "port": 1883},
        "metrics": {"listen": listen},
        **extra,
    }
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def fill_spool(path: Path, rows: int, *, first_ts_ms: int) -> None:
    with Spool(path) as spool:
        for i in range(rows):
            spool.batches.append(
                lambda seq: b"x" * 100,
                first_ts_ms=first_ts_ms + i * 1000,
                last_ts_ms=first_ts_ms + i * 1000,
                sample_count=10,
            )
        spool.losses.record(LossRecord(LossReason.MAX_AGE, '{job="kepler"}', 1, 2, 7))


# --- the spool, read-only -------------------------------------------------------------------------------


def test_read_spool_is_read_only_and_leaves_no_files(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    fill_spool(path, 3, first_ts_ms=5_000)
    before = sorted(p.name for p in tmp_path.iterdir())
    view = status_cmd.read_spool(path)
    assert (view.rows, view.bytes, view.samples, view.oldest_ms) == (3, 300, 30, 5_000)
    assert view.losses == {"max_age": 7} and view.last_seq == 3
    # A closed spool is read as immutable: no -wal / -shm files made by whoever ran `status`.
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_read_spool_beside_a_writer(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path) as spool:
        spool.batches.append(lambda seq: b"y" * 50, first_ts_ms=1, last_ts_ms=1, sample_count=2)
        assert status_cmd.read_spool(path).rows == 1
        spool.batches.append(lambda seq: b"y" * 50, first_ts_ms=2, last_ts_ms=2, sample_count=2)
        assert status_cmd.read_spool(path).rows == 2  # through the writer's WAL


def test_missing_spool_is_reported_not_created(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write_config(tmp_path)
    assert cli.main(["status", "--config", str(config), "--json", "--rate-seconds", "0"]) == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["spool"]["exists"] is False and "does not exist" in snap["spool"]["error"]
    assert snap["relay"]["relay_reachable"] is False
    assert "relay not running / metrics unreachable" in snap["relay"]["error"]
    assert not (tmp_path / "spool.db").exists()
    assert cli.main(["status", "--config", str(config), "--rate-seconds", "0"]) == 0
    out = capsys.readouterr().out
    assert "does not exist" in out and "relay not running / metrics unreachable" in out


# --- snapshots and their text ------------------------------------------------------------------------------


def _settings(tmp_path: Path, **extra: Any) -> settings.Settings:
    return settings.load(str(write_config(tmp_path, **extra)))


def _metrics(connected: bool, *, acked: int, error: str | None = None) -> status_cmd.Samples:
    m = RelayMetrics()
    m.observe_mqtt(True, NOW - 75)
    if not connected:
        m.observe_mqtt(False, NOW - 75)
    m.acked.labels("ok").inc(acked)
    m.publish_bytes.inc(acked * 1000)
    m.scrapes.labels("kepler", "ok").inc(40)
    if error:
        m.scrapes.labels("kepler", "http_error").inc(2)
        m.scrape_failed("kepler", error, NOW - 3)
    server_text = generate_latest(m.registry).decode()
    samples: status_cmd.Samples = {}
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(server_text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return samples


def _reading(at: float, rows: int, metrics: status_cmd.Samples | None, **spool: Any) -> Reading:
    view = SpoolView(
        rows=rows, bytes=rows * 1000, samples=rows * 50, oldest_ms=int((NOW - 600) * 1000), **spool
    )
    return Reading(at, view, None, metrics, None if metrics is not None else "relay not running")


def test_snapshot_json_has_stable_keys(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    snap = status_cmd.snapshot(
        s,
        [_reading(NOW - 10, 100, _metrics(True, acked=10)), _reading(NOW, 50, _metrics(True, acked=60))],
    )
    assert sorted(snap) == [
        "budget", "cluster", "config", "drain", "losses", "node", "relay", "spool", "targets",
        "timestamp_seconds", "version",
    ]  # fmt: skip
    assert snap["version"] == 1
    assert snap["relay"] == {
        "relay_reachable": True,
        "metrics_url": "http://127.0.0.1:1/metrics",
        "error": None,
        "broker": "127.0.0.1:1883",
        "connected": True,
        "since": NOW - 75,
        "inflight_batches": 0.0,
        "last_error": None,
        "last_ack_timestamp_seconds": None,
        "ack_timeout_seconds": 60.0,
        "acked_nothing_since": None,
    }
    assert snap["drain"] == {
        "interval_seconds": 10.0,
        "state": "draining",
        "acked_batches_per_second": 5.0,
        "spooled_batches_per_second": 0.0,
        "sent_payload_bytes_per_second": 5000.0,
        "wire_bytes_per_second": 0.0,
        "backlog_rows_per_second": -5.0,
        "backlog_bytes_per_second": -5000.0,
        "eta_seconds": 10.0,
    }
    assert snap["spool"]["rows"] == 50 and snap["spool"]["oldest_unsent_age_seconds"] == 600.0
    assert snap["budget"] is None
    assert snap["losses"] == {"source": "spool", "total": 0, "by_reason": {}}
    assert snap["targets"]["kepler"]["health"] == "ok"
    json.dumps(snap)  # JSON-able as it is


def test_text_while_disconnected_and_backlog_growing(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    m = _metrics(False, acked=0, error="HTTP 503   Service\nUnavailable")
    snap = status_cmd.snapshot(
        s, [_reading(NOW - 5, 10, m), _reading(NOW, 15, m, losses={"spool_full": 12, "max_age": 3})]
    )
    text = statusview.render_plain(snap)
    assert "disconnected from 127.0.0.1:1883 since" in text and "(1m15s)" in text
    assert "backlog  15 batches, 14.6 KiB, 750 samples; oldest unsent" in text and "(10m00s ago)" in text
    assert "drain    growing" in text and "+1.0 batches/s" in text
    assert "losses   15 samples: max_age=3, spool_full=12" in text
    # the error label is one line, whitespace squeezed
    assert "kepler: failing (40 ok, 2 failed); last error" in text and "HTTP 503 Service Unavailable" in text


def test_text_without_relay(tmp_path: Path) -> None:
    s = _settings(tmp_path, budget_file="budget.yaml")
    snap = status_cmd.snapshot(s, [_reading(NOW, 0, None)])
    text = statusview.render_plain(snap)
    assert "link     relay not running" in text
    assert "drain    empty" in text
    assert "budget   " in text and "state unknown" in text
    assert "kepler: unknown" in text


def test_budget_from_self_metrics(tmp_path: Path) -> None:
    m = RelayMetrics()
    m.observe_budget_state("degraded")
    m.budget_level.labels("node").set(2)
    m.budget_resolution.labels("node").set(20)
    m.budget_level.labels("gpu").set(0)
    m.budget_resolution.labels("gpu").set(5)
    m.budget_rate.set(2048)
    samples: status_cmd.Samples = {}
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for x in family.samples:
            samples.setdefault(x.name, []).append((dict(x.labels), float(x.value)))
    snap = status_cmd.snapshot(_settings(tmp_path, budget_file="b.yaml"), [_reading(NOW, 1, samples)])
    assert snap["budget"]["state"] == "degraded" and snap["budget"]["degrade_level"] == 2
    assert snap["budget"]["classes"]["node"] == {"degrade_level": 2, "resolution_seconds": 20.0}
    assert "budget   degraded, degrade level 2 (node 20s); allowed 2.0 KiB/s" in statusview.render_plain(snap)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.4, "59s"), (61, "1m01s"), (3600 * 2 + 120, "2h02m"), (90000, "1d01h")],
)
def test_fmt_duration(seconds: float, text: str) -> None:
    assert statusview.fmt_duration(seconds) == text


def test_fmt_bytes_and_bar() -> None:
    assert [statusview.fmt_bytes(n) for n in (0, 1023, 1536, 5 * 2**20, 3 * 2**30)] == [
        "0 B", "1023 B", "1.5 KiB", "5.0 MiB", "3.0 GiB",
    ]  # fmt: skip
    assert statusview.bar(0.5, width=10) == "[#####-----]  50%"
    assert statusview.bar(1.0, width=4) == "[####] 100%"


def test_peak_measures_the_drain_of_the_largest_backlog() -> None:
    peak = statusview.Peak()
    assert [peak.fraction(n) for n in (4, 10, 5, 0, 2)] == [0.0, 0.0, 0.5, 1.0, 0.0]
    assert peak.fraction(None) is None


def test_self_metrics_one_error_series_per_target() -> None:
    m = RelayMetrics()
    m.scrape_failed("a", "timeout", 10)
    m.scrape_failed("a", "connection refused", 20)
    m.scrape_failed("b", "x" * 500, 30)
    text = generate_latest(m.registry).decode()
    lines = [x for x in text.splitlines() if x.startswith("edge_relay_scrape_last_error_timestamp_seconds{")]
    assert len(lines) == 2
    assert 'error="connection refused",target="a"} 20.0' in text
    assert max(len(x) for x in lines) < 200
    assert m.mqtt_disconnected_since._value.get() > 0  # "disconnected since the start"
    m.observe_mqtt(True, 100)
    m.observe_mqtt(True, 200)  # no change, no new "since"
    assert (m.mqtt_connected_since._value.get(), m.mqtt_disconnected_since._value.get()) == (100, 0)
    m.observe_mqtt(False, 300)
    assert (m.mqtt_connected_since._value.get(), m.mqtt_disconnected_since._value.get()) == (0, 300)


def test_metrics_url_of_wildcard_listen() -> None:
    assert status_cmd.metrics_url("0.0.0.0:9901") == "http://127.0.0.1:9901/metrics"
    assert status_cmd.metrics_url("[::]:9901") == "http://[::1]:9901/metrics"
    assert status_cmd.metrics_url("") is None


def test_json_against_a_live_metrics_endpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    m = RelayMetrics()
    m.observe_mqtt(True, NOW)
    body = generate_latest(m.registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        fill_spool(tmp_path / "spool.db", 2, first_ts_ms=1000)
        config = write_config(tmp_path, listen=f"127.0.0.1:{server.server_address[1]}")
        assert cli.main(["status", "--config", str(config), "--json", "--rate-seconds", "0.2"]) == 0
    finally:
        server.shutdown()
        server.server_close()
    snap = json.loads(capsys.readouterr().out)
    assert snap["relay"]["connected"] is True and snap["relay"]["since"] == NOW
    assert snap["spool"]["rows"] == 2 and snap["losses"]["by_reason"] == {"max_age": 7}
    assert snap["drain"]["state"] == "steady" and snap["drain"]["interval_seconds"] >= 0.2


def test_plain_watch_redraws_in_a_pty(tmp_path: Path) -> None:
    """``--watch --plain`` (what the sidecar image without rich shows): home + clear, then the status,
    every interval; Ctrl-C ends it with status 0."""
    fill_spool(tmp_path / "spool.db", 3, first_ts_ms=1000)
    config = write_config(tmp_path)
    master, slave = pty.openpty()
    argv = [
        sys.executable,
        "-m",
        "edge_relay.cli",
        "status",
        "--config",
        str(config),
        "--watch",
        "0.2",
        "--plain",
    ]
    # As a terminal's foreground job gets it: SIGINT at its default. A suite started in the background
    # by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and Python keeps it ignored.
    proc = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    os.close(slave)
    out = b""
    try:
        deadline = time.monotonic() + 20
        while out.count(b"\x1b[H\x1b[2J") < 3 and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                out += os.read(master, 65536)
        proc.send_signal(signal.SIGINT)
        # Read on while it ends, as a terminal does: a redraw it was writing when Ctrl-C came is
        # flushed at exit, and would block on a full pty nobody reads.
        deadline = time.monotonic() + 20
        while proc.poll() is None and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                try:
                    out += os.read(master, 65536)
                except OSError:  # EIO: the last holder of the slave side has closed it
                    break
        # EIO comes when the child closes the pty on its way out, before it can be reaped: wait for it.
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    frames = out.decode(errors="replace").split("\x1b[H\x1b[2J")[1:]
    assert len(frames) >= 3, out
    assert "backlog  3 batches, 300 B, 30 samples" in frames[1]
    assert "relay not running / metrics unreachable" in frames[1]
    assert "[------------------------------]   0% of the backlog drained" in frames[1]


# --- in a real terminal, through an outage ----------------------------------------------------------------


class Terminal:
    """A tmux session on its own server socket (never the user's), read with capture-pane."""

    def __init__(self, command: str, tmp_path: Path) -> None:
        self.socket = f"edge-relay-status-test-{free_port()}"
        self.run("new-session", "-d", "-x", "150", "-y", "30", "-s", "status", command)
        self.tmp_path = tmp_path
        self.screens: list[str] = []

    def run(self, *args: str) -> str:
        argv = ["tmux", "-L", self.socket, "-f", "/dev/null", *args]
        # The server passes its environment on; COLUMNS/LINES (set under pytest) would pin rich to 80x24.
        env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10, env=env).stdout

    def screen(self) -> str:
        text = self.run("capture-pane", "-p", "-t", "status")
        self.screens.append(text)
        return text

    def wait_for(self, predicate: Any, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.2)
        raise AssertionError(f"screen never showed {what}; last screen:\n{self.screens[-1]}")

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


def backlog_rows(screen: str) -> int | None:
    m = re.search(r"^backlog\s+([\d,]+) batches", screen, re.MULTILINE)
    return None if m is None else int(m.group(1).replace(",", ""))


class _Exporter(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"# TYPE demo_gauge gauge\ndemo_gauge 1\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def exporter() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Exporter)
    Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    server.shutdown()
    server.server_close()


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux for a real terminal")
def test_watch_in_a_terminal_through_a_broker_outage(
    tmp_path: Path, make_service: ServiceFactory, exporter: str
) -> None:
    # Persistent: the ingester's session and subscription survive the restart, so the drain starts at once.
    broker = make_service(Mosquitto, persistence=True)
    procs: list[Program] = []
    term: Terminal | None = None
    with MockReceiver() as receiver:
        # A receiver that takes a while per write: a drain that lasts a few redraws.
        receiver.default = Reply(delay_s=0.08)
        try:
            ingest_cfg = ingest_config(tmp_path, mqtt_port=broker.port, remote_write_url=receiver.url)
            procs.append(program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp_path).start())
            urls = {"demo": exporter, "broken": f"http://127.0.0.1:{free_port()}/metrics"}
            relay_cfg = relay_config(
                tmp_path,
                urls=urls,
                mqtt_port=broker.port,
                interval=0.5,
                openmetrics=(),
                mqtt__keepalive_seconds=3,
                mqtt__reconnect_min_seconds=0.2,
                mqtt__reconnect_max_seconds=0.5,
                # What the relay publishes before the ingester is back is lost to its shared subscription
                # (mosquitto queues nothing for an offline $share member): published again after this.
                mqtt__ack_timeout_seconds=2,
            )
            procs.append(program("edge-relay", "edge_relay.cli", relay_cfg, tmp_path).start())
            command = shlex.join(
                [
                    sys.executable,
                    "-m",
                    "edge_relay.cli",
                    "status",
                    "--config",
                    str(relay_cfg),
                    "--watch",
                    "0.5",
                ]
            )
            term = Terminal(command, tmp_path)
            port = f"127.0.0.1:{broker.port}"

            screen = term.wait_for(lambda t: f"connected to {port} since" in t, 30, "connected")
            assert "demo: ok" in term.wait_for(lambda t: "demo: ok" in t, 10, "the working target")
            screen = term.wait_for(lambda t: "broken: failing" in t, 10, "the failing target")
            assert "Connection refused" in screen

            broker.stop()
            screen = term.wait_for(lambda t: f"disconnected from {port} since" in t, 15, "disconnected")
            first = backlog_rows(screen) or 0
            screen = term.wait_for(
                lambda t: f"disconnected from {port}" in t and (backlog_rows(t) or 0) >= first + 12,
                20,
                "a growing backlog while disconnected",
            )
            assert "growing" in term.wait_for(
                lambda t: "drain    growing" in t, 10, "the drain state 'growing'"
            )
            assert "  0%" in term.screen()  # nothing of this backlog drained yet
            peak = backlog_rows(term.screen()) or 0

            broker.restart()
            screen = term.wait_for(
                lambda t: f"connected to {port} since" in t and "drain    draining:" in t, 20, "the drain"
            )
            assert re.search(r"batches/s acked, .* empty in ~[0-9hms]+ ", screen), screen
            screen = term.wait_for(
                lambda t: f"connected to {port} since" in t and backlog_rows(t) == 0,
                30,
                "the backlog drained",
            )
            assert "100%" in screen and "drain    empty" in screen
            assert peak >= 12
            shown = [backlog_rows(t) for t in term.screens]
            assert max(x or 0 for x in shown) >= peak
        finally:
            if term is not None:
                term.close()
            for p in reversed(procs):
                p.kill()
