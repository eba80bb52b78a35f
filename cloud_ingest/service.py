"""``cloud-ingest run``: subscribe -> decode -> write -> ack, with a dead-letter store and self-metrics.

Batches of one node always go to the same worker thread, so a node's batches are written in the
order they arrived; different nodes are written in parallel. The ingester keeps no state that
another replica would need: any replica can decode and write any v1/v2 batch. Wire format v3 delta
frames need the node's stream state, which every replica of a share group keeps by following every
frame (``cloud_ingest/follow.py``); a frame whose base is not held is acked ``need_state`` (the relay
re-sends it self-contained), never dead-lettered nor counted as an outcome of the node.

Fleet view (``cloud_ingest/outcome/fleet.py``): every replica keeps its own, from the retained status messages
(not shared), the outcomes of the batches it handles, and the application acks of *all* replicas: it
subscribes to ``<prefix>/v1/+/+/ack`` with QoS 0 (nothing is queued for it), so it knows which seqs
another replica finished or rejected. Seq gaps are only exported while that view is complete: without
a share group (every replica gets every batch), or once an ack has come back through that
subscription (the broker may refuse it: the ingester then needs read access to the ack topics).
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sqlite3
import threading
import time
import zlib
from typing import Any

import paho.mqtt.client as mqtt

from cloud_ingest import settings as settings_mod
from cloud_ingest.ack import Acker
from cloud_ingest.commands import checkconfig
from cloud_ingest.follow import Follower, StreamState, is_v3, replayable
from cloud_ingest.isolate import isolate, joined
from cloud_ingest.outcome.deadletters import DeadLetterFull, DeadLetterStore
from cloud_ingest.outcome.fleet import Fleet
from cloud_ingest.pipeline.decode import Decoded, Refused, decode
from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.settings import Settings
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient, WriteOutcome
from cloud_ingest.subscribe import Admission, Subscriber
from relay_common.backoff import Backoff
from relay_common.httpserver import MetricsServer
from schemas import codec, topics
from schemas.model import Batch

log = logging.getLogger("cloud_ingest")


class Ingester:
    def __init__(
        self, s: Settings, metrics: IngestMetrics | None = None, *, fleet: Fleet | None = None
    ) -> None:
        self.settings = s
        if metrics is not None and fleet is not None and metrics.fleet is not fleet:
            raise ValueError("pass the fleet inside the metrics (IngestMetrics(fleet=...)), not beside them")
        self.metrics = metrics or IngestMetrics(fleet=fleet)
        self.fleet = self.metrics.fleet
        # Without a share group every replica gets every batch, so it sees every seq by itself.
        self.fleet.set_complete_view(s.share_group is None)
        self.ack_filter = f"{s.topic_prefix}/{topics.TOPIC_VERSION}/+/+/ack"
        self._ack_sub_mid: int | None = None
        self._ack_view = False
        self.stop_event = threading.Event()
        self.dead_letters = DeadLetterStore(s.dead_letter_path, max_bytes=s.dead_letter_max_bytes)
        self.metrics.dead_letter_max_bytes.set(s.dead_letter_max_bytes)
        self.metrics.dead_letter_bytes.set_function(self._dead_letter_bytes)
        self._full_logged_at = -float("inf")
        self.writer = RemoteWriteClient(
            s.remote_write_url,
            timeout_s=s.remote_write_timeout_seconds,
            headers=s.remote_write_headers,
            backoff=Backoff(s.retry_min_seconds, s.retry_max_seconds),
            max_retry_s=s.max_retry_seconds,
            stop_event=self.stop_event,
            on_config_error=lambda status: self.metrics.config_errors.labels(str(status)).inc(),
        )
        following = s.share_group is not None and s.follow
        self.stream = StreamState(
            s.limits,
            max_nodes=s.stream_max_nodes,
            keep=s.stream_keep_states,
            wait_s=s.state_wait_seconds if following else 0.0,
            metrics=self.metrics,
        )
        self.follower = Follower(self.stream, s.topic_prefix, threads=s.workers, metrics=self.metrics)
        self.subscriber = Subscriber(
            host=s.mqtt_host,
            port=s.mqtt_port,
            client_id=s.client_id,
            prefix=s.topic_prefix,
            share_group=s.share_group,
            keepalive_seconds=s.keepalive_seconds,
            session_expiry_seconds=s.session_expiry_seconds,
            receive_maximum=s.receive_maximum,
            reconnect_min_seconds=s.reconnect_min_seconds,
            reconnect_max_seconds=s.reconnect_max_seconds,
            on_batch=self._enqueue,
            on_status=self._on_status,
            on_connection=self._on_connection,
            username=s.username,
            password=s.password,
            tls=s.tls,
            follow=following,
            on_follow=self.follower.submit,
            # Nothing to wait for when no follow copies come (refused, no subscription identifiers).
            on_following=lambda on: setattr(self.stream, "wait_s", s.state_wait_seconds if on else 0.0),
        )
        self.acker = Acker(self.subscriber, s.topic_prefix)
        self._chained_on_subscribe = self.subscriber.client.on_subscribe
        self.subscriber.client.on_subscribe = self._on_subscribe
        self.queues: list[queue.Queue[mqtt.MQTTMessage | None]] = [queue.Queue() for _ in range(s.workers)]
        # Bounds the queues: at most the Receive Maximum we announce, whatever the broker sends.
        self.admission = Admission(s.receive_maximum, self.stop_event)
        self._qos0_logged_at = -float("inf")
        self._qos0_unlogged = 0
        self.workers = [
            threading.Thread(target=self._work, args=(q,), name=f"ingest-{i}", daemon=True)
            for i, q in enumerate(self.queues)
        ]
        self._logged: set[tuple[str | None, str]] = set()
        self._logged_lock = threading.Lock()
        self._logged_acks: set[str] = set()

    def start(self) -> None:
        for w in self.workers:
            w.start()
        self.follower.start()
        self.subscriber.start()

    def stop(self) -> None:
        self.stop_event.set()
        self.subscriber.stop()
        for q in self.queues:
            q.put(None)
        for w in self.workers:
            w.join(30)
        self.follower.stop()
        self.dead_letters.close()

    # --- subscribe --------------------------------------------------------------------------

    def _on_connection(self, up: bool) -> None:
        self.metrics.mqtt_connected.set(1 if up else 0)
        if not up:
            return
        # Called from the connect callback, before any message of the new connection is handled: acks
        # published while this replica was away are not queued for it (QoS 0), so count gaps afresh.
        self.fleet.reset_seq_tracking()
        _, self._ack_sub_mid = self.subscriber.client.subscribe(self.ack_filter, qos=0)

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, properties: Any
    ) -> None:
        if mid == self._ack_sub_mid and any(rc.is_failure for rc in reason_codes):
            log.warning(
                "the broker refused the subscription to %s (%s): seq gaps are only exported without a "
                "share group; give the ingester read access to the ack topics",
                self.ack_filter,
                reason_codes[0],
            )
            self._ack_view = False
            self.fleet.set_complete_view(self.settings.share_group is None)
        if self._chained_on_subscribe is not None:
            self._chained_on_subscribe(client, userdata, mid, reason_codes, properties)

    def _on_ack(self, message: mqtt.MQTTMessage) -> None:
        """An application ack of any replica (our own included): which seqs of a node are finished."""
        try:
            cluster, node, _ = topics.parse_topic(self.settings.topic_prefix, message.topic)
            ack = codec.decode_ack(message.payload)
        except (ValueError, codec.DecodeError) as e:
            if "bad_ack" not in self._logged_acks:
                self._logged_acks.add("bad_ack")
                log.warning("ignoring a malformed ack on %s: %s (logged once)", message.topic, e)
            return
        if ack.node != node:
            return
        self.fleet.observe_acks(
            cluster,
            node,
            # partial: finished too; need_state: not finished (the relay sends that seq again)
            ok=[r.seq for r in ack.results if r.result in ("ok", "partial")],
            rejected=[r.seq for r in ack.results if r.result == "rejected"],
            incarnation=ack.incarnation,
        )
        if not self._ack_view:
            self._ack_view = True
            self.fleet.set_complete_view(True)

    def _enqueue(self, message: mqtt.MQTTMessage) -> None:
        if message.topic.endswith("/ack"):
            self._on_ack(message)
            return
        if message.qos == 0:
            self._refuse_qos0(message)
            return
        if not self.admission.admit():
            return  # stopping: not PUBACKed, so the broker delivers it again
        levels = message.topic.split("/")
        node_key = "/".join(levels[-3:-1]).encode()
        self.queues[zlib.crc32(node_key) % len(self.queues)].put(message)
        self.metrics.queue_depth.inc()

    def _refuse_qos0(self, message: mqtt.MQTTMessage) -> None:
        """The delivery contract is QoS 1: a QoS 0 batch has no PUBACK to hold back and no flow control
        (Receive Maximum covers QoS 1 and 2 only), so a flood of them would queue without bound. Not
        dead-lettered either (the store would fill with a flood): counted, logged once a minute."""
        self.metrics.refused.labels("qos0").inc()
        self.metrics.messages.labels("refused").inc()
        now = time.monotonic()
        if now - self._qos0_logged_at < 60:
            self._qos0_unlogged += 1
            return
        log.error(
            "refused a QoS 0 batch on %s: batches must be published with QoS 1 (%d more since the last "
            'such message; counted in cloud_ingest_batches_refused_total{reason="qos0"})',
            message.topic,
            self._qos0_unlogged,
        )
        self._qos0_logged_at = now
        self._qos0_unlogged = 0

    def _on_status(self, message: mqtt.MQTTMessage) -> None:
        try:
            cluster, node, _ = topics.parse_topic(self.settings.topic_prefix, message.topic)
            if not message.payload:
                return  # a cleared retained message
            status = codec.decode_status(message.payload)
        except (ValueError, codec.DecodeError) as e:
            self._log_once(None, "bad_status", f"ignoring malformed status on {message.topic}: {e}")
            return
        self.fleet.observe_status(cluster, node, status, retained=bool(message.retain))

    # --- decode -> write -> ack ---------------------------------------------------------------

    def _work(self, q: queue.Queue[mqtt.MQTTMessage | None]) -> None:
        while True:
            message = q.get()
            if message is None:
                return
            try:
                self.handle(message)
            except Exception:
                # Leave the message un-PUBACKed: the broker redelivers it after a reconnect.
                log.exception("unexpected error handling a batch from %s", message.topic)
            finally:
                self.metrics.queue_depth.dec()
                self.admission.done()

    def _log_once(self, node: str | None, reason: str, text: str) -> None:
        with self._logged_lock:  # workers of different nodes may refuse at the same moment
            if (node, reason) in self._logged:
                return
            self._logged.add((node, reason))
        log.error("%s (further %s refusals from this node are only counted)", text, reason)

    def _warn_once(self, node: str, what: str, text: str) -> None:
        with self._logged_lock:
            if (node, what) in self._logged:
                return
            self._logged.add((node, what))
        log.warning("%s (logged once per node; counted in cloud_ingest_series_%s_total)", text, what)

    def _log_full(self, e: DeadLetterFull) -> None:
        # Once a minute: a full store refuses every letter until an operator makes room.
        now = time.monotonic()
        if now - self._full_logged_at < 60:
            return
        self._full_logged_at = now
        log.error(
            "%s: batches the receiver rejected are not acknowledged (the edges keep them) until letters "
            "are replayed or deleted (cloud-ingest dead-letters)",
            e,
        )

    def _dead_letter_bytes(self) -> float:
        try:
            return float(self.dead_letters.used_bytes())
        except sqlite3.Error:  # closed at shutdown while /metrics is still served
            return float("nan")

    def handle(self, message: mqtt.MQTTMessage) -> str:
        """Process one batch message to its final outcome; returns the outcome name."""
        s = self.settings
        payload = bytes(message.payload)
        try:
            decoded = decode(
                message.topic,
                payload,
                prefix=s.topic_prefix,
                limits=s.limits,
                max_future_seconds=s.max_future_seconds,
                decoder=self.stream.decode,
                labels_cache=self.writer.labels_cache,
            )
        except Refused as r:
            if r.reason == "need_state" and r.cluster is not None and r.node is not None and r.seq:
                return self._need_state(message, r.cluster, r.node, r.seq, r.incarnation)
            return self._refuse(message, payload, r)
        batch = decoded.batch
        self._observe_age("decoded", batch)
        if decoded.identity_overridden:
            self.metrics.identity_overridden.labels(decoded.node).inc(decoded.identity_overridden)
            self._warn_once(
                decoded.node,
                "identity_overridden",
                f"batch on {message.topic} has series labelled with another cluster or node: written with "
                "the topic's, the sent values kept as exported_cluster / exported_node",
            )
        started = time.monotonic()
        outcome = self.writer.write(batch)
        written, refused = batch.sample_count, decoded.refused
        reasons = [decoded.refused_reason] if refused is not None else []
        if outcome.status == "rejected":
            log.error("receiver rejected batch %s seq=%d: %s", decoded.node, batch.seq, outcome.reason)
            isolation = isolate(
                batch,
                lambda part: self.writer.write(part, permanent_after=1),
                outcome.reason or "rejected by the remote-write receiver",
                max_writes=s.isolate_max_writes,
            )
            self.metrics.isolation_writes.inc(isolation.writes)
            if isolation.status == "retry_later":
                outcome = WriteOutcome("retry_later", reason=isolation.retry_reason)
            else:
                written = isolation.written
                refused = joined(isolation.refused, refused)
                reasons = isolation.reasons + reasons
                if refused is not None:
                    log.error(
                        "of batch %s seq=%d, %d samples were written, %d refused in %d requests: %s",
                        decoded.node,
                        batch.seq,
                        written,
                        refused.sample_count,
                        isolation.writes + 1,
                        "; ".join(reasons),
                    )
        self.metrics.write_duration.observe(time.monotonic() - started)
        if outcome.status == "retry_later":
            if self.stop_event.is_set():
                # Shutting down mid-retry: no PUBACK, so the broker gives the batch to another replica.
                return "abandoned"
            log.warning("giving up on batch %s seq=%d for now: %s", decoded.node, batch.seq, outcome.reason)
            self.metrics.retry_later.inc()
            self.acker.release(message)
            self.metrics.messages.labels("retry_later").inc()
            return "retry_later"
        return self._finish(message, payload, decoded, written, refused, reasons)

    def _observe_age(self, stage: str, batch: Batch) -> None:
        self.metrics.batch_age.labels(stage).observe(max(0.0, time.time() - batch.last_timestamp_ms / 1000))

    def _finish(
        self,
        message: mqtt.MQTTMessage,
        payload: bytes,
        decoded: Decoded,
        written: int,
        refused: Batch | None,
        reasons: list[str],
    ) -> str:
        """Dead-letter what was refused, count what was written, ack: ``ok`` (all written), ``partial``
        (some) or ``rejected`` (none). Nothing is acked before its refused part is stored."""
        batch = decoded.batch
        reason = "; ".join(reasons)
        result: codec.AckResultKind = "ok"
        if refused is not None:
            slug = "future_timestamp" if reasons[0].startswith("future_timestamp") else "receiver_rejected"
            # Nothing written: the message as it came (v3: as a v2 batch, replayable without the stream
            # state), else the refused samples as a batch of their own.
            try:
                letter = payload if not written and not is_v3(payload) else self._letter(refused, payload)
                self.dead_letters.put(
                    message.topic, letter, reason, cluster=decoded.cluster, node=decoded.node, seq=batch.seq
                )
            except DeadLetterFull as e:
                # Valid data with nowhere to go: an ack would delete the last copy at the edge. No ack,
                # so the edge keeps the batch and publishes it again after its ack timeout.
                self.metrics.dead_letter_overflow.labels(slug).inc()
                self._log_full(e)
                self.acker.release(message)
                self.metrics.messages.labels("dead_letter_full").inc()
                return "dead_letter_full"
            self.metrics.dead_letters.labels(slug).inc()
            self.fleet.observe_dead_letter(
                decoded.cluster, decoded.node, seq=batch.seq, refused=False, incarnation=batch.incarnation
            )
            if written:
                self.metrics.samples_refused.labels(decoded.node, slug).inc(refused.sample_count)
                # A relay that predates partial acks (no incarnation in its header) would refuse the ack
                # and publish the batch forever; it gets "ok", the refused part is in the dead letter.
                result = "partial" if batch.incarnation else "ok"
            else:
                result = "rejected"
        if written:
            self.metrics.samples_written.labels(decoded.node).inc(written)
            self.metrics.batches_written.labels(decoded.node).inc()
            self._observe_age("written", batch)
            self.fleet.observe_written(
                decoded.cluster,
                decoded.node,
                seq=batch.seq,
                samples=written,
                newest_ms=batch.last_timestamp_ms,
                incarnation=batch.incarnation,
            )
        self._ack(
            message,
            decoded.cluster,
            decoded.node,
            batch.seq,
            result,
            incarnation=batch.incarnation,
            reason=None if result == "ok" else reason,
            written=written if result == "partial" else 0,
            refused=refused.sample_count if result == "partial" and refused is not None else 0,
        )
        status = {"ok": "written", "partial": "partial", "rejected": "rejected"}[result]
        self.metrics.messages.labels(status).inc()
        return status

    def _letter(self, refused: Batch, payload: bytes) -> bytes:
        try:
            return codec.encode_batch(refused, limits=self.settings.limits, version=codec.FORMAT_V2)
        except codec.EncodeError as e:
            # Cannot happen for a part of a valid batch; if it does, keep the whole message (a replay
            # writes its other samples again, with the same values) rather than nothing.
            log.error("cannot encode the refused part of a batch (%s): dead-lettering the whole", e)
            if is_v3(payload):  # no replay could decode a delta frame: the edge keeps it instead
                raise DeadLetterFull("the refused part of a v3 frame cannot be kept as a v2 batch") from e
            return payload

    def _refuse(self, message: mqtt.MQTTMessage, payload: bytes, r: Refused) -> str:
        """A message the ingester will never write (invalid, hostile, all in the future)."""
        # A v3 frame refused after decoding is kept as the v2 batch it decoded to (its samples may be
        # replayable later: future timestamps); one refused by the codec as it came (only diagnosable).
        letter = replayable(payload, r.batch, self.settings.limits) if r.batch is not None else payload
        # Samples only stamped ahead (a fast clock) are valid data, replayable once their time has
        # come: kept like a receiver's refusal, every one of them, and held at the edge (no ack) when
        # the store is full. Invalid payloads would be refused again: the first few of each node and
        # reason are kept to diagnose, the rest counted, so a node flooding garbage cannot fill the store.
        valid_data = r.reason == "future_timestamp" and r.batch is not None and letter is not None
        if letter is not None and (valid_data or self.dead_letters.keep_refused(r.node, r.reason)):
            # The reason starts with its slug once (a DecodeError's text already does).
            text = str(r) if str(r).startswith(f"{r.reason}:") else f"{r.reason}: {r}"
            try:
                self.dead_letters.put(message.topic, letter, text, cluster=r.cluster, node=r.node, seq=r.seq)
            except DeadLetterFull as e:
                self.metrics.dead_letter_overflow.labels(r.reason).inc()
                self._log_full(e)
                if valid_data:  # an ack would delete the last copy at the edge
                    self.acker.release(message)
                    self.metrics.messages.labels("dead_letter_full").inc()
                    return "dead_letter_full"
                # Else only counted: the edge records the batch in its ledger when "rejected" arrives.
        self.metrics.refused.labels(r.reason).inc()
        self.metrics.dead_letters.labels(r.reason).inc()
        self._log_once(r.node, r.reason, f"refused batch on {message.topic}: {r}")
        if r.cluster is not None and r.node is not None:
            self.fleet.observe_dead_letter(
                r.cluster, r.node, seq=r.seq, refused=True, incarnation=r.incarnation
            )
        if r.seq is not None and r.node is not None and r.cluster is not None:
            self._ack(
                message, r.cluster, r.node, r.seq, "rejected", incarnation=r.incarnation, reason=r.reason
            )
        else:
            self.acker.release(message)
        self.metrics.messages.labels("refused").inc()
        return "refused"

    def _need_state(self, message: mqtt.MQTTMessage, cluster: str, node: str, seq: int, inc: int) -> str:
        """A v3 delta frame whose base state this replica does not hold (``StreamState.decode``
        already waited for the follow path): ack ``need_state``, so the relay re-sends the seq
        self-contained. Not dead-lettered, not an outcome of the node in the fleet view."""
        self._ack(message, cluster, node, seq, "need_state", incarnation=inc)
        self.metrics.need_state.inc()
        self.metrics.messages.labels("need_state").inc()
        return "need_state"

    def _ack(
        self,
        message: mqtt.MQTTMessage,
        cluster: str,
        node: str,
        seq: int,
        result: codec.AckResultKind,
        *,
        incarnation: int,
        reason: str | None = None,
        written: int = 0,
        refused: int = 0,
    ) -> None:
        self.acker.ack(
            message,
            cluster=cluster,
            node=node,
            seq=seq,
            result=result,
            reason=reason,
            incarnation=incarnation,
            written=written,
            refused=refused,
        )
        self.metrics.acks.labels(result).inc()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML)")


def run(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    # What `check-config` checks, checked here too: both refuse a config with the same message.
    checkconfig.validate(s)
    logging.getLogger().setLevel(s.log_level)
    ingester = Ingester(s)
    server = MetricsServer.start(
        s.metrics_listen, ingester.metrics.registry, ready=ingester.subscriber.connected.is_set
    )
    done = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    log.info(
        "cloud ingest %s: %s -> %s (%d workers)", s.client_id, s.mqtt_host, s.remote_write_url, s.workers
    )
    ingester.start()
    done.wait()
    ingester.stop()
    if server is not None:
        server.stop()
    return 0
