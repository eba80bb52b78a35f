"""``edge_relay.uplink.netloop.WakeableLoop`` against a real mosquitto: paho driven through its external-loop
API reads, writes (also what a callback queued) and keeps alive like ``Client.loop``, and ``wake()``
from another thread ends a turn at once. The uplink built on it: test_uplink.py,
``test_idle_uplink_sleeps_and_publishes_a_kicked_row_at_once``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from edge_relay.uplink.netloop import WakeableLoop
from testkit.services import Mosquitto

pytestmark = pytest.mark.integration


def _client(broker: Mosquitto, **kwargs: Any) -> mqtt.Client:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=f"netloop-{uuid.uuid4().hex[:8]}",
        protocol=mqtt.MQTTv5,
    )
    client.connect(broker.host, broker.port, **kwargs)
    return client


def _turn_until(net: WakeableLoop, client: mqtt.Client, done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not done():
        assert time.monotonic() < deadline, what
        assert net.turn(client, 0.2) == mqtt.MQTT_ERR_SUCCESS


@pytest.fixture
def net() -> Iterator[WakeableLoop]:
    loop = WakeableLoop()
    yield loop
    loop.close()


def test_wake_from_another_thread_ends_a_long_turn(mosquitto: Mosquitto, net: WakeableLoop) -> None:
    client = _client(mosquitto)
    connected = threading.Event()
    client.on_connect = lambda *_: connected.set()
    _turn_until(net, client, connected.is_set, "no CONNACK")
    net.clear()
    assert not net.woken

    timer = threading.Timer(0.3, net.wake)
    timer.start()
    started = time.monotonic()
    assert net.turn(client, 30.0) == mqtt.MQTT_ERR_SUCCESS
    # Without the wake the turn would have slept its 30 s: the bound only has to be far below that.
    assert time.monotonic() - started < 10
    assert net.woken
    # The wake byte was drained: the next turn sleeps its timeout again, although nobody has acted on
    # ``woken`` yet (the uplink's connect waits turn like this: they must not spin).
    started = time.monotonic()
    net.turn(client, 0.5)
    assert time.monotonic() - started >= 0.4
    assert net.woken
    net.clear()
    assert not net.woken
    client.disconnect()


def test_reads_writes_and_what_a_callback_queued(mosquitto: Mosquitto, net: WakeableLoop) -> None:
    # The echo client is driven only by turns; it answers inside its message callback, where paho
    # queues the publication without writing it.
    echo = _client(mosquitto)
    subscribed = threading.Event()
    echo.on_subscribe = lambda *_: subscribed.set()
    echo.on_connect = lambda c, *_: c.subscribe("netloop/ping", qos=1)
    echo.on_message = lambda c, _u, m: c.publish("netloop/pong", bytes(m.payload) + b"!", qos=1)
    _turn_until(net, echo, subscribed.is_set, "the echo client could not subscribe")

    answers: list[bytes] = []
    peer = _client(mosquitto)
    ready = threading.Event()
    peer.on_subscribe = lambda *_: ready.set()
    peer.on_connect = lambda c, *_: c.subscribe("netloop/pong", qos=1)
    peer.on_message = lambda _c, _u, m: answers.append(bytes(m.payload))
    peer.loop_start()
    try:
        assert ready.wait(10)
        for i in range(5):
            peer.publish("netloop/ping", f"n{i}".encode(), qos=1)
        _turn_until(net, echo, lambda: len(answers) == 5, "the echoes did not come back")
        assert sorted(answers) == [f"n{i}!".encode() for i in range(5)]
    finally:
        peer.disconnect()
        peer.loop_stop()
        echo.disconnect()


def test_keepalive_pings_are_sent_by_turns(mosquitto: Mosquitto, net: WakeableLoop) -> None:
    # Nothing else goes over the connection for three keepalive periods: the broker (which drops a
    # client silent for 1.5 keepalives) keeps it only if the turns send PINGREQs.
    client = _client(mosquitto, keepalive=1)
    client.on_connect = lambda *_: None
    lost = threading.Event()
    client.on_disconnect = lambda *_: lost.set()
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        assert net.turn(client, 1.0) == mqtt.MQTT_ERR_SUCCESS
    assert not lost.is_set()
    assert client.is_connected()
    client.disconnect()


def test_a_client_without_a_socket_is_not_connected(net: WakeableLoop) -> None:
    client = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="none")
    assert net.turn(client, 5.0) == mqtt.MQTT_ERR_NO_CONN


def test_closed_loop_ignores_wakes(net: WakeableLoop) -> None:
    net.close()
    net.wake()  # a kick racing the uplink's end must not raise
    assert net.woken
