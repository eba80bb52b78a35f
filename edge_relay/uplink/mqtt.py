"""Ship spooled batches over MQTT and delete them once the cloud acknowledges them.

One thread owns the paho client and drives its network loop itself (``edge_relay.uplink.netloop``: paho's
external-loop calls in a ``select()`` that ``kick()`` wakes), so that all MQTT state lives in one
thread, reconnects use our own backoff with jitter, and a new row goes out at once while an idle
relay sleeps.

Delivery contract: a batch is published with QoS 1 on ``<prefix>/v1/<cluster>/<node>/batch``; the
spool row is deleted only when the cloud's *application* ack for (node, seq) arrives on the ack topic,
which is subscribed with QoS 1 in a persistent session, so acks sent while the relay is away are
kept by the broker. A batch whose ack does not come within ``ack_timeout_seconds`` is published
again; the ingester's writes are idempotent, so a duplicate costs bytes, never correctness. An ack
``rejected`` (the cloud refused the batch for good) deletes the row too, but together with a loss-ledger
entry (``rejected_by_cloud``) naming its jobs, time range and samples.

The uplink sees the spool only as a ``SendQueue`` (what to send next given the ``InFlight`` set, sent,
acked, refused, set aside) and reports through a ``StatusSource``; all three are built by the relay before it.
Every publication goes through the ``edge_relay.uplink.pacer.Pacer`` (given by the relay, shared with the
budget controller; unlimited without a budget), which also meters the connection's bytes after every
network-loop turn.

Commands: with a ``CommandInbox`` (``edge_relay.recorder.backfill``), the uplink also subscribes (QoS 1, in
the same persistent session) to the node's ``cmd`` topic, decodes each request strictly
(``schemas.codec.command``) and hands it to the inbox, or refuses it with a reason; it publishes the
inbox's results on ``cmd_result`` (QoS 1, not retained).

Why the link is down: every failed connection attempt and every lost connection is classified
(``connect_error_reason``, ``refusal_reason``: one of ``selfmetrics.MQTT_ERROR_REASONS``) and recorded
with its message and time in the self-metrics, where ``edge-relay status`` reads it; each application ack
stamps ``edge_relay_last_ack_timestamp_seconds``, so a stalled cloud shows as the time it last answered.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import sqlite3
import ssl
import threading
import time
from typing import Any, Protocol

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edge_relay.ledger import LossReason
from edge_relay.recorder.backfill import CommandInbox
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.settings import MQTT
from edge_relay.store.spool import InFlight, SendQueue, SpoolError
from edge_relay.uplink.acks import apply_ack
from edge_relay.uplink.netloop import WakeableLoop
from edge_relay.uplink.pacer import Pacer
from edge_relay.uplink.stream import Prepared, StreamCoder
from relay_common.backoff import Backoff
from relay_common.mqtt_tls import tls_configure
from schemas import codec, topics
from schemas.codec.command import decode_request, peek_request_id

log = logging.getLogger("edge_relay.uplink")

# CONNACK codes that mean "this broker does not speak the protocol version you asked for".
_UNSUPPORTED_VERSION = {1, 132}
# CONNACK codes that refuse who we are: MQTT 3.1.1's 4 (bad user name or password) and 5 (not
# authorised), MQTT 5's 0x86, 0x87, 0x8A (banned) and 0x8C (bad authentication method).
_NOT_AUTHORIZED = {4, 5, 0x86, 0x87, 0x8A, 0x8C}
# The reason paho gives a connection it closed because the broker did not answer within the keepalive.
_KEEPALIVE_TIMEOUT = "Keep alive timeout"
# New rows, acks and commands wake the loop at once (``WakeableLoop``); the pump also runs on its
# own, every second while batches are in flight or the pacer holds one back (ack timeouts, tokens),
# and every 5 s otherwise, in case a row came without a kick.
_PUMP_EVERY_S = 1.0
_IDLE_PUMP_EVERY_S = 5.0
# After a reconnect with the session present: how long acks of batches in flight may take to come
# (the ingester's acks queued at the broker arrive right after the reconnect) before they go again.
_RECONNECT_ACK_WAIT_S = 10.0
# Rows waiting at the end of a cycle up to which a new live row still goes out at once.
_LIVE_WAITING_ROWS = 4
# The longest one network-loop turn blocks: paho's keepalive housekeeping runs at least this often.
_TURN_MAX_S = 1.0


def connect_error_reason(error: BaseException) -> str:
    """The ``MQTT_ERROR_REASONS`` value of an exception from opening the connection (TCP, TLS)."""
    # SSLError is an OSError, and the certificate errors are ValueErrors too: TLS first.
    if isinstance(error, ssl.SSLError | ssl.CertificateError):
        return "tls"
    if isinstance(error, socket.gaierror):
        return "dns"
    if isinstance(error, ConnectionRefusedError):
        return "connection_refused"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, ConnectionError):  # reset, aborted: the broker's side hung up
        return "closed"
    return "other"


def refusal_reason(code: int) -> str:
    """The ``MQTT_ERROR_REASONS`` value of a refusing CONNACK's return (3.1.1) or reason (5) code."""
    if code in _NOT_AUTHORIZED:
        return "not_authorized"
    if code in _UNSUPPORTED_VERSION:
        return "protocol"
    return "other"


class StatusSource(Protocol):
    def fields(self) -> dict[str, Any]:
        """The node's state for the retained status message (``edge_relay.uplink.status.StatusReport``)."""
        ...


class Uplink:
    def __init__(
        self,
        cfg: MQTT,
        *,
        cluster: str,
        node: str,
        queue: SendQueue,
        inflight: InFlight,
        metrics: RelayMetrics,
        status: StatusSource,
        pacer: Pacer | None = None,
        commands: CommandInbox | None = None,
        stream: StreamCoder | None = None,
    ) -> None:
        self.cfg = cfg
        self.commands = commands
        self.stream = stream
        self.cluster = cluster
        self.node = node
        self.queue = queue
        self.inflight = inflight
        self.metrics = metrics
        self.status = status
        prefix = cfg.topic_prefix
        self.batch_topic = topics.batch_topic(prefix, cluster, node)
        self.ack_topic = topics.ack_topic(prefix, cluster, node)
        self.status_topic = topics.status_topic(prefix, cluster, node)
        self.cmd_topic = topics.cmd_topic(prefix, cluster, node)
        self.cmd_result_topic = topics.cmd_result_topic(prefix, cluster, node)
        self.backoff = Backoff(cfg.reconnect_min_seconds, cfg.reconnect_max_seconds)
        self._use_v5 = cfg.protocol != "v311"
        self._client: mqtt.Client | None = None
        self._connected = False
        self._connack_pending = False
        self._refusal: tuple[int, str] | None = None
        # The last loss as paho or the broker's DISCONNECT explained it: (reason, message).
        self._disconnect_why: tuple[str, str] | None = None
        self._connected_since = 0.0
        self._max_packet: int | None = None  # the broker's MaximumPacketSize (MQTT 5 CONNACK)
        # Publications the broker has not PUBACKed yet: lost with the connection, so sent again at once.
        self._mid_seq: dict[int, int] = {}
        self._net = WakeableLoop()
        self._stop = threading.Event()
        self._drain_until = 0.0
        self._thread = threading.Thread(target=self._run, name="uplink", daemon=True)
        self._next_status = 0.0
        self._last_pump = 0.0
        self.connected_event = threading.Event()
        # Send-queue passes begun and ended (kick_and_wait): one begun after a kick sees its rows.
        self._passes = threading.Condition()
        self._passes_begun = 0
        self._passes_done = 0
        # Paces publications and meters the connection; without one given: unlimited, metered.
        self.pacer = pacer if pacer is not None else Pacer(metrics)

    # --- public API (any thread) -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        """New rows are in the spool."""
        self._net.wake()

    def kick_and_wait(self, timeout_s: float) -> bool:
        """``kick()``, then wait up to ``timeout_s`` until the uplink thread has been through its send
        queue once since, so the new rows are published or held back (pacer, in-flight window) by
        then. At once when not connected. Why: the relay thread's housekeeping after a cycle (the
        flight recorder packs a minute of scrapes every minute, 1.5-2 s at 20,000 series on a slow
        core) shared the GIL with the stream coding of the fresh row, which then took 2-4x as long.
        True when a pass ended in time."""
        with self._passes:
            target = self._passes_begun + 1
            self._net.wake()
            if not self._connected:
                return False
            return self._passes.wait_for(lambda: self._passes_done >= target, timeout_s)

    def stop(self, drain_seconds: float = 5.0) -> None:
        """Try to get in-flight and pending batches acked for up to ``drain_seconds``, then leave."""
        self._drain_until = time.monotonic() + drain_seconds
        self._stop.set()
        self._net.wake()
        self._thread.join(drain_seconds + 10)

    @property
    def connected(self) -> bool:
        return self._connected

    def publishes_at_once(self, waiting_rows: int) -> bool:
        """A row spooled now goes out at once as a v3 frame (stream coding on, connected, at most a few
        rows already waiting), so it is re-coded and deleted on its ack rather than read back later."""
        return (
            self.stream is not None
            and self.stream.enabled
            and self.connected
            and waiting_rows <= _LIVE_WAITING_ROWS
        )

    # --- the uplink thread -------------------------------------------------------------------

    def _status_payload(self, state: str) -> bytes:
        body: dict[str, Any] = {
            "v": 1,
            "cluster": self.cluster,
            "node": self.node,
            "state": state,
            "ts_ms": int(time.time() * 1000),
        }
        if state == "online":
            body.update(self.status.fields())
            body["inflight"] = len(self.inflight)
        return codec.encode_status(body)

    def _new_client(self) -> mqtt.Client:
        cfg = self.cfg
        if self._use_v5:
            client = mqtt.Client(
                callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                client_id=cfg.client_id,
                protocol=mqtt.MQTTv5,
            )
        else:
            client = mqtt.Client(
                callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
                client_id=cfg.client_id,
                protocol=mqtt.MQTTv311,
                clean_session=False,
            )
        client.max_inflight_messages_set(max(cfg.inflight_batches, 1) + 2)
        client.max_queued_messages_set(0)
        if cfg.username is not None:
            client.username_pw_set(cfg.username, cfg.password)
        tls_configure(client, cfg.tls)
        client.will_set(self.status_topic, self._status_payload("offline"), qos=1, retain=True)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        return client

    def _connect(self) -> None:
        self.metrics.mqtt_connects.labels("attempt").inc()
        client = self._new_client()
        self.pacer.new_connection()
        cfg = self.cfg
        try:
            if self._use_v5:
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = cfg.session_expiry_seconds
                client.connect(cfg.host, cfg.port, cfg.keepalive_seconds, clean_start=False, properties=props)
            else:
                client.connect(cfg.host, cfg.port, cfg.keepalive_seconds)
        except (OSError, ValueError) as e:
            self._connect_failed(connect_error_reason(e), f"{type(e).__name__}: {e}")
            return
        self._client = client
        self._connack_pending = True
        self._refusal = None
        deadline = time.monotonic() + cfg.keepalive_seconds
        closed = False
        while self._connack_pending and time.monotonic() < deadline and not self._stop.is_set():
            if self._net.turn(client, 0.1) != mqtt.MQTT_ERR_SUCCESS:
                closed = True
                break
        if self._connected:
            self._connected_since = time.monotonic()
            return
        self._drop_client()
        refusal = self._refusal
        if (
            refusal is not None
            and refusal[0] in _UNSUPPORTED_VERSION
            and cfg.protocol == "auto"
            and self._use_v5
        ):
            # Only an explicit "unsupported protocol version" moves us to 3.1.1, and only once per
            # refusal: a dropped CONNECT (broker restarting, partition) must not downgrade a v5 broker.
            self._use_v5 = False
            log.warning("broker refused MQTT 5 (%s); retrying with MQTT 3.1.1", refusal[1])
            return
        if refusal is not None:
            self._connect_failed(refusal_reason(refusal[0]), f"refused: {refusal[1]}")
        elif closed:
            self._connect_failed("closed", "the broker closed the connection before its CONNACK")
        elif not self._stop.is_set():
            self._connect_failed("timeout", f"no CONNACK within {cfg.keepalive_seconds:g}s")

    def _connect_failed(self, reason: str, why: str) -> None:
        delay = self.backoff.next_delay()
        self.metrics.mqtt_connects.labels("failed").inc()
        self.metrics.mqtt_failed(reason, why, time.time())
        log.warning(
            "cannot connect to MQTT broker %s:%d (%s); retrying in %.1fs",
            self.cfg.host,
            self.cfg.port,
            why,
            delay,
        )
        # Not woken by new spool rows: only the backoff (or a stop) ends this wait.
        self._stop.wait(delay)

    def _drop_client(self) -> None:
        if self._client is not None:
            # After a lost connection paho has closed the socket already; this only matters for a
            # connection that never got its CONNACK. Closing a broken socket may fail in many ways.
            with contextlib.suppress(Exception):
                self._client.disconnect()
        self._client = None
        self.inflight.discard(self._mid_seq.values())
        self._mid_seq.clear()
        self._connected = False
        self.connected_event.clear()
        self.metrics.observe_mqtt(False, time.time())

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        self._connack_pending = False
        value = getattr(reason_code, "value", reason_code)
        if getattr(reason_code, "is_failure", bool(value)):
            self._refusal = (value, str(reason_code))
            return
        self._connected = True
        self.connected_event.set()
        self._max_packet = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        self.metrics.mqtt_connects.labels("connected").inc()
        self.metrics.observe_mqtt(True, time.time())
        session_present = bool(getattr(flags, "session_present", False))
        log.info(
            "connected to MQTT %s:%d as %s (MQTT %s, session present: %s)",
            self.cfg.host,
            self.cfg.port,
            self.cfg.client_id,
            "5" if self._use_v5 else "3.1.1",
            session_present,
        )
        if self.stream is not None:
            # Frames the old connection had not got PUBACKed (gone with it) or the broker had not
            # delivered (a lost session) may be the base of the next one: restart the chain.
            self.stream.new_session()
        if not session_present:
            # The broker lost our session: publications it had not delivered are gone, republish now.
            self.inflight.clear()
        else:
            # A broker that restarted with our session may still have dropped what it had PUBACKed
            # and not yet handed to an ingester (mosquitto, shared subscriptions whose members were
            # not back yet): whatever is not acked soon after the reconnect goes again, not only after
            # the full ack timeout. Duplicates cost bytes, never correctness.
            self.inflight.hasten(self.cfg.ack_timeout_seconds, time.monotonic(), _RECONNECT_ACK_WAIT_S)
        client.subscribe(self.ack_topic, qos=1)
        if self.commands is not None:
            client.subscribe(self.cmd_topic, qos=1)
        client.publish(self.status_topic, self._status_payload("online"), qos=1, retain=True)
        self._next_status = time.monotonic() + self.cfg.status_interval_seconds
        self._net.wake()

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, properties: Any
    ) -> None:
        if self._connected:
            log.warning("disconnected from MQTT broker: %s", reason_code)
            if getattr(flags, "is_disconnect_packet_from_server", False):
                self._disconnect_why = ("closed", f"the broker disconnected us: {reason_code}")
            elif str(reason_code) == _KEEPALIVE_TIMEOUT:
                self._disconnect_why = ("timeout", "connection lost: no answer within the keepalive")
            else:
                self._disconnect_why = ("closed", f"connection lost: {reason_code}")
        self._connected = False
        self.connected_event.clear()
        self.metrics.observe_mqtt(False, time.time())

    def _on_publish(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_code: Any, properties: Any
    ) -> None:
        self._mid_seq.pop(mid, None)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if message.topic == self.cmd_topic and self.commands is not None:
            self._on_command(bytes(message.payload))
            return
        if message.topic != self.ack_topic:
            return
        try:
            ack = codec.decode_ack(message.payload)
        except codec.DecodeError as e:
            log.error("ignoring malformed ack on %s: %s", message.topic, e)
            return
        if ack.node != self.node:
            log.error("ignoring ack for node %r on %s (this is %r)", ack.node, message.topic, self.node)
            return
        self.metrics.last_ack.set(time.time())
        try:
            applied = apply_ack(self.queue, self.inflight, ack, time.monotonic(), self.stream)
        except (SpoolError, sqlite3.Error) as e:
            # The rows stay; their acks will come again when the batches are re-published.
            log.error("cannot delete acked rows from the spool: %s", e)
            applied = None
        if applied is not None and applied.ignored:
            self.metrics.acks_ignored.labels("other_incarnation").inc()
            log.warning(
                "ignoring an ack for seq(s) %s of spool incarnation %d (this spool is %d): it was queued "
                "for a spool that has since been recreated",
                ",".join(str(r.seq) for r in ack.results[:5]),
                ack.incarnation,
                self.queue.incarnation,
            )
            return
        if applied is not None:
            for latency in applied.latencies:
                self.metrics.ack_latency.observe(latency)
            for result in ack.results:
                self.metrics.acked.labels(result.result).inc()
            for result, loss in applied.refused:
                log.error(
                    "cloud %s batch seq=%d (%d samples of %s refused, in the loss ledger as %s; %d "
                    "written): %s",
                    "rejected" if result.result == "rejected" else "partly refused",
                    result.seq,
                    loss.samples,
                    loss.series,
                    loss.reason,
                    result.written,
                    result.reason,
                )
        self._publish_inflight()
        self._net.wake()

    def _on_command(self, payload: bytes) -> None:
        assert self.commands is not None
        if not payload:
            return  # an empty retained message clearing the topic: nothing was asked
        try:
            req = decode_request(payload)
        except codec.DecodeError as e:
            log.error("refusing a malformed command on %s: %s", self.cmd_topic, e)
            self.commands.refuse(peek_request_id(payload), f"{e.reason}: {e.message}"[:200])
        else:
            self.commands.submit(req)
        self._net.wake()

    def _publish_results(self, client: mqtt.Client) -> None:
        if self.commands is None:
            return
        results = self.commands.outgoing()
        for i, payload in enumerate(results):
            if client.publish(self.cmd_result_topic, payload, qos=1).rc != mqtt.MQTT_ERR_SUCCESS:
                self.commands.requeue(results[i:])  # sent after the next connect
                return
            self.pacer.charge_publish(len(payload))

    def _publish_inflight(self) -> None:
        self.metrics.inflight.set(len(self.inflight))

    def _pump(self, client: mqtt.Client) -> None:
        now = time.monotonic()
        expired = self.inflight.expire(self.cfg.ack_timeout_seconds, now)
        if expired:
            log.warning(
                "no ack within %.0fs for %d batch(es); publishing again",
                self.cfg.ack_timeout_seconds,
                len(expired),
            )
        # Fresh rows first, then the backlog, oldest data first; a fresh row the pacer holds back is
        # skipped, a backlog row stops the pump, and a head held back for a fill time goes first
        # (SendQueue: every row goes in the end while the bucket refills).
        rows = self.queue.next_rows(self.inflight, hold_s=self.pacer.fill_seconds)
        sent: list[int] = []
        for row in rows:
            prepared = self.stream.prepare(row) if self.stream is not None else Prepared.spooled(row)
            if not self.pacer.allows(len(prepared.payload), now):
                if self.queue.held(row):
                    continue
                break
            # Topic + header overhead is far below 1 KiB; a row the broker cannot take would block the
            # spool forever, so it is set aside (kept, counted, reported) instead.
            if self._max_packet is not None and len(row.payload) + 1024 > self._max_packet:
                reason = (
                    f"{len(row.payload)} bytes exceed the broker's maximum packet size {self._max_packet}"
                )
                log.error("quarantining spool row seq=%d: %s", row.seq, reason)
                self.queue.set_aside(row.seq, reason, LossReason.OVERSIZED_BATCH)
                continue
            payload = prepared.payload
            info = client.publish(self.batch_topic, payload, qos=1)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:
                break
            if self.stream is not None:
                self.stream.published(prepared)
            self.inflight.add(row.seq, now)
            self._mid_seq[info.mid] = row.seq
            sent.append(row.seq)
            if row.was_sent:
                self.metrics.published.labels("retry").inc()
            else:
                self.metrics.published.labels("first").inc()
                self.metrics.publish_delay.observe(max(0.0, time.time() - row.last_ts_ms / 1000))
            self.metrics.publish_bytes.inc(len(payload))
            # Charged now with an estimate so the next row sees it; the pacer's meter corrects it.
            self.pacer.charge_publish(len(payload))
        if sent:
            self.queue.sent(sent, int(time.time() * 1000))
        self._publish_inflight()

    def _run(self) -> None:
        # Supervise: a spool hiccup (locked database, I/O error) or a bug must not end shipping for good.
        try:
            while True:
                try:
                    self._loop()
                    return
                except Exception:
                    log.exception("uplink error; reconnecting after a pause")
                    self._drop_client()
                    self._stop.wait(self.backoff.next_delay())
                    if self._stop.is_set():
                        return
        finally:
            self._net.close()

    def _loop(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if stopping and (
                time.monotonic() >= self._drain_until or not self._connected or not self._has_work()
            ):
                break
            if self._client is None or not self._connected:
                if stopping:
                    break
                self._drop_client()
                self._connect()
                continue
            client = self._client
            rc = self._net.turn(client, self._turn_timeout())
            ok = rc == mqtt.MQTT_ERR_SUCCESS
            self.pacer.meter(client.socket())
            if not ok or not self._connected:
                self._connection_lost(rc)
                self._drop_client()
                # Wait before reconnecting: two relays sharing a client id, or a broker that drops us
                # right after CONNACK, must not turn into a reconnect storm.
                delay = self.backoff.next_delay()
                log.warning(
                    "lost connection to MQTT broker %s:%d; reconnecting in %.1fs",
                    self.cfg.host,
                    self.cfg.port,
                    delay,
                )
                self._stop.wait(delay)
                continue
            now = time.monotonic()
            if self._connected_since and now - self._connected_since >= self.cfg.keepalive_seconds:
                self.backoff.reset()  # the connection proved stable
                self._connected_since = 0.0
            if self._net.woken or now >= self._last_pump + self._pump_every():
                with self._passes:
                    self._passes_begun += 1
                self._net.clear()
                self._last_pump = now
                try:
                    self._publish_results(client)
                    self._pump(client)
                finally:
                    with self._passes:
                        self._passes_done = self._passes_begun
                        self._passes.notify_all()
            if now >= self._next_status:
                self._next_status = now + self.cfg.status_interval_seconds
                client.publish(self.status_topic, self._status_payload("online"), qos=1, retain=True)
        self._leave()

    def _connection_lost(self, rc: mqtt.MQTTErrorCode) -> None:
        why, self._disconnect_why = self._disconnect_why, None
        reason, message = why or ("closed", f"connection lost: {getattr(rc, 'name', rc)}")
        self.metrics.mqtt_failed(reason, message, time.time())

    def _pump_every(self) -> float:
        return _PUMP_EVERY_S if self.inflight or self.pacer.waiting else _IDLE_PUMP_EVERY_S

    def _turn_timeout(self) -> float:
        """Until the next thing the loop must do: a pump (at once after a wake), a status message,
        housekeeping."""
        if self._net.woken:
            return 0.0
        now = time.monotonic()
        return max(0.0, min(self._last_pump + self._pump_every(), self._next_status, now + _TURN_MAX_S) - now)

    def _has_work(self) -> bool:
        return bool(self.inflight) or not self.queue.empty()

    def _leave(self) -> None:
        client = self._client
        if client is None or not self._connected:
            return
        # A clean DISCONNECT suppresses the will, so say "offline" ourselves.
        try:
            info = client.publish(self.status_topic, self._status_payload("offline"), qos=1, retain=True)
            deadline = time.monotonic() + 2
            while (
                info.rc == mqtt.MQTT_ERR_SUCCESS and not info.is_published() and time.monotonic() < deadline
            ):
                if self._net.turn(client, 0.05) != mqtt.MQTT_ERR_SUCCESS:
                    break
            client.disconnect()
            self._net.turn(client, 0.1)
        except (RuntimeError, ValueError, OSError) as e:
            # The connection broke while leaving: the broker publishes the will ("offline") instead.
            log.warning("could not say goodbye to the broker: %s", e)
        finally:
            self._drop_client()
