"""The decode stage: turn an untrusted batch message into a validated batch, or refuse it with a reason.

Everything in a payload is hostile until checked: the codec enforces sizes, decompression limits
and label rules; this stage adds what only the cloud knows (the topic the message came on, the clock),
and makes sure no series claims another node (``pin_identity``): a ``cluster`` or ``node`` label that
differs from the topic's is overwritten with the topic's, the value sent kept as ``exported_cluster``
/ ``exported_node`` (as Prometheus does for a target label with ``honor_labels: false``), whatever the
relay's ``add_node_labels``. Overwritten rather than refused: the series is the node's own data, only
mislabelled (an exporter's own ``node`` label, say), and refusing it would lose it. A missing label is
not added: the relay adds both (``add_node_labels: true``, the default) or was told to send series
exactly as Prometheus would scrape them (``false``), and the ingester cannot tell the two apart, nor
needs to. It also refuses a batch whose request at the sink would be far larger than the
batch itself (``expansion_limit``: measured by the sink's ``request_bound``), before the sink builds it.

Payloads are decoded by ``decoder`` (the pipeline passes ``StreamState.decode``, which decodes v1/v2 as
before and v3 frames against the node's stream state); a v3 delta frame whose base state is not held
is refused with reason ``need_state``, which the pipeline acks as such and never dead-letters. A
refusal made after decoding carries the decoded ``batch``, so a v3 frame is dead-lettered as a batch a
replay can decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cloud_ingest.isolate import split_future
from cloud_ingest.sinks.remote_write.request import request_size_bound
from schemas import codec, topics
from schemas.model import Batch, Labels

# How much larger than the decompression limit the request of a batch may be at the sink. A remote-write
# request repeats every label string in every series that carries it; wire format v1 does too (each label
# set whole), so a v1 body expands to about its own size plus ~10 bytes a sample, never 2x. Format v2 names
# each string once per batch: 50,000 series sharing four 4,000-byte values are a legal 52 KB v2 batch
# and an 800 MB request (1.5 GiB to build before the pair cache was shared; container limit 1 GiB, and
# the unacked message comes back: a crash loop). 4x lets through anything a v1 batch within the limits
# could carry and refuses such batches before anything is built: 128 MiB at the default 32 MiB limit.
REQUEST_EXPANSION = 4


class RequestBound(Protocol):
    """``Sink.request_bound``: an upper bound of the bytes a batch becomes at the sink."""

    def __call__(self, batch: Batch, cap: int, *, max_pair_bytes: int) -> int: ...


class Refused(Exception):
    """A message that will never be written. ``seq`` is set when the edge can be told (ack rejected)."""

    def __init__(
        self,
        reason: str,
        message: str,
        *,
        cluster: str | None,
        node: str | None,
        seq: int | None,
        incarnation: int = 0,
        batch: Batch | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.cluster = cluster
        self.node = node
        self.seq = seq
        self.incarnation = incarnation  # the batch's spool incarnation, echoed in the ack
        self.batch = batch  # what was decoded, when the refusal came after decoding


@dataclass(frozen=True, slots=True)
class Decoded:
    cluster: str
    node: str
    batch: Batch  # what is to be written
    identity_overridden: int = 0  # label sets whose sent cluster/node was replaced by the topic's
    # Samples of the message that will not be written (timestamps too far in the future), as a batch
    # of their own to dead-letter, and why.
    refused: Batch | None = None
    refused_reason: str = ""


def decode(
    topic: str,
    payload: bytes,
    *,
    prefix: str,
    limits: codec.Limits,
    max_future_seconds: float,
    now_ms: int | None = None,
    max_request_bytes: int | None = None,
    decoder: Callable[[bytes], Batch] | None = None,
    request_bound: RequestBound = request_size_bound,
) -> Decoded:
    """The batch of one message, or :class:`Refused`. ``max_request_bytes`` caps the request it may
    become at the sink (default ``REQUEST_EXPANSION`` x ``limits.max_decompressed_bytes``), measured by
    ``request_bound`` (default: a remote-write 1.0 request's, ``request_size_bound``)."""
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
            incarnation=header.incarnation,
        )
    try:
        batch = codec.decode_batch(payload, limits) if decoder is None else decoder(payload)
    except codec.DecodeError as e:
        raise Refused(
            e.reason, str(e), cluster=cluster, node=node, seq=header.seq, incarnation=header.incarnation
        ) from e
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    limit_ms = now_ms + int(max_future_seconds * 1000)
    future: Batch | None = None
    future_reason = ""
    if batch.last_timestamp_ms > limit_ms:
        # One series with a clock an hour ahead must not cost the others of its scrape: the samples
        # in the future are split off (dead-lettered, replayable once their time has come).
        good, future = split_future(batch, limit_ms)
        if future is None:  # only empty scrape blocks are in the future: nothing of them to write
            future_reason = f"future_timestamp: an empty scrape at {batch.last_timestamp_ms} ms"
        else:
            future_reason = (
                f"future_timestamp: {future.sample_count} sample(s) up to {future.last_timestamp_ms} ms "
                f"are more than {max_future_seconds:g}s in the future"
            )
            future.labelsets, _ = pin_identity(future.labelsets, cluster, node)
        if good is None:
            raise Refused(
                "future_timestamp",
                future_reason,
                cluster=cluster,
                node=node,
                seq=header.seq,
                incarnation=header.incarnation,
                batch=batch if future is None else future,
            )
        batch = good
        if future is None:
            future_reason = ""
    batch.labelsets, overridden = pin_identity(batch.labelsets, cluster, node)
    # After pin_identity: the labels measured are the ones that will be written.
    cap = max_request_bytes
    if cap is None:
        cap = REQUEST_EXPANSION * limits.max_decompressed_bytes
    size = request_bound(
        batch, cap, max_pair_bytes=limits.max_label_name_bytes + limits.max_label_value_bytes
    )
    if size > cap:
        raise Refused(
            "expansion_limit",
            f"the batch would become a remote-write request of up to {size} bytes, more than {cap} "
            f"({len(batch.labelsets)} series, {batch.sample_count} samples in {len(payload)} bytes)",
            cluster=cluster,
            node=node,
            seq=header.seq,
            incarnation=header.incarnation,
            batch=batch,
        )
    return Decoded(cluster, node, batch, overridden, future, future_reason)


_EXPORTED = "exported_"


def pin_identity(labelsets: list[Labels], cluster: str, node: str) -> tuple[list[Labels], int]:
    """No label set claims another node: a ``cluster`` or ``node`` label with a value other than the
    topic's (what the broker's ACL vouches for; the labels are whatever the node sent) gets the topic's,
    the value sent kept as ``exported_<name>`` (again prefixed while that name is taken). A missing
    label stays missing (``add_node_labels: false``). Returns the label sets (the same list when
    nothing changed) and how many were changed. Once per label set, never per sample: the samples
    refer to the table.
    """
    want_cluster, want_node = ("cluster", cluster), ("node", node)
    out = labelsets
    overridden = 0
    for i, labels in enumerate(labelsets):
        # Tuple membership runs in C: this check is all an honest node's label sets cost.
        if want_node in labels and want_cluster in labels:
            continue
        pairs = dict(labels)
        if "cluster" not in pairs and "node" not in pairs:
            continue  # add_node_labels: false, an exporter without such labels
        changed = False
        for name, value in (want_cluster, want_node):
            sent = pairs.get(name)
            if sent is None or sent == value:
                continue
            changed = True
            pairs[name] = value
            exported = _EXPORTED + name
            while exported in pairs:
                exported = _EXPORTED + exported
            pairs[exported] = sent
        if changed:
            if out is labelsets:
                out = list(labelsets)
            out[i] = tuple(sorted(pairs.items()))
            overridden += 1
    return out, overridden
