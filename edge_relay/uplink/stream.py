"""Stream coding at publication (wire format v3, ``docs/stream-codec.md``).

The spool keeps every batch self-contained, in ``batch.format_version`` (v2), exactly as it keeps
them without stream coding; only a live-lane row that goes out at once is spooled as v1, the wire
format that is quickest to write (``edge_relay.encode.lanes``). The uplink publishes each row as a v3
frame that ``StreamCoder`` codes against the frame *published* before it: the series dictionary
and the values' history are the ingester's state of this node, and a frame names the state it needs
by id, so it decodes exactly or not at all. Design choice, improving on the design's section 5 (a
spool of delta frames, chain-aware deletion and re-anchoring): the chain follows publication order,
so

- what the spool stores, evicts, degrades and replays is unchanged, with no chain to keep decodable;
- a frame an ingester cannot decode (``need_state``: restarted, a replica that never saw the chain,
  a broker that lost undelivered frames) is published again as the spooled batch itself, which is
  self-contained, and the next frame is a key frame, so the chain restarts at once;
- the backlog after an outage is stream-coded too, in the order it goes out.

The cost: the spool's rows are v2 sized, or v1 until their ack (disk, not link), and a row that is
not in ``RecentBatches`` (the backlog, after a restart) is decoded once before it is coded (about 1
us/sample, only then).

Frames are prepared before the pacer decides and committed only when published (``Prepared``), so a
frame that waits is never the base of the next one. A ``rejected`` ack for a seq that went out as a
v3 frame is not a loss: the batch goes again self-contained, and when the reason says the ingester
does not know the format (an ingester older than v3), stream coding pauses for ``pause_s``.

The uplink thread alone uses ``StreamCoder``; the store's ``RecentBatches`` is filled by the sink
(relay loop).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.recent import RecentBatches
from edge_relay.store.spool import SpoolRow
from schemas import codec
from schemas.codec.stream import StreamEncoder, frame_base

log = logging.getLogger("edge_relay.stream")

# Reasons an ingester gives for a format it does not know (schemas.codec: unknown_version/_codec).
UNKNOWN_FORMAT = ("unknown_version", "unknown_codec")
# What a v3 ingester from before the multi-cycle layout says about its frames (reason "malformed").
_OLD_FRAME_KINDS = "unknown v3 frame kind"
LIVE, WINDOWED = 0, 1  # the stream's chains: rows of one cycle, and rows of several (windows)
LANES = (LIVE, WINDOWED)
_RATIO_WEIGHT = 0.1  # EWMA weight of one frame in wire_ratio
_TRACKED_SEQS = 65_536  # unacked seqs remembered (rows evicted unacked never come back to clear theirs)


@dataclass(frozen=True, slots=True)
class Prepared:
    """What to publish for a row; ``commit`` once it is published (a no-op for a spooled batch)."""

    seq: int
    payload: bytes
    kind: str  # "delta" | "key" (v3 frames) | "batch" (the spooled batch as it is)
    commit: Callable[[], None]
    spooled_bytes: int = 0  # the row's size and format version, for the wire ratio
    spooled_version: int = codec.FORMAT_V2
    lane: int = 0  # the chain it was coded in (LIVE, WINDOWED)

    @classmethod
    def spooled(cls, row: SpoolRow) -> Prepared:
        """The spooled batch as it is (self-contained; nothing to commit)."""
        return cls(row.seq, row.payload, "batch", _nothing)


def _nothing() -> None:
    return None


def _envelope_version(payload: bytes) -> int:
    """The format version of a spooled row (the byte after the magic)."""
    return payload[len(codec.MAGIC)] if len(payload) > len(codec.MAGIC) else 0


class _SeqSet:
    """A bounded set of seqs, oldest dropped first."""

    def __init__(self) -> None:
        self._seqs: OrderedDict[int, None] = OrderedDict()

    def add(self, seq: int) -> None:
        self._seqs[seq] = None
        while len(self._seqs) > _TRACKED_SEQS:
            self._seqs.popitem(last=False)

    def discard(self, seq: int) -> None:
        self._seqs.pop(seq, None)

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)


class StreamCoder:
    def __init__(
        self,
        cluster: str,
        node: str,
        *,
        recent: RecentBatches,
        metrics: RelayMetrics,
        enabled: bool = True,
        keyframe_every: int = 360,
        level: int = 3,
        pause_s: float = 3600.0,
        interval_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # One chain per lane: a window coded against the live frame published before it would name
        # every one of its series anew (22 KB where 6 KB against the last window, on the budget e2e
        # test); each frame names its base, so which chain a row goes in is only a matter of bytes.
        self.encoders = tuple(
            StreamEncoder(cluster, node, keyframe_every=keyframe_every, level=level) for _ in LANES
        )
        # A row spanning more than this is a window (or a past part, a backfill): the windowed chain.
        self._window_span_ms = int(1.5 * interval_s * 1000) if interval_s > 0 else 2**62
        self.recent = recent
        self.metrics = metrics
        self.configured = enabled
        self.pause_s = pause_s
        self._clock = clock
        self._paused_until = 0.0
        self._multicycle_until = 0.0  # the multi-cycle layout is off until then (an older ingester)
        self._key_next = [False for _ in LANES]
        self._as_frames = _SeqSet()  # last published as a v3 frame
        self._self_contained = _SeqSet()  # to publish as the spooled batch (need_state, rejected)
        self._logged: set[str] = set()
        # Wire bytes per spooled byte of the frames published lately, by the rows' format version
        # (v1 rows are about twice v2's size): the budget controller weighs what the spool gets by
        # it, so stream coding leaves room instead of degrading.
        self.wire_ratio: dict[int, float] = {}
        metrics.stream_enabled.set(1 if enabled else 0)

    @property
    def enabled(self) -> bool:
        on = self.configured and self._clock() >= self._paused_until
        self.metrics.stream_enabled.set(1 if on else 0)
        return on

    def prepare(self, row: SpoolRow) -> Prepared:
        """The payload to publish for ``row``: the next frame of the stream, or the spooled batch."""
        if not self.enabled or row.seq in self._self_contained:
            return Prepared.spooled(row)
        if self._multicycle_until and self._clock() >= self._multicycle_until:
            self._multicycle_until = 0.0
            for encoder in self.encoders:
                encoder.multicycle = True
        batch = self.recent.get(row.seq)
        try:
            if batch is None:
                batch = codec.decode_batch(row.payload)
            batch.seq = row.seq
            lane = (
                WINDOWED
                if batch.last_timestamp_ms - batch.first_timestamp_ms > self._window_span_ms
                else LIVE
            )
            # Validated: by the codec when the sink spooled it, or when it was decoded from its row.
            data, commit = self.encoders[lane].prepare(batch, key=self._key_next[lane], validated=True)
        except (codec.DecodeError, codec.EncodeError) as e:
            # The spooled batch is always publishable as it is; the stream just skips this row.
            self._log_once(e.reason, f"publishing seq {row.seq} as the spooled batch, not a v3 frame: {e}")
            return Prepared.spooled(row)
        kind = "key" if frame_base(data) is None else "delta"
        if kind == "delta" and len(data) > len(row.payload):
            # A delta frame that costs more than the self-contained batch (most of its series new to
            # the chain): the batch goes instead, uncommitted, so the chain stays where it was. Key
            # frames always go: they are what restarts a chain.
            return Prepared.spooled(row)
        return Prepared(row.seq, data, kind, commit, len(row.payload), _envelope_version(row.payload), lane)

    def published(self, prepared: Prepared) -> str:
        """``prepared`` went out: it is now the stream's position. Returns its kind (for metrics)."""
        kind = prepared.kind
        if kind != "batch":
            prepared.commit()
            self._key_next[prepared.lane] = False
            self._as_frames.add(prepared.seq)
            if prepared.spooled_bytes:
                ratio = min(len(prepared.payload) / prepared.spooled_bytes, 4.0)
                last = self.wire_ratio.get(prepared.spooled_version, ratio)
                self.wire_ratio[prepared.spooled_version] = last + _RATIO_WEIGHT * (ratio - last)
        else:
            self._as_frames.discard(prepared.seq)
        self.recent.discard(prepared.seq)
        self.metrics.stream_frames.labels(kind).inc()
        return kind

    def wire_bytes(self, spooled_bytes: int, version: int = codec.FORMAT_V2) -> int:
        """About what ``spooled_bytes`` of batches spooled as ``version`` will cost on the wire, at the
        recent ratio of such rows."""
        ratio = self.wire_ratio.get(version, 1.0) if self.enabled else 1.0
        return round(spooled_bytes * ratio)

    def need_state(self, seq: int) -> None:
        """An ingester lacked the state frame ``seq`` was coded against: that batch goes again as the
        spooled batch, and the next frame restarts the chain."""
        self.metrics.stream_need_state.inc()
        self._self_contained.add(seq)
        self._key_next = [True for _ in LANES]

    def rejected(self, seq: int, reason: str) -> bool:
        """A ``rejected`` ack: True when it was for a v3 frame, which is then published again as the
        spooled batch (never a loss: the ingester may not know v3, or failed on the frame); False when
        the spooled batch itself was rejected (a real refusal, for the loss ledger)."""
        if seq not in self._as_frames:
            return False
        self._as_frames.discard(seq)
        self._self_contained.add(seq)
        self._key_next = [True for _ in LANES]
        if _OLD_FRAME_KINDS in reason and self.encoders[WINDOWED].multicycle:
            # A v3 ingester older than the multi-cycle layout (frame kinds 0x02/0x03): windows go in
            # the single-cycle layout for a while, rather than every window twice (frame, then batch).
            self._multicycle_until = self._clock() + self.pause_s
            for encoder in self.encoders:
                encoder.multicycle = False
            log.warning(
                "the ingester does not decode v3's multi-cycle frames (%s): windows go in the single-cycle "
                "layout for %.0fs; upgrade the ingesters to get it",
                reason,
                self.pause_s,
            )
        elif reason.split(":", 1)[0].strip() in UNKNOWN_FORMAT and self.enabled:
            self._paused_until = self._clock() + self.pause_s
            log.warning(
                "the ingester does not decode wire format v3 (%s): publishing the spooled batches as they "
                "are for %.0fs; upgrade the ingesters to get stream coding",
                reason,
                self.pause_s,
            )
        return True

    def done(self, seq: int) -> None:
        """The cloud has finished ``seq`` (written, or refused for good)."""
        self._as_frames.discard(seq)
        self._self_contained.discard(seq)

    def new_session(self) -> None:
        """A new MQTT connection: frames published on the old one may never have been delivered."""
        self._key_next = [True for _ in LANES]

    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.warning("%s (logged once per reason)", message)
