"""Stream coding state for wire format v3: the per-node encoder, the decoder and the state message.

No MQTT here: ``StreamEncoder`` turns each scrape cycle of one node into a v3 frame (a key frame every
``keyframe_every`` frames or when asked, else a delta frame coded against the previous frame) and can
serialise its current state (``state()``: the message for ``<prefix>/v1/<cluster>/<node>/state``).
``StreamDecoder`` decodes frames of any number of nodes against the states it holds or can look up by
id, and refuses a delta frame whose base state it lacks with ``DecodeError("need_state")``: losing
state costs a re-sent frame, never a wrong sample.  Design: ``docs/stream-codec.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Final

import msgpack

from schemas import columnar
from schemas.codec import v3
from schemas.codec.compression import DEFAULT_ZSTD_LEVEL, bounded_decompress, compressor
from schemas.codec.envelope import MAGIC, decode_batch, open_envelope
from schemas.codec.errors import EncodeError, Invalid, refuse, run_decoder
from schemas.codec.header import Header, check_header_names
from schemas.codec.label_columns import encode_labels, read_labels
from schemas.codec.limits import DEFAULT_LIMITS, INT64_MAX, Limits
from schemas.codec.parsing import refuse_msgpack_error, strict_map
from schemas.codec.v3 import CODEC_V3, FORMAT_V3, KIND_NONE, SID_BYTES, State
from schemas.codec.v3 import multicycle as mc  # not ``multicycle``: StreamEncoder's flag has that name
from schemas.codec.v3.state import in_range, zigzag_int
from schemas.codec.validate import validate_batch
from schemas.model import Batch

STATE_MAGIC: Final = b"ERS"
STATE_VERSION: Final = 1
DEFAULT_KEYFRAME_EVERY: Final = 360  # 30 min at 5 s: docs/stream-codec.md, table 1
_STATE_SECTIONS: Final = 8  # COUNT, 5 label sections, BLOCKS, VALUES
_HEADER_MAX_STR: Final = 1024
StateLookup = Callable[[str, str, bytes], bytes | None]  # (cluster, node, sid) -> state message


def frame_base(data: bytes, limits: Limits = DEFAULT_LIMITS) -> bytes | None:
    """The base state id a v3 frame needs (None: a key frame, or not a v3 frame), body not decompressed."""

    def go() -> bytes | None:
        header, body, _ = open_envelope(data, limits)
        return v3.split_body(body)[0] if header.version == FORMAT_V3 else None

    base: bytes | None = run_decoder(go)
    return base


def frame_ids(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[bytes | None, bytes]:
    """(base state id or None for a key frame, id of the state the frame leaves) of a v3 frame,
    without its base: the content is decompressed (within the limits) and hashed, not decoded. A
    decoder that lacks a frame's base knows from this which state it will never get from that frame."""

    def go() -> tuple[bytes | None, bytes]:
        header, body, _ = open_envelope(data, limits)
        if header.version != FORMAT_V3:
            refuse("unknown_version", f"not a v3 frame (version {header.version})")
        base, compressed = v3.split_body(body)
        content = v3.content_of(compressed, limits)
        return base, v3.state_id(header.node, v3.NO_BASE if base is None else base, content)

    ids: tuple[bytes | None, bytes] = run_decoder(go)
    return ids


class StreamEncoder:
    """Encodes the scrape cycles of one node as a v3 frame stream (not thread-safe)."""

    def __init__(
        self,
        cluster: str,
        node: str,
        *,
        keyframe_every: int = DEFAULT_KEYFRAME_EVERY,
        level: int = DEFAULT_ZSTD_LEVEL,
        limits: Limits = DEFAULT_LIMITS,
        multicycle: bool = True,
        multicycle_level: int = mc.DEFAULT_LEVEL,
        orders: tuple[int, ...] = mc.ORDERS,
    ) -> None:
        """``multicycle``: a batch of several scrape cycles (a window) goes in the multi-cycle layout
        (frame kinds 0x02/0x03), compressed at ``multicycle_level``, predictor orders from ``orders``;
        a batch of one cycle is always a 0x00/0x01 frame."""
        if keyframe_every < 1:
            raise ValueError("keyframe_every must be >= 1")
        if not orders or not set(orders) <= set(mc.ORDERS):
            raise ValueError(f"orders must be among {mc.ORDERS}")
        self.multicycle = multicycle
        self.multicycle_level = multicycle_level
        self.orders = tuple(orders)
        self.cluster = cluster
        self.node = node
        self.keyframe_every = keyframe_every
        self.level = level
        self.limits = limits
        self._state: State | None = None
        self._since_key = 0

    @property
    def sid(self) -> bytes | None:
        """Id of the state the next delta frame will be coded against (None before the first frame)."""
        return None if self._state is None else self._state.sid

    def encode(self, batch: Batch, *, key: bool = False) -> bytes:
        """The next frame of the stream: a key frame when asked, at the cadence, or when the dictionary
        would outgrow its caps or carry more than twice the live series (a key frame compacts it)."""
        data, commit = self.prepare(batch, key=key)
        commit()
        return data

    def prepare(
        self, batch: Batch, *, key: bool = False, validated: bool = False
    ) -> tuple[bytes, Callable[[], None]]:
        """``encode`` in two steps: the frame, and the call that makes it the stream's position. A frame
        that is not published after all (the uplink's pacer said wait) is dropped uncommitted, so the
        next frame is not coded against a state no decoder ever saw.

        ``validated``: ``batch`` passed ``encode_batch``'s or ``decode_batch``'s checks under these
        limits (the relay's spooled batches all did), so only its node is checked again."""
        self._check(batch, validated)
        base = self._state
        if (
            base is None
            or key
            or self._since_key + 1 >= self.keyframe_every
            or len(base.labels) > 2 * len(batch.labelsets) + 1024
        ):
            base = None
        try:
            data, state = self._frame(base, batch)
        except EncodeError as exc:
            if base is None or exc.reason not in ("too_many_series", "too_many_label_pairs"):
                raise
            base = None
            data, state = self._frame(None, batch)
        since_key = 0 if base is None else self._since_key + 1
        position = self._state

        def commit() -> None:
            if self._state is not position:
                raise RuntimeError("another frame was committed since this one was prepared")
            self._state, self._since_key = state, since_key

        return data, commit

    def keyframe(self, batch: Batch) -> bytes:
        """``batch`` as a key frame that also restarts the stream (later frames build on it)."""
        return self.encode(batch, key=True)

    def self_contained(self, batch: Batch) -> bytes:
        """``batch`` as a key frame that leaves the stream alone: a frame re-sent after ``need_state``."""
        self._check(batch)
        return self._frame(None, batch)[0]

    def state(self) -> bytes:
        """The state message of the current state (what a decoder needs for the next delta frame)."""
        if self._state is None:
            raise EncodeError("need_state", "no frame encoded yet")
        return encode_state(self.cluster, self._state, self.level)

    def _check(self, batch: Batch, validated: bool = False) -> None:
        if (batch.cluster, batch.node) != (self.cluster, self.node):
            raise EncodeError("bad_header", f"batch of {batch.node!r} given to the encoder of {self.node!r}")
        if validated:
            return
        # Label sets already in the dictionary passed these checks when they were added.
        known = self._state.index if self._state is not None else ()
        validate_batch(batch, self.limits, known)

    def _frame(self, base: State | None, batch: Batch) -> tuple[bytes, State]:
        cycle = mc.cycle_length(batch) if self.multicycle else 0
        try:
            if cycle:
                content, state = mc.encode_frame(base, batch, self.limits, cycle, self.orders)
                body = v3.pack_body(base, content, self.multicycle_level, multicycle=True)
            else:
                content, state = v3.encode_frame(base, batch, self.limits)
                body = v3.pack_body(base, content, self.level)
        except Invalid as exc:
            raise EncodeError(exc.reason, exc.message) from None
        header = {
            "cluster": batch.cluster,
            "node": batch.node,
            "seq": batch.seq,
            "t0": batch.first_timestamp_ms,
            "t1": batch.last_timestamp_ms,
            "n": batch.sample_count,
            "codec": CODEC_V3,
            "body": body,
        }
        if batch.incarnation:
            header["inc"] = batch.incarnation
        out = MAGIC + bytes((FORMAT_V3,)) + msgpack.packb(header, use_bin_type=True)
        if len(out) > self.limits.max_payload_bytes:
            raise EncodeError("oversized", f"frame of {len(out)} bytes > {self.limits.max_payload_bytes}")
        return out, state


CHAINS: Final = 3  # chain positions kept per node: the live and the windowed lane, and one just ended


class _NodeStates:
    """The states a decoder holds of one node: the newest (``recent``), and each chain's newest
    (``tips``: a state replaces its base there; a key frame starts a chain, the least recent goes)."""

    __slots__ = ("recent", "tips")

    def __init__(self) -> None:
        self.recent: OrderedDict[bytes, State] = OrderedDict()
        self.tips: OrderedDict[bytes, State] = OrderedDict()

    def get(self, sid: bytes) -> State | None:
        held = self.recent.get(sid)
        return held if held is not None else self.tips.get(sid)

    def put(self, state: State, base: bytes | None, keep: int) -> None:
        for held in (self.recent, self.tips):
            held[state.sid] = state
            held.move_to_end(state.sid)
        while len(self.recent) > keep:
            self.recent.popitem(last=False)
        if base is not None:
            self.tips.pop(base, None)
        while len(self.tips) > CHAINS:
            self.tips.popitem(last=False)


class StreamDecoder:
    """Decodes frames of any format version; v3 delta frames against the states it holds or looks up.

    Keeps the ``keep`` newest states per node, so a redelivered frame (QoS 1) still finds its base,
    plus the newest state of each of the node's last ``CHAINS`` chains (a relay codes its live and its
    windowed lane in chains of their own: the windowed chain's position must outlive the dozen live
    frames between two windows), and with ``max_nodes`` the states of at most that many nodes: storing
    a state of one more node forgets the node least recently stored (its next delta frame is refused
    with ``need_state``).
    """

    def __init__(
        self, limits: Limits = DEFAULT_LIMITS, *, keep: int = 4, max_nodes: int | None = None
    ) -> None:
        self.limits = limits
        self.keep = max(1, keep)
        self.max_nodes = None if max_nodes is None else max(1, max_nodes)
        self.evicted = 0  # nodes forgotten to stay within max_nodes
        self._states: OrderedDict[tuple[str, str], _NodeStates] = OrderedDict()

    @property
    def nodes(self) -> int:
        """Nodes whose states are held."""
        return len(self._states)

    def has_state(self, cluster: str, node: str, sid: bytes) -> bool:
        held = self._states.get((cluster, node))
        return held is not None and held.get(sid) is not None

    def forget(self, cluster: str, node: str) -> None:
        self._states.pop((cluster, node), None)

    def decode(self, data: bytes, state_lookup: StateLookup | None = None) -> Batch:
        """Decode a frame (or a v1/v2 batch); ``need_state`` when its base state is nowhere to be had.

        ``state_lookup(cluster, node, sid)`` may supply a state message (the retained one, say); one
        that is not the state asked for is ignored.
        """
        return self.decode_with_header(data, state_lookup)[1]

    def decode_with_header(
        self, data: bytes, state_lookup: StateLookup | None = None
    ) -> tuple[Header, Batch, bytes | None]:
        """(header, batch, id of the state the frame left or None for v1/v2) of a frame."""

        def go() -> tuple[Header, Batch, bytes | None]:
            header, body, _ = open_envelope(data, self.limits)
            if header.version != FORMAT_V3:
                return header, decode_batch(data, self.limits), None
            kind, base_id, compressed = v3.split_frame(body)
            base = None
            if base_id is not None:
                base = self._find(header.cluster, header.node, base_id, state_lookup)
            content = v3.content_of(compressed, self.limits)
            batch, state = v3.decode_kind(kind)(base, header, content, self.limits)
            batch.incarnation = header.incarnation
            self._store(header.cluster, state, base_id)
            return header, batch, state.sid

        result: tuple[Header, Batch, bytes | None] = run_decoder(go)
        return result

    def load_state(self, message: bytes) -> bytes:
        """Take a state message (``StreamEncoder.state()``); return its state id."""
        cluster, state = run_decoder(lambda: decode_state(message, self.limits))
        self._store(cluster, state)
        return state.sid

    def _find(self, cluster: str, node: str, sid: bytes, lookup: StateLookup | None) -> State:
        states = self._states.get((cluster, node))
        held = states.get(sid) if states is not None else None
        if held is not None:
            return held
        message = lookup(cluster, node, sid) if lookup is not None else None
        if message is not None:
            try:
                got_cluster, state = decode_state(message, self.limits)
            except Invalid:  # a bad or stale state message: the frame is re-sent self-contained
                got_cluster, state = "", State(node)
            if (got_cluster, state.node, state.sid) == (cluster, node, sid):
                self._store(cluster, state)
                return state
        refuse("need_state", f"no state {sid.hex()} of node {node!r}")

    def _store(self, cluster: str, state: State, base: bytes | None = None) -> None:
        key = (cluster, state.node)
        states = self._states.get(key)
        if states is None:
            states = self._states[key] = _NodeStates()
        self._states.move_to_end(key)
        states.put(state, base, self.keep)
        while self.max_nodes is not None and len(self._states) > self.max_nodes:
            self._states.popitem(last=False)
            self.evicted += 1


# --------------------------------------------------------------------------------------------------
# State message: b"ERS" + version byte + msgpack {cluster, node, sid, body}; body = zstd(sections).


def encode_state(cluster: str, state: State, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    count = bytearray()
    columnar.put_uvarint(count, len(state.labels))
    labels = encode_labels(state.labels) if state.labels else (b"",) * 5
    blocks = bytearray()
    columnar.put_uvarint(blocks, len(state.blocks))
    for t, ids in state.blocks:
        columnar.put_uvarint(blocks, t)
        columnar.put_uvarint(blocks, len(ids))
        for i in ids:
            columnar.put_uvarint(blocks, i)
    values = bytearray()
    for kind, m, d in zip(state.kinds, state.ms, state.ds, strict=True):
        values.append(kind)
        if kind != KIND_NONE:  # m and the previous integer m - d: both within the kind's range
            columnar.put_uvarint(values, zigzag_int(m))
            columnar.put_uvarint(values, zigzag_int(m - d))
    content = v3.join_sections((bytes(count), *labels, bytes(blocks), bytes(values)))
    body = compressor(level).compress(content)
    fields = {"cluster": cluster, "node": state.node, "sid": state.sid, "body": body}
    return STATE_MAGIC + bytes((STATE_VERSION,)) + msgpack.packb(fields, use_bin_type=True)


def decode_state(message: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[str, State]:
    """(cluster, state) of a state message; raises ``Invalid`` (callers run it through ``_run``)."""
    if not isinstance(message, bytes | bytearray | memoryview):
        refuse("malformed", f"expected bytes, got {type(message).__name__}")
    view = memoryview(message).cast("B")
    # A state holds a dictionary: allowed up to the decompression cap, not just one payload.
    if len(view) > limits.max_payload_bytes:
        refuse("oversized", f"state message of {len(view)} bytes > {limits.max_payload_bytes}")
    if bytes(view[:3]) != STATE_MAGIC[: len(view[:3])]:
        refuse("bad_magic", "not a stream state message")
    if len(view) < 4:
        refuse("truncated", f"state message of {len(view)} bytes")
    if view[3] != STATE_VERSION:
        refuse("unknown_version", f"state message version {view[3]}")
    try:
        fields = msgpack.unpackb(
            view[4:],
            raw=False,
            strict_map_key=True,
            use_list=False,
            object_pairs_hook=strict_map,
            max_bin_len=limits.max_payload_bytes,
            max_str_len=_HEADER_MAX_STR,
            max_array_len=8,
            max_map_len=8,
            max_ext_len=8,
        )
    except ValueError as exc:
        refuse_msgpack_error(exc, "state message")
    if type(fields) is not dict or set(fields) != {"cluster", "node", "sid", "body"}:
        refuse("malformed", "state message needs exactly cluster, node, sid, body")
    check_header_names(fields["cluster"], fields["node"])
    sid, body = fields["sid"], fields["body"]
    if type(sid) is not bytes or len(sid) != SID_BYTES or type(body) is not bytes:
        refuse("malformed", "state message sid/body")
    content = bytes(bounded_decompress(body, limits.max_decompressed_bytes))
    return fields["cluster"], _read_state(fields["node"], sid, content, limits)


def _read_state(node: str, sid: bytes, content: bytes, limits: Limits) -> State:
    r = columnar.Reader(content, "state")
    parts = [r.take(r.uvarint()) for _ in range(_STATE_SECTIONS)]
    r.done()
    count = columnar.Reader(parts[0], "COUNT")
    n = count.count(limits.max_series, "too_many_series", "series")
    count.done()
    st = State(node, sid)
    if n:
        for labels in read_labels(parts[1:6], n, limits):
            st.add_series(labels)
        if st.pairs > limits.max_label_pairs:
            refuse("too_many_label_pairs", f"dictionary of more than {limits.max_label_pairs} label pairs")
    elif any(parts[1:6]):
        refuse("length_mismatch", "label sections in the state of an empty dictionary")
    br = columnar.Reader(parts[6], "BLOCKS")
    total = 0
    for _ in range(br.count(limits.max_scrapes, "too_many_scrapes", "blocks")):
        t = br.uvarint()
        if t > INT64_MAX:
            refuse("bad_timestamp", f"state block timestamp {t}")
        size = br.count(min(n, br.remaining()), "bad_index", "block members")
        total += size
        if total > limits.max_samples:
            refuse("too_many_samples", f"state blocks of more than {limits.max_samples} series")
        ids = br.uvarints(size)
        if ids and max(ids) >= n:
            refuse("bad_index", f"state block names series {max(ids)} of {n}")
        if len(set(ids)) != len(ids):
            refuse("duplicate_sample", "a series twice in one state block")
        st.blocks.append((t, ids))
    br.done()
    vr = columnar.Reader(parts[7], "VALUES")
    for i in range(n):
        kind = vr.take(1)[0]
        if kind == KIND_NONE:
            continue
        m = columnar.unzigzag(vr.uvarint())
        prev = columnar.unzigzag(vr.uvarint())
        if not (in_range(kind, m) and in_range(kind, prev)):
            refuse("malformed", f"state of series {i}: kind 0x{kind:02x} with {m}, {prev}")
        st.kinds[i], st.ms[i], st.ds[i] = kind, m, m - prev
    vr.done()
    return st
