"""What becomes of one batch message, as the intake needs it to settle the message: the ``Outcome``, and
the ``Answer`` the edge is told (its application ack).

Three ways to settle, whatever the transport:

- an ``answer``: tell the edge (the ack on its ack topic), then let the transport forget the message;
  only ever for an outcome that is final for the edge (written, partly written, rejected, need_state);
- no answer, not ``hold``: let the transport forget the message without telling the edge, which
  publishes the batch again after its ack timeout (retried later, dead-letter store full, refused
  without a seq to answer);
- ``hold``: neither (stopping mid-write): the transport delivers the message again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from schemas import codec

OutcomeName = Literal[
    "written",
    "partial",
    "rejected",
    "refused",
    "need_state",
    "retry_later",
    "dead_letter_full",
    "abandoned",
]


@dataclass(frozen=True, slots=True)
class Answer:
    """The application ack of one batch. ``incarnation`` is the batch header's (0: it had none, nor will
    the ack); ``written`` and ``refused`` are the sample counts of a ``partial`` result. ``need_state``
    (no reason, no counts) is only ever sent for a v3 frame: older relays refuse the key."""

    cluster: str
    node: str
    seq: int
    result: codec.AckResultKind
    reason: str | None = None
    incarnation: int = 0
    written: int = 0
    refused: int = 0

    def encode(self) -> bytes:
        """The ack message's payload."""
        reason = self.reason
        if reason is not None and len(reason) > codec.MAX_REASON_CHARS:
            # The full text is in the dead-letter store; the edge only needs to know why, briefly.
            reason = reason[: codec.MAX_REASON_CHARS - 3] + "..."
        result = codec.AckResult(self.seq, self.result, reason or None, self.written, self.refused)
        return codec.encode_ack(self.node, [result], incarnation=self.incarnation)


@dataclass(frozen=True, slots=True)
class Outcome:
    """The final outcome of a batch message: ``name`` (what ``cloud_ingest_messages_total`` counts), the
    ``answer`` for the edge, or none; ``hold``: the message is not to be released."""

    name: OutcomeName
    answer: Answer | None = None
    hold: bool = False
