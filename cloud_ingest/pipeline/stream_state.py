"""Stream state of one ingester process for wire format v3 (live mode): the decoder the decode stage uses.

A v3 delta frame decodes only against the state its predecessor left (``docs/stream-codec.md``
section 4). Replicas of a share group each get only some frames of a node, so an intake may also hand
this state every frame of every node (*follow copies*: the MQTT intake's ``intake/mqtt/follow.py``),
decoded only to advance the node's state; only what the shared delivery hands the pipeline is written
and acked.

What was chosen, and why:

- One ``StreamDecoder`` per process behind one lock (``StreamState``). Decoding is CPU-bound Python
  (the GIL serialises it anyway), so a lock per node would buy nothing but complexity. Memory is
  bounded: the states of at most ``max_nodes`` nodes and ``keep`` states per node (so a QoS 1
  redelivery still finds its base).
- Which nodes keep their state when ``max_nodes`` are held: a newcomer never pushes out a node that
  decoded a frame within ``protect_s``; only a node idle that long is forgotten for it (least recently
  active first), otherwise the newcomer's own state is dropped at once. The topic's (cluster, node) is
  whatever the publisher wrote and the ingester cannot tell identities apart over MQTT (the broker's
  ACL binds them), so this is what keeps a flood of made-up nodes from costing live nodes their
  state: the flood costs only itself. The newcomer's frame is still decoded and written (a key frame
  needs no base); its next delta frame is acked ``need_state`` and the edge re-sends self-contained,
  a cost in bytes, never a sample. Forgetting a node costs the same.
- Each frame is decoded once: the outcome is cached under a blake2b digest of the payload (the two
  deliveries are the same bytes; the digest covers the header, so a cached result is only ever used
  for the same cluster/node/seq/inc), bounded by entries and by samples. A copy of the cached batch
  is handed out, so what later stages rebind never reaches the cache. The cache is an optimisation:
  with ``keep`` >= 2 a frame whose result was evicted decodes again against its still-held base.
- ``advance`` (a follow copy) never runs on the thread that waits in ``decode`` (a shared copy): a
  worker may be waiting (below) for exactly the follow copy that would be queued behind it.
- The shared copy of a delta frame whose base is not held waits at most ``wait_s`` (the two deliveries
  are not ordered against each other) for the follow path to reach the base, then is refused with
  ``DecodeError("need_state")``: the pipeline acks ``need_state``, never dead-letters it. ``wait_s``
  is 0 while no follow copies come (``set_following``): nothing could bring the base. The wait ends
  early (or is not begun) when it is futile: a follow copy that cannot be decoded records the id of the
  state it would have left (``frame_ids``: its content hashed, not decoded), and follow copies of a
  node arrive in publication order, so once the copy of the frame itself or of its base failed, the
  base will not come (a restarted replica thus answers at once, not after ``wait_s`` per node). After a
  wait timed out for a node (its follow copy was lost), later frames of that node are refused at once
  until a frame of the node decodes again.
- The state a frame leaves is kept whatever becomes of its samples (the state is about bytes, the ack
  about samples): decoding happens before the write, and nothing undoes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from schemas import codec
from schemas.codec import FORMAT_V3, MAGIC, DecodeError, Limits, StreamDecoder
from schemas.codec.stream import frame_ids
from schemas.model import Batch

if TYPE_CHECKING:
    from cloud_ingest.selfmetrics import IngestMetrics

DEFAULT_WAIT_S: Final = 2.0
DEFAULT_CACHE_ENTRIES: Final = 1024
DEFAULT_CACHE_SAMPLES: Final = 2_000_000  # decoded values held for the other delivery: ~16 MB + labels
# A node that decoded a frame this recently is never forgotten for a newcomer: far above any relay's
# batch interval, so only nodes that stopped sending (or never came back) make room.
DEFAULT_PROTECT_S: Final = 900.0
_STUCK_MAX: Final = 4096
_LOST_MAX: Final = 16384  # 16-byte state ids


def is_v3(payload: bytes) -> bool:
    """Whether a payload is a v3 envelope (``ERB`` + version byte 3), without parsing anything."""
    return len(payload) > 3 and payload[:3] == MAGIC and payload[3] == FORMAT_V3


@dataclasses.dataclass(slots=True)
class _Entry:
    batch: Batch | None
    error: DecodeError | None
    samples: int


class StreamState:
    """The per-process decoder state: ``decode`` for the shared (write + ack) delivery, ``advance``
    for the follow delivery. Thread-safe."""

    def __init__(
        self,
        limits: Limits = codec.DEFAULT_LIMITS,
        *,
        max_nodes: int = 1000,
        keep: int = 4,
        wait_s: float = DEFAULT_WAIT_S,
        cache_entries: int = DEFAULT_CACHE_ENTRIES,
        cache_samples: int = DEFAULT_CACHE_SAMPLES,
        protect_s: float = DEFAULT_PROTECT_S,
        metrics: IngestMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.wait_s = wait_s  # 0 when nothing follows: no other delivery could bring the base
        self._wait_when_following = wait_s
        self.cache_entries = max(1, cache_entries)
        self.cache_samples = cache_samples
        self.metrics = metrics
        self.max_nodes = max(1, max_nodes)
        self.protect_s = protect_s
        self._clock = clock
        # The decoder holds every node it is given; which ones stay is decided here (_admit).
        self._decoder = StreamDecoder(limits, keep=keep)
        # Nodes whose states are held -> when they last decoded a frame, least recently active first.
        self._active: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._cond = threading.Condition()
        self._cache: OrderedDict[bytes, _Entry] = OrderedDict()
        self._cached_samples = 0
        # Nodes whose last wait for a base timed out, with no frame of theirs decoded since.
        self._stuck: OrderedDict[tuple[str, str], None] = OrderedDict()
        # Ids of states whose frames came and could not be decoded (their base was not held).
        self._lost: OrderedDict[bytes, None] = OrderedDict()
        self.decodes = 0  # frames actually decoded (not served from the cache)
        if metrics is not None:
            metrics.stream_nodes.set_function(lambda: float(len(self._active)))

    def set_following(self, following: bool) -> None:
        """Whether follow copies come now (the intake's follow path is live): only then may a shared copy
        wait ``wait_s`` for its base."""
        self.wait_s = self._wait_when_following if following else 0.0

    @property
    def nodes(self) -> int:
        """Nodes whose states are held."""
        return len(self._active)

    def has_state(self, cluster: str, node: str, sid: bytes) -> bool:
        with self._cond:
            return self._decoder.has_state(cluster, node, sid)

    def forget(self, cluster: str, node: str) -> None:
        with self._cond:
            self._decoder.forget(cluster, node)
            self._active.pop((cluster, node), None)

    def decode(self, payload: bytes) -> Batch:
        """The batch of a shared delivery (any format version); ``DecodeError("need_state")`` when
        it is a delta frame whose base is not held, after waiting up to ``wait_s`` for the follow
        path to bring it. Runs on a worker thread."""
        payload = bytes(payload)
        if not is_v3(payload):
            return codec.decode_batch(payload, self.limits)
        digest = _digest(payload)
        deadline = time.monotonic() + self.wait_s
        ids: tuple[tuple[str, str], bytes | None, bytes] | None = None
        while True:
            with self._cond:
                while True:
                    try:
                        return self._decode_locked(digest, payload)
                    except DecodeError as e:
                        if e.reason != "need_state" or self.wait_s <= 0:
                            raise
                        failed = e
                    if ids is None:
                        break  # learn the frame's state ids outside the lock, then look again
                    key, base, own = ids
                    remaining = deadline - time.monotonic()
                    # Futile to wait when the follow copy of this frame or of its base already came
                    # and could not be decoded (copies of a node arrive in publication order), or
                    # when the node's last wait timed out and nothing of it decoded since.
                    if remaining <= 0 or key in self._stuck or own in self._lost or base in self._lost:
                        if remaining <= 0:
                            self._mark_stuck(key)
                        self._mark(self._lost, own, _LOST_MAX)  # its successors need not wait either
                        raise failed
                    # Woken by every frame decoded and every follow copy that failed to decode.
                    self._cond.wait(remaining)
            header = codec.peek_header(payload, self.limits)
            base, own = frame_ids(payload, self.limits)
            ids = ((header.cluster, header.node), base, own)

    def advance(self, cluster: str, node: str, payload: bytes) -> str:
        """Decode a follow copy (already checked to be on the topic of ``cluster``/``node``) only for
        the state it leaves. Returns the outcome: ``decoded``, ``cached`` (decoded before, through
        either delivery), ``need_state`` (its base is not held: this replica lost the chain),
        ``ignored`` (not v3) or ``invalid``."""
        payload = bytes(payload)
        if not is_v3(payload):
            return "ignored"
        digest = _digest(payload)
        try:
            header = codec.peek_header(payload, self.limits)
        except DecodeError:
            return "invalid"
        if (header.cluster, header.node) != (cluster, node):
            return "invalid"  # the topic is what the broker's ACL vouches for
        with self._cond:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                return "cached"
            try:
                self._decode_locked(digest, payload)
                return "decoded"
            except DecodeError as e:
                if e.reason != "need_state":
                    return "invalid"
        # This replica lost the chain: the state this frame leaves will never be held through it.
        # Hashing its content (outside the lock) tells a shared copy waiting for it to stop waiting.
        try:
            _, own = frame_ids(payload, self.limits)
        except DecodeError:
            return "invalid"
        with self._cond:
            self._mark(self._lost, own, _LOST_MAX)
            self._cond.notify_all()
        return "need_state"

    # --- internals (hold self._cond) ---------------------------------------------------------

    def _decode_locked(self, digest: bytes, payload: bytes) -> Batch:
        entry = self._cache.get(digest)
        if entry is None:
            try:
                header, batch, _ = self._decoder.decode_with_header(payload)
            except DecodeError as e:
                if e.reason == "need_state":
                    raise  # not cached: the base may arrive
                entry = _Entry(None, e, 0)
            else:
                self.decodes += 1
                entry = _Entry(batch, None, batch.sample_count)
                self._stuck.pop((batch.cluster, batch.node), None)
                self._admit((header.cluster, header.node))
                self._cond.notify_all()
            self._remember(digest, entry)
        else:
            self._cache.move_to_end(digest)
        if entry.error is not None:
            raise entry.error
        assert entry.batch is not None
        # A copy: the decode stage rebinds labelsets (identity pinning) on what it is given.
        return dataclasses.replace(entry.batch)

    def _remember(self, digest: bytes, entry: _Entry) -> None:
        if entry.samples > self.cache_samples:
            return  # too big to keep around; the other delivery decodes it again from its base
        self._cache[digest] = entry
        self._cached_samples += entry.samples
        while len(self._cache) > self.cache_entries or self._cached_samples > self.cache_samples:
            _, old = self._cache.popitem(last=False)
            self._cached_samples -= old.samples

    def _mark_stuck(self, key: tuple[str, str]) -> None:
        self._mark(self._stuck, key, _STUCK_MAX)

    @staticmethod
    def _mark(marks: OrderedDict[Any, None], key: Any, cap: int) -> None:
        marks[key] = None
        marks.move_to_end(key)
        while len(marks) > cap:
            marks.popitem(last=False)

    def _admit(self, key: tuple[str, str]) -> None:
        """The node ``key`` just decoded a frame (its state is held now): keep it, making room by
        forgetting the least recently active node if that one is idle for ``protect_s``, or else
        forget the newcomer's state again (it alone pays, with a ``need_state`` on its next delta)."""
        now = self._clock()
        if key in self._active:
            self._active[key] = now
            self._active.move_to_end(key)
            return
        if len(self._active) >= self.max_nodes:
            oldest, active_at = next(iter(self._active.items()))
            if now - active_at < self.protect_s:
                self._decoder.forget(*key)
                if self.metrics is not None:
                    self.metrics.stream_newcomers_refused.inc()
                return
            del self._active[oldest]
            self._decoder.forget(*oldest)
            if self.metrics is not None:
                self.metrics.stream_evictions.inc()
        self._active[key] = now


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()
