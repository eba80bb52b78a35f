"""Batch messages of the shared subscription, from paho's network thread to their settlement.

``offer`` (paho's network thread) refuses a QoS 0 batch and hands the message to ``Admission``, which
queues it on its node's worker at once or, while the Receive Maximum is at work, once a place frees up
(never making the network thread wait). ``handle`` (a worker)
hands the pipeline a ``Delivery`` and settles the message by the ``Outcome`` it returns: the answer to
the edge and the PUBACK (``Acker``), a PUBACK alone, or nothing (held: the broker delivers it again).
"""

from __future__ import annotations

import logging
import time

import paho.mqtt.client as mqtt

from cloud_ingest.intake.mqtt.acker import Acker
from cloud_ingest.intake.mqtt.admission import Admission
from cloud_ingest.intake.workers import Workers
from cloud_ingest.pipeline.flow import Delivery, Pipeline
from cloud_ingest.selfmetrics import IngestMetrics

log = logging.getLogger("cloud_ingest")


class BatchIntake:
    def __init__(
        self, pipeline: Pipeline, workers: Workers, admission: Admission, acker: Acker, metrics: IngestMetrics
    ) -> None:
        self.pipeline = pipeline
        self.workers = workers
        self.admission = admission
        self.acker = acker
        self.metrics = metrics
        self._qos0_logged_at = -float("inf")
        self._qos0_unlogged = 0

    def offer(self, message: mqtt.MQTTMessage) -> None:
        """A batch message as it came (paho's network thread)."""
        if message.qos == 0:
            self._refuse_qos0(message)
            return
        levels = message.topic.split("/")
        node_key = "/".join(levels[-3:-1]).encode()

        def start() -> None:
            self.metrics.queue_depth.inc()
            self.workers.submit(node_key, lambda: self._work(message))

        # Never waits: paho's network thread must go on reading, writing and pinging.
        self.admission.offer(start)

    def handle(self, message: mqtt.MQTTMessage) -> str:
        """Process one admitted batch message to its final outcome and settle it; the outcome's name."""
        outcome = self.pipeline.handle(Delivery(message.topic, bytes(message.payload)))
        if outcome.hold:
            return outcome.name
        if outcome.answer is None:
            self.acker.release(message)
        else:
            self.acker.ack(message, outcome.answer)
            self.metrics.acks.labels(outcome.answer.result).inc()
        return outcome.name

    def _work(self, message: mqtt.MQTTMessage) -> None:
        try:
            self.handle(message)
        except Exception:
            # Leave the message un-PUBACKed: the broker redelivers it after a reconnect.
            log.exception("unexpected error handling a batch from %s", message.topic)
        finally:
            self.metrics.queue_depth.dec()
            self.admission.done()

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
