"""Wire format v2 ("columnar+zstd"): round trips, v1 equivalence, golden vectors, every refusal,
hostile input, and the size gain on a realistic window.  Speed lives in bench/codec_bench.py."""

from __future__ import annotations

import random
from array import array
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_codec import (  # shared helpers
    GOLDEN,
    T0,
    bad_batch,
    decode_error,
    golden_json,
    golden_paths,
    measure_refusal,
)

from edge_relay.collect.parse import SeriesCache, parse
from edge_relay.collect.shape import TargetShaper
from edge_relay.encode.batches import to_batch
from schemas import codec, columnar
from schemas.codec import DEFAULT_LIMITS, DecodeError, EncodeError, Limits
from schemas.codec.envelope import open_envelope
from schemas.codec.v2 import split_streams
from schemas.golden import vectors as mg
from schemas.model import STALE_NAN, STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits
from schemas.values import ValueDecoder, ValueEncoder, decimal_scale
from simulator import EXPORTERS, Simulator

V1, V2 = codec.FORMAT_V1, codec.FORMAT_V2
STREAM = {name: i for i, name in enumerate(codec.V2_STREAMS)}


# --------------------------------------------------------------------------------------------------
# helpers

Sample = tuple[Labels, int, int]


def samples(batch: Batch) -> Counter[Sample]:
    """What consumers compare: (labels, timestamp, value bits), counted."""
    out: Counter[Sample] = Counter()
    for block in batch.scrapes:
        for i, (idx, value) in enumerate(zip(block.series, block.values, strict=True)):
            out[(batch.labelsets[idx], block.sample_timestamp(i), float_bits(value))] += 1
    return out


def encode2(batch: Batch, level: int = 3, **kwargs: Any) -> bytes:
    return codec.encode_batch(batch, level, version=V2, **kwargs)


def decodes_or_refuses(data: bytes) -> None:
    """Hostile input: a clean DecodeError, or a batch that holds together."""
    try:
        batch = codec.decode_batch(data)
    except DecodeError as err:
        assert err.reason in codec.REASONS
        assert not err.message.startswith("unhandled"), err
    else:
        check_shape(batch)


def check_shape(batch: Batch) -> None:
    """A decoded v2 batch: one block per distinct timestamp, ascending; series ascending within one."""
    times = [b.timestamp_ms for b in batch.scrapes]
    assert times == sorted(set(times))
    for block in batch.scrapes:
        assert block.timestamps is None
        assert list(block.series) == sorted(set(block.series))
        assert len(block.series) == len(block.values)
        assert all(s < len(batch.labelsets) for s in block.series)
    assert len(set(batch.labelsets)) == len(batch.labelsets)


def raw_streams(data: bytes) -> list[bytes]:
    _header, body, _decode_body = open_envelope(data, DEFAULT_LIMITS)
    return split_streams(body, DEFAULT_LIMITS)


def envelope(streams: list[bytes], batch: Batch | None = None, **fields: Any) -> bytes:
    """A v2 envelope around raw streams; n / t0 / t1 from ``batch`` unless given."""
    if batch is not None:
        auto = {"n": batch.sample_count, "t0": batch.first_timestamp_ms, "t1": batch.last_timestamp_ms}
        fields = {**auto, **fields}
    return mg.v2_envelope(streams, **fields)


def strings_of(streams: list[bytes]) -> list[str]:
    lengths = columnar.Reader(streams[STREAM["LSTRLEN"]], "x")
    data = streams[STREAM["LSTR"]]
    out, pos = [], 0
    while lengths.remaining():
        size = lengths.uvarint()
        out.append(data[pos : pos + size].decode())
        pos += size
    return out


def with_strings(streams: list[bytes], strings: list[str]) -> list[bytes]:
    raw = [s.encode() for s in strings]
    return mg.with_streams(streams, LSTRLEN=bytes(columnar.uvarints(map(len, raw))), LSTR=b"".join(raw))


uv = mg.uv


# --------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("name", sorted(mg.V2_BATCHES))
def test_round_trip_examples(name: str) -> None:
    batch = mg.V2_BATCHES[name][0]()
    data = encode2(batch)
    assert data[:4] == b"ERB\x02"
    header, decoded = codec.decode_batch_with_header(data)
    assert samples(decoded) == samples(batch)
    check_shape(decoded)
    assert set(decoded.labelsets) == set(batch.labelsets)  # label sets without samples included
    assert header == codec.Header(
        2,
        batch.cluster,
        batch.node,
        batch.seq,
        batch.first_timestamp_ms,
        batch.last_timestamp_ms,
        batch.sample_count,
        "columnar+zstd",
    )
    assert codec.peek_header(data) == header
    # Canonical: the decoded batch encodes to the same bytes, and v1 carries the same samples.
    assert encode2(decoded) == data
    assert samples(codec.decode_batch(codec.encode_batch(batch, version=V1))) == samples(decoded)


def test_version_selection() -> None:
    batch = mg.batch_small()
    assert (codec.FORMAT_V2, codec.CODEC_V2) == (2, "columnar+zstd")
    assert codec.CURRENT_FORMAT_VERSION == codec.FORMAT_V2
    assert codec.encode_batch(batch)[:4] == b"ERB\x02"  # v2 is the default
    assert codec.encode_batch(batch, version=codec.FORMAT_V2) == codec.encode_batch(batch)
    for bad in (0, 4, "2"):
        with pytest.raises(EncodeError) as info:
            codec.encode_batch(batch, version=bad)  # type: ignore[arg-type]
        assert info.value.reason == "unknown_version"


def test_block_layout_and_independence_from_input_order() -> None:
    batch = mg.batch_window()
    decoded = codec.decode_batch(encode2(batch))
    assert [b.timestamp_ms for b in decoded.scrapes] == sorted(
        {t for _, t, _ in samples(batch)}  # every sample timestamp, once
    )
    # Shuffling series and blocks of the input changes nothing on the wire.
    rnd = random.Random(5)
    perm = list(range(len(batch.labelsets)))
    rnd.shuffle(perm)
    where = {old: new for new, old in enumerate(perm)}
    blocks = [
        ScrapeBlock(b.timestamp_ms, array("I", [where[s] for s in b.series]), b.values, b.timestamps)
        for b in batch.scrapes
    ]
    rnd.shuffle(blocks)
    shuffled = Batch(batch.cluster, batch.node, batch.seq, [batch.labelsets[i] for i in perm], blocks)
    assert encode2(shuffled) == encode2(batch)


def test_every_value_bit_pattern_survives() -> None:
    bits = [b for _, b in mg.SPECIAL_BITS] + [0x7FF0000000000001, 0xFFF0000000000002, 1 << 63 | 1]
    rnd = random.Random(3)
    n = len(bits)
    labelsets = [mg.labels("m", i=f"{i:02d}") for i in range(n)]
    blocks = []
    for k in range(6):
        order = list(range(n))
        rnd.shuffle(order)
        blocks.append(
            ScrapeBlock(T0 + 1000 * k, array("I", order), mg.values_from_bits([bits[i] for i in order]))
        )
    batch = Batch("c", "n", 1, labelsets, blocks)
    assert samples(codec.decode_batch(encode2(batch))) == samples(batch)


@pytest.mark.parametrize(
    "values",
    [
        [-0.0, 0.0, 2.68156158598852e154],  # found by hypothesis: order-2 first delta of 2**63
        [-0.0, 1.0, 2.0, 3.0],
        [-1e300, 0.0, 1e300],
    ],
)
def test_deltas_that_leave_int64_still_round_trip(values: list[float]) -> None:
    # Between the raw bits of a negative float (int64 near -2**63) and a positive one, the first
    # difference does not fit 64 bits: the encoder must not pick an order that writes it.
    blocks = [ScrapeBlock(T0 + i, array("I", [0]), array("d", [v])) for i, v in enumerate(values)]
    batch = Batch("c", "n", 1, [mg.labels("m")], blocks)
    assert samples(codec.decode_batch(encode2(batch))) == samples(batch)


def test_stale_markers_keep_a_series_decimal() -> None:
    stale = mg.f64(STALE_NAN_BITS)
    values = [[1.5, 2.25, stale, 3.0], [stale, 0.125, 0.25, stale], [stale, stale, stale, stale]]
    batch = Batch(
        "c",
        "n",
        1,
        [mg.labels("m", i=str(i)) for i in range(3)],
        [ScrapeBlock(T0 + k, array("I", [0, 1, 2]), array("d", [v[k] for v in values])) for k in range(4)],
    )
    data = encode2(batch)
    kinds = raw_streams(data)[STREAM["VKIND"]]
    assert all(kind & columnar.KIND_STALE for kind in kinds[0::2]), kinds.hex()
    assert not raw_streams(data)[STREAM["VXOR"]]
    assert samples(codec.decode_batch(data)) == samples(batch)


def test_encoder_accepts_plain_sequences() -> None:
    batch = Batch("c", "n", 1, [mg.labels("up")], [ScrapeBlock(T0, [0], [2.5], [T0 - 1])])  # type: ignore[arg-type]
    decoded = codec.decode_batch(encode2(batch))
    assert list(decoded.scrapes[0].values) == [2.5]
    assert decoded.scrapes[0].timestamp_ms == T0 - 1


def test_levels_decode_and_output_is_deterministic() -> None:
    batch = mg.batch_window()
    assert encode2(batch) == encode2(batch)
    for level in (1, 3, 9, 19):
        assert samples(codec.decode_batch(encode2(batch, level))) == samples(batch)


# --------------------------------------------------------------------------------------------------
# duplicates: v2 has one value per (series, timestamp)


def test_equal_duplicates_merge_and_conflicts_are_refused() -> None:
    ls = [mg.labels("m")]
    same = Batch(
        "c",
        "n",
        1,
        ls,
        [
            ScrapeBlock(T0, array("I", [0]), array("d", [1.0])),
            ScrapeBlock(T0, array("I", [0]), array("d", [1.0])),
            # An exporter repeating an explicit timestamp across scrapes: the same sample again.
            ScrapeBlock(T0 + 5000, array("I", [0]), array("d", [1.0]), array("q", [T0])),
        ],
    )
    header, decoded = codec.decode_batch_with_header(encode2(same))
    assert header.sample_count == 1
    assert set(samples(decoded)) == set(samples(same))
    assert set(samples(codec.decode_batch(codec.encode_batch(same, version=V1)))) == set(samples(decoded))
    stale_twice = Batch(
        "c",
        "n",
        1,
        ls,
        [ScrapeBlock(T0, array("I", [0]), mg.values_from_bits([STALE_NAN_BITS])) for _ in range(2)],
    )
    assert codec.decode_batch(encode2(stale_twice)).sample_count == 1
    for other in (2.0, float("nan")):
        clash = Batch(
            "c",
            "n",
            1,
            ls,
            [
                ScrapeBlock(T0, array("I", [0]), array("d", [1.0])),
                ScrapeBlock(T0 + 9, array("I", [0]), array("d", [other]), array("q", [T0])),
            ],
        )
        with pytest.raises(EncodeError) as info:
            encode2(clash)
        assert info.value.reason == "duplicate_sample"
    zeros = Batch(
        "c",
        "n",
        1,
        ls,
        [ScrapeBlock(T0, array("I", [0]), array("d", [v])) for v in (0.0, -0.0)],
    )
    with pytest.raises(EncodeError) as info:
        encode2(zeros)  # equal as floats, different bits
    assert info.value.reason == "duplicate_sample"


# --------------------------------------------------------------------------------------------------
# property tests

label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,8}", fullmatch=True).filter(lambda s: s != "__name__")
metric_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
labelset_st = st.builds(
    lambda metric, extra: tuple(sorted({"__name__": metric, **extra}.items())),
    metric_names,
    st.dictionaries(label_names, st.text(min_size=1, max_size=10), max_size=4),
)
special_bits = st.sampled_from([b for _, b in mg.SPECIAL_BITS])


@st.composite
def series_bits(draw: st.DrawFn, count: int) -> list[int]:
    """The bit patterns of ``count`` consecutive samples of one series, in one of several styles."""
    style = draw(st.sampled_from(["decimal", "counter", "float", "bits", "const"]))
    if style in ("decimal", "counter"):
        k = draw(st.sampled_from([0, 0, 1, 2, 3, 6, 9, 15, 22]))
        m = draw(st.integers(-(10**12), 10**12))
        values = []
        for _ in range(count):
            values.append(m / 10**k)
            step = draw(st.integers(0, 10**6) if style == "counter" else st.integers(-(10**4), 10**4))
            m += step
        bits = [float_bits(v) for v in values]
    elif style == "float":
        bits = [float_bits(v) for v in draw(st.lists(st.floats(), min_size=count, max_size=count))]
    elif style == "bits":
        bits = draw(st.lists(st.integers(0, 2**64 - 1) | special_bits, min_size=count, max_size=count))
    else:
        bits = [draw(special_bits | st.integers(0, 2**64 - 1))] * count
    if count and draw(st.booleans()):
        # Stale markers where a series vanished: at the end, or anywhere.
        for at in draw(st.sets(st.integers(0, count - 1), max_size=3)) | {count - 1}:
            bits[at] = STALE_NAN_BITS
    return bits


@st.composite
def windows(draw: st.DrawFn) -> Batch:
    """Several scrapes of a few targets, like the relay's window: series come, go and come back."""
    labelsets = draw(st.lists(labelset_st, max_size=10, unique=True))
    n_targets = draw(st.integers(1, 3))
    ticks = draw(st.integers(1, 8))
    target = [draw(st.integers(0, n_targets - 1)) for _ in labelsets]
    present = []
    for _ in labelsets:
        if draw(st.booleans()):
            lo = draw(st.integers(0, ticks))
            present.append(list(range(lo, draw(st.integers(lo, ticks)))))
        else:
            present.append(sorted(draw(st.sets(st.integers(0, ticks - 1)))))
    values = {s: iter(draw(series_bits(len(p)))) for s, p in enumerate(present)}
    blocks = []
    for tick in range(ticks):
        for tg in range(n_targets):
            ts = T0 + 10_000 * tick + 1000 * tg + draw(st.integers(0, 99))
            series = [s for s in range(len(labelsets)) if target[s] == tg and tick in present[s]]
            if draw(st.booleans()):
                series = draw(st.permutations(series))
            bits = [next(values[s]) for s in series]
            explicit = None
            if series and draw(st.integers(0, 4)) == 0:
                # Explicit timestamps stay within the target's tick: never two per series and time.
                explicit = array("q", [ts - draw(st.integers(0, 99)) for _ in series])
            blocks.append(ScrapeBlock(ts, array("I", series), mg.values_from_bits(bits), explicit))
    if draw(st.booleans()):
        blocks.append(ScrapeBlock(draw(st.integers(0, 2**63 - 1)), array("I"), array("d")))
    blocks = draw(st.permutations(blocks))
    return Batch("lab", "edge-01", draw(st.integers(1, 2**63 - 1)), labelsets, blocks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(windows(), st.sampled_from([1, 3, 5]))
def test_property_window_round_trip(batch: Batch, level: int) -> None:
    data = encode2(batch, level)
    header, decoded = codec.decode_batch_with_header(data)
    check_shape(decoded)
    assert samples(decoded) == samples(batch)
    assert (header.first_ts_ms, header.last_ts_ms) == (batch.first_timestamp_ms, batch.last_timestamp_ms)
    assert header.sample_count == batch.sample_count
    assert encode2(decoded, level) == data
    assert samples(codec.decode_batch(codec.encode_batch(batch, level, version=V1))) == samples(decoded)


@st.composite
def arbitrary_batches(draw: st.DrawFn) -> Batch:
    """Any valid v1 batch: arbitrary timestamps, so (series, timestamp) may repeat across blocks."""
    labelsets = draw(st.lists(labelset_st, max_size=8, unique=True))
    blocks = []
    stamps = st.integers(0, 2**63 - 1) | st.integers(T0, T0 + 3)
    for _ in range(draw(st.integers(0, 5))):
        order = draw(st.permutations(range(len(labelsets))))
        series = order[: draw(st.integers(0, len(order)))]
        bits = draw(
            st.lists(st.integers(0, 2**64 - 1) | special_bits, min_size=len(series), max_size=len(series))
        )
        explicit = None
        if draw(st.booleans()):
            explicit = array("q", draw(st.lists(stamps, min_size=len(series), max_size=len(series))))
        blocks.append(ScrapeBlock(draw(stamps), array("I", series), mg.values_from_bits(bits), explicit))
    return Batch("lab", "n", 1, labelsets, blocks)


@settings(max_examples=300, deadline=None)
@given(arbitrary_batches())
def test_property_arbitrary_batches_match_v1(batch: Batch) -> None:
    values: dict[tuple[Labels, int], set[int]] = {}
    for labels, ts, bits in samples(batch):
        values.setdefault((labels, ts), set()).add(bits)
    if any(len(v) > 1 for v in values.values()):
        with pytest.raises(EncodeError) as info:
            encode2(batch)
        assert info.value.reason == "duplicate_sample"
        return
    header, decoded = codec.decode_batch_with_header(encode2(batch))
    check_shape(decoded)
    assert set(samples(decoded)) == set(samples(codec.decode_batch(codec.encode_batch(batch, version=V1))))
    assert max(samples(decoded).values(), default=1) == 1
    assert header.sample_count == len(values)
    assert (header.first_ts_ms, header.last_ts_ms) == (batch.first_timestamp_ms, batch.last_timestamp_ms)


@settings(max_examples=500, deadline=None)
@given(
    st.lists(st.integers(0, 2**64 - 1) | special_bits | st.floats().map(float_bits), min_size=1, max_size=40)
)
def test_property_value_columns(bits: list[int]) -> None:
    # The value codec alone, many series through one encoder so the exponent hint carries over.
    enc = ValueEncoder()
    series = [bits, bits[::-1], [b & ~0xFFFF for b in bits], [float_bits(float(i)) for i in range(len(bits))]]
    for one in series:
        enc.add(list(mg.values_from_bits(one)))
    dec = ValueDecoder(enc.streams())
    for one in series:
        out = array("d")
        dec.series(len(one), out)
        assert columnar.f64_bits(out).tolist() == one
    dec.done()


def test_decimal_scale() -> None:
    assert decimal_scale([0.1, 0.2, 0.3], 0) == (1, [1, 2, 3])
    assert decimal_scale([1e15, 2e15], 5) == (0, [10**15, 2 * 10**15])
    assert decimal_scale([1.5, 2.0], 9) == (1, [15, 20])  # factors of ten stripped
    assert decimal_scale([123456.789], 0) == (3, [123456789])
    assert decimal_scale([1e-22], 0) == (22, [1])
    assert decimal_scale([1e10 + 0.5], 9) == (1, [100000000005])  # hint too large for 2**53
    for hopeless in ([-0.0], [float("nan")], [float("inf")], [0.1 + 0.2], [2.0**63], [1e22], [1e-23]):
        assert decimal_scale(hopeless, 3) is None, hopeless


def test_small_pieces() -> None:
    for width in (1, 2, 4, 8):
        values = [0, 1, -1, 2 ** (8 * width - 1) - 1, -(2 ** (8 * width - 1))]
        packed = columnar.pack_ints(values, width)
        assert columnar.unpack_ints(packed, width).tolist() == values
    assert columnar.shuffle(b"abcdef", 2) == b"acebdf"
    assert columnar.unshuffle(b"acebdf", 2) == b"abcdef"
    assert [
        columnar.width_for(lo, hi) for lo, hi in [(0, 0), (-128, 127), (-129, 0), (0, 2**31), (0, 2**63)]
    ] == [
        0,
        1,
        2,
        8,
        16,
    ]
    assert columnar.runs_of([0, 1, 2, 5, 6, 9]) == [(0, 3), (2, 2), (2, 1)]
    assert columnar.runs_of([]) == []
    for value in (0, 1, 127, 128, 2**63, 2**64 - 1):
        reader = columnar.Reader(bytes(columnar.uvarints([value])), "x")
        assert reader.uvarint() == value
        reader.done()
    for bad, reason in (
        (b"\x80", "length_mismatch"),
        (b"\xff" * 11, "malformed"),
        (b"\xff" * 9 + b"\x02", "malformed"),
    ):
        with pytest.raises(columnar.ColumnError) as info:
            columnar.Reader(bad, "x").uvarint()
        assert info.value.reason == reason
    with pytest.raises(columnar.ColumnError) as info:
        columnar.Reader(b"\x00" * 10, "x").uvarints(11)
    assert info.value.reason == "length_mismatch"


# --------------------------------------------------------------------------------------------------
# golden vectors


def test_golden_v2_covers_the_v1_batches() -> None:
    assert {p.stem for p in golden_paths("v2_batch_")} >= {f"v2_{p.stem}" for p in golden_paths("batch_")}


@pytest.mark.parametrize("path", golden_paths("v2_batch_"), ids=lambda p: p.stem)
def test_golden_v2_batch(path: Path) -> None:
    data = path.read_bytes()
    expected = golden_json(path)
    assert expected["kind"] == "batch" and expected["header"]["version"] == 2
    header, batch = codec.decode_batch_with_header(data)
    assert codec.batch_to_json(header, batch) == {
        k: v for k, v in expected.items() if k not in ("kind", "description", "encoder")
    }
    # The transforms are deterministic: the decompressed streams must match whatever zstd does.
    again = encode2(batch, expected["encoder"]["zstd_level"])
    assert raw_streams(again) == raw_streams(data)
    running = ".".join(map(str, zstandard.ZSTD_VERSION))
    if running == expected["encoder"]["zstd"]:
        assert again == data
    # The same samples as the v1 vector of the same batch.
    v1 = GOLDEN / path.name.removeprefix("v2_")
    if v1.exists():
        assert samples(codec.decode_batch(v1.read_bytes())) == samples(batch)


@pytest.mark.parametrize("path", golden_paths("v2_invalid_"), ids=lambda p: p.stem)
def test_golden_v2_invalid(path: Path) -> None:
    assert decode_error(path.read_bytes()).reason == golden_json(path)["error"]


# --------------------------------------------------------------------------------------------------
# every refusal reason, in a v2 envelope

_SMALL = mg.batch_small()
_SMALL_DATA = encode2(_SMALL)
_S = raw_streams(_SMALL_DATA)
_PAIR = Batch(
    "lab",
    "edge-01",
    1,
    [mg.labels("m", a="1"), mg.labels("m", a="2")],
    [ScrapeBlock(T0, array("I", [0, 1]), array("d", [1.0, 2.0]))],
)
_P = raw_streams(encode2(_PAIR))


def _env(
    changes: dict[str, bytes] | None = None, base: list[bytes] = _S, batch: Batch = _SMALL, **fields: Any
) -> bytes:
    return envelope(mg.with_streams(base, **(changes or {})), batch, **fields)


def _renamed(old: str, new: str) -> bytes:
    return envelope(with_strings(_S, [new if s == old else s for s in strings_of(_S)]), _SMALL)


def _bomb(size: int = 33 << 20) -> bytes:
    frame = mg.rle_zstd_frame(size)
    return mg.raw_envelope(
        mg.header_for(uv(len(frame)) + frame + uv(0) * (len(codec.V2_STREAMS) - 1), codec=codec.CODEC_V2),
        version=V2,
    )


REASON_CASES: dict[str, list[tuple[bytes, Limits]]] = {}


def _case(reason: str, data: bytes, limits: Limits = DEFAULT_LIMITS) -> None:
    REASON_CASES.setdefault(reason, []).append((data, limits))


_case("truncated", _SMALL_DATA[:3])
_case("truncated", _SMALL_DATA[:30])
_case("bad_magic", b"XRB" + _SMALL_DATA[3:])
_case("unknown_version", b"ERB\x04" + _SMALL_DATA[4:])
_case("oversized", _SMALL_DATA, Limits(max_payload_bytes=len(_SMALL_DATA) - 1))
_case("limit_exceeded", mg.raw_envelope(mg.header_for(b"", codec=codec.CODEC_V2, pad="x" * 2000), version=V2))
_case("malformed", _SMALL_DATA + b"\x00")
_case("malformed", _env(seq="1"))
_case(
    "malformed", mg.raw_envelope(mg.header_for(uv(0) * 3, codec=codec.CODEC_V2), version=V2)
)  # 3 streams of 15
_case("malformed", _env({"VKIND": b"\x81" + _S[STREAM["VKIND"]][1:]}))
_case("malformed", _env({"VKIND": b"\x17\x00" + _S[STREAM["VKIND"]][2:]}))  # exponent 23
_case("malformed", _env({"VKIND": b"\x00\x03" + _S[STREAM["VKIND"]][2:]}))  # width 3
_case("malformed", _env({"LSTR": _S[STREAM["LSTR"]].replace(b"package", b"packag\xff")}))
_case("malformed", _env({"GROUPS": uv(1, 3, 1, 0, 0)}))  # a run of no timestamps
_case("bad_header", _env(seq=0))
_case("bad_header", _env(node="a/b"))
_case("unknown_codec", _env(codec=codec.CODEC_V1))
_case("unknown_codec", _env(codec="columnar+lz4"))
_case(
    "bad_compression",
    mg.raw_envelope(mg.header_for(uv(4) + b"zstd" + uv(0) * 14, codec=codec.CODEC_V2), version=V2),
)
_case("bad_compression", (GOLDEN / "v2_invalid_bad_compression.bin").read_bytes())
_case("decompression_limit", _bomb())
_case("decompression_limit", _SMALL_DATA, Limits(max_decompressed_bytes=50))
_case("header_mismatch", _env(n=7))
_case("header_mismatch", _env(t0=T0 - 1))
_case("header_mismatch", _env(t1=T0 + 5001))
_case("too_many_series", _SMALL_DATA, Limits(max_series=2))
_case("too_many_series", _env({"GROUPS": uv(10**9)}))
_case("too_many_samples", _SMALL_DATA, Limits(max_samples=5))
_case("too_many_samples", _env({"GROUPS": uv(1, 3, 1, 0, 2)}, n=0), Limits(max_samples=5))
_case("too_many_scrapes", _SMALL_DATA, Limits(max_scrapes=1))
_case("too_many_labels", _SMALL_DATA, Limits(max_labels_per_series=2))
_case("too_many_label_pairs", _SMALL_DATA, Limits(max_label_pairs=7))
_case("too_many_label_pairs", _env({"LMETA": uv(10**9)}))
_case("label_too_long", _SMALL_DATA, Limits(max_label_value_bytes=10))
_case("label_too_long", _SMALL_DATA, Limits(max_label_name_bytes=3))
_case("invalid_label_name", _renamed("zone", "zo-e"))
_case("invalid_metric_name", _renamed("up", "u-"))
_case("missing_metric_name", _renamed("__name__", "__nbme__"))
_case("empty_label_value", _renamed("idle", ""))
_case("unsorted_labels", _env({"LMETA": _S[STREAM["LMETA"]].replace(uv(3, 0, 1, 4), uv(3, 1, 0, 4))}))
_case("duplicate_label_name", _env({"LMETA": _S[STREAM["LMETA"]].replace(uv(3, 0, 1, 4), uv(3, 0, 1, 1))}))
_case("duplicate_series", _env({"LIDS": b"\x00\x00\x00\x00"}, base=_P, batch=_PAIR))
_case("bad_index", _env({"LSCHEMA": b"\x00\x01\x09"}))
_case("bad_index", _env({"LIDS": b"\x00\x00\x00\x07"}, base=_P, batch=_PAIR))
_case("bad_index", _env({"LMETA": _S[STREAM["LMETA"]].replace(uv(3, 0, 1, 4), uv(3, 0, 1, 99))}))
_case("bad_index", _env({"GROUPS": uv(1, 3, 1, 1, 2)}))  # indices 1..2 of a table of two
_case("bad_index", _env({"VSTALE": uv(1, 5), "VKIND": b"\x40\x00" + _S[STREAM["VKIND"]][2:]}))
_case("length_mismatch", _env({"VFIRST": _S[STREAM["VFIRST"]][:-1]}))
_case("length_mismatch", _env({"VFIRST": _S[STREAM["VFIRST"]] + b"\x00"}))
_case("length_mismatch", _env({"LSCHEMA": b"\x00\x01"}))
_case("length_mismatch", _env({"LSTR": _S[STREAM["LSTR"]] + b"x"}))
_case("length_mismatch", _env({"VDELTA2": b"\x00"}))
_case("length_mismatch", _env({"TIMES": _S[STREAM["TIMES"]] + b"\x00"}))
_case("bad_timestamp", _env({"TIMES": uv(2, T0, 0)}, t1=T0))
_case("bad_timestamp", _env({"TIMES": uv(2, 2**63 - 2, 5)}, t0=2**63 - 2, t1=2**63 - 1))


def test_every_reason_has_a_v2_case() -> None:
    # duplicate_sample cannot be written in v2 (a series has one value per timestamp by construction):
    # only the encoder raises it, see test_equal_duplicates_merge_and_conflicts_are_refused.
    # need_state is v3's (a delta frame without its state): tests/wire/test_codec_v3.py.
    assert set(REASON_CASES) == codec.REASONS - {"duplicate_sample", "need_state"}


@pytest.mark.parametrize(
    ("reason", "data", "limits"),
    [(r, d, lim) for r, cases in REASON_CASES.items() for d, lim in cases],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_reason_reachable(reason: str, data: bytes, limits: Limits) -> None:
    assert decode_error(data, limits).reason == reason


def test_peek_header_does_not_decompress() -> None:
    header = codec.peek_header(_bomb(4 << 30))
    assert (header.version, header.codec) == (2, "columnar+zstd")


# --------------------------------------------------------------------------------------------------
# hostile input


@pytest.mark.parametrize("path", golden_paths("v2_batch_"), ids=lambda p: p.stem)
def test_truncated_at_every_offset(path: Path) -> None:
    data = path.read_bytes()
    for cut in range(len(data)):
        decode_error(data[:cut])


@pytest.mark.parametrize("path", golden_paths("v2_batch_"), ids=lambda p: p.stem)
def test_every_single_byte_corruption(path: Path) -> None:
    data = path.read_bytes()
    rnd = random.Random(path.stem)
    for pos in range(len(data)):
        mutated = bytearray(data)
        mutated[pos] ^= rnd.randrange(1, 256)
        decodes_or_refuses(bytes(mutated))


def test_every_bit_flip_of_a_small_payload() -> None:
    data = (GOLDEN / "v2_batch_small.bin").read_bytes()
    for pos in range(len(data)):
        for bit in range(8):
            mutated = bytearray(data)
            mutated[pos] ^= 1 << bit
            decodes_or_refuses(bytes(mutated))


@pytest.mark.parametrize("name", ["batch_window", "batch_special_values", "batch_timestamps"])
def test_every_corruption_inside_the_streams(name: str) -> None:
    # zstd checksums stop wire-level flips early; re-compressing mutated streams reaches the parser.
    batch = mg.V2_BATCHES[name][0]()
    streams = raw_streams(encode2(batch))
    rnd = random.Random(name)
    for i, raw in enumerate(streams):
        for pos in range(len(raw)):
            for value in {raw[pos] ^ (1 << rnd.randrange(8)), rnd.randrange(256), 0, 0xFF}:
                mutated = bytearray(raw)
                mutated[pos] = value
                decodes_or_refuses(
                    envelope(mg.with_streams(streams, **{codec.V2_STREAMS[i]: bytes(mutated)}), batch)
                )
        for cut in range(len(raw)):
            decodes_or_refuses(envelope(mg.with_streams(streams, **{codec.V2_STREAMS[i]: raw[:cut]}), batch))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_streams(data: st.DataObject) -> None:
    streams = list(_S)
    for _ in range(data.draw(st.integers(1, 3))):
        name = data.draw(st.sampled_from(codec.V2_STREAMS))
        streams[STREAM[name]] = data.draw(st.binary(max_size=40))
    decodes_or_refuses(envelope(streams, _SMALL))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_fuzz_v2_envelope(blob: bytes) -> None:
    decode_error(b"ERB\x02" + blob)
    decodes_or_refuses(mg.raw_envelope(mg.header_for(blob, codec=codec.CODEC_V2), version=V2))


HUGE = 10**9
_HUGE_CLAIMS = {
    "timestamps": ({"TIMES": uv(HUGE, T0)}, "too_many_scrapes"),
    "timestamps under the cap": ({"TIMES": uv(99_999, T0)}, "length_mismatch"),
    "groups": ({"GROUPS": uv(HUGE)}, "too_many_series"),
    "series in a group": ({"GROUPS": uv(1, HUGE, 0)}, "too_many_series"),
    "runs": ({"GROUPS": uv(1, 3, HUGE)}, "bad_index"),
    "run length": ({"GROUPS": uv(1, 3, 1, 0, HUGE)}, "bad_index"),
    "samples": ({"GROUPS": uv(2, 100_000, 1, 0, 2, 100_000, 1, 0, 2)}, "too_many_samples"),
    "label names": ({"LMETA": uv(HUGE)}, "too_many_label_pairs"),
    "schemas": ({"LMETA": uv(1, HUGE)}, "malformed"),
    "labels per schema": ({"LMETA": uv(1, 1, HUGE)}, "too_many_labels"),
    "dictionary": ({"LMETA": uv(1, 1, 1, 0, HUGE)}, "too_many_label_pairs"),
    "string length": ({"LSTRLEN": uv(HUGE) + _S[STREAM["LSTRLEN"]][1:]}, "label_too_long"),
    "stale markers": ({"VKIND": b"\x40\x00" + _S[STREAM["VKIND"]][2:], "VSTALE": uv(HUGE)}, "malformed"),
    "stale markers under the count": (
        {"VKIND": b"\x40\x00" + _S[STREAM["VKIND"]][2:], "VSTALE": uv(2)},
        "length_mismatch",
    ),
}


@pytest.mark.parametrize("name", sorted(_HUGE_CLAIMS))
def test_huge_claims_fail_fast(name: str) -> None:
    changes, reason = _HUGE_CLAIMS[name]
    limits = Limits(max_samples=300_000, max_series=200_000)
    data = _env(changes)
    err, elapsed, peak = measure_refusal(lambda: decode_error(data, limits))
    assert err.reason == reason, err
    assert elapsed < 1.0, elapsed
    assert peak < 8 << 20, peak


def test_many_groups_of_empty_series_stay_bounded() -> None:
    # 200 000 one-series groups without samples: legal counts, bounded work, refused by the labels.
    groups = uv(200_000) + uv(1, 0) * 200_000
    data = _env({"GROUPS": groups}, n=0)
    err, elapsed, peak = measure_refusal(lambda: decode_error(data))
    assert err.reason == "length_mismatch"
    assert elapsed < 10 and peak < 64 << 20, (elapsed, peak)


# --------------------------------------------------------------------------------------------------
# encoder-side validation is shared with v1: tests/wire/test_codec.py checks its refusals in both formats


def test_encoder_limits() -> None:
    batch = mg.batch_window()
    data = encode2(batch)
    for limits, reason in [
        (Limits(max_payload_bytes=len(data) - 1), "oversized"),
        (Limits(max_decompressed_bytes=100), "decompression_limit"),
        (Limits(max_samples=5), "too_many_samples"),
    ]:
        with pytest.raises(EncodeError) as info:
            encode2(batch, limits=limits)
        assert info.value.reason == reason
    # v2 has a block per distinct timestamp, so explicit timestamps count against max_scrapes.
    spread = ScrapeBlock(T0, array("I", range(3)), array("d", [1.0] * 3), array("q", [1, 2, 3]))
    many = Batch("c", "n", 1, [mg.labels("m", i=str(i)) for i in range(3)], [spread])
    with pytest.raises(EncodeError) as info:
        encode2(many, limits=Limits(max_scrapes=2))
    assert info.value.reason == "too_many_scrapes"
    v1_many = codec.encode_batch(many, limits=Limits(max_scrapes=2), version=V1)
    assert codec.decode_batch(v1_many, Limits(max_scrapes=2))


def test_unvalidated_garbage_is_an_encode_error() -> None:
    batch = bad_batch(scrapes=[ScrapeBlock(T0, array("I", [7]), array("d", [1.0]))])
    with pytest.raises(EncodeError) as info:
        encode2(batch, validate=False)
    assert info.value.reason == "malformed"


# --------------------------------------------------------------------------------------------------
# size on the relay's workload


def simulator_window(series: int, scrapes: int) -> Batch:
    """``scrapes`` scrapes of the four simulated exporters, shaped like the relay does, in one batch."""
    sim = Simulator(seed=1, series=series)
    ctype = "text/plain; version=0.0.4"
    caches = {e: SeriesCache() for e in EXPORTERS}
    shapers = {
        e: TargetShaper(e, {"job": e, "instance": f"edge-gpu-01:{i}"}, {"node": "edge-gpu-01"})
        for i, e in enumerate(EXPORTERS)
    }
    shaped = []
    for tick in range(30, 30 + scrapes):
        for i, e in enumerate(EXPORTERS):
            parsed = parse(sim.render(e, tick).decode(), ctype, caches[e])
            # Each target is scraped at its own offset within the 5 s interval.
            shaped.append(shapers[e].shape(T0 + 5000 * tick + 1250 * i + tick % 7, parsed, 0.01))
    batch = to_batch("lab", "edge-gpu-01", shaped)
    batch.seq = 1
    return batch


def test_v2_is_much_smaller_on_a_realistic_window() -> None:
    batch = simulator_window(2000, 12)
    v1, v2 = codec.encode_batch(batch, version=V1), encode2(batch)
    assert samples(codec.decode_batch(v2)) == samples(batch)
    print(
        f"\n{batch.sample_count} samples: v1 {len(v1) / batch.sample_count:.2f} B/sample, "
        f"v2 {len(v2) / batch.sample_count:.2f} B/sample"
    )
    # Measured 4.75 vs 1.46 B/sample: v2 must stay at least 2.5x smaller.
    assert len(v1) >= 2.5 * len(v2)


one_value = st.one_of(
    st.floats(width=64),
    st.integers(-(10**9), 10**9).flatmap(lambda m: st.integers(0, 9).map(lambda k: m / 10**k)),
    st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), 2.0**53, 1e300, 5e-324]),
    st.sampled_from([STALE_NAN, float("nan")]),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(one_value, st.booleans()), min_size=1, max_size=40))
def test_add_one_writes_exactly_what_add_of_one_value_writes(values: list[tuple[float, bool]]) -> None:
    """The fast path for series with one sample (every series of a live cycle) is byte for byte the
    general one, whatever exponent the series before left (-0.0, NaN, Inf, huge and tiny values)."""
    fast, general = ValueEncoder(), ValueEncoder()
    for value, several in values:
        if several:  # a series with more samples in between moves the exponent hint
            fast.add([value, value])
            general.add([value, value])
        fast.add_one(value)
        general.add([value])
    assert fast.streams() == general.streams()
