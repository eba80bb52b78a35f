"""The last stage: what becomes of a batch once its fate is known. Dead letters, the fleet view, the
counters, and the ``Outcome`` with the answer the edge is told.

Nothing is acked before what is kept of the batch is stored: every method stores its dead letter first
and only then returns an outcome that answers the edge; a letter that does not fit (the store is full)
turns into an outcome that answers nothing, so the edge keeps the batch.

What a dead letter holds of a message: the message as it came, unless it is v3, whose delta frames no
later replay could decode (``replayable``); a refused part of a written batch is a v2 batch of its own.
Payloads the ingester refused as invalid would be refused again: only the first few of each node and
reason are kept (``DeadLetterStore.keep_refused``), the rest counted. Samples refused only for being
stamped ahead (a fast clock) are valid data, replayable once their time has come: kept like a
receiver's refusal, every one of them.
"""

from __future__ import annotations

import logging
import sqlite3
import time

from cloud_ingest.once import OncePerKey
from cloud_ingest.outcome.answer import Answer, Outcome, OutcomeName
from cloud_ingest.outcome.deadletters import DeadLetterFull, DeadLetterStore
from cloud_ingest.outcome.fleet import Fleet
from cloud_ingest.pipeline.decode import Decoded, Refused
from cloud_ingest.pipeline.stream_state import is_v3
from cloud_ingest.selfmetrics import IngestMetrics
from schemas import codec
from schemas.codec import Limits
from schemas.model import Batch

log = logging.getLogger("cloud_ingest")

_OUTCOME_OF: dict[codec.AckResultKind, OutcomeName] = {
    "ok": "written",
    "partial": "partial",
    "rejected": "rejected",
}


def replayable(payload: bytes, batch: Batch | None, limits: Limits) -> bytes | None:
    """What the dead-letter store may keep of a message: the message itself unless it is v3, whose
    delta frames no later replay could decode; for v3 the decoded ``batch`` re-encoded as v2 (None:
    nothing replayable to keep)."""
    if not is_v3(payload):
        return payload
    if batch is None:
        return None
    try:
        return codec.encode_batch(batch, limits=limits, version=codec.FORMAT_V2)
    except codec.EncodeError as e:  # cannot happen for a batch that decoded within the same limits
        log.error("cannot re-encode a decoded v3 frame as v2 (%s): not dead-lettered", e)
        return None


class Finisher:
    """The finish stage. Thread-safe: workers finish batches of different nodes at once (the store and
    the fleet view lock for themselves)."""

    def __init__(
        self, dead_letters: DeadLetterStore, fleet: Fleet, metrics: IngestMetrics, limits: Limits
    ) -> None:
        self.dead_letters = dead_letters
        self.fleet = fleet
        self.metrics = metrics
        self.limits = limits
        self._refusals_logged = OncePerKey()
        self._full_logged_at = -float("inf")
        metrics.dead_letter_max_bytes.set(dead_letters.max_bytes)
        metrics.dead_letter_bytes.set_function(self._dead_letter_bytes)

    def finished(
        self,
        topic: str,
        payload: bytes,
        decoded: Decoded,
        written: int,
        refused: Batch | None,
        reasons: list[str],
    ) -> Outcome:
        """A batch the sink is done with: ``written`` samples taken, ``refused`` (if any) refused for
        good with ``reasons``. Answers ``ok`` (all written), ``partial`` (some) or ``rejected`` (none)."""
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
                    topic, letter, reason, cluster=decoded.cluster, node=decoded.node, seq=batch.seq
                )
            except DeadLetterFull as e:
                # Valid data with nowhere to go: an ack would delete the last copy at the edge. No ack,
                # so the edge keeps the batch and publishes it again after its ack timeout.
                self.metrics.dead_letter_overflow.labels(slug).inc()
                self._log_full(e)
                self.metrics.messages.labels("dead_letter_full").inc()
                return Outcome("dead_letter_full")
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
            self.metrics.observe_batch_age("written", batch)
            self.fleet.observe_written(
                decoded.cluster,
                decoded.node,
                seq=batch.seq,
                samples=written,
                newest_ms=batch.last_timestamp_ms,
                incarnation=batch.incarnation,
            )
        answer = Answer(
            decoded.cluster,
            decoded.node,
            batch.seq,
            result,
            reason=None if result == "ok" else reason,
            incarnation=batch.incarnation,
            written=written if result == "partial" else 0,
            refused=refused.sample_count if result == "partial" and refused is not None else 0,
        )
        name = _OUTCOME_OF[result]
        self.metrics.messages.labels(name).inc()
        return Outcome(name, answer)

    def deferred(self, decoded: Decoded, reason: str) -> Outcome:
        """The sink gave up for now: no answer, so the edge publishes the batch again."""
        log.warning("giving up on batch %s seq=%d for now: %s", decoded.node, decoded.batch.seq, reason)
        self.metrics.retry_later.inc()
        self.metrics.messages.labels("retry_later").inc()
        return Outcome("retry_later")

    def need_state(self, cluster: str, node: str, seq: int, incarnation: int) -> Outcome:
        """A v3 delta frame whose base state this replica does not hold (``StreamState.decode`` already
        waited for the follow path): answered ``need_state``, so the relay re-sends the seq
        self-contained. Not dead-lettered, not an outcome of the node in the fleet view."""
        self.metrics.need_state.inc()
        self.metrics.messages.labels("need_state").inc()
        return Outcome("need_state", Answer(cluster, node, seq, "need_state", incarnation=incarnation))

    def refused(self, topic: str, payload: bytes, r: Refused) -> Outcome:
        """A message the ingester will never write (invalid, hostile, all in the future)."""
        # A v3 frame refused after decoding is kept as the v2 batch it decoded to (its samples may be
        # replayable later: future timestamps); one refused by the codec as it came (only diagnosable).
        letter = replayable(payload, r.batch, self.limits) if r.batch is not None else payload
        # Samples only stamped ahead (a fast clock) are valid data, replayable once their time has
        # come: kept like a receiver's refusal, every one of them, and held at the edge (no ack) when
        # the store is full. Invalid payloads would be refused again: the first few of each node and
        # reason are kept to diagnose, the rest counted, so a node flooding garbage cannot fill the store.
        valid_data = r.reason == "future_timestamp" and r.batch is not None and letter is not None
        if letter is not None and (valid_data or self.dead_letters.keep_refused(r.node, r.reason)):
            # The reason starts with its slug once (a DecodeError's text already does).
            text = str(r) if str(r).startswith(f"{r.reason}:") else f"{r.reason}: {r}"
            try:
                self.dead_letters.put(topic, letter, text, cluster=r.cluster, node=r.node, seq=r.seq)
            except DeadLetterFull as e:
                self.metrics.dead_letter_overflow.labels(r.reason).inc()
                self._log_full(e)
                if valid_data:  # an ack would delete the last copy at the edge
                    self.metrics.messages.labels("dead_letter_full").inc()
                    return Outcome("dead_letter_full")
                # Else only counted: the edge records the batch in its ledger when "rejected" arrives.
        self.metrics.refused.labels(r.reason).inc()
        self.metrics.dead_letters.labels(r.reason).inc()
        if self._refusals_logged.first((r.node, r.reason)):
            log.error(
                "refused batch on %s: %s (further %s refusals from this node are only counted)",
                topic,
                r,
                r.reason,
            )
        if r.cluster is not None and r.node is not None:
            self.fleet.observe_dead_letter(
                r.cluster, r.node, seq=r.seq, refused=True, incarnation=r.incarnation
            )
        answer = None
        if r.seq is not None and r.node is not None and r.cluster is not None:
            answer = Answer(r.cluster, r.node, r.seq, "rejected", reason=r.reason, incarnation=r.incarnation)
        self.metrics.messages.labels("refused").inc()
        return Outcome("refused", answer)

    def _letter(self, refused: Batch, payload: bytes) -> bytes:
        try:
            return codec.encode_batch(refused, limits=self.limits, version=codec.FORMAT_V2)
        except codec.EncodeError as e:
            # Cannot happen for a part of a valid batch; if it does, keep the whole message (a replay
            # writes its other samples again, with the same values) rather than nothing.
            log.error("cannot encode the refused part of a batch (%s): dead-lettering the whole", e)
            if is_v3(payload):  # no replay could decode a delta frame: the edge keeps it instead
                raise DeadLetterFull("the refused part of a v3 frame cannot be kept as a v2 batch") from e
            return payload

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
