"""What one application ack from the cloud does to the spool (stage 6's bookkeeping, apart from MQTT).

The uplink thread calls ``apply_ack`` for every ack it receives; it touches only the ``SendQueue``,
the ``InFlight`` set and, with stream coding, the ``StreamCoder``, so the delivery state machine is
tested without a broker (``tests/edge/test_delivery_state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_relay.ledger import LossRecord
from edge_relay.store.retention import describe_row
from edge_relay.store.spool import InFlight, SendQueue
from edge_relay.uplink.stream import StreamCoder
from schemas import codec
from schemas.codec import AckResult


@dataclass(frozen=True, slots=True)
class AppliedAck:
    ignored: bool  # for another spool incarnation: nothing was done
    latencies: list[float] = field(default_factory=list)  # seconds since publication, of acked batches
    refused: list[tuple[AckResult, LossRecord]] = field(default_factory=list)  # rows refused, as ledgered


def apply_ack(
    queue: SendQueue, inflight: InFlight, ack: codec.Ack, now: float, stream: StreamCoder | None = None
) -> AppliedAck:
    """What one ack does to the spool: ``ok`` deletes the row; ``rejected`` deletes it together with
    its loss ledger entry (retrying would only loop; deleting silently would lose data without a
    trace), ``partial`` too, with the count of samples the cloud refused (it wrote the others); an ack
    of another spool incarnation does nothing at all. With stream coding (``stream``): ``need_state``,
    and ``rejected`` for a v3 frame, keep the row, to be published again self-contained. Every acked
    seq leaves the in-flight set. Raises SpoolError when the spool cannot apply it (the rows stay; the
    batches are published again and acked again)."""
    if not queue.applies(ack.incarnation):
        return AppliedAck(ignored=True)
    latencies: list[float] = []
    final: list[AckResult] = []  # the results that finish their row
    for result in ack.results:
        sent = inflight.pop(result.seq)
        if result.result == "need_state":
            if stream is not None:
                stream.need_state(result.seq)
            continue
        if sent is not None:
            latencies.append(now - sent)
        if (
            result.result == "rejected"
            and stream is not None
            and stream.rejected(result.seq, result.reason or "")
        ):
            continue
        if stream is not None:
            stream.done(result.seq)
        final.append(result)
    queue.acked([r.seq for r in final if r.result == "ok"])
    refused: list[tuple[AckResult, LossRecord]] = []
    for result in final:
        if result.result != "ok":
            count = result.refused if result.result == "partial" else None
            loss = queue.refused(result.seq, describe_row, samples=count)
            if loss is not None:
                refused.append((result, loss))
    return AppliedAck(False, latencies, refused)
