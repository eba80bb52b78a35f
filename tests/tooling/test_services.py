"""Smoke tests of testkit/services.py: the real services start, talk, restart and are reaped."""

from __future__ import annotations

import math
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import cramjam
import paho.mqtt.client as mqtt
import pytest
import requests

from schemas.model import STALE_NAN, is_stale
from testkit.services import (
    Mosquitto,
    Prometheus,
    RawSamples,
    ServiceError,
    ServiceFactory,
    VictoriaMetrics,
    free_port,
    now_ms,
    wait_until,
)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# -- helpers that need no service ----------------------------------------------------------------


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_wait_until_returns_value_and_times_out() -> None:
    calls = iter(range(10))
    assert wait_until(lambda: next(calls) >= 3, timeout=5, interval=0) is True
    with pytest.raises(TimeoutError, match="the moon"):
        wait_until(lambda: False, timeout=0.05, interval=0.01, message="the moon")


# -- minimal remote-write 1.0 client (the real one lives in cloud_ingest) --------------------------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int64 -> two's complement, 10 bytes
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """Length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


Series = tuple[Mapping[str, str], Sequence[tuple[int, float]]]


def write_request(series: Sequence[Series]) -> bytes:
    """prometheus.WriteRequest: timeseries=1 {labels=1 {name=1, value=2}, samples=2 {value=1, ts=2}}."""
    body = b""
    for labels, samples in series:
        ts = b"".join(
            _field(1, _field(1, k.encode()) + _field(2, v.encode())) for k, v in sorted(labels.items())
        )
        for t, v in samples:
            # value: double (wire type 1, tag 0x09); timestamp: int64 varint (tag 0x10)
            ts += _field(2, b"\x09" + struct.pack("<d", v) + b"\x10" + _varint(t))
        body += _field(1, ts)
    return body


def remote_write(url: str, series: Sequence[Series]) -> requests.Response:
    return requests.post(
        url,
        data=bytes(cramjam.snappy.compress_raw(write_request(series))),
        headers={
            "Content-Encoding": "snappy",
            "Content-Type": "application/x-protobuf",
            "X-Prometheus-Remote-Write-Version": "0.1.0",
        },
        timeout=10,
    )


def _key(labels: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    return frozenset(labels.items())


def _comparable(samples: RawSamples) -> dict[frozenset[tuple[str, str]], list[tuple[int, str]]]:
    # repr() makes NaN equal to NaN and keeps -0.0 apart from 0.0.
    return {k: [(t, repr(v)) for t, v in s] for k, s in samples.items()}


COUNTER = {"__name__": "relay_smoke_total", "job": "smoke", "instance": "edge-1"}
GAUGE = {"__name__": "relay_smoke_gauge", "job": "smoke"}


def write_smoke_series(url: str, now_ms: int) -> RawSamples:
    """Write two series, then one out-of-order sample; return what must be stored."""
    counter = [(now_ms - 60_000, 1.5), (now_ms - 30_000, 2.25)]
    gauge = [(now_ms - 30_000, -1234.5678), (now_ms - 20_000, math.inf)]
    resp = remote_write(url, [(COUNTER, counter), (GAUGE, gauge)])
    assert resp.status_code == 204, resp.text
    out_of_order = (now_ms - 30 * 60_000, 0.5)  # 30 min before the counter's newest sample
    resp = remote_write(url, [(COUNTER, [out_of_order])])
    assert resp.status_code == 204, resp.text
    return {_key(COUNTER): [out_of_order, *counter], _key(GAUGE): gauge}


# -- mosquitto ------------------------------------------------------------------------------------


class MqttClient:
    """paho client with blocking connect/subscribe/publish, for tests."""

    def __init__(self, broker: Mosquitto, client_id: str, *, clean_session: bool = True) -> None:
        self.messages: queue.Queue[mqtt.MQTTMessage] = queue.Queue()
        self.session_present: bool | None = None
        self._connected = threading.Event()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=mqtt.MQTTv311,
        )
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)
        self.client.connect(broker.host, broker.port, keepalive=30)
        self.client.loop_start()
        assert self._connected.wait(5), f"{client_id} could not connect to {broker}"

    def _on_connect(
        self, _c: object, _u: object, flags: mqtt.ConnectFlags, reason: object, _p: object
    ) -> None:
        self.session_present = flags.session_present
        self._connected.set()

    def subscribe(self, topic: str, qos: int = 1) -> None:
        self._subscribed.clear()
        self.client.subscribe(topic, qos)
        assert self._subscribed.wait(5), f"no SUBACK for {topic}"

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        info = self.client.publish(topic, payload, qos)
        info.wait_for_publish(5)  # QoS 1: returns once the broker's PUBACK arrived
        assert info.is_published()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@contextmanager
def mqtt_client(broker: Mosquitto, client_id: str, *, clean_session: bool = True) -> Iterator[MqttClient]:
    client = MqttClient(broker, client_id, clean_session=clean_session)
    try:
        yield client
    finally:
        client.close()


def test_mosquitto_qos1_publish_subscribe(mosquitto: Mosquitto) -> None:
    assert mosquitto.startup_seconds is not None
    with mqtt_client(mosquitto, "sub") as sub, mqtt_client(mosquitto, "pub") as pub:
        sub.subscribe("relay/smoke", qos=1)
        pub.publish("relay/smoke", b"\x00hello\xff", qos=1)
        msg = sub.messages.get(timeout=5)
    assert (msg.topic, msg.payload, msg.qos) == ("relay/smoke", b"\x00hello\xff", 1)


def test_mosquitto_restart_keeps_port_and_stop_reaps_group(mosquitto: Mosquitto) -> None:
    port, old_pid = mosquitto.port, mosquitto.pid
    mosquitto.restart()
    assert mosquitto.port == port and mosquitto.pid != old_pid
    with mqtt_client(mosquitto, "after-restart"):
        pass
    pid = mosquitto.pid
    assert pid is not None and mosquitto.kill() == -9
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # the whole group is gone and reaped
    mosquitto.restart(graceful=False)
    assert mosquitto.port == port and mosquitto.is_running()
    assert mosquitto.stop() == 0


def test_mosquitto_persistent_session_survives_restart(make_service: ServiceFactory) -> None:
    broker = make_service(Mosquitto, persistence=True)
    with mqtt_client(broker, "ingester", clean_session=False) as sub:
        sub.subscribe("relay/queued", qos=1)
    with mqtt_client(broker, "edge") as pub:
        pub.publish("relay/queued", b"while you were away", qos=1)
    broker.restart()  # SIGTERM: mosquitto writes its db on a clean shutdown
    with mqtt_client(broker, "ingester", clean_session=False) as sub:
        msg = sub.messages.get(timeout=5)
        assert sub.session_present is True
    assert (msg.topic, msg.payload, msg.qos) == ("relay/queued", b"while you were away", 1)


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie counts: orphans are reparented to an init that may never reap them.
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_services_die_with_a_hard_killed_test_process(tmp_path: Path) -> None:
    code = (
        "import sys, time\n"
        "from testkit.services import Mosquitto\n"
        "print(Mosquitto(sys.argv[1]).start().pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert child.stdout is not None
        pid = int(child.stdout.readline())
    finally:
        child.kill()  # SIGKILL: no fixture teardown, no atexit
        child.wait()
    try:
        wait_until(lambda: _dead(pid), timeout=5, message=f"orphaned mosquitto {pid} to die")
    finally:
        if not _dead(pid):
            os.kill(pid, signal.SIGKILL)


def test_start_failure_reports_log_tail(tmp_path: Path) -> None:
    broker = Mosquitto(tmp_path, extra_conf="no_such_option 1")
    with pytest.raises(ServiceError, match=r"(?s)exited with.*Last 50 lines.*no_such_option"):
        broker.start()
    assert not broker.is_running()


def test_start_retries_on_a_new_port_when_ours_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]

        broker = Mosquitto(tmp_path / "auto")
        broker.port = taken  # as if someone grabbed the port between free_port() and start()
        try:
            broker.start()
            assert broker.port != taken and broker.is_running()
        finally:
            broker.stop()

        fixed = Mosquitto(tmp_path / "fixed", port=taken)  # an explicit port is never swapped
        with pytest.raises(ServiceError, match="could not bind"):
            fixed.start()


# -- Prometheus -----------------------------------------------------------------------------------


def test_prometheus_remote_write_round_trip(prometheus: Prometheus) -> None:
    now = now_ms()
    expected = write_smoke_series(prometheus.remote_write_url, now)
    got = prometheus.raw_samples('{job="smoke"}')
    assert _comparable(got) == _comparable(expected)
    assert prometheus.raw_samples('{__name__=~".+"}').keys() == got.keys()


def test_prometheus_values_are_bit_exact(prometheus: Prometheus) -> None:
    now = now_ms()
    values = [1 / 3, 0.1 + 0.2, 5e-324, 1.7976931348623157e308, -0.0, math.nan, -math.inf, 2.0**53 + 2]
    samples = [(now - 1000 * (len(values) - i), v) for i, v in enumerate(values)]
    labels = {"__name__": "relay_smoke_floats", "le": "+Inf"}
    assert remote_write(prometheus.remote_write_url, [(labels, samples)]).status_code == 204
    got = prometheus.raw_samples("relay_smoke_floats", lookback="1m")
    assert _comparable(got) == _comparable({_key(labels): samples})


def test_prometheus_rejects_out_of_order_without_window(make_service: ServiceFactory) -> None:
    prometheus = make_service(Prometheus, ooo_window=None)
    now = now_ms()
    assert remote_write(prometheus.remote_write_url, [(COUNTER, [(now, 1.0)])]).status_code == 204
    resp = remote_write(prometheus.remote_write_url, [(COUNTER, [(now - 1000, 2.0)])])
    assert resp.status_code == 400 and "out of order" in resp.text
    assert prometheus.raw_samples("relay_smoke_total", at=now / 1000) == {_key(COUNTER): [(now, 1.0)]}


# -- VictoriaMetrics ------------------------------------------------------------------------------


def test_victoria_metrics_remote_write_round_trip(victoria_metrics: VictoriaMetrics) -> None:
    now = now_ms()
    expected = write_smoke_series(victoria_metrics.remote_write_url, now)
    victoria_metrics.flush()
    got = victoria_metrics.raw_samples('{job="smoke"}')
    # These values have few decimal digits, so VM's decimal storage returns them exactly.
    assert _comparable(got) == _comparable(expected)
    window = victoria_metrics.raw_samples('{job="smoke"}', start_ms=now - 60_000, end_ms=now - 30_000)
    assert window == {
        _key(COUNTER): [(now - 60_000, 1.5), (now - 30_000, 2.25)],
        _key(GAUGE): [(now - 30_000, -1234.5678)],
    }


def test_victoria_metrics_precision_and_stale_markers(victoria_metrics: VictoriaMetrics) -> None:
    now = now_ms()
    labels = {"__name__": "relay_smoke_precision"}
    samples = [(now - 3000, 1 / 3), (now - 2000, STALE_NAN), (now - 1000, math.nan)]
    assert remote_write(victoria_metrics.remote_write_url, [(labels, samples)]).status_code == 204
    victoria_metrics.flush()
    [(third_ts, third), (stale_ts, stale)] = victoria_metrics.raw_samples("relay_smoke_precision")[
        _key(labels)
    ]
    # About 12 significant digits survive; the stale marker survives; a plain NaN is dropped.
    assert third_ts == now - 3000 and math.isclose(third, 1 / 3, rel_tol=1e-11)
    assert stale_ts == now - 2000 and is_stale(stale)
