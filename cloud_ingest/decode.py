"""Stage 2 (cloud): turn an untrusted MQTT message into a validated batch, or refuse it with a reason.

Everything in a payload is hostile until checked: the codec enforces sizes, decompression limits
and label rules; this stage adds what only the cloud knows (the topic the message came on, the clock).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from schemas import codec, topics
from schemas.model import Batch


class Refused(Exception):
    """A message that will never be written. ``seq`` is set when the edge can be told (ack rejected)."""

    def __init__(
        self, reason: str, message: str, *, cluster: str | None, node: str | None, seq: int | None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.cluster = cluster
        self.node = node
        self.seq = seq


@dataclass(frozen=True, slots=True)
class Decoded:
    cluster: str
    node: str
    batch: Batch


def decode(
    topic: str,
    payload: bytes,
    *,
    prefix: str,
    limits: codec.Limits,
    max_future_seconds: float,
    now_ms: int | None = None,
) -> Decoded:
    try:
        cluster, node, kind = topics.parse_topic(prefix, topic)
    except ValueError as e:
        raise Refused("bad_topic", str(e), cluster=None, node=None, seq=None) from e
    if kind != "batch":
        raise Refused("bad_topic", f"not a batch topic: {topic}", cluster=cluster, node=node, seq=None)
    try:
        header = codec.peek_header(payload, limits)
    except codec.DecodeError as e:
        raise Refused(e.reason, str(e), cluster=cluster, node=node, seq=None) from e
    if header.node != node or header.cluster != cluster:
        # The topic is what the broker's ACL vouches for; never write under another node's name.
        raise Refused(
            "node_mismatch",
            f"payload says {header.cluster}/{header.node} but came on the topic of {cluster}/{node}",
            cluster=cluster,
            node=node,
            seq=header.seq,
        )
    try:
        batch = codec.decode_batch(payload, limits)
    except codec.DecodeError as e:
        raise Refused(e.reason, str(e), cluster=cluster, node=node, seq=header.seq) from e
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    if batch.last_timestamp_ms > now_ms + max_future_seconds * 1000:
        raise Refused(
            "future_timestamp",
            f"sample at {batch.last_timestamp_ms} ms is more than {max_future_seconds:g}s in the future",
            cluster=cluster,
            node=node,
            seq=header.seq,
        )
    return Decoded(cluster, node, batch)
