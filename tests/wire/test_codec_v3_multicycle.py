"""Wire format v3, multi-cycle layout (frame kinds 0x02/0x03, ``schemas/codec/v3/multicycle.py``): round
trips of windows bit for bit, chains mixing single- and multi-cycle frames, the state message between
them, the predictor orders and the byte planes, hostile frames, golden vectors."""

from __future__ import annotations

import json
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import GOLDEN, T0
from test_codec_v3 import (
    SPECIAL,
    assert_cuts_and_flips_refused,
    bits,
    decode_with,
    make_batch,
    refusal,
    samples,
    value_bits,
)

from edge_relay.uplink import stream as relay_stream
from schemas import codec, columnar
from schemas.codec import DEFAULT_LIMITS, DecodeError, Limits, StreamDecoder, StreamEncoder, decode_state
from schemas.codec import v3 as v3mod
from schemas.codec.errors import run_decoder
from schemas.codec.header import Header
from schemas.codec.v3 import multicycle as mc
from schemas.golden import vectors as mg
from schemas.golden import vectors_v3 as g3
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock

V3 = codec.FORMAT_V3
V3_GOLDEN = GOLDEN / "v3"
NEG_ZERO = bits(-0.0)
INF = bits(float("inf"))
NAN_PAYLOAD = 0x7FF4DEADBEEF0001


def kind_of(data: bytes) -> int:
    body: bytes = msgpack.unpackb(data[4:], raw=False)["body"]
    return body[0]


def window(seq: int, cycles: list[list[tuple[list[Labels], list[int], list[int] | None]]], t0: int) -> Batch:
    """A window batch: ``cycles`` of blocks (label sets, value bits, explicit timestamps), 5 s apart."""
    blocks = []
    for c, cycle in enumerate(cycles):
        for j, (ls, vals, stamps) in enumerate(cycle):
            t = t0 + 5000 * c + 1250 * j
            blocks.append((t, ls, vals, None if stamps is None else [t - s for s in stamps]))
    return make_batch(seq, blocks)


def targets(n: int = 2) -> list[list[Labels]]:
    return [[mg.labels("m", job=f"t{j}", pod=str(i)) for i in range(4)] for j in range(n)]


def smooth_windows(n: int, cycles: int = 12) -> list[Batch]:
    """Counters (order 2 exact), a quadratic (order 3 exact), a flapping gauge (order 1), a constant;
    two targets (the second's first series a straight line)."""
    ts = targets()
    out = []
    for w in range(n):
        cyc = []
        for c in range(cycles):
            k = w * cycles + c
            vals = [bits(1000.0 + 17.25 * k), bits(37.5 * k * k), bits(0.5 + 0.01 * (k % 2)), bits(3.0)]
            cyc.append([(ts[0], vals, None), (ts[1], [bits(float(3 * k)), *vals[1:]], None)])
        out.append(window(w + 1, cyc, T0 + 60_000 * w))
    return out


def content_parts(data: bytes) -> tuple[bytes, list[bytes]]:
    body = msgpack.unpackb(data[4:], raw=False)["body"]
    kind, _base, compressed = v3mod.split_frame(body)
    names = mc.MC_SECTIONS if kind in (v3mod.FRAME_MC_KEY, v3mod.FRAME_MC_DELTA) else v3mod.V3_SECTIONS
    content = zstandard.ZstdDecompressor().decompress(compressed)
    r = columnar.Reader(content, "x")
    return body[: len(body) - len(compressed)], [r.take(r.uvarint()) for _ in names]


def with_sections(data: bytes, **changes: bytes) -> bytes:
    prefix, parts = content_parts(data)
    for name, value in changes.items():
        parts[mc.MC_SECTIONS.index(name)] = value
    header = msgpack.unpackb(data[4:], raw=False)
    header["body"] = prefix + zstandard.ZstdCompressor(level=3).compress(v3mod.join_sections(tuple(parts)))
    return mg.raw_envelope(header, version=V3)


# --------------------------------------------------------------------------------------------------
# what the encoder chooses


def test_windows_take_the_multicycle_kinds_and_single_cycles_do_not() -> None:
    enc, dec = StreamEncoder("lab", "edge-01"), StreamDecoder()
    kinds = []
    for batch in smooth_windows(3):
        data = enc.encode(batch)
        kinds.append(kind_of(data))
        assert samples(dec.decode(data)) == samples(batch)
    assert kinds == [v3mod.FRAME_MC_KEY, v3mod.FRAME_MC_DELTA, v3mod.FRAME_MC_DELTA]
    one = smooth_windows(1, cycles=1)[0]
    assert kind_of(StreamEncoder("lab", "edge-01").encode(one)) == v3mod.FRAME_KEY
    assert kind_of(StreamEncoder("lab", "edge-01", multicycle=False).encode(smooth_windows(1)[0])) == 0


def test_cycle_length() -> None:
    assert [mc.cycle_length(b) for b in smooth_windows(1, cycles=1)] == [0]
    assert [mc.cycle_length(b) for b in smooth_windows(1, cycles=3)] == [2]
    assert mc.cycle_length(mg.batch_window()) == 2
    assert mc.cycle_length(make_batch(1, [])) == 0


def test_orders_follow_the_series_and_beat_the_single_cycle_layout() -> None:
    batches = smooth_windows(3)
    sizes = {}
    residuals = {}
    for name, kw in (("single", {"multicycle": False}), ("12", {"orders": (1, 2)}), ("1234", {})):
        enc = StreamEncoder("lab", "edge-01", multicycle_level=3, **kw)
        frames = [enc.encode(b) for b in batches]
        sizes[name] = sum(map(len, frames[1:]))
        if name == "single":
            continue
        parts = [content_parts(f)[1] for f in frames[1:]]
        residuals[name] = sum(len(p[mc.MC_SECTIONS.index("DELTAS")]) for p in parts)
        order = parts[0][mc.MC_SECTIONS.index("ORDER")]
        if name == "1234":
            # first-use order: t0's counter, quadratic, flapping gauge, constant (a tie: v3's order
            # 2), then t1's straight line, quadratic, gauge, constant
            assert list(order) == [2, 3, 1, 2, 2, 3, 1, 2]
        else:
            assert list(order) == [2, 2, 1, 2, 2, 2, 1, 2]
    assert residuals["1234"] < residuals["12"]
    assert sizes["1234"] < sizes["single"] and sizes["12"] < sizes["single"]


def test_planes() -> None:
    zs = [0, 1, 127, 128, 300, 2**63, 2**64 - 1, 5, 2**14]
    buf = mc.planes(zs)
    assert len(buf) == sum((z.bit_length() + 6) // 7 or 1 for z in zs)
    assert buf[: len(zs)] == bytes((z & 0x7F) | (0x80 if z > 0x7F else 0) for z in zs)  # plane 0
    assert mc.unplanes(buf, len(zs)) == zs
    assert mc.planes([]) == b"" and mc.unplanes(b"", 0) == []


# --------------------------------------------------------------------------------------------------
# property: random windows, cycle counts and kinds in one chain


@st.composite
def windows(draw: st.DrawFn) -> tuple[list[Batch], int, tuple[int, ...]]:
    """Windows of 1..4 cycles of 0..3 targets: series appear and disappear mid-window, special values,
    stale markers, explicit timestamps; a target's series always start with its first label set."""
    n_targets = draw(st.integers(1, 3))
    universe = [[mg.labels("m", job=f"t{j}", pod=str(i)) for i in range(6)] for j in range(n_targets)]
    last: dict[Labels, int] = {}
    t = T0
    out = []
    for w in range(draw(st.integers(1, 6))):
        blocks = []
        for _c in range(draw(st.integers(1, 4))):
            t += 5000
            for j in range(n_targets):
                extra = draw(st.lists(st.sampled_from(universe[j][1:]), unique=True, max_size=5))
                members = [universe[j][0], *extra] if draw(st.integers(0, 7)) else extra
                vals = [draw(value_bits(last.get(lab))) for lab in members]
                for p in range(len(vals)):
                    pick = draw(st.integers(0, 15))
                    if pick == 0:
                        vals[p] = STALE_NAN_BITS
                    elif pick == 1:
                        vals[p] = draw(st.sampled_from([NEG_ZERO, INF, INF | 1 << 63, NAN_PAYLOAD, *SPECIAL]))
                last.update(zip(members, vals, strict=True))
                stamps = None
                if members and draw(st.integers(0, 6)) == 0:
                    stamps = [t + j - draw(st.integers(0, 2000)) for _ in members]
                blocks.append((t + j, members, vals, stamps))
        out.append(make_batch(w + 1, blocks))
    orders = draw(st.sampled_from([(1, 2, 3, 4), (1, 2), (2,), (3,), (4,), (1,)]))
    return out, draw(st.integers(1, 6)), orders


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(), st.integers(0, 6))
def test_random_windows_round_trip_bit_exact(
    case: tuple[list[Batch], int, tuple[int, ...]], cut: int
) -> None:
    batches, every, orders = case
    enc = StreamEncoder("lab", "edge-01", keyframe_every=every, orders=orders)
    dec = StreamDecoder()
    state: bytes | None = None
    for k, batch in enumerate(batches):
        if k == cut:  # an ingester restarts mid-chain: the state message carries what the next frame needs
            dec = StreamDecoder()
            state = enc.state() if enc.sid else None
        data = enc.encode(batch)
        assert samples(dec.decode(data, lambda c, n, s, held=state: held)) == samples(batch)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(), st.data())
def test_any_cycle_length_and_kind_mix_decode_to_the_encoders_state(
    case: tuple[list[Batch], int, tuple[int, ...]], data: st.DataObject
) -> None:
    """Frame by frame, a random layout (single-cycle or multi-cycle with any P): the batch bit for bit
    and the decoder's state equal to the encoder's (dictionary, blocks, kinds, m, d, id)."""
    batches, _every, orders = case
    enc_st = dec_st = None
    for batch in batches:
        n = len(batch.scrapes)
        cycle = data.draw(st.sampled_from([-1, *range(1, n + 1)] if n else [-1, 0]))  # -1: single-cycle
        header = Header(
            V3, "lab", "edge-01", batch.seq, batch.first_timestamp_ms, batch.last_timestamp_ms,
            batch.sample_count, v3mod.CODEC_V3,
        )  # fmt: skip
        if cycle < 0:
            content, enc_st = v3mod.encode_frame(enc_st, batch, DEFAULT_LIMITS)
            got, dec_st = v3mod.decode_frame(dec_st, header, content, DEFAULT_LIMITS)
        else:
            content, enc_st = mc.encode_frame(enc_st, batch, DEFAULT_LIMITS, cycle, orders)
            got, dec_st = mc.decode_frame(dec_st, header, content, DEFAULT_LIMITS)
        assert samples(got) == samples(batch)
        assert dec_st == enc_st


def test_chain_alternates_kinds_and_state_messages() -> None:
    """The relay's live and windowed lanes share one chain: single- and multi-cycle frames in turn,
    an ingester restart between them, a state message taken after either kind."""
    live = smooth_windows(8, cycles=1)
    win = smooth_windows(8, cycles=3)
    enc = StreamEncoder("lab", "edge-01", keyframe_every=1000)
    dec = StreamDecoder()
    kinds = []
    for k in range(8):
        batch = win[k] if k % 2 else live[k]
        batch.seq = k + 1
        state = enc.state() if enc.sid else None
        data = enc.encode(batch)
        kinds.append(kind_of(data))
        assert samples(dec.decode(data)) == samples(batch)
        fresh = StreamDecoder()
        if state is not None:
            fresh.load_state(state)
        assert samples(fresh.decode(data)) == samples(batch)
    assert kinds == [0x00, 0x03, 0x01, 0x03, 0x01, 0x03, 0x01, 0x03]


def test_special_values_across_a_window() -> None:
    pattern = [*SPECIAL, 0, 2**64 - 1, 2**63, 2**63 - 1, 1, bits(0.25), NEG_ZERO, STALE_NAN_BITS, NAN_PAYLOAD]
    seq = [a for a in pattern for _ in (0, 1)] + pattern[::-1]
    ls = [mg.labels("special"), mg.labels("other")]
    cycles = [[(ls, [v, pattern[c % len(pattern)]], None)] for c, v in enumerate(seq)]
    enc, dec = StreamEncoder("lab", "edge-01"), StreamDecoder()
    for orders in ((1, 2, 3, 4), (4,), (1,)):
        enc = StreamEncoder("lab", "edge-01", orders=orders)
        for w in range(0, len(cycles), 12):
            batch = window(w + 1, cycles[w : w + 12], T0 + 5000 * w)
            assert samples(dec.decode(enc.encode(batch))) == samples(batch)


def test_raw_bits_across_the_sign_bit_fall_back_to_exceptions() -> None:
    """Residuals past 64 bits under every order: exceptions, exactly (``_walk``)."""
    swing = [0, 2**64 - 1, 1, 2**64 - 2, 2**63, 2**63 - 1, 3, 2**64 - 3] * 2
    ls = [mg.labels("swing")]
    for orders in ((1, 2, 3, 4), (3,), (4,)):
        enc, dec = StreamEncoder("lab", "edge-01", orders=orders), StreamDecoder()
        batch = window(1, [[(ls, [NAN_PAYLOAD], None)]] + [[(ls, [v], None)] for v in swing], T0)
        assert samples(dec.decode(enc.encode(batch))) == samples(batch)


# --------------------------------------------------------------------------------------------------
# hostile input


def _mc_frames() -> tuple[list[bytes], list[bytes | None]]:
    enc = StreamEncoder("lab", "edge-01")
    frames, states = [], []
    for b in [mg.batch_window(), *smooth_windows(2, cycles=3)]:
        b.node = "edge-01"
        states.append(enc.state() if enc.sid else None)
        frames.append(enc.encode(b))
    assert [kind_of(f) for f in frames] == [0x02, 0x03, 0x03]
    return frames, states


def test_every_cut_and_byte_flip_is_refused_cleanly() -> None:
    frames, states = _mc_frames()
    assert_cuts_and_flips_refused(frames[:2], states[:2])


def test_content_changes_are_refused_or_decode_to_a_whole_batch() -> None:
    frames, states = _mc_frames()
    for data, state in zip(frames[:2], states[:2], strict=True):
        _prefix, parts = content_parts(data)
        for s, part in enumerate(parts):
            for i in range(len(part)):
                for delta in (1, 0x80, 0x7F):
                    changed = bytearray(part)
                    changed[i] = (changed[i] + delta) & 0xFF
                    frame = with_sections(data, **{mc.MC_SECTIONS[s]: bytes(changed)})
                    try:
                        batch = decode_with(frame, state)
                    except DecodeError as err:
                        assert err.reason in codec.REASONS and not err.message.startswith("unhandled"), err
                    else:
                        assert sum(map(len, (b.values for b in batch.scrapes))) == batch.sample_count
            for cut in range(len(part)):
                try:
                    decode_with(with_sections(data, **{mc.MC_SECTIONS[s]: part[:cut]}), state)
                except DecodeError as err:
                    assert err.reason in codec.REASONS and not err.message.startswith("unhandled"), err


def _deltas() -> bytes:
    return content_parts(_mc_frames()[0][0])[1][mc.MC_SECTIONS.index("DELTAS")]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"BLOCKS": columnar.uvarints([10**9])}, "too_many_scrapes"),
        ({"BLOCKS": columnar.uvarints([8, 0])}, "malformed"),  # no blocks per cycle
        ({"BLOCKS": columnar.uvarints([8, 9])}, "malformed"),  # more per cycle than blocks
        ({"BLOCKS": columnar.uvarints([0, 1])}, "malformed"),
        ({"BLOCKS": columnar.uvarints([1, 1, 0x10, 0])}, "malformed"),  # unknown block flag
        ({"BLOCKS": columnar.uvarints([1, 1, 1, 0, 0, 10**6])}, "bad_index"),  # more members than bytes
        ({"BLOCKS": columnar.uvarints([1, 1, 0, 2**64 - 1])}, "bad_timestamp"),
        ({"ORDER": b""}, "length_mismatch"),
        ({"ORDER": b"\x02" * 1000}, "length_mismatch"),
        ({"EXC": columnar.uvarints([10**9])}, "length_mismatch"),
        ({"EXC": bytes(columnar.uvarints([1, 0])) + b"\x30" + bytes(columnar.uvarints([0]))}, "malformed"),
        ({"DELTAS": b""}, "length_mismatch"),
    ],
)
def test_wrong_counts_are_refused(changes: dict[str, bytes], reason: str) -> None:
    data = _mc_frames()[0][0]
    assert refusal(lambda: decode_with(with_sections(data, **changes), None)).reason == reason


def test_bad_orders_and_planes_are_refused() -> None:
    data = _mc_frames()[0][0]
    order = content_parts(data)[1][mc.MC_SECTIONS.index("ORDER")]
    for bad in (0, 5, 0xFF):
        changed = bytes([bad]) + order[1:]
        assert (
            refusal(lambda c=changed: decode_with(with_sections(data, ORDER=c), None)).reason == "malformed"
        )
    deltas = _deltas()
    assert refusal(lambda: decode_with(with_sections(data, DELTAS=deltas + b"\x00"), None)).reason == (
        "length_mismatch"
    )
    # a residual of eleven bytes, and one of ten bytes past 2^64: the first delta's planes only
    n = len(deltas)
    for tail, reason in ((b"\xff" * 9 + b"\x01", "malformed"), (b"\xff" * 8 + b"\x02", "malformed")):
        changed = bytes([deltas[0] | 0x80]) + deltas[1:n] + tail
        got = refusal(lambda c=changed: decode_with(with_sections(data, DELTAS=c), None))
        assert got.reason in (reason, "length_mismatch")
    for buf, count, reason in (
        (b"\x80" * 9 + b"\x02", 1, "malformed"),  # ten bytes, 2^64
        (b"\x80" * 10 + b"\x01", 1, "malformed"),  # eleven bytes
        (b"\x80\x80", 1, "length_mismatch"),
        (b"\x80", 2, "length_mismatch"),
    ):
        assert refusal(lambda b=buf, n=count: run_decoder(lambda: mc.unplanes(b, n))).reason == reason
    assert mc.unplanes(b"\xff" * 9 + b"\x01", 1) == [2**64 - 1]


def test_unknown_frame_kind_is_its_own_reason() -> None:
    data = _mc_frames()[0][0]
    header = msgpack.unpackb(data[4:], raw=False)
    for kind in (0x04, 0x07, 0xFF):
        header["body"] = bytes([kind]) + header["body"][1:]
        err = refusal(lambda h=header: codec.decode_batch(mg.raw_envelope(h, version=V3)))
        assert err.reason == v3mod.UNKNOWN_FRAME_KIND != "malformed"
        assert "unknown v3 frame kind" in err.message
        # what the relay reads from the ingester's rejection: a format it does not know, so it pauses
        assert str(err).split(":", 1)[0].strip() in relay_stream.UNKNOWN_FORMAT


def test_multicycle_key_frame_decodes_alone_and_delta_needs_state() -> None:
    frames, _ = _mc_frames()
    assert codec.frame_base(frames[0]) is None and codec.frame_base(frames[1]) is not None
    assert samples(codec.decode_batch(frames[0])) == samples(mg.batch_window())
    assert refusal(lambda: codec.decode_batch(frames[1])).reason == "need_state"
    assert refusal(lambda: StreamDecoder().decode(frames[1])).reason == "need_state"


def test_limits_bound_the_decoder() -> None:
    frames, _ = _mc_frames()
    assert refusal(lambda: decode_with(frames[0], None, Limits(max_samples=5))).reason == "too_many_samples"
    assert refusal(lambda: decode_with(frames[0], None, Limits(max_scrapes=3))).reason == "too_many_scrapes"


# --------------------------------------------------------------------------------------------------
# golden vectors


def _json(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return out


def test_golden_multicycle_chain() -> None:
    paths = sorted(V3_GOLDEN.glob("v3_multicycle_[0-9].bin"))
    assert [p.stem for p in paths] == ["v3_multicycle_0", "v3_multicycle_1", "v3_multicycle_2"]
    assert [kind_of(p.read_bytes()) for p in paths] == [0x02, 0x01, 0x03]
    dec = StreamDecoder()
    again = StreamEncoder("lab", "edge-01", keyframe_every=100, level=mg.LEVEL, multicycle_level=mg.LEVEL)
    for path, batch in zip(paths, g3.v3_multicycle_stream(), strict=True):
        expected = _json(path)
        header, got, sid = dec.decode_with_header(path.read_bytes())
        assert sid is not None and sid.hex() == expected["sid"]
        view = json.loads(json.dumps(codec.batch_to_json(header, got)))
        assert {k: view[k] for k in ("header", "labelsets", "scrapes")} == {
            k: expected[k] for k in ("header", "labelsets", "scrapes")
        }
        # Encoding the window again gives the same frame content (and so the same state id).
        assert content_parts(again.encode(batch))[1] == content_parts(path.read_bytes())[1]
    _cluster, state = decode_state((V3_GOLDEN / "v3_multicycle_state_after_2.bin").read_bytes())
    assert state.sid.hex() == _json(V3_GOLDEN / "v3_multicycle_state_after_2.bin")["sid"]
    assert state == dec._states[("lab", "edge-01")].get(state.sid)


def test_golden_single_cycle_stream_is_unchanged() -> None:
    """The 0x00/0x01 vectors encode again to the same bytes with the multi-cycle layout on."""
    enc = StreamEncoder("lab", "edge-01", keyframe_every=100, level=mg.LEVEL)
    for k, batch in enumerate(g3.v3_stream()):
        assert enc.encode(batch) == (V3_GOLDEN / f"v3_stream_{k}.bin").read_bytes()


def test_state_of_a_window_frame_is_the_last_cycle() -> None:
    enc = StreamEncoder("lab", "edge-01")
    batch = smooth_windows(1, cycles=3)[0]
    enc.encode(batch)
    assert enc._state is not None
    assert [t for t, _ in enc._state.blocks] == [b.timestamp_ms for b in batch.scrapes[-2:]]


def test_explicit_timestamps_in_a_window() -> None:
    ls = targets(1)[0]
    cycles = [[(ls, [bits(float(c + i)) for i in range(4)], [c, 0, 1, 2])] for c in range(6)]
    batch = window(1, cycles, T0)
    enc, dec = StreamEncoder("lab", "edge-01"), StreamDecoder()
    data = enc.encode(batch)
    assert kind_of(data) == 0x02
    got = dec.decode(data)
    assert samples(got) == samples(batch)
    assert any(b.timestamps is not None for b in got.scrapes)
    assert isinstance(got.scrapes[0], ScrapeBlock) and isinstance(got.scrapes[0].series, array)
