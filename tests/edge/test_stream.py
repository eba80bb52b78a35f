"""Stream coding at publication (``edge_relay.uplink.stream``): every spooled batch reaches a decoder exactly,
whatever state the decoder loses and whatever frames the link loses; ``need_state`` and a rejected v3
frame keep the row and send it again self-contained; a rejected spooled batch is a loss, ledgered."""

from __future__ import annotations

import math
import struct
import time
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_relay.ledger import LossLedger
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.recent import RecentBatches
from edge_relay.store.spool import InFlight, SendQueue, Spool
from edge_relay.store.spool.schema import SpoolRow
from edge_relay.uplink.acks import apply_ack
from edge_relay.uplink.stream import StreamCoder
from schemas import codec
from schemas.codec import Ack, AckResult
from schemas.codec.envelope import open_envelope
from schemas.codec.stream import CHAINS, StreamDecoder, StreamEncoder, frame_base
from schemas.model import Batch, Labels, ScrapeBlock

CLUSTER, NODE = "c1", "n1"


def series(i: int) -> Labels:
    return (("__name__", "gpu_temp_celsius"), ("gpu", str(i % 8)), ("pod", f"p{i}"))


def make_batch(cycle: int, present: list[int], values: list[float]) -> Batch:
    labels = [series(i) for i in present]
    block = ScrapeBlock(1_700_000_000_000 + cycle * 5000, array("I", range(len(labels))), array("d", values))
    return Batch(CLUSTER, NODE, 0, labels, [block], incarnation=7)


def samples(batch: Batch) -> set[tuple[Labels, int, int]]:
    out = set()
    for block in batch.scrapes:
        for i, idx in enumerate(block.series):
            ts = block.timestamps[i] if block.timestamps is not None else block.timestamp_ms
            bits = struct.unpack("<Q", struct.pack("<d", block.values[i]))[0]
            out.add((batch.labelsets[idx], ts, bits))
    return out


def row_of(seq: int, payload: bytes) -> SpoolRow:
    return SpoolRow(seq, payload, 0, 0, 0, 1, len(payload), 0, int(time.time() * 1000), 0, None, 0)


def coder(recent: RecentBatches | None = None, **kw: object) -> StreamCoder:
    return StreamCoder(CLUSTER, NODE, recent=recent or RecentBatches(), metrics=RelayMetrics(), **kw)  # type: ignore[arg-type]


values_st = st.one_of(
    st.floats(allow_nan=False, width=64),
    st.integers(0, 10**6).map(float),
    st.just(math.nan),
)
cycle_st = st.tuples(
    st.lists(st.booleans(), min_size=12, max_size=12), st.lists(values_st, min_size=12, max_size=12)
)
op_st = st.sampled_from(["spool", "spool", "publish", "deliver", "deliver", "lose", "forget"])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cycles=st.lists(cycle_st, min_size=1, max_size=14),
    ops=st.lists(op_st, min_size=1, max_size=60),
    keyframe_every=st.integers(1, 6),
    cached=st.booleans(),
)
def test_every_batch_decodes_exactly_whatever_state_is_lost(
    cycles: list[tuple[list[bool], list[float]]], ops: list[str], keyframe_every: int, cached: bool
) -> None:
    """A model of relay and ingester: the spool's rows (v2, self-contained), the coder publishing them
    in seq order, a wire that may lose frames, a decoder that may lose its state. At the end, with a
    working link, every batch is decoded with exactly its samples, in a few rounds."""
    recent = RecentBatches()
    c = coder(recent, keyframe_every=keyframe_every)
    decoder = StreamDecoder()
    spooled: dict[int, tuple[Batch, bytes]] = {}
    truth: dict[int, set[tuple[Labels, int, int]]] = {}
    inflight: set[int] = set()
    wire: list[tuple[int, bytes]] = []
    written: dict[int, set[tuple[Labels, int, int]]] = {}
    pending_cycles = list(enumerate(cycles))
    kinds: list[str] = []

    def spool() -> None:
        if not pending_cycles:
            return
        cycle, (mask, vals) = pending_cycles.pop(0)
        present = [i for i, on in enumerate(mask) if on] or [0]
        batch = make_batch(cycle, present, [vals[i] for i in present])
        batch.seq = len(spooled) + len(written) + 1
        payload = codec.encode_batch(batch)
        spooled[batch.seq] = (batch, payload)
        truth[batch.seq] = samples(batch)
        if cached:
            recent.put(batch)

    def publish() -> None:
        for seq in sorted(spooled):
            if seq in inflight:
                continue
            prepared = c.prepare(row_of(seq, spooled[seq][1]))
            kinds.append(c.published(prepared))
            inflight.add(seq)
            wire.append((seq, prepared.payload))

    def deliver() -> None:
        while wire:
            seq, payload = wire.pop(0)
            inflight.discard(seq)
            try:
                got = decoder.decode(payload)
            except codec.DecodeError as e:
                assert e.reason == "need_state"
                c.need_state(seq)
                continue
            assert samples(got) == truth[seq]
            if seq in spooled:
                written[seq] = samples(got)
                del spooled[seq]
                c.done(seq)

    for op in ops:
        if op == "spool":
            spool()
        elif op == "publish":
            publish()
        elif op == "deliver":
            deliver()
        elif op == "lose" and wire:
            seq, _ = wire.pop(0)  # lost in transit: the ack never comes, the row goes again
            inflight.discard(seq)
        elif op == "forget":
            decoder = StreamDecoder()  # an ingester restart, or another replica
    while pending_cycles:
        spool()
    for _ in range(4):
        publish()
        deliver()
    assert not spooled, f"rows never decoded: {sorted(spooled)}"
    assert written == truth
    # Once the link and the decoder behave, lost state has cost its bytes: at most one more need_state,
    # then delta frames (a key frame only at the cadence).
    need_before = c.metrics.stream_need_state._value.get()
    published_before = len(kinds)
    for cycle in range(len(cycles), len(cycles) + 12):
        pending_cycles.append((cycle, ([True] * 12, [float(cycle + j) for j in range(12)])))
        spool()
        publish()
        deliver()
    assert not spooled and written == truth
    assert c.metrics.stream_need_state._value.get() - need_before <= 1
    final = kinds[published_before:]
    # 12 cycles: key frames at the cadence, plus one re-send and one key frame for a need_state.
    assert final.count("delta") >= 12 - math.ceil(12 / keyframe_every) - 2, final


def test_a_frame_not_published_is_never_the_base_of_the_next():
    batches = [make_batch(i, list(range(12)), [float(i * 12 + j) for j in range(12)]) for i in range(3)]
    for i, b in enumerate(batches, 1):
        b.seq = i
    c = coder()
    decoder = StreamDecoder()
    first = c.prepare(row_of(1, codec.encode_batch(batches[0])))
    c.published(first)
    decoder.decode(first.payload)
    c.prepare(row_of(2, codec.encode_batch(batches[1])))  # the pacer said wait: dropped
    again = c.prepare(row_of(2, codec.encode_batch(batches[1])))
    c.published(again)
    assert samples(decoder.decode(again.payload)) == samples(batches[1])


def window_batch(first_cycle: int, cycles: int, present: list[int]) -> Batch:
    """``cycles`` scrapes 5 s apart of the series in ``present`` (a batch window's row)."""
    labels = [series(i) for i in present]
    blocks = [
        ScrapeBlock(
            1_700_000_000_000 + (first_cycle + c) * 5000,
            array("I", range(len(labels))),
            array("d", [float(first_cycle + c + j) for j in range(len(labels))]),
        )
        for c in range(cycles)
    ]
    return Batch(CLUSTER, NODE, 0, labels, blocks, incarnation=7)


def test_live_and_windowed_rows_are_coded_in_chains_of_their_own():
    """A window is coded against the last window, not against the live frame published just before it
    (which would name every series of the window anew); a decoder keeping only the newest state of
    each chain beside one recent state decodes both chains, a dozen live frames between two windows."""
    c = coder(interval_s=5.0)
    decoder = StreamDecoder(keep=1)
    window_frames: list[bytes] = []
    seq = 0
    for w in range(4):
        for cycle in range(12):
            seq += 1
            live = make_batch(w * 12 + cycle, [0, 1, 2], [float(seq), 2.0, 3.0])  # the critical class
            live.seq = seq
            prepared = c.prepare(row_of(seq, codec.encode_batch(live)))
            c.published(prepared)
            assert samples(decoder.decode(prepared.payload)) == samples(live)
        seq += 1
        window = window_batch(w * 12, 12, list(range(3, 40)))
        window.seq = seq
        prepared = c.prepare(row_of(seq, codec.encode_batch(window)))
        c.published(prepared)
        assert samples(decoder.decode(prepared.payload)) == samples(window)
        window_frames.append(prepared.payload)
    bases = [frame_base(f) for f in window_frames]
    assert bases[0] is None and None not in bases[1:]  # one key frame, then deltas of its own chain
    one_chain = coder()  # interval unknown: every row in one chain, windows after live frames
    sizes = []
    for seq in range(1, len(window_frames) + 1):
        live = make_batch(seq, [0, 1, 2], [float(seq), 2.0, 3.0])
        live.seq = 2 * seq - 1
        one_chain.published(one_chain.prepare(row_of(live.seq, codec.encode_batch(live))))
        window = window_batch((seq - 1) * 12, 12, list(range(3, 40)))
        window.seq = 2 * seq
        sizes.append(len(one_chain.prepare(row_of(window.seq, codec.encode_batch(window))).payload))
    assert sum(map(len, window_frames[1:])) < sum(sizes[1:])


def test_a_decoder_keeps_each_chains_newest_state():
    """``keep`` newest states plus each chain's newest: a chain idle for many frames of another still
    decodes; a key frame starts a chain, and beyond CHAINS chains the least recently moved one goes."""
    encoders = [StreamEncoder(CLUSTER, NODE) for _ in range(CHAINS + 1)]
    decoder = StreamDecoder(keep=1)

    def frame(chain: int, cycle: int) -> bytes:
        b = make_batch(cycle, [chain, 10 + chain], [float(cycle), float(chain)])
        b.seq = cycle
        return encoders[chain].encode(b)

    decoder.decode(frame(0, 1))
    for cycle in range(2, 30):
        decoder.decode(frame(1, cycle))
    decoder.decode(frame(0, 30))  # chain 0's tip outlived 28 frames of chain 1
    for chain in range(2, CHAINS + 1):  # more chains start: chain 1, the least recently moved, goes
        decoder.decode(frame(chain, 31))
    with pytest.raises(codec.DecodeError) as e:
        decoder.decode(frame(1, 32))
    assert e.value.reason == "need_state"
    decoder.decode(frame(0, 33))


def test_a_delta_frame_larger_than_its_spooled_batch_goes_as_the_batch():
    """Most series new to the chain: the delta frame would cost more than the self-contained batch, so
    the batch goes, and the chain stays where it was (the next frame is coded against the last one
    published)."""
    c = coder()
    decoder = StreamDecoder()
    first = make_batch(0, list(range(200)), [float(i) for i in range(200)])
    first.seq = 1
    published = c.prepare(row_of(1, codec.encode_batch(first)))
    c.published(published)
    decoder.decode(published.payload)
    other = make_batch(1, list(range(1000, 1200)), [i * 1.37 for i in range(200)])
    other.seq = 2
    row = codec.encode_batch(other)
    frame, _ = c.encoders[0].prepare(other, validated=True)
    assert len(frame) > len(row)  # the case under test
    prepared = c.prepare(row_of(2, row))
    assert prepared.kind == "batch" and prepared.payload == row  # the batch, not the bigger frame
    c.published(prepared)
    again = make_batch(2, list(range(200)), [float(i) + 1 for i in range(200)])
    again.seq = 3
    nxt = c.prepare(row_of(3, codec.encode_batch(again)))
    assert nxt.kind == "delta"
    c.published(nxt)
    # Decoded by a decoder that saw only frame 1: the chain did not move past it.
    assert samples(decoder.decode(nxt.payload)) == samples(again)


def test_the_wire_ratio_is_kept_per_spooled_format():
    """The budget controller weighs spooled bytes by what such rows cost on the wire. v1 rows (the
    live lane's quick form) and v2 rows of the same data differ in size, so one ratio for both would
    mis-charge whichever lane published last."""
    c = coder()
    assert c.wire_bytes(10_000, codec.FORMAT_V2) == 10_000  # nothing published yet: as spooled

    def publish(seqs: range, version: int) -> None:
        for seq in seqs:
            b = make_batch(seq, list(range(300)), [seq * 0.25 + j for j in range(300)])
            b.seq = seq
            c.published(c.prepare(row_of(seq, codec.encode_batch(b, version=version))))

    publish(range(1, 61), codec.FORMAT_V2)
    v2 = c.wire_bytes(10_000, codec.FORMAT_V2)
    assert 0 < v2 < 2_000  # delta frames are a fraction of their rows
    assert c.wire_bytes(10_000, codec.FORMAT_V1) == 10_000  # no v1 row published yet
    publish(range(61, 121), codec.FORMAT_V1)
    assert c.wire_bytes(10_000, codec.FORMAT_V2) == v2  # v1 rows leave v2's ratio alone
    assert 0 < c.wire_bytes(10_000, codec.FORMAT_V1) < 2_000
    assert coder(enabled=False).wire_bytes(10_000, codec.FORMAT_V1) == 10_000


def test_spooled_batch_is_published_when_coding_is_off_or_needed_self_contained():
    b = make_batch(0, [0, 1], [1.0, 2.0])
    b.seq = 1
    payload = codec.encode_batch(b)
    off = coder(enabled=False)
    assert off.prepare(row_of(1, payload)).payload == payload
    on = coder()
    first = on.prepare(row_of(1, payload))
    assert first.payload != payload and first.payload[3] == 3  # a v3 frame
    on.published(first)
    on.need_state(1)
    assert on.prepare(row_of(1, payload)).payload == payload


def test_an_ingester_without_v3_pauses_stream_coding():
    now = [0.0]
    c = coder(clock=lambda: now[0], pause_s=600)
    b = make_batch(0, [0], [1.0])
    b.seq = 1
    payload = codec.encode_batch(b)
    c.published(c.prepare(row_of(1, payload)))
    assert c.rejected(1, "unknown_version")
    assert not c.enabled
    assert c.prepare(row_of(2, payload)).kind == "batch"
    now[0] = 601
    assert c.enabled
    # A rejection of a spooled batch (not a frame) is the cloud's refusal, not the codec's.
    assert not c.rejected(2, "receiver_rejected")


def test_an_ingester_without_the_multi_cycle_layout_gets_single_cycle_windows_for_a_while():
    """A v3 ingester from before frame kinds 0x02/0x03 refuses a window's frame as malformed: the window
    goes again as its batch, and windows are coded in the single-cycle layout until the pause ends."""
    now = [0.0]
    c = coder(clock=lambda: now[0], pause_s=600, interval_s=5.0)

    def publish_window(seq: int) -> bytes:
        window = window_batch(seq * 12, 12, list(range(20)))
        window.seq = seq
        prepared = c.prepare(row_of(seq, codec.encode_batch(window)))
        c.published(prepared)
        return prepared.payload

    def frame_kind(payload: bytes) -> int:
        _header, body, _ = open_envelope(payload, codec.DEFAULT_LIMITS)
        return body[0]

    assert frame_kind(publish_window(1)) == 0x02  # a multi-cycle key frame
    assert c.rejected(1, "malformed: unknown v3 frame kind 0x02")
    assert c.enabled  # stream coding goes on
    again = window_batch(12, 12, list(range(20)))
    again.seq = 1
    assert c.prepare(row_of(1, codec.encode_batch(again))).kind == "batch"
    assert frame_kind(publish_window(2)) in (0x00, 0x01)
    now[0] = 601
    assert frame_kind(publish_window(3)) in (0x02, 0x03)


def test_an_undecodable_row_goes_out_as_it_is():
    c = coder()
    junk = b"ERB\x02not msgpack"
    assert c.prepare(row_of(1, junk)).payload == junk


def _append(spool: Spool, batch: Batch) -> int:
    return spool.batches.append(
        lambda seq: codec.encode_batch(Batch(CLUSTER, NODE, seq, batch.labelsets, batch.scrapes)),
        first_ts_ms=batch.first_timestamp_ms,
        last_ts_ms=batch.last_timestamp_ms,
        sample_count=batch.sample_count,
    )


def test_need_state_and_a_rejected_frame_keep_the_row_a_rejected_batch_is_ledgered(spool: Spool):
    queue = SendQueue(spool.batches, order="live_first", inflight_limit=10, live_window_s=5)
    inflight = InFlight()
    c = coder()
    seqs = [_append(spool, make_batch(i, [0, 1, 2], [1.0, 2.0, 3.0])) for i in range(3)]
    for row in queue.next_rows(inflight):
        c.published(c.prepare(row))
        inflight.add(row.seq, 0.0)
    ack = Ack(NODE, [AckResult(seqs[0], "need_state"), AckResult(seqs[1], "rejected", "need_state")])
    applied = apply_ack(queue, inflight, ack, 1.0, c)
    assert not applied.refused
    assert [r.seq for r in spool.batches.pending(10)] == seqs
    # Both go again as the spooled batch: self-contained.
    rows = {r.seq: r for r in queue.next_rows(inflight)}
    assert c.prepare(rows[seqs[0]]).kind == "batch" and c.prepare(rows[seqs[1]]).kind == "batch"
    applied = apply_ack(
        queue, inflight, Ack(NODE, [AckResult(seqs[1], "rejected", "receiver_rejected")]), 2, c
    )
    assert len(applied.refused) == 1
    assert LossLedger(spool.losses).totals()["rejected_by_cloud"] == 3
    apply_ack(queue, inflight, Ack(NODE, [AckResult(seqs[0], "ok"), AckResult(seqs[2], "ok")]), 3, c)
    assert spool.batches.count() == 0
