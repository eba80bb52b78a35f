"""Integration tests of stage 6, ``edge_relay.uplink.mqtt.Uplink``.

The uplink talks to a real mosquitto (``testkit/services.py``); the cloud is faked in the test with
paho-mqtt: it subscribes to the node's batch topic and publishes application acks on the ack topic,
following a per-test policy.  Network faults come from a small TCP proxy that can silently swallow
traffic (``LinkProxy``); protocol negotiation is checked against a raw-socket fake broker
(``FakeBroker``) that only speaks as much MQTT as the uplink needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import MQTT
from edge_relay.store.spool import Spool
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.pacer import Pacer, TokenBucket, WireMeter, tcp_bytes
from schemas import codec, topics
from schemas.codec import AckResult, AckResultKind
from schemas.model import Batch, ScrapeBlock
from testkit.netfaults import LinkProxy
from testkit.services import LOOPBACK, Mosquitto, ServiceFactory, wait_until
from testkit.uplinks import mqtt_settings, spool_uplink

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CLUSTER = "lab"
NODE = "edge-1"
PREFIX = "edgemetrics"
BATCH_TOPIC = topics.batch_topic(PREFIX, CLUSTER, NODE)
ACK_TOPIC = topics.ack_topic(PREFIX, CLUSTER, NODE)
STATUS_TOPIC = topics.status_topic(PREFIX, CLUSTER, NODE)


# -- configuration, spool rows, metrics -----------------------------------------------------------


def mqtt_cfg(port: int, **overrides: Any) -> MQTT:
    """A 3 s keepalive unless a test says otherwise: a dead link is noticed within seconds."""
    return mqtt_settings(port, **{"keepalive_seconds": 3, **overrides})


def batch_payload(seq: int, ts_ms: int) -> bytes:
    """A real encoded batch (the uplink never decodes it, the fake cloud peeks at its header)."""
    labels = (("__name__", "kepler_node_package_joules_total"), ("instance", f"{NODE}:9102"))
    block = ScrapeBlock(ts_ms, array("I", [0]), array("d", [float(seq)]))
    return codec.encode_batch(Batch(CLUSTER, NODE, seq, [labels], [block]))


def append_rows(spool: Spool, n: int) -> list[int]:
    seqs: list[int] = []
    for _ in range(n):
        ts = int(time.time() * 1000)
        seqs.append(
            spool.batches.append(
                lambda seq, ts=ts: batch_payload(seq, ts), first_ts_ms=ts, last_ts_ms=ts, sample_count=1
            )
        )
    return seqs


def spool_seqs(spool: Spool) -> list[int]:
    return [row.seq for row in spool.batches.pending(1_000_000)]


def metric(metrics: RelayMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def acked_total(metrics: RelayMetrics, result: str) -> float:
    return metric(metrics, "edge_relay_batches_acked_total", result=result)


def published_total(metrics: RelayMetrics, kind: str) -> float:
    return metric(metrics, "edge_relay_batches_published_total", kind=kind)


# -- the fake cloud ---------------------------------------------------------------------------------

# (seq, how many times this seq has been delivered so far) -> the ack to send, or None for no ack.
AckPolicy = Callable[[int, int], AckResult | None]


def ack_all(seq: int, _n: int) -> AckResult | None:
    return AckResult(seq, "ok")


def never_ack(_seq: int, _n: int) -> AckResult | None:
    return None


@dataclass(frozen=True)
class Delivery:
    seq: int
    topic: str
    qos: int
    retain: bool
    payload: bytes


class FakeCloud:
    """Subscribes to the node's batch topic (QoS 1) and acks on its ack topic as ``policy`` says."""

    def __init__(self, host: str, port: int, policy: AckPolicy = never_ack) -> None:
        self.policy = policy
        self.deliveries: list[Delivery] = []
        self.acked: dict[int, str] = {}
        self.max_outstanding = 0
        self.subscribed = threading.Event()
        self._lock = threading.Lock()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"fake-cloud-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.reconnect_delay_set(0.1, 0.5)
        self.client.connect_async(host, port, keepalive=5)
        self.client.loop_start()

    def _on_connect(self, client: mqtt.Client, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        if not reason.is_failure:
            self.subscribed.clear()
            client.subscribe(BATCH_TOPIC, qos=1)

    def _on_subscribe(self, _c: mqtt.Client, _u: Any, _mid: int, _codes: Any, _p: Any) -> None:
        self.subscribed.set()

    def _on_message(self, client: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        payload = bytes(msg.payload)
        try:
            seq = codec.peek_header(payload).seq
        except codec.DecodeError:
            seq = -1  # not a batch (some tests spool arbitrary bytes); never acked
        with self._lock:
            self.deliveries.append(Delivery(seq, msg.topic, msg.qos, bool(msg.retain), payload))
            outstanding = {d.seq for d in self.deliveries} - self.acked.keys()
            self.max_outstanding = max(self.max_outstanding, len(outstanding))
            n = sum(d.seq == seq for d in self.deliveries)
            result = self.policy(seq, n)
            if result is not None:
                self.acked[seq] = result.result
        if result is not None:
            # Inside a paho callback: publish, but never wait for the PUBACK here.
            client.publish(ACK_TOPIC, codec.encode_ack(NODE, [result]), qos=1)

    # -- test side --

    def seqs(self) -> list[int]:
        """Delivered seqs in arrival order, duplicates included."""
        with self._lock:
            return [d.seq for d in self.deliveries]

    def distinct(self) -> set[int]:
        return set(self.seqs())

    def count(self, seq: int) -> int:
        return self.seqs().count(seq)

    def ack(
        self, seqs: list[int], result: AckResultKind = "ok", reason: str | None = None, incarnation: int = 0
    ) -> None:
        """Publish one ack message for ``seqs`` and wait until the broker has it (PUBACK)."""
        results = [AckResult(s, result, reason) for s in seqs]
        with self._lock:
            for s in seqs:
                self.acked[s] = result
        payload = codec.encode_ack(NODE, results, incarnation=incarnation)
        info = self.client.publish(ACK_TOPIC, payload, qos=1)
        info.wait_for_publish(5)
        assert info.is_published(), "the broker did not PUBACK the cloud's ack"

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


class StatusWatcher:
    """Records every message on the node's status topic, decoded, with its retain flag."""

    def __init__(self, host: str, port: int) -> None:
        self.statuses: list[tuple[dict[str, Any], bool]] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"status-watcher-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_connect = lambda c, *_: c.subscribe(STATUS_TOPIC, qos=1)
        self.client.on_subscribe = lambda *_: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect(host, port, keepalive=5)
        self.client.loop_start()
        assert self._subscribed.wait(5), "status watcher could not subscribe"

    def _on_message(self, _c: mqtt.Client, _u: Any, msg: mqtt.MQTTMessage) -> None:
        status = codec.decode_status(bytes(msg.payload))
        with self._lock:
            self.statuses.append((status, bool(msg.retain)))

    def states(self) -> list[str]:
        with self._lock:
            return [s["state"] for s, _ in self.statuses]

    def first_retained(self) -> dict[str, Any] | None:
        with self._lock:
            return next((s for s, retained in self.statuses if retained), None)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def retained_status(broker: Mosquitto, timeout: float = 5.0) -> dict[str, Any]:
    """What a subscriber arriving now gets as the retained status."""
    watcher = StatusWatcher(broker.host, broker.port)
    try:
        return wait_until(watcher.first_retained, timeout=timeout, message="a retained status")
    finally:
        watcher.close()


def retained_in_state(broker: Mosquitto, state: str) -> dict[str, Any] | None:
    """The retained status if there is one (within a second) and it is in ``state``, else None.

    For polling: a fresh subscriber may arrive before the status it waits for has been retained.
    """
    try:
        status = retained_status(broker, timeout=1.0)
    except TimeoutError:
        return None
    return status if status["state"] == state else None


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture
def make_cloud() -> Iterator[Callable[..., FakeCloud]]:
    clouds: list[FakeCloud] = []

    def make(broker: Mosquitto, policy: AckPolicy = never_ack, *, wait: bool = True) -> FakeCloud:
        cloud = FakeCloud(broker.host, broker.port, policy)
        clouds.append(cloud)
        if wait:
            assert cloud.subscribed.wait(10), "the fake cloud could not subscribe"
        return cloud

    yield make
    for cloud in clouds:
        cloud.close()


@pytest.fixture
def make_uplink(make_service: ServiceFactory) -> Iterator[Callable[..., Uplink]]:
    """Started uplinks, stopped at teardown (before the services, which make_service reaps later)."""
    uplinks: list[Uplink] = []

    def make(cfg: MQTT, spool: Spool, *, start: bool = True, live_window_s: float = 0.0) -> Uplink:
        # live_window_s=0: no row counts as "live", so these tests see the backlog order (oldest first);
        # test_live_first_* sets it to check the live-first order.
        uplink = spool_uplink(cfg, spool, cluster=CLUSTER, node=NODE, live_window_s=live_window_s)
        if start:
            uplink.start()
            uplinks.append(uplink)
        return uplink

    yield make
    for uplink in uplinks:
        uplink.stop(0)


@pytest.fixture
def impatient_spool(tmp_path: Path) -> Iterator[Spool]:
    """A spool that gives up after 100 ms when another process holds SQLite's write lock."""
    s = Spool(tmp_path / "spool.db", busy_timeout_ms=100)
    yield s
    s.close()


# -- 1. publication and ack semantics ---------------------------------------------------------------


def test_rows_published_qos1_oldest_first_and_deleted_only_on_ack(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    cloud = make_cloud(mosquitto)
    seqs = append_rows(spool, 5)
    assert seqs == [1, 2, 3, 4, 5]
    uplink = make_uplink(mqtt_cfg(mosquitto.port), spool)
    uplink.kick()

    wait_until(lambda: len(cloud.seqs()) >= 5, timeout=10, message="5 batches at the cloud")
    assert cloud.seqs() == seqs  # oldest first, each once
    payloads = {row.seq: row.payload for row in spool.batches.pending(10)}
    for d in cloud.deliveries:
        assert d.topic == BATCH_TOPIC == f"{PREFIX}/v1/{CLUSTER}/{NODE}/batch"
        assert d.qos == 1  # the cloud subscribed with QoS 1: the delivery is QoS 1 only if published so
        assert not d.retain
        assert d.payload == payloads[d.seq]

    # No ack, no deletion (the broker's PUBACK is not an application ack).
    time.sleep(1.0)
    assert spool_seqs(spool) == seqs
    assert acked_total(uplink.metrics, "ok") == 0

    cloud.ack([2])
    cloud.ack([4], "rejected", "decode failed: bad magic")
    wait_until(lambda: spool_seqs(spool) == [1, 3, 5], timeout=10, message="rows 2 and 4 deleted")
    assert acked_total(uplink.metrics, "ok") == 1
    assert acked_total(uplink.metrics, "rejected") == 1

    cloud.ack([1, 3, 5])
    wait_until(lambda: not spool_seqs(spool), timeout=10, message="spool empty")
    assert acked_total(uplink.metrics, "ok") == 4
    assert published_total(uplink.metrics, "first") == 5
    assert published_total(uplink.metrics, "retry") == 0


def test_idle_uplink_sleeps_and_publishes_a_kicked_row_at_once(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    cloud = make_cloud(mosquitto)
    uplink = make_uplink(mqtt_cfg(mosquitto.port), spool, start=False)
    turns = 0
    turn = uplink._net.turn

    def counted(client: mqtt.Client, timeout: float) -> mqtt.MQTTErrorCode:
        nonlocal turns
        turns += 1
        return turn(client, timeout)

    uplink._net.turn = counted  # type: ignore[method-assign]
    uplink.start()
    try:
        wait_until(lambda: uplink.connected, timeout=10, message="uplink connected")
        time.sleep(0.5)  # the first pump after the connect
        before = turns
        time.sleep(3.0)
        # Idle: housekeeping once a second (turns of Client.loop(0.25) came 4 times a second).
        assert turns - before <= 5

        seqs = append_rows(spool, 1)
        kicked = time.monotonic()
        uplink.kick()
        wait_until(lambda: cloud.seqs() == seqs, timeout=10, message="the kicked row at the cloud")
        # Far sooner than the idle pump (5 s), which a kick that did not wake the loop would wait for.
        assert time.monotonic() - kicked < 3.0
    finally:
        uplink.stop(0)


# -- 2. in-flight window ----------------------------------------------------------------------------


def test_kick_and_wait_returns_once_the_kicked_row_is_published(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    uplink = make_uplink(mqtt_cfg(mosquitto.port), spool)
    # Not connected yet: at once, without waiting out the timeout.
    started = time.monotonic()
    if not uplink.connected:
        # It may connect between the check and the call: then it waits for its pass, as below.
        assert uplink.kick_and_wait(30.0) is False or uplink.connected
        assert time.monotonic() - started < 5.0
    wait_until(lambda: uplink.connected, timeout=10, message="uplink connected")
    make_cloud(mosquitto)
    for n in range(1, 4):
        append_rows(spool, 1)
        assert uplink.kick_and_wait(10.0) is True
        assert published_total(uplink.metrics, "first") == n  # by the time it returns


def test_inflight_window_limits_outstanding_batches(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    cloud = make_cloud(mosquitto)
    seqs = append_rows(spool, 10)
    uplink = make_uplink(mqtt_cfg(mosquitto.port, inflight_batches=3), spool)
    uplink.kick()

    wait_until(lambda: len(cloud.distinct()) >= 3, timeout=10, message="3 batches at the cloud")
    time.sleep(1.5)  # more than one pump period: nothing else may leave
    uplink.kick()
    time.sleep(0.5)
    assert cloud.seqs() == [1, 2, 3]
    assert metric(uplink.metrics, "edge_relay_inflight_batches") == 3

    cloud.ack([1, 2, 3])
    wait_until(lambda: cloud.distinct() >= {4, 5, 6}, timeout=10, message="batches 4-6 at the cloud")
    time.sleep(1.5)
    assert cloud.distinct() == {1, 2, 3, 4, 5, 6}

    cloud.policy = ack_all
    cloud.ack([4, 5, 6])
    wait_until(lambda: not spool_seqs(spool), timeout=15, message="spool drained")
    assert cloud.distinct() == set(seqs)
    assert cloud.max_outstanding == 3
    assert sorted(cloud.seqs()) == seqs  # no republication was needed


# -- 3. republication after the ack timeout ---------------------------------------------------------


def test_unacked_batch_is_republished_after_ack_timeout(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    # The cloud ignores the first delivery of every batch and acks the second one.
    cloud = make_cloud(mosquitto, lambda seq, n: AckResult(seq, "ok") if n >= 2 else None)
    seqs = append_rows(spool, 3)
    uplink = make_uplink(mqtt_cfg(mosquitto.port, ack_timeout_seconds=1.0), spool)
    uplink.kick()

    wait_until(lambda: not spool_seqs(spool), timeout=15, message="all rows acked after a republication")
    assert all(cloud.count(s) >= 2 for s in seqs), cloud.seqs()
    assert published_total(uplink.metrics, "first") == 3
    assert published_total(uplink.metrics, "retry") >= 3
    assert acked_total(uplink.metrics, "ok") >= 3
    # Publish delay is the first publication's: a republication would count a batch twice.
    assert metric(uplink.metrics, "edge_relay_publish_delay_seconds_count") == 3


def test_publish_delay_is_the_age_of_a_batch_newest_sample_at_its_first_publication(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    cloud = make_cloud(mosquitto)
    now_ms = int(time.time() * 1000)
    # A backlog row scraped 100-90 s ago, then a fresh one.
    old = spool.batches.append(
        lambda seq: batch_payload(seq, now_ms - 90_000),
        first_ts_ms=now_ms - 100_000,
        last_ts_ms=now_ms - 90_000,
        sample_count=1,
    )
    fresh = append_rows(spool, 1)
    uplink = make_uplink(mqtt_cfg(mosquitto.port), spool)
    uplink.kick()
    wait_until(lambda: len(cloud.seqs()) >= 2, timeout=10, message="both batches at the cloud")
    assert sorted(cloud.seqs()) == [old, *fresh]

    def bucket(le: str) -> float:
        return metric(uplink.metrics, "edge_relay_publish_delay_seconds_bucket", le=le)

    assert bucket("5.0") == 1  # the fresh row
    assert bucket("60.0") == 1
    assert bucket("300.0") == 2  # the backlog row: 90 s old by its newest sample, not its first
    assert metric(uplink.metrics, "edge_relay_publish_delay_seconds_sum") >= 90


# -- 4. broker down at start ------------------------------------------------------------------------


def test_broker_down_at_start_then_backlog_delivered(
    make_service: ServiceFactory,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    broker = make_service(Mosquitto)
    broker.stop()  # keeps its port for the later start
    seqs = append_rows(spool, 6)
    uplink = make_uplink(mqtt_cfg(broker.port, ack_timeout_seconds=2.0), spool)
    uplink.kick()

    wait_until(
        lambda: metric(uplink.metrics, "edge_relay_mqtt_connect_attempts_total", result="failed") >= 3,
        timeout=10,
        message="three failed connection attempts",
    )
    assert not uplink.connected
    assert spool_seqs(spool) == seqs

    broker.restart()
    cloud = make_cloud(broker, ack_all, wait=False)
    assert uplink.connected_event.wait(10), "the uplink did not connect once the broker was up"
    wait_until(lambda: not spool_seqs(spool), timeout=20, message="backlog delivered and acked")
    assert cloud.distinct() == set(seqs)
    assert metric(uplink.metrics, "edge_relay_mqtt_connected") == 1


# -- 5. broker restart mid-stream -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("persistence", "graceful"),
    [(True, True), (False, True), (True, False)],
    ids=["persistent-restart", "volatile-restart", "persistent-crash"],
)
def test_broker_restart_mid_stream_loses_nothing(
    make_service: ServiceFactory,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
    persistence: bool,
    graceful: bool,
) -> None:
    broker = make_service(Mosquitto, persistence=persistence)
    cloud = make_cloud(broker)
    seqs = append_rows(spool, 12)
    uplink = make_uplink(mqtt_cfg(broker.port, inflight_batches=4, ack_timeout_seconds=2.0), spool)
    uplink.kick()

    # Let part of the stream through, then pull the broker from under it.
    wait_until(lambda: len(cloud.distinct()) >= 4, timeout=10, message="first window at the cloud")
    cloud.ack([1, 2])
    wait_until(lambda: len(cloud.distinct()) >= 6, timeout=10, message="window refilled")
    broker.restart(graceful=graceful)
    assert spool_seqs(spool) == seqs[2:]

    cloud.policy = ack_all
    wait_until(lambda: not spool_seqs(spool), timeout=30, message="every row acked after the restart")
    assert cloud.distinct() == set(seqs)
    assert set(cloud.acked) == set(seqs)
    assert metric(uplink.metrics, "edge_relay_mqtt_connect_attempts_total", result="connected") >= 2


# -- 6. acks queued in the persistent session -------------------------------------------------------


@pytest.mark.parametrize("protocol", ["v5", "v311"])
def test_ack_sent_while_relay_away_is_delivered_on_reconnect(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
    protocol: str,
) -> None:
    cloud = make_cloud(mosquitto)
    seqs = append_rows(spool, 2)
    cfg = mqtt_cfg(mosquitto.port, protocol=protocol)
    first = make_uplink(cfg, spool)
    first.kick()
    wait_until(lambda: cloud.distinct() == set(seqs), timeout=10, message="both batches at the cloud")
    first.stop(0)
    assert not first.connected

    # The relay is away: the broker must keep this ack in the relay's session.
    cloud.ack([seqs[0]])
    time.sleep(0.3)
    assert spool_seqs(spool) == seqs

    # Same client id, same spool, new process-like instance; the cloud acks nothing more from here on.
    second = make_uplink(cfg, spool)
    wait_until(lambda: spool_seqs(spool) == seqs[1:], timeout=10, message="queued ack applied")
    assert acked_total(second.metrics, "ok") == 1
    assert cloud.acked == {seqs[0]: "ok"}


def test_acks_queued_for_a_recreated_spool_delete_nothing(
    mosquitto: Mosquitto,
    tmp_path: Path,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    """A new spool file (an emptyDir after a rollout, a deleted file) starts at seq 1 again, while acks
    for the old file's seqs may still wait in the relay's persistent session (same client id)."""
    cloud = make_cloud(mosquitto)
    cfg = mqtt_cfg(mosquitto.port)
    old = Spool(tmp_path / "old.db")
    assert append_rows(old, 2) == [1, 2]
    first = make_uplink(cfg, old)
    first.kick()
    wait_until(lambda: cloud.distinct() == {1, 2}, timeout=10, message="the old spool's batches")
    first.stop(0)
    cloud.ack([1, 2], incarnation=old.incarnation)  # queued at the broker: the relay is away
    old.close()

    new = Spool(tmp_path / "new.db")
    assert new.incarnation != old.incarnation
    assert append_rows(new, 3) == [1, 2, 3]
    second = make_uplink(cfg, new)
    wait_until(
        lambda: metric(second.metrics, "edge_relay_acks_ignored_total", reason="other_incarnation") == 1,
        timeout=10,
        message="the old incarnation's ack arrives and is ignored",
    )
    assert spool_seqs(new) == [1, 2, 3]
    # Its own incarnation's acks apply, and so do acks without one (an ingester that predates it).
    cloud.ack([1], incarnation=new.incarnation)
    wait_until(lambda: spool_seqs(new) == [2, 3], timeout=10, message="own incarnation's ack applied")
    cloud.ack([2])
    wait_until(lambda: spool_seqs(new) == [3], timeout=10, message="an ack without incarnation applied")
    second.stop(0)
    new.close()


# -- 7. retained status and last will ---------------------------------------------------------------


def test_retained_online_status_then_offline_after_clean_stop(
    mosquitto: Mosquitto, spool: Spool, make_uplink: Callable[..., Uplink]
) -> None:
    append_rows(spool, 3)
    uplink = make_uplink(mqtt_cfg(mosquitto.port), spool)
    assert uplink.connected_event.wait(10)

    online = wait_until(lambda: retained_in_state(mosquitto, "online"), timeout=10, message="online")
    assert (online["cluster"], online["node"], online["v"]) == (CLUSTER, NODE, 1)
    assert online["spool_rows"] == 3
    assert online["spool_samples"] == 3
    assert online["spool_bytes"] == spool.stats().bytes > 0
    assert "inflight" in online

    uplink.stop(0.5)
    offline = wait_until(lambda: retained_in_state(mosquitto, "offline"), timeout=10, message="offline")
    assert (offline["cluster"], offline["node"]) == (CLUSTER, NODE)


_CHILD = r"""
import json, sys, time
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.ledger import LossLedger
from edge_relay.settings import MQTT
from edge_relay.store.spool import InFlight, SendQueue, Spool
from edge_relay.uplink.status import StatusReport
from edge_relay.uplink.mqtt import Uplink

args = json.loads(sys.argv[1])
spool = Spool(args["spool"])
cfg = MQTT(**args["mqtt"])
queue = SendQueue(spool.batches, order=cfg.order, inflight_limit=cfg.inflight_batches, live_window_s=5.0)
uplink = Uplink(
    cfg, cluster=args["cluster"], node=args["node"], queue=queue, inflight=InFlight(),
    metrics=RelayMetrics(), status=StatusReport(spool, LossLedger(spool.losses), None),
)
uplink.start()
if not uplink.connected_event.wait(20):
    sys.exit(3)
print("connected", flush=True)
time.sleep(600)
"""


def test_last_will_offline_after_abrupt_death(mosquitto: Mosquitto, tmp_path: Path) -> None:
    path = tmp_path / "child-spool.db"
    with contextlib.closing(Spool(path)) as s:
        append_rows(s, 2)
    cfg = mqtt_cfg(mosquitto.port, keepalive_seconds=2)
    args = {"spool": str(path), "cluster": CLUSTER, "node": NODE, "mqtt": dataclasses.asdict(cfg)}
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    watcher = StatusWatcher(mosquitto.host, mosquitto.port)
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(args)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "connected", "the uplink subprocess did not connect"
        wait_until(lambda: "online" in watcher.states(), timeout=10, message="online status")
        online = wait_until(lambda: retained_in_state(mosquitto, "online"), timeout=10, message="online")
        assert online["spool_rows"] == 2

        proc.kill()  # SIGKILL: no DISCONNECT, no "offline" of its own; only the will can say it
        proc.wait(10)
        wait_until(lambda: watcher.states()[-1] == "offline", timeout=10, message="last will")
        offline = wait_until(lambda: retained_in_state(mosquitto, "offline"), timeout=10, message="will")
        assert (offline["cluster"], offline["node"]) == (CLUSTER, NODE)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        watcher.close()


# -- 8. silent network partition --------------------------------------------------------------------


def test_silent_partition_detected_by_keepalive_then_everything_delivered(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    keepalive = 2
    cloud = make_cloud(mosquitto, ack_all)
    proxy = LinkProxy(mosquitto.port)
    try:
        before = append_rows(spool, 3)
        uplink = make_uplink(
            mqtt_cfg(proxy.port, keepalive_seconds=keepalive, ack_timeout_seconds=2.0, inflight_batches=2),
            spool,
        )
        uplink.kick()
        wait_until(lambda: not spool_seqs(spool), timeout=10, message="first rows acked through the proxy")
        assert uplink.connected

        proxy.blackhole()
        during = append_rows(spool, 5)
        uplink.kick()
        # PINGREQ after one keepalive of silence, give up after a second one; 3x plus slack as deadline.
        wait_until(lambda: not uplink.connected, timeout=3 * keepalive + 3, message="partition noticed")
        assert not proxy.forwarding.is_set()
        assert spool_seqs(spool) == during  # nothing acked, nothing lost
        time.sleep(1.0)  # a reconnect attempt or two into the void

        proxy.heal()
        wait_until(lambda: not spool_seqs(spool), timeout=30, message="rows acked after the partition")
        assert uplink.connected
        assert cloud.distinct() == set(before + during)
        assert proxy.connections >= 2
    finally:
        proxy.close()


# -- 9. MQTT 3.1.1 fallback -------------------------------------------------------------------------

# CONNACK answers to a level-5 CONNECT: MQTT 5 style (reason code 0x84 + empty properties) and what a
# 3.1.1-only broker sends (return code 1, "unacceptable protocol version").
V5_REFUSED_0X84 = bytes([0x20, 0x03, 0x00, 0x84, 0x00])
V311_STYLE_REFUSED = bytes([0x20, 0x02, 0x00, 0x01])
V5_NOT_AUTHORIZED = bytes([0x20, 0x03, 0x00, 0x87, 0x00])
V311_ACCEPTED = bytes([0x20, 0x02, 0x00, 0x00])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return buf


def _read_packet(sock: socket.socket) -> tuple[int, bytes]:
    header = _recv_exact(sock, 1)[0]
    length, shift = 0, 0
    while True:
        byte = _recv_exact(sock, 1)[0]
        length |= (byte & 0x7F) << shift
        if not byte & 0x80:
            break
        shift += 7
    return header, _recv_exact(sock, length)


class FakeBroker:
    """Just enough of an MQTT server on 127.0.0.1 to test protocol negotiation.

    A level-5 CONNECT gets ``v5_connack`` and the connection is closed; a level-4 (3.1.1) CONNECT gets
    ``v4_connack`` and, if that accepted it, SUBSCRIBE/PUBLISH QoS 1/PINGREQ are answered and the
    rest swallowed.
    """

    def __init__(self, v5_connack: bytes, v4_connack: bytes = V311_ACCEPTED) -> None:
        self.v5_connack = v5_connack
        self.v4_connack = v4_connack
        self.levels: list[int] = []  # protocol level of every CONNECT, in order
        self.published: list[tuple[str, int]] = []  # (topic, qos) of every PUBLISH
        self._lock = threading.Lock()
        self._closing = False
        self._conns: set[socket.socket] = set()
        self._listener = socket.create_server((LOOPBACK, 0))
        self._listener.settimeout(0.2)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="fake-broker", daemon=True)
        self._thread.start()

    def connect_levels(self) -> list[int]:
        with self._lock:
            return list(self.levels)

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fake-broker-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            header, body = _read_packet(conn)
            if header >> 4 != 1:
                return
            name_len = int.from_bytes(body[0:2], "big")
            level = body[2 + name_len]
            with self._lock:
                self.levels.append(level)
            if level == 5:
                conn.sendall(self.v5_connack)
                return
            conn.sendall(self.v4_connack)
            if self.v4_connack[-1] != 0:
                return
            while True:
                header, body = _read_packet(conn)
                kind = header >> 4
                if kind == 3:  # PUBLISH
                    qos = (header >> 1) & 3
                    topic_len = int.from_bytes(body[0:2], "big")
                    topic = body[2 : 2 + topic_len].decode()
                    with self._lock:
                        self.published.append((topic, qos))
                    if qos == 1:
                        conn.sendall(bytes([0x40, 0x02]) + body[2 + topic_len : 4 + topic_len])
                elif kind == 8:  # SUBSCRIBE (3.1.1: packet id, then filter + requested QoS pairs)
                    granted = bytearray()
                    i = 2
                    while i < len(body):
                        filter_len = int.from_bytes(body[i : i + 2], "big")
                        granted.append(min(body[i + 2 + filter_len], 1))
                        i += 3 + filter_len
                    conn.sendall(bytes([0x90, 2 + len(granted)]) + body[0:2] + bytes(granted))
                elif kind == 12:  # PINGREQ
                    conn.sendall(bytes([0xD0, 0x00]))
                elif kind == 14:  # DISCONNECT
                    return
        except (OSError, ConnectionError, IndexError):
            pass
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
            with self._lock:
                self._conns.discard(conn)

    def close(self) -> None:
        self._closing = True
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


@pytest.fixture
def make_fake_broker() -> Iterator[Callable[..., FakeBroker]]:
    brokers: list[FakeBroker] = []

    def make(v5_connack: bytes, v4_connack: bytes = V311_ACCEPTED) -> FakeBroker:
        broker = FakeBroker(v5_connack, v4_connack)
        brokers.append(broker)
        return broker

    yield make
    for broker in brokers:
        broker.close()


@pytest.mark.parametrize(
    "refusal", [V5_REFUSED_0X84, V311_STYLE_REFUSED], ids=["connack-0x84", "connack-rc1"]
)
def test_auto_protocol_falls_back_to_mqtt311(
    make_fake_broker: Callable[..., FakeBroker],
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    refusal: bytes,
) -> None:
    broker = make_fake_broker(refusal)
    append_rows(spool, 1)
    uplink = make_uplink(mqtt_cfg(broker.port, protocol="auto"), spool)
    uplink.kick()
    assert uplink.connected_event.wait(10), f"no 3.1.1 fallback; CONNECT levels {broker.connect_levels()}"
    levels = broker.connect_levels()
    assert levels[0] == 5 and levels[-1] == 4, levels
    # Connected for real: the batch goes out with QoS 1 over the 3.1.1 connection.
    wait_until(lambda: (BATCH_TOPIC, 1) in broker.published, timeout=10, message="batch over 3.1.1")
    assert uplink.connected and broker.connect_levels()[-1] == 4


def test_v311_protocol_connects_directly_at_level_4(
    make_fake_broker: Callable[..., FakeBroker], spool: Spool, make_uplink: Callable[..., Uplink]
) -> None:
    broker = make_fake_broker(V5_REFUSED_0X84)
    uplink = make_uplink(mqtt_cfg(broker.port, protocol="v311"), spool)
    assert uplink.connected_event.wait(10)
    assert broker.connect_levels() == [4]


def test_v5_protocol_never_downgrades(
    make_fake_broker: Callable[..., FakeBroker], spool: Spool, make_uplink: Callable[..., Uplink]
) -> None:
    broker = make_fake_broker(V5_REFUSED_0X84)
    uplink = make_uplink(mqtt_cfg(broker.port, protocol="v5"), spool)
    wait_until(lambda: len(broker.connect_levels()) >= 3, timeout=10, message="three CONNECT attempts")
    time.sleep(0.5)
    assert set(broker.connect_levels()) == {5}
    assert not uplink.connected_event.is_set()


def test_refused_connection_is_retried_with_backoff(
    make_fake_broker: Callable[..., FakeBroker], spool: Spool, make_uplink: Callable[..., Uplink]
) -> None:
    broker = make_fake_broker(V5_NOT_AUTHORIZED)
    uplink = make_uplink(
        mqtt_cfg(broker.port, protocol="v5", reconnect_min_seconds=0.5, reconnect_max_seconds=1.0), spool
    )
    time.sleep(3.0)
    attempts = len(broker.connect_levels())
    # Backoff between 0 and 0.5-1 s (full jitter): about 6-10 attempts in 3 s, never hundreds.
    assert 1 <= attempts <= 30, f"{attempts} CONNECTs in 3 s"
    assert metric(uplink.metrics, "edge_relay_mqtt_connect_attempts_total", result="failed") >= 1
    assert not uplink.connected_event.is_set()


# -- robustness: a spool error must not kill the uplink -----------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_uplink_survives_a_transiently_locked_spool(
    mosquitto: Mosquitto,
    impatient_spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    spool = impatient_spool
    cloud = make_cloud(mosquitto)
    seqs = append_rows(spool, 2)
    uplink = make_uplink(mqtt_cfg(mosquitto.port, ack_timeout_seconds=1.5), spool)
    uplink.kick()
    wait_until(lambda: cloud.distinct() == set(seqs), timeout=10, message="batches at the cloud")

    # An operator's sqlite3 shell (or a backup) holds the write lock for a moment.
    with contextlib.closing(sqlite3.connect(spool.path, isolation_level=None)) as other:
        other.execute("BEGIN IMMEDIATE")
        cloud.ack(seqs)
        time.sleep(1.0)
        other.execute("ROLLBACK")

    cloud.policy = ack_all
    wait_until(lambda: not spool_seqs(spool), timeout=8, message="rows acked once the lock is gone")


# -- reconnect storms and poison rows -----------------------------------------------------------------


def connects(uplink: Uplink) -> float:
    return metric(uplink.metrics, "edge_relay_mqtt_connect_attempts_total", result="connected")


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_duplicate_client_id_does_not_cause_a_reconnect_storm(
    mosquitto: Mosquitto, tmp_path: Path, make_uplink: Callable[..., Uplink]
) -> None:
    cfg = mqtt_cfg(
        mosquitto.port,
        client_id="edge-relay-duplicated",
        reconnect_min_seconds=0.5,
        reconnect_max_seconds=2.0,
    )
    spools = [Spool(tmp_path / f"dup-{i}.db") for i in range(2)]
    uplinks: list[Uplink] = []
    try:
        uplinks += [make_uplink(cfg, s) for s in spools]
        time.sleep(3.0)
        counts = [connects(u) for u in uplinks]
        # Misconfigured, so they may keep fighting over the session, but at the backoff's pace.
        assert max(counts) <= 30, f"CONNACKs in 3 s: {counts}"
    finally:
        for u in uplinks:
            u.stop(0)  # before their spools close
        for s in spools:
            s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_oversized_batch_neither_blocks_the_spool_nor_storms_the_broker(
    make_service: ServiceFactory,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    broker = make_service(Mosquitto, extra_conf="max_packet_size 4096")
    cloud = make_cloud(broker, ack_all)
    big = spool.batches.append(lambda _seq: os.urandom(8000), first_ts_ms=1, last_ts_ms=1, sample_count=1)
    small = append_rows(spool, 4)
    uplink = make_uplink(mqtt_cfg(broker.port, inflight_batches=2, ack_timeout_seconds=2.0), spool)
    uplink.kick()

    time.sleep(3.0)
    assert connects(uplink) <= 30, f"{connects(uplink)} connections in 3 s"
    # The batch that can never go through must not hold up the others (quarantine or skip it).
    wait_until(lambda: not set(small) & set(spool_seqs(spool)), timeout=10, message="small rows acked")
    assert cloud.distinct() >= set(small)
    assert big not in cloud.distinct()


# -- ordering after an outage --------------------------------------------------------------------


def test_live_first_sends_the_fresh_batch_before_the_backlog(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    backlog = append_rows(spool, 5)
    time.sleep(1.2)  # older than two live windows of 0.5 s: this is backlog now
    fresh = append_rows(spool, 1)
    cloud = make_cloud(mosquitto, ack_all)
    uplink = make_uplink(mqtt_cfg(mosquitto.port, inflight_batches=1), spool, live_window_s=0.5)
    uplink.kick()
    wait_until(lambda: not spool_seqs(spool), timeout=15, message="spool drained")
    assert cloud.seqs() == fresh + backlog  # live first, then the backlog oldest-first


def test_strict_order_sends_one_batch_at_a_time_oldest_first(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    backlog = append_rows(spool, 5)
    time.sleep(1.2)
    fresh = append_rows(spool, 1)
    cloud = make_cloud(mosquitto, ack_all)
    cfg = mqtt_cfg(mosquitto.port, inflight_batches=10, order="strict")
    make_uplink(cfg, spool, live_window_s=0.5).kick()
    wait_until(lambda: not spool_seqs(spool), timeout=15, message="spool drained")
    assert cloud.seqs() == backlog + fresh
    assert cloud.max_outstanding == 1


# -- bandwidth budget: pacing and the wire meter ------------------------------------------------------


def test_token_bucket_paces_and_charges_real_bytes() -> None:
    now = [0.0]
    bucket = TokenBucket(clock=lambda: now[0])
    assert bucket.allows(10**9)  # unlimited until configured
    bucket.configure(1000.0, 4000.0)
    assert bucket.allows(4000)
    bucket.charge(4000)
    assert not bucket.allows(1)
    now[0] += 1.0
    assert bucket.allows(1000) and not bucket.allows(1001)
    bucket.charge(-500)  # an over-estimate given back
    assert bucket.allows(1500)
    now[0] += 100.0  # never more than the depth
    assert bucket.tokens <= 4000 and bucket.allows(4000)
    bucket.charge(4000)
    now[0] += 4.0
    assert bucket.allows(10**6)  # a batch larger than the depth goes once the bucket is full
    bucket.configure(0.0, 0.0)  # a used-up quota lets nothing through
    now[0] += 100.0
    assert not bucket.allows(1)


def test_wire_meter_reads_the_kernel_counters() -> None:
    server = socket.create_server((LOOPBACK, 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    try:
        meter = WireMeter()
        meter.new_connection()
        client.sendall(b"x" * 5000)
        got = 0
        while got < 5000:
            got += len(peer.recv(65536))
        peer.sendall(b"y" * 300)
        assert client.recv(1000)
        wait_until(lambda: tcp_bytes(client) == (5000, 300), timeout=5, message="kernel counters")
        assert meter.sample(client) == (5000, 300)
        client.sendall(b"z" * 10)
        wait_until(lambda: (tcp_bytes(client) or (0, 0))[0] == 5010, timeout=5, message="10 more bytes")
        assert meter.sample(client) == (10, 0)
        assert meter.total == 5310
    finally:
        for s in (client, peer, server):
            s.close()


class NoTcpInfo:
    """A socket whose kernel has no TCP_INFO byte counters."""

    def getsockopt(self, *args: Any) -> bytes:
        raise OSError("no TCP_INFO")


def test_pacer_without_tcp_info_counts_its_estimate_and_adds_up_the_waiting() -> None:
    now = [0.0]
    metrics = RelayMetrics()
    pacer = Pacer(metrics, clock=lambda: now[0])
    assert pacer.allows(10**9, now[0])  # unlimited until configured
    pacer.configure(1000.0, 4000.0)
    assert pacer.allows(10**9, now[0])  # applied at the next loop turn's meter
    pacer.meter(NoTcpInfo())
    pacer.charge_publish(3904)  # with the framing estimate (96 B): the whole burst
    pacer.meter(NoTcpInfo())
    assert pacer.published_payload_bytes == 3904
    assert pacer.wire_total == 4000
    assert metric(metrics, "edge_relay_wire_bytes_total", direction="sent") == 4000
    assert not pacer.allows(1, now[0]) and pacer.waiting
    now[0] += 1.5
    assert pacer.allows(1000 - 96, now[0]) and not pacer.waiting
    assert pacer.paced_seconds == 1.5


def big_payload(seq: int, ts_ms: int, series: int = 400) -> bytes:
    """A batch of ``series`` random values: about 8 bytes a series after compression."""
    rng = random.Random(seq)
    labels = [
        (("__name__", "kepler_container_joules_total"), ("container_id", f"{i:064x}")) for i in range(series)
    ]
    block = ScrapeBlock(ts_ms, array("I", range(series)), array("d", (rng.random() for _ in range(series))))
    return codec.encode_batch(Batch(CLUSTER, NODE, seq, labels, [block]))


def test_budget_paces_the_connection_and_counts_every_byte(
    mosquitto: Mosquitto,
    spool: Spool,
    make_cloud: Callable[..., FakeCloud],
    make_uplink: Callable[..., Uplink],
) -> None:
    """Over the whole run the broker connection carries at most burst + rate x elapsed (+5%), counted by
    an independent proxy, and the relay's own wire count agrees with the proxy's."""
    cloud = make_cloud(mosquitto, ack_all)
    ts = int(time.time() * 1000)
    for _ in range(30):
        spool.batches.append(
            lambda seq: big_payload(seq, ts), first_ts_ms=ts, last_ts_ms=ts, sample_count=400
        )
    total_payload = sum(len(r.payload) for r in spool.batches.pending(100))
    rate, burst = 8000.0, 12000.0
    proxy = LinkProxy(mosquitto.port)
    uplink = make_uplink(mqtt_cfg(proxy.port, status_interval_seconds=2.0), spool, start=False)
    try:
        uplink.pacer.configure(rate, burst)
        started = time.monotonic()
        uplink.start()
        uplink.kick()
        worst = 0.0
        deadline = started + 60
        while spool.stats().rows and time.monotonic() < deadline:
            elapsed = time.monotonic() - started
            worst = max(worst, proxy.bytes_total - (burst + rate * elapsed))
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        assert spool.stats().rows == 0, "every batch delivered and acked"
        assert len(cloud.distinct()) == 30
        # Paced: it took about (bytes - burst) / rate, not the fraction of a second loopback needs.
        assert elapsed >= (total_payload - burst) / rate * 0.9
        # Within budget at every moment, allowing one batch of overshoot and 5%.
        one_batch = max(len(big_payload(1, ts)), 1)
        assert worst <= one_batch + 0.05 * (burst + rate * elapsed), (worst, one_batch)
        # The relay's own count is the kernel's count of the same connection: the proxy saw the same.
        wait_until(
            lambda: abs(uplink.pacer.wire_total - proxy.bytes_total) <= 0.02 * proxy.bytes_total,
            timeout=5,
            message=f"relay wire count {uplink.pacer.wire_total} vs proxy {proxy.bytes_total}",
        )
        assert metric(uplink.metrics, "edge_relay_wire_bytes_total", direction="sent") >= total_payload
        assert uplink.pacer.paced_seconds > 0
    finally:
        uplink.stop(0)  # started by hand (after configuring its pacer), so the fixture does not stop it
        proxy.close()
