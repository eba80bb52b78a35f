"""``cloud-ingest run``: builds the ingester's parts in dependency order, hands each what it needs, runs.

Built first what the others need: the self-metrics (with the fleet view they export), the dead-letter
store, the sink (a remote-write client and a ``RemoteWriteSink`` around it per target; with several
targets a ``FanOutSink`` over them, each with its own queue; a target's ``write_relabel_configs`` as a
``WriteRelabelSink`` around its sink), the v3 stream state; then
the pipeline (decode -> sink -> finish); then the MQTT intake: the session, the acker, admission, the
worker threads, the batch intake, the follower, the status and ack feeds, and last the subscriber, which
routes every delivery to one of them. Data flows one way, from the subscriber to the pipeline and the
fleet view; no part calls back into ``Ingester``, which holds no policy.

The ingester keeps no state that another replica would need: any replica can decode and write any
v1/v2 batch; v3 frames need the node's stream state, which every replica of a share group keeps by
following every frame (``intake/mqtt/follow.py``).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from cloud_ingest import settings as settings_mod
from cloud_ingest.commands import checkconfig
from cloud_ingest.intake.mqtt.acker import Acker
from cloud_ingest.intake.mqtt.admission import Admission
from cloud_ingest.intake.mqtt.batches import BatchIntake
from cloud_ingest.intake.mqtt.fleet_feed import AckView, StatusFeed
from cloud_ingest.intake.mqtt.follow import Follower
from cloud_ingest.intake.mqtt.session import MqttSession
from cloud_ingest.intake.mqtt.subscriber import Subscriber
from cloud_ingest.intake.workers import Workers
from cloud_ingest.outcome.deadletters import DeadLetterStore
from cloud_ingest.outcome.fleet import Fleet
from cloud_ingest.pipeline.finish import Finisher
from cloud_ingest.pipeline.flow import Pipeline
from cloud_ingest.pipeline.stream_state import StreamState
from cloud_ingest.selfmetrics import IngestMetrics
from cloud_ingest.settings import Settings
from cloud_ingest.sinks.fanout import FanOutSink, Target
from cloud_ingest.sinks.relabeled import WriteRelabelSink
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from cloud_ingest.sinks.remote_write.sink import RemoteWriteSink
from cloud_ingest.sinks.sink import Sink
from relay_common.backoff import Backoff
from relay_common.httpserver import MetricsServer

log = logging.getLogger("cloud_ingest")


class Ingester:
    def __init__(
        self, s: Settings, metrics: IngestMetrics | None = None, *, fleet: Fleet | None = None
    ) -> None:
        if metrics is not None and fleet is not None and metrics.fleet is not fleet:
            raise ValueError("pass the fleet inside the metrics (IngestMetrics(fleet=...)), not beside them")
        self.settings = s
        self.metrics = metrics or IngestMetrics(fleet=fleet)
        self.fleet = self.metrics.fleet
        self.stopping = threading.Event()
        self.dead_letters = DeadLetterStore(s.dead_letter_path, max_bytes=s.dead_letter_max_bytes)

        self.writers = [
            RemoteWriteClient(
                t.url,
                timeout_s=t.timeout_seconds,
                headers=t.headers,
                connection=t.connection,
                backoff=Backoff(t.retry_min_seconds, t.retry_max_seconds),
                max_retry_s=t.max_retry_seconds,
                stop_event=self.stopping,
                on_config_error=self.metrics.config_error,
            )
            for t in s.remote_write_targets
        ]
        self.writer = self.writers[0]
        sinks: list[Sink] = []
        for writer, t in zip(self.writers, s.remote_write_targets, strict=True):
            sink: Sink = RemoteWriteSink(
                writer, isolate_max_writes=t.isolate_max_writes, metrics=self.metrics
            )
            sinks.append(WriteRelabelSink(sink, t.write_relabel) if t.write_relabel else sink)
        # One target: written on the pipeline's worker as it always was; several: a queue each.
        self.sink: Sink = (
            sinks[0]
            if len(sinks) == 1
            else FanOutSink(
                [
                    Target(t.name, sink, t.required, t.queue_batches)
                    for sink, t in zip(sinks, s.remote_write_targets, strict=True)
                ],
                threads=s.workers,
                on_dropped=self.metrics.dropped_for,
            )
        )
        following = s.share_group is not None and s.follow
        self.stream = StreamState(
            s.limits,
            max_nodes=s.stream_max_nodes,
            keep=s.stream_keep_states,
            wait_s=s.state_wait_seconds if following else 0.0,
            metrics=self.metrics,
        )
        self.pipeline = Pipeline(
            prefix=s.topic_prefix,
            limits=s.limits,
            max_future_seconds=s.max_future_seconds,
            stream=self.stream,
            sink=self.sink,
            finish=Finisher(self.dead_letters, self.fleet, self.metrics, s.limits),
            metrics=self.metrics,
            stopping=self.stopping,
        )

        self.session = MqttSession(
            host=s.mqtt_host,
            port=s.mqtt_port,
            client_id=s.client_id,
            keepalive_seconds=s.keepalive_seconds,
            session_expiry_seconds=s.session_expiry_seconds,
            receive_maximum=s.receive_maximum,
            reconnect_min_seconds=s.reconnect_min_seconds,
            reconnect_max_seconds=s.reconnect_max_seconds,
            username=s.username,
            password=s.password,
            tls=s.tls,
        )
        self.acker = Acker(self.session, s.topic_prefix)
        # Bounds the queues: at most the Receive Maximum we announce, whatever the broker sends.
        self.admission = Admission(s.receive_maximum, self.stopping)
        self.workers = Workers(s.workers)
        self.batches = BatchIntake(self.pipeline, self.workers, self.admission, self.acker, self.metrics)
        self.follower = Follower(self.stream, s.topic_prefix, threads=s.workers, metrics=self.metrics)
        self.subscriber = Subscriber(
            self.session,
            prefix=s.topic_prefix,
            share_group=s.share_group,
            batches=self.batches,
            statuses=StatusFeed(self.fleet, s.topic_prefix),
            acks=AckView(self.fleet, s.topic_prefix, share_group=s.share_group),
            follow=following,
            follower=self.follower,
            metrics=self.metrics,
        )

    def start(self) -> None:
        self.workers.start()
        self.follower.start()
        self.session.start()

    def stop(self) -> None:
        self.stopping.set()
        self.session.stop()
        self.workers.stop()
        self.follower.stop()
        self.sink.close()
        self.dead_letters.close()


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
        "cloud ingest %s: %s -> %s (%d workers)",
        s.client_id,
        s.mqtt_host,
        ", ".join(t.url for t in s.remote_write_targets),
        s.workers,
    )
    ingester.start()
    done.wait()
    ingester.stop()
    if server is not None:
        server.stop()
    return 0
