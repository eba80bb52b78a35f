"""Wire format v3 ("stream+zstd"): stream round trips with churn, state loss and state messages,
refusal of frames against the wrong state, hostile frames and state messages, golden vectors."""

from __future__ import annotations

import json
import struct
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import GOLDEN, T0

from schemas import codec, columnar
from schemas.codec import DEFAULT_LIMITS, DecodeError, EncodeError, Limits, StreamDecoder, StreamEncoder
from schemas.codec import v3 as v3mod
from schemas.golden import vectors as mg
from schemas.golden import vectors_v3 as g3
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits

V3 = codec.FORMAT_V3
V3_GOLDEN = GOLDEN / "v3"
Sample = tuple[Labels, int, int]


def samples(batch: Batch) -> Counter[Sample]:
    out: Counter[Sample] = Counter()
    for block in batch.scrapes:
        for i, (idx, value) in enumerate(zip(block.series, block.values, strict=True)):
            out[(batch.labelsets[idx], block.sample_timestamp(i), float_bits(value))] += 1
    return out


def refusal(fn: Any) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        fn()
    err = info.value
    assert err.reason in codec.REASONS
    assert not err.message.startswith("unhandled"), err
    return err


def make_batch(seq: int, blocks: list[tuple[int, list[Labels], list[int], list[int] | None]]) -> Batch:
    table: dict[Labels, int] = {}
    scrapes = []
    for t, ls, bits, stamps in blocks:
        ids = array("I", [table.setdefault(lab, len(table)) for lab in ls])
        ts = None if stamps is None else array("q", stamps)
        scrapes.append(ScrapeBlock(t, ids, mg.values_from_bits(bits), ts))
    return Batch("lab", "edge-01", seq, list(table), scrapes)


def bits(x: float) -> int:
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def stream(n: int = 6, churn: bool = True) -> list[Batch]:
    """A small realistic stream: counters, gauges, a float counter, a pod replaced mid-way."""
    node = [mg.labels("node_load1", job="node"), mg.labels("node_cpu_seconds_total", cpu="0", job="node")]
    out = []
    for k in range(n):
        pod = "a" if not churn or k < n // 2 else "b"
        kep = [mg.labels("kepler_joules_total", pod=pod), mg.labels("up", job="kepler")]
        node_bits = [bits(0.5 + 0.01 * k), bits(1234.5678901234567 + 5.0123456789 * k)]
        kep_bits = [bits(1000.0 + 17.125 * k), bits(1.0)]
        out.append(
            make_batch(
                k + 1, [(T0 + 5000 * k, node, node_bits, None), (T0 + 5000 * k + 1250, kep, kep_bits, None)]
            )
        )
    return out


# --------------------------------------------------------------------------------------------------
# the envelope: key frames alone, delta frames need state


def test_key_frame_decodes_alone_and_peeks() -> None:
    batch = mg.batch_window()
    data = codec.encode_batch(batch, version=V3)
    assert data[:4] == b"ERB\x03"
    header = codec.peek_header(data)
    assert (header.version, header.codec, header.sample_count) == (3, "stream+zstd", batch.sample_count)
    assert (header.first_ts_ms, header.last_ts_ms) == (batch.first_timestamp_ms, batch.last_timestamp_ms)
    assert samples(codec.decode_batch(data)) == samples(batch)
    assert codec.frame_base(data) is None


def test_delta_frame_needs_state_but_peeks() -> None:
    frames = [StreamEncoder("lab", "edge-01").encode(b) for b in stream(1)]
    enc = StreamEncoder("lab", "edge-01")
    first, second = (enc.encode(b) for b in stream(2))
    assert codec.frame_base(first) is None and codec.frame_base(second) is not None
    assert codec.peek_header(second).seq == 2
    assert refusal(lambda: codec.decode_batch(second)).reason == "need_state"
    assert refusal(lambda: StreamDecoder().decode(second)).reason == "need_state"
    assert samples(codec.decode_batch(frames[0])) == samples(stream(1)[0])


def test_v1_v2_still_decode_through_the_stream_decoder() -> None:
    batch = mg.batch_small()
    dec = StreamDecoder()
    for version in (codec.FORMAT_V1, codec.FORMAT_V2):
        assert samples(dec.decode(codec.encode_batch(batch, version=version))) == samples(batch)


def test_stream_round_trip_and_sizes() -> None:
    enc, dec = StreamEncoder("lab", "edge-01", keyframe_every=100), StreamDecoder()
    sizes = []
    for batch in stream(12):
        data = enc.encode(batch)
        sizes.append(len(data))
        assert samples(dec.decode(data)) == samples(batch)
    assert max(sizes[1:]) < sizes[0]  # deltas are cheaper than the key frame


def test_keyframe_cadence_and_explicit_keyframes() -> None:
    enc = StreamEncoder("lab", "edge-01", keyframe_every=3)
    kinds = [codec.frame_base(enc.encode(b)) is None for b in stream(7)]
    assert kinds == [True, False, False, True, False, False, True]
    b = stream(8)[7]
    assert codec.frame_base(enc.keyframe(b)) is None
    sid = enc.sid
    again = enc.self_contained(b)
    assert codec.frame_base(again) is None and enc.sid == sid  # a re-send leaves the stream alone


def test_duplicate_delivery_still_decodes() -> None:
    enc, dec = StreamEncoder("lab", "edge-01"), StreamDecoder()
    frames = [enc.encode(b) for b in stream(4)]
    for data in (frames[0], frames[1], frames[1], frames[2], frames[1], frames[3]):
        dec.decode(data)  # QoS 1 redelivery: the older base is still held


# --------------------------------------------------------------------------------------------------
# state: loss, state messages, wrong state


def test_restarted_decoder_needs_state_until_keyframe_or_state_message() -> None:
    enc = StreamEncoder("lab", "edge-01", keyframe_every=5)
    batches = stream(8)
    frames, states = [], []
    for b in batches:
        states.append(enc.state() if enc.sid else None)  # the state each frame is coded against
        frames.append(enc.encode(b))
    fresh = StreamDecoder()
    assert refusal(lambda: fresh.decode(frames[2])).reason == "need_state"
    retained = states[2]
    assert retained is not None
    got = fresh.decode(frames[2], lambda c, n, sid: retained)
    assert samples(got) == samples(batches[2])
    assert samples(fresh.decode(frames[3])) == samples(batches[3])  # and it follows the chain
    other = StreamDecoder()
    assert samples(other.decode(frames[5])) == samples(batches[5])  # frame 5 is a key frame


def test_round_robin_replicas_lose_bytes_never_samples() -> None:
    """Two replicas taking turns (a shared subscription, no stickiness, no following): each frame
    decodes, or is refused need_state and then decodes when re-sent self-contained."""
    enc = StreamEncoder("lab", "edge-01")
    replicas = [StreamDecoder(), StreamDecoder()]
    resent = 0
    for k, batch in enumerate(stream(10)):
        data = enc.encode(batch)
        replica = replicas[k % 2]
        try:
            got = replica.decode(data)
        except DecodeError as err:
            assert err.reason == "need_state"
            resent += 1
            got = replica.decode(enc.self_contained(batch))
        assert samples(got) == samples(batch)
    assert resent == 9  # every frame but the first key frame: bytes, not samples
    # With following (every replica decodes every frame for state), none is refused.
    follower = StreamDecoder()
    enc = StreamEncoder("lab", "edge-01")
    for batch in stream(10):
        data = enc.encode(batch)
        follower.decode(data)
        assert samples(follower.decode(data)) == samples(batch)  # the shared delivery of the same frame


def test_state_message_round_trip() -> None:
    enc = StreamEncoder("lab", "edge-01")
    batches = stream(5)
    for b in batches[:4]:
        enc.encode(b)
    message = enc.state()
    assert message[:4] == b"ERS\x01"
    cluster, state = codec.decode_state(message)
    assert cluster == "lab" and state.sid == enc.sid
    assert enc._state is not None
    ref = enc._state
    assert (state.labels, state.blocks, state.kinds, state.ms, state.ds) == (
        ref.labels,
        ref.blocks,
        ref.kinds,
        ref.ms,
        ref.ds,
    )
    dec = StreamDecoder()
    assert dec.load_state(message) == enc.sid
    assert samples(dec.decode(enc.encode(batches[4]))) == samples(batches[4])


def test_frame_against_another_state_is_refused() -> None:
    a, b = StreamEncoder("lab", "edge-01"), StreamEncoder("lab", "edge-01")
    one, two = stream(3), stream(3, churn=False)
    for x, y in zip(one[:2], two[:2], strict=True):
        a.encode(x)
        b.encode(y)
    dec = StreamDecoder()
    dec.load_state(a.state())
    frame_b = b.encode(two[2])
    assert refusal(lambda: dec.decode(frame_b)).reason == "need_state"
    # A lookup that answers with some other state (a stale retained message) is not taken either.
    wrong = a.state()
    assert refusal(lambda: StreamDecoder().decode(frame_b, lambda c, n, s: wrong)).reason == "need_state"
    assert refusal(lambda: StreamDecoder().decode(frame_b, lambda c, n, s: b"junk")).reason == "need_state"
    # And a frame of another node never meets this node's state.
    c = StreamEncoder("lab", "edge-02")
    other = [Batch("lab", "edge-02", x.seq, x.labelsets, x.scrapes) for x in stream(2, churn=False)]
    c.encode(other[0])
    assert refusal(lambda: dec.decode(c.encode(other[1]))).reason == "need_state"


def test_encoder_refuses_other_nodes_and_invalid_batches() -> None:
    enc = StreamEncoder("lab", "edge-02")
    with pytest.raises(EncodeError):
        enc.encode(stream(1)[0])
    bad = make_batch(1, [(T0, [mg.labels("up"), mg.labels("up")], [0, 0], None)])
    bad.node = "edge-02"
    with pytest.raises(EncodeError):
        enc.encode(bad)
    assert enc.sid is None


def test_dictionary_is_compacted_by_a_key_frame() -> None:
    enc = StreamEncoder("lab", "edge-01", keyframe_every=10_000, limits=Limits(max_series=40))
    keys = 0
    for k in range(30):  # five new series every frame: the dictionary would pass max_series
        ls = [mg.labels("churn_total", pod=f"p{k}-{i}") for i in range(5)]
        data = enc.encode(make_batch(k + 1, [(T0 + 5000 * k, ls, [bits(float(i)) for i in range(5)], None)]))
        keys += codec.frame_base(data) is None
    assert keys >= 3


def test_special_values_bit_exact_across_frames() -> None:
    """Every special bit pattern after every other one (raw-bit deltas past 64 bits, NaN payloads,
    -0.0 after 0.0, stale markers between decimals) in one series."""
    pattern = [b for _, b in mg.SPECIAL_BITS] + [0, 2**64 - 1, 2**63, 2**63 - 1, 1, bits(0.25), bits(-0.0)]
    sequence = [a for a in pattern for _ in (0, 1)] + pattern[::-1]
    enc, dec = StreamEncoder("lab", "edge-01"), StreamDecoder()
    series = [mg.labels("special"), mg.labels("other")]
    for k, value in enumerate(sequence):
        batch = make_batch(k + 1, [(T0 + 5000 * k, series, [value, pattern[k % len(pattern)]], None)])
        assert samples(dec.decode(enc.encode(batch))) == samples(batch)


# --------------------------------------------------------------------------------------------------
# property: random streams with churn, special values, restarts


SPECIAL = [b for _, b in mg.SPECIAL_BITS]


@st.composite
def value_bits(draw: st.DrawFn, prev: int | None) -> int:
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.sampled_from(SPECIAL))
    if choice == 1:
        return draw(st.integers(0, 2**64 - 1))
    if choice <= 4 and prev is not None:  # a counter or a gauge moving a little
        return prev + draw(st.integers(-3, 3)) if 3 < prev < 2**63 - 3 else prev
    if choice <= 7:
        return bits(draw(st.integers(-(10**6), 10**6)) / 10 ** draw(st.integers(0, 4)))
    return bits(draw(st.floats(allow_nan=False)))


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[Batch], int]:
    universe = [mg.labels("m", pod=str(i)) for i in range(12)]
    n_frames = draw(st.integers(1, 10))
    last: dict[tuple[int, Labels], int] = {}
    t = T0
    batches = []
    for k in range(n_frames):
        blocks = []
        for j in range(draw(st.integers(0, 3))):
            members = draw(st.lists(st.sampled_from(universe), unique=True, max_size=6))
            t += draw(st.integers(0, 6000))
            vals = [draw(value_bits(last.get((j, lab)))) for lab in members]
            last.update({(j, lab): v for lab, v in zip(members, vals, strict=True)})
            stamps = None
            if members and draw(st.integers(0, 5)) == 0:
                stamps = [t - draw(st.integers(0, 2000)) for _ in members]
            blocks.append((t, members, vals, stamps))
        batches.append(make_batch(k + 1, blocks))
    return batches, draw(st.integers(1, 6))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_random_streams_round_trip_bit_exact(case: tuple[list[Batch], int]) -> None:
    batches, every = case
    enc, dec = StreamEncoder("lab", "edge-01", keyframe_every=every), StreamDecoder()
    fresh_ok = 0
    for batch in batches:
        data = enc.encode(batch)
        assert samples(dec.decode(data)) == samples(batch)
        # A replica that never saw the stream: the exact batch, or need_state; never anything else.
        try:
            got = StreamDecoder().decode(data)
        except DecodeError as err:
            assert err.reason == "need_state"
        else:
            fresh_ok += 1
            assert samples(got) == samples(batch)
    assert fresh_ok >= 1  # the first frame is a key frame


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.integers(0, 9))
def test_restart_mid_stream_recovers_from_the_state_message(case: tuple[list[Batch], int], cut: int) -> None:
    batches, every = case
    enc = StreamEncoder("lab", "edge-01", keyframe_every=every)
    dec = StreamDecoder()
    state: bytes | None = None
    for k, batch in enumerate(batches):
        if k == cut:  # the ingester restarts; the state topic keeps the encoder's state message
            dec = StreamDecoder()
            state = enc.state() if enc.sid else None
        data = enc.encode(batch)
        got = dec.decode(data, lambda c, n, s, held=state: held)
        assert samples(got) == samples(batch)


# --------------------------------------------------------------------------------------------------
# hostile input


def _frames() -> tuple[list[bytes], list[bytes | None]]:
    # The single-cycle layout (0x00/0x01) even for the window: see tests/wire/test_codec_v3_multicycle.py.
    enc = StreamEncoder("lab", "edge-01", multicycle=False)
    frames, states = [], []
    for b in [mg.batch_window(), *stream(3)]:
        b.node = "edge-01"
        states.append(enc.state() if enc.sid else None)
        frames.append(enc.encode(b))
    return frames, states


def _rebody(data: bytes, body: bytes, **fields: Any) -> bytes:
    header = msgpack.unpackb(data[4:], raw=False)
    header.update(body=body, **fields)
    return mg.raw_envelope(header, version=V3)


def _content(data: bytes) -> tuple[bytes, list[bytes]]:
    body = msgpack.unpackb(data[4:], raw=False)["body"]
    _base, compressed = v3mod.split_body(body)
    content = zstandard.ZstdDecompressor().decompress(compressed)
    r = columnar.Reader(content, "x")
    return body[: len(body) - len(compressed)], [r.take(r.uvarint()) for _ in v3mod.V3_SECTIONS]


def _with_sections(data: bytes, **changes: bytes) -> bytes:
    prefix, parts = _content(data)
    for name, value in changes.items():
        parts[v3mod.V3_SECTIONS.index(name)] = value
    content = v3mod.join_sections(tuple(parts))
    return _rebody(data, prefix + zstandard.ZstdCompressor(level=3).compress(content))


def decode_with(data: bytes, state: bytes | None, limits: Limits = DEFAULT_LIMITS) -> Batch:
    dec = StreamDecoder(limits)
    return dec.decode(data, lambda c, n, s: state)


def assert_cuts_and_flips_refused(frames: list[bytes], states: list[bytes | None]) -> None:
    """Every prefix of each frame is refused, and every byte flip decodes or is refused with a reason."""
    for data, state in zip(frames, states, strict=True):
        for cut in range(len(data)):
            refusal(lambda d=data[:cut], s=state: decode_with(d, s))
        for i in range(4, len(data)):
            flipped = bytearray(data)
            flipped[i] ^= 0x55
            try:
                decode_with(bytes(flipped), state)
            except DecodeError as err:
                assert err.reason in codec.REASONS and not err.message.startswith("unhandled"), err


def test_every_cut_and_byte_flip_is_refused_cleanly() -> None:
    frames, states = _frames()
    assert_cuts_and_flips_refused(frames[:2], states[:2])


def test_content_changes_are_refused_or_decode_to_a_whole_batch() -> None:
    frames, states = _frames()
    data, state = frames[2], states[2]
    _prefix, parts = _content(data)
    for s, part in enumerate(parts):
        for i in range(len(part)):
            for delta in (1, 0x80):
                changed = bytearray(part)
                changed[i] = (changed[i] + delta) & 0xFF
                frame = _with_sections(data, **{v3mod.V3_SECTIONS[s]: bytes(changed)})
                try:
                    batch = decode_with(frame, state)
                except DecodeError as err:
                    assert not err.message.startswith("unhandled"), err
                else:
                    assert sum(map(len, (b.values for b in batch.scrapes))) == batch.sample_count


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"ADDED": columnar.uvarints([5])}, "length_mismatch"),  # five new series, no label sections
        ({"ADDED": columnar.uvarints([10**9])}, "too_many_series"),
        ({"BLOCKS": columnar.uvarints([10**9])}, "too_many_scrapes"),
        ({"BLOCKS": columnar.uvarints([1, 0x10, 0])}, "malformed"),  # unknown block flag
        ({"BLOCKS": columnar.uvarints([1, 1, 0, 0, 1, 999])}, "bad_index"),  # id past the dictionary
        ({"BLOCKS": columnar.uvarints([1, 1, 0, 0, 10**6])}, "bad_index"),  # more members than bytes
        ({"BLOCKS": columnar.uvarints([1, 1, 0, 0, 2, 0, 0])}, "duplicate_sample"),
        ({"BLOCKS": columnar.uvarints([1, 0, 2**64 - 1])}, "bad_timestamp"),
        ({"EXC": columnar.uvarints([10**9])}, "length_mismatch"),
        ({"EXC": bytes(columnar.uvarints([1, 0])) + b"\x30" + bytes(columnar.uvarints([0]))}, "malformed"),
        ({"DELTAS": b""}, "length_mismatch"),
    ],
)
def test_wrong_counts_are_refused(changes: dict[str, bytes], reason: str) -> None:
    frames, _states = _frames()
    assert refusal(lambda: decode_with(_with_sections(frames[0], **changes), None)).reason == reason


def test_limits_hold_for_v3() -> None:
    frames, states = _frames()
    key = frames[0]
    batch = codec.decode_batch(key)
    n = batch.sample_count
    small = {
        "oversized": Limits(max_payload_bytes=len(key) - 1),
        "too_many_series": Limits(max_series=len(batch.labelsets) - 1),
        "too_many_samples": Limits(max_samples=n - 1),
        "too_many_scrapes": Limits(max_scrapes=len(batch.scrapes) - 1),
        "too_many_label_pairs": Limits(max_label_pairs=10),
        "decompression_limit": Limits(max_decompressed_bytes=64),
    }
    for reason, limits in small.items():
        got = refusal(lambda lim=limits: codec.decode_batch(key, lim)).reason
        assert got in (reason, "header_mismatch" if reason == "too_many_samples" else reason)
    bomb = _rebody(key, b"\x00" + mg.rle_zstd_frame(64 << 20))
    assert refusal(lambda: codec.decode_batch(bomb)).reason == "decompression_limit"
    body = msgpack.unpackb(frames[1][4:], raw=False)["body"]
    for fields in ({"n": 1}, {"t0": T0 - 1}, {"t1": 2**62}):
        wrong = _rebody(frames[1], body, **fields)
        assert refusal(lambda w=wrong: decode_with(w, states[1])).reason == "header_mismatch"
    assert decode_with(frames[1], states[1]).sample_count == codec.peek_header(frames[1]).sample_count


def test_label_rules_hold_for_added_series() -> None:
    key = codec.encode_batch(make_batch(1, [(T0, [mg.labels("up", job="x")], [0], None)]), version=V3)
    _prefix, parts = _content(key)
    bad_labels = {"LSTR": parts[3].replace(b"job", b"j-b")}
    assert (
        refusal(lambda: codec.decode_batch(_with_sections(key, **bad_labels))).reason == "invalid_label_name"
    )
    assert codec.decode_batch(key).labelsets == [mg.labels("up", job="x")]


def test_hostile_state_messages() -> None:
    enc = StreamEncoder("lab", "edge-01")
    for b in stream(3):
        enc.encode(b)
    message = enc.state()
    for cut in range(len(message)):
        refusal(lambda m=message[:cut]: StreamDecoder().load_state(m))
    for i in range(len(message)):
        flipped = bytearray(message)
        flipped[i] ^= 0x21
        try:
            StreamDecoder().load_state(bytes(flipped))
        except DecodeError as err:
            assert not err.message.startswith("unhandled"), err
    fields = msgpack.unpackb(message[4:], raw=False)
    huge = {**fields, "body": mg.rle_zstd_frame(64 << 20)}
    bomb = b"ERS\x01" + msgpack.packb(huge, use_bin_type=True)
    assert refusal(lambda: StreamDecoder().load_state(bomb)).reason == "decompression_limit"
    assert refusal(lambda: StreamDecoder().load_state(b"ERS\x02" + message[4:])).reason == "unknown_version"
    assert refusal(lambda: StreamDecoder().load_state(b"ERB" + message[3:])).reason == "bad_magic"
    assert (
        refusal(lambda: StreamDecoder(Limits(max_series=2)).load_state(message)).reason == "too_many_series"
    )


# --------------------------------------------------------------------------------------------------
# golden vectors (schemas/golden/v3/)


def _v3_golden(prefix: str) -> list[Path]:
    found = sorted(V3_GOLDEN.glob(f"{prefix}*.bin"))
    assert found, f"no golden vectors {prefix}*.bin in {V3_GOLDEN}"
    return found


def _json(path: Path) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return out


def _view(header: codec.Header, batch: Batch) -> dict[str, Any]:
    return json.loads(json.dumps(codec.batch_to_json(header, batch)))  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", _v3_golden("v3_batch_"), ids=lambda p: p.stem)
def test_golden_v3_key_frames(path: Path) -> None:
    expected = _json(path)
    header, batch = codec.decode_batch_with_header(path.read_bytes())
    got = _view(header, batch)
    assert {k: got[k] for k in ("header", "labelsets", "scrapes")} == {
        k: expected[k] for k in ("header", "labelsets", "scrapes")
    }
    # Encoding the batch again gives the same frame content (compressed bytes only with the same zstd).
    make, _description = mg.V2_BATCHES[path.stem.removeprefix("v3_")]
    again = codec.encode_batch(make(), version=V3)
    assert _content(again)[1] == _content(path.read_bytes())[1]


def test_golden_v3_stream_and_state() -> None:
    paths = _v3_golden("v3_stream_")
    dec = StreamDecoder()
    for path in paths:
        expected = _json(path)
        header, batch, sid = dec.decode_with_header(path.read_bytes())
        assert sid is not None and sid.hex() == expected["sid"]
        base = codec.frame_base(path.read_bytes())
        assert (None if base is None else base.hex()) == expected["base"]
        got = _view(header, batch)
        assert {k: got[k] for k in ("header", "labelsets", "scrapes")} == {
            k: expected[k] for k in ("header", "labelsets", "scrapes")
        }
    state = (V3_GOLDEN / "v3_state_after_2.bin").read_bytes()
    assert StreamDecoder().load_state(state).hex() == _json(V3_GOLDEN / "v3_state_after_2.bin")["sid"]
    last = paths[-1].read_bytes()
    header, batch, _ = StreamDecoder().decode_with_header(last, lambda c, n, s: state)
    assert _view(header, batch)["scrapes"] == _json(paths[-1])["scrapes"]
    # The stream re-encodes to the same frame contents, so the same state ids.
    enc = StreamEncoder("lab", "edge-01", keyframe_every=100)
    for path, batch in zip(paths, g3.v3_stream(), strict=True):
        assert _content(enc.encode(batch))[1] == _content(path.read_bytes())[1]


@pytest.mark.parametrize("path", _v3_golden("v3_invalid_"), ids=lambda p: p.stem)
def test_golden_v3_invalid(path: Path) -> None:
    assert refusal(lambda: codec.decode_batch(path.read_bytes())).reason == _json(path)["error"]


def test_need_state_is_a_reason() -> None:
    assert "need_state" in codec.REASONS
    assert STALE_NAN_BITS in SPECIAL
