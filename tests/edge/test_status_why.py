"""The status says why: the broker connection's last error by reason, a cloud that stopped acking, and
the relay's ``/status`` page in a real headless browser.

Each reason a relay can meet on loopback is produced for real: a closed port (``connection_refused``), a
mosquitto that wants a password (``not_authorized``), a TLS listener whose certificate the relay's CA
did not sign (``tls``). The stalled cloud is a relay and a mosquitto without an ingester.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from prometheus_client import generate_latest

# The certificates tests/test_mqtt_tls.py makes for its brokers (pytest puts tests/ on the path).
from edge_relay import settings
from edge_relay.commands import status as status_cmd
from edge_relay.commands import statusview
from edge_relay.selfmetrics import MQTT_ERROR_REASONS, RelayMetrics
from edge_relay.uplink.mqtt import connect_error_reason, refusal_reason
from testkit.exporters import ScriptedExporter
from testkit.netfaults import LinkProxy
from testkit.pki import make_pki
from testkit.services import Mosquitto, ServiceFactory, free_port, wait_until
from testkit.stack import Program, program, relay_config

NOW = 1_800_000_000.0
HOSTILE = '<script>alert("x")</script> & <b>bold</b>'


# --- classifying errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ConnectionRefusedError(111, "Connection refused"), "connection_refused"),
        (socket.gaierror(-2, "Name or service not known"), "dns"),
        (TimeoutError("timed out"), "timeout"),
        (ssl.SSLCertVerificationError(1, "certificate verify failed"), "tls"),
        (ssl.SSLError(1, "wrong version number"), "tls"),
        (ConnectionResetError(104, "Connection reset by peer"), "closed"),
        (OSError(113, "No route to host"), "other"),
        (ValueError("Invalid host."), "other"),
    ],
)
def test_connect_errors_by_reason(error: BaseException, reason: str) -> None:
    assert connect_error_reason(error) == reason


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        *[(code, "not_authorized") for code in (4, 5, 0x86, 0x87)],
        *[(1, "protocol"), (0x84, "protocol"), (3, "other"), (0x88, "other")],
    ],
)
def test_connack_refusals_by_reason(code: int, reason: str) -> None:
    assert refusal_reason(code) == reason


def test_last_error_metrics_keep_one_series_and_a_time_per_reason() -> None:
    m = RelayMetrics()
    text = generate_latest(m.registry).decode()
    # Every reason exists from the start (0: never), the info series only after an error.
    for reason in MQTT_ERROR_REASONS:
        assert f'edge_relay_mqtt_last_error_timestamp_seconds{{reason="{reason}"}} 0.0' in text
        assert f'edge_relay_mqtt_connection_errors_total{{reason="{reason}"}} 0.0' in text
    assert "edge_relay_mqtt_last_error_info{" not in text
    assert "edge_relay_last_ack_timestamp_seconds 0.0" in text
    m.mqtt_failed("connection_refused", "ConnectionRefusedError: [Errno 111]\n Connection refused", 10)
    m.mqtt_failed("connection_refused", "ConnectionRefusedError: [Errno 111] Connection refused", 20)
    m.mqtt_failed("tls", "x" * 500, 30)
    m.mqtt_failed("made_up", "?", 40)  # not a reason: counted as other
    text = generate_latest(m.registry).decode()
    info = [x for x in text.splitlines() if x.startswith("edge_relay_mqtt_last_error_info{")]
    assert info == ['edge_relay_mqtt_last_error_info{message="?",reason="other"} 1.0']
    assert 'edge_relay_mqtt_last_error_timestamp_seconds{reason="connection_refused"} 20.0' in text
    assert 'edge_relay_mqtt_last_error_timestamp_seconds{reason="tls"} 30.0' in text
    assert 'edge_relay_mqtt_connection_errors_total{reason="connection_refused"} 2.0' in text
    m.mqtt_failed("tls", "y" * 500, 50)
    info = [x for x in generate_latest(m.registry).decode().splitlines() if "last_error_info{" in x]
    assert len(info) == 1 and 'reason="tls"' in info[0] and len(info[0]) < 200


# --- the snapshot, its text and its page --------------------------------------------------------------


def _samples(m: RelayMetrics) -> status_cmd.Samples:
    return status_cmd.parse_metrics(generate_latest(m.registry).decode())


def _settings(tmp_path: Path) -> settings.Settings:
    cfg = {
        "node": "n1",
        "cluster": "c1",
        "targets": [
            {"name": "kepler", "url": "http://127.0.0.1:28282/metrics"},
            {"name": "dcgm", "url": "http://127.0.0.1:28283/metrics"},
        ],
        "spool": {"path": str(tmp_path / "spool.db")},
        "mqtt": {"host": "127.0.0.1", "port": 1883, "ack_timeout_seconds": 30},
        "metrics": {"listen": "127.0.0.1:1"},
    }
    path = tmp_path / "relay.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return settings.load(str(path))


def _reading(at: float, m: RelayMetrics, rows: int = 3) -> status_cmd.Reading:
    view = status_cmd.SpoolView(
        rows=rows, bytes=rows * 1000, samples=rows * 50, oldest_ms=int((at - 60) * 1000)
    )
    return status_cmd.Reading(at, view, None, _samples(m), None)


def test_disconnected_shows_the_last_error(tmp_path: Path) -> None:
    m = RelayMetrics()
    m.observe_mqtt(False, NOW - 90)
    m.mqtt_failed("not_authorized", "refused: Not authorized", NOW - 4)
    snap = status_cmd.snapshot(_settings(tmp_path), [_reading(NOW, m)])
    assert snap["relay"]["last_error"] == {
        "reason": "not_authorized",
        "message": "refused: Not authorized",
        "timestamp_seconds": NOW - 4,
    }
    text = statusview.render_plain(snap)
    assert "link     disconnected from 127.0.0.1:1883 since" in text
    assert "(4s ago): not_authorized: refused: Not authorized" in text.splitlines()[2]
    # Once the link is back the error stays in the JSON but is no longer the link's state.
    m.observe_mqtt(True, NOW + 1)
    snap = status_cmd.snapshot(_settings(tmp_path), [_reading(NOW + 2, m)])
    assert snap["relay"]["last_error"]["reason"] == "not_authorized"
    assert "last error" not in statusview.render_plain(snap)


def test_a_stalled_cloud_shows_since_when(tmp_path: Path) -> None:
    s = _settings(tmp_path)
    m = RelayMetrics()
    m.observe_mqtt(True, NOW - 600)
    m.inflight.set(4)
    m.last_ack.set(NOW - 125)
    snap = status_cmd.snapshot(s, [_reading(NOW, m)])
    assert snap["relay"]["last_ack_timestamp_seconds"] == NOW - 125
    assert snap["relay"]["acked_nothing_since"] == NOW - 125
    text = statusview.render_plain(snap)
    line = f"cloud has acked nothing since {statusview.fmt_time(NOW - 125)} (2m05s); ack timeout 30s"
    assert line in text
    # Within the ack timeout, or with nothing in flight, the cloud is not late.
    m.last_ack.set(NOW - 20)
    assert status_cmd.snapshot(s, [_reading(NOW, m)])["relay"]["acked_nothing_since"] is None
    m.last_ack.set(NOW - 125)
    m.inflight.set(0)
    assert status_cmd.snapshot(s, [_reading(NOW, m)])["relay"]["acked_nothing_since"] is None
    # Never acked: counted from the connection, which came up long ago.
    m2 = RelayMetrics()
    m2.observe_mqtt(True, NOW - 300)
    m2.inflight.set(1)
    snap = status_cmd.snapshot(s, [_reading(NOW, m2)])
    assert snap["relay"]["acked_nothing_since"] == NOW - 300
    assert "(5m00s) (no ack since the relay connected)" in statusview.render_plain(snap)
    # An ack long ago, before a reconnection moments ago: not late yet.
    m.inflight.set(2)
    m.observe_mqtt(False, NOW - 30)
    m.observe_mqtt(True, NOW - 10)
    assert status_cmd.snapshot(s, [_reading(NOW, m)])["relay"]["acked_nothing_since"] is None


def test_html_escapes_every_value_and_has_no_script(tmp_path: Path) -> None:
    m = RelayMetrics()
    m.observe_mqtt(False, NOW - 90)
    m.mqtt_failed("other", HOSTILE, NOW - 2)
    m.scrapes.labels("kepler", "ok").inc(9)
    m.samples_scraped.labels("kepler").inc(900)
    m.scrapes.labels("dcgm", "http_error").inc(3)
    m.scrape_failed("dcgm", HOSTILE, NOW - 1)
    snap = status_cmd.snapshot(_settings(tmp_path), [_reading(NOW, m)])
    page = statusview.render_html(snap)
    assert "<script" not in page and "<b>" not in page
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt; &amp; &lt;b&gt;bold&lt;/b&gt;") == 2
    assert not any(x in page for x in ("://", "src=", "<link", "url(")), page  # nothing from elsewhere
    assert snap["targets"]["kepler"]["samples_per_scrape"] == 100.0


# --- real relays, real brokers --------------------------------------------------------------------------


@pytest.fixture
def exporter() -> Iterator[str]:
    with ScriptedExporter(lambda n: "# TYPE demo_gauge gauge\ndemo_gauge 1\ndemo_other 2\n") as e:
        yield e.url


@pytest.fixture
def relays() -> Iterator[list[Program]]:
    started: list[Program] = []
    yield started
    for p in started:
        p.kill()


def _start_relay(
    tmp_path: Path, exporter: str, port: int, relays: list[Program], **mqtt: Any
) -> tuple[Program, Path]:
    overrides = {f"mqtt__{k}": v for k, v in mqtt.items()}
    urls = {"demo": exporter, "broken": f"http://127.0.0.1:{free_port()}/metrics"}
    cfg = relay_config(tmp_path, urls=urls, mqtt_port=port, interval=0.5, openmetrics=(), **overrides)
    relay = program("edge-relay", "edge_relay.cli", cfg, tmp_path).start()
    relays.append(relay)
    return relay, cfg


def _wait_for(
    relay: Program, cfg: Path, what: str, check: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    s = settings.load(str(cfg))
    snaps: list[dict[str, Any]] = []

    def seen() -> bool:
        assert relay.alive(), relay.log_tail()
        snaps.append(status_cmd.snapshot(s, [status_cmd.read(s)]))
        return check(snaps[-1])

    try:
        wait_until(seen, 30, 0.3, what)
    except Exception as e:
        raise AssertionError(f"{what}: last snapshot {snaps[-1:]}\n{relay.log_tail()}") from e
    return snaps[-1]


def _status_text(cfg: Path) -> str:
    argv = [sys.executable, "-m", "edge_relay.cli", "status", "--config", str(cfg), "--rate-seconds", "0"]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=60).stdout


def _disconnected_because(reason: str) -> Callable[[dict[str, Any]], bool]:
    def check(snap: dict[str, Any]) -> bool:
        err = snap["relay"]["last_error"]
        return snap["relay"]["connected"] is False and err is not None and err["reason"] == reason

    return check


def test_refused_shows_in_status_and_on_the_page(
    tmp_path: Path, exporter: str, relays: list[Program]
) -> None:
    relay, cfg = _start_relay(tmp_path, exporter, free_port(), relays)
    snap = _wait_for(relay, cfg, "a refused connection", _disconnected_because("connection_refused"))
    assert "Connection refused" in snap["relay"]["last_error"]["message"]
    text = _status_text(cfg)
    assert "link     disconnected from 127.0.0.1:" in text
    assert "connection_refused: ConnectionRefusedError: [Errno 111] Connection refused" in text
    listen = yaml.safe_load(cfg.read_text())["metrics"]["listen"]
    page = requests.get(f"http://{listen}/status", timeout=10)
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "script-src" not in page.headers["Content-Security-Policy"]  # default-src 'none' covers it
    assert "connection_refused" in page.text


def test_not_authorized(
    tmp_path: Path, make_service: ServiceFactory, exporter: str, relays: list[Program]
) -> None:
    passwords = tmp_path / "passwords"
    passwords.write_text("")
    tool = Path(Mosquitto.default_binary).with_name("mosquitto_passwd")
    binary = str(tool) if tool.exists() else "/usr/bin/mosquitto_passwd"
    subprocess.run([binary, "-b", str(passwords), "edge", "right"], check=True, capture_output=True)
    broker = make_service(Mosquitto, extra_conf=f"allow_anonymous false\npassword_file {passwords}")
    relay, cfg = _start_relay(tmp_path, exporter, broker.port, relays, username="edge", password="wrong")
    snap = _wait_for(relay, cfg, "a refused login", _disconnected_because("not_authorized"))
    assert "refused: " in snap["relay"]["last_error"]["message"]
    assert "not_authorized: refused: " in _status_text(cfg)


def test_untrusted_broker_certificate(
    tmp_path: Path, make_service: ServiceFactory, exporter: str, relays: list[Program]
) -> None:
    broker_pki = make_pki(tmp_path / "broker-pki", [])
    other_pki = make_pki(tmp_path / "other-pki", [], ca_name="a CA the broker does not use")
    tls_port = free_port()
    broker = make_service(
        Mosquitto,
        extra_conf=(
            f"listener {tls_port} 127.0.0.1\n"
            f"certfile {broker_pki.cert('broker')}\nkeyfile {broker_pki.key('broker')}\n"
        ),
    )
    wait_until(lambda: _accepts(tls_port), 10, 0.1, "the TLS listener")
    assert broker.is_running()
    relay, cfg = _start_relay(tmp_path, exporter, tls_port, relays, tls={"ca_file": other_pki.ca})
    snap = _wait_for(relay, cfg, "a failed TLS handshake", _disconnected_because("tls"))
    assert "CERTIFICATE_VERIFY_FAILED" in snap["relay"]["last_error"]["message"]
    assert "tls: SSLCertVerificationError" in _status_text(cfg)


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_no_ingester_the_cloud_has_acked_nothing(
    tmp_path: Path, make_service: ServiceFactory, exporter: str, relays: list[Program]
) -> None:
    broker = make_service(Mosquitto)
    relay, cfg = _start_relay(tmp_path, exporter, broker.port, relays, ack_timeout_seconds=2)
    snap = _wait_for(relay, cfg, "the stall", lambda snap: snap["relay"]["acked_nothing_since"] is not None)
    assert snap["relay"]["connected"] and snap["relay"]["inflight_batches"]
    assert snap["relay"]["last_ack_timestamp_seconds"] is None
    text = _status_text(cfg)
    assert "link     connected to" in text
    assert "cloud has acked nothing since" in text and "(no ack since the relay connected)" in text


class Peer:
    """A TCP listener on loopback that plays a broken broker: it answers every connection with
    ``reply`` (bytes after reading the CONNECT; b"" closes at once, None says nothing, ever)."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            if self.reply is None:
                self.held.append(conn)
                continue
            with contextlib.suppress(OSError):
                if self.reply:
                    conn.recv(4096)
                    conn.sendall(self.reply)
                    time.sleep(0.2)
            conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.mark.parametrize(
    ("reply", "mqtt", "reason", "message"),
    [
        (b"", {}, "closed", "the broker closed the connection before its CONNACK"),
        (None, {"keepalive_seconds": 2}, "timeout", "no CONNACK within 2s"),
        # MQTT 3.1.1 CONNACK, return code 1: unacceptable protocol version.
        (b"\x20\x02\x00\x01", {"protocol": "v311"}, "protocol", "refused: Unsupported protocol version"),
    ],
)
def test_a_broken_peer(
    tmp_path: Path,
    exporter: str,
    relays: list[Program],
    reply: bytes | None,
    mqtt: dict[str, Any],
    reason: str,
    message: str,
) -> None:
    peer = Peer(reply)
    try:
        relay, cfg = _start_relay(tmp_path, exporter, peer.port, relays, **mqtt)
        snap = _wait_for(relay, cfg, f"a failure for {reason}", _disconnected_because(reason))
    finally:
        peer.close()
    assert snap["relay"]["last_error"]["message"] == message


def test_unknown_host(tmp_path: Path, exporter: str, relays: list[Program]) -> None:
    relay, cfg = _start_relay(tmp_path, exporter, 1883, relays, host="broker.invalid")
    snap = _wait_for(relay, cfg, "a name that does not resolve", _disconnected_because("dns"))
    assert snap["relay"]["last_error"]["message"].startswith("gaierror: ")


def test_a_lost_connection_is_closed(
    tmp_path: Path, make_service: ServiceFactory, exporter: str, relays: list[Program]
) -> None:
    broker = make_service(Mosquitto)
    relay, cfg = _start_relay(tmp_path, exporter, broker.port, relays)
    _wait_for(relay, cfg, "connected", lambda snap: snap["relay"]["connected"] is True)
    broker.stop()
    # The loss comes first (closed), then the attempts to come back (refused).
    snap = _wait_for(relay, cfg, "the loss, then refusals", _disconnected_because("connection_refused"))
    s = settings.load(str(cfg))
    m = status_cmd.read(s).metrics
    assert m is not None
    closed = [v for lab, v in m["edge_relay_mqtt_connection_errors_total"] if lab["reason"] == "closed"]
    assert closed == [1.0], snap


def test_a_silent_link_is_a_timeout(
    tmp_path: Path, make_service: ServiceFactory, exporter: str, relays: list[Program]
) -> None:
    broker = make_service(Mosquitto)
    link = LinkProxy(broker.port)
    try:
        relay, cfg = _start_relay(tmp_path, exporter, link.port, relays, keepalive_seconds=2)
        _wait_for(relay, cfg, "connected", lambda snap: snap["relay"]["connected"] is True)
        link.blackhole()  # nothing answers, nothing is closed: only the keepalive can tell
        snap = _wait_for(relay, cfg, "the keepalive's verdict", _disconnected_because("timeout"))
        m = status_cmd.read(settings.load(str(cfg))).metrics  # before closing the proxy closes the link
    finally:
        link.close()
    assert snap["relay"]["last_error"]["message"] in (
        "connection lost: no answer within the keepalive",
        "no CONNACK within 2s",  # the reconnection attempts after it, into the same silence
    )
    assert m is not None
    timeouts = [v for lab, v in m["edge_relay_mqtt_connection_errors_total"] if lab["reason"] == "timeout"]
    closed = [v for lab, v in m["edge_relay_mqtt_connection_errors_total"] if lab["reason"] == "closed"]
    assert timeouts[0] >= 1 and closed == [0.0]


# --- the page in a real browser ---------------------------------------------------------------------------


def _chromium(tmp_path: Path, *args: str) -> str:
    argv = [
        "chromium",
        "--headless",
        "--no-sandbox",  # as root in a container
        "--disable-gpu",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=90).stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (./dev installs it)")
def test_the_page_in_a_headless_browser(tmp_path: Path, exporter: str, relays: list[Program]) -> None:
    relay, cfg = _start_relay(tmp_path, exporter, free_port(), relays)
    _wait_for(
        relay,
        cfg,
        "a scraped target, a failing one and a refused link",
        lambda snap: (
            snap["targets"]["demo"]["health"] == "ok"
            and snap["targets"]["broken"]["health"] == "failing"
            and _disconnected_because("connection_refused")(snap)
        ),
    )
    listen = yaml.safe_load(cfg.read_text())["metrics"]["listen"]
    url = f"http://{listen}/status"
    dom = _chromium(tmp_path, "--dump-dom", url)
    assert "<title>edge-relay test/edge-gpu-01</title>" in dom
    rows = {
        line.split("</td>")[0].rsplit(">", 1)[-1]: line
        for line in dom.replace("<tr", "\n<tr").splitlines()
        if line.startswith('<tr class="target">')
    }
    assert sorted(rows) == ["broken", "demo"], dom
    assert ">ok<" in rows["demo"] and ">2.0<" in rows["demo"]  # two samples a scrape
    assert ">failing<" in rows["broken"] and "Connection refused" in rows["broken"]
    assert "disconnected from 127.0.0.1:" in dom and "connection_refused: ConnectionRefusedError" in dom
    assert "backlog" in dom and "budget" in dom and "none (no budget_file)" in dom
    shot = tmp_path / "status.png"
    _chromium(tmp_path, f"--screenshot={shot}", "--window-size=1400,700", url)
    assert shot.stat().st_size > 10_000
