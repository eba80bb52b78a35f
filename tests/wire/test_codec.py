"""Wire codec: round trips, golden vectors, every DecodeError reason, hostile input."""

from __future__ import annotations

import json
import math
import random
import struct
import time
import tracemalloc
from array import array
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import codec, schema_path
from schemas.codec import DEFAULT_LIMITS, AckResult, DecodeError, EncodeError, Limits, v1
from schemas.codec.envelope import open_envelope
from schemas.golden import vectors as mg
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock, float_bits

GOLDEN = schema_path("golden")
T0 = mg.T0


# --------------------------------------------------------------------------------------------------
# helpers


def view(batch: Batch) -> dict[str, Any]:
    """Comparable form of a batch: value columns as raw bytes so NaN payloads compare exactly."""
    return {
        "cluster": batch.cluster,
        "node": batch.node,
        "seq": batch.seq,
        "labelsets": list(batch.labelsets),
        "scrapes": [
            (
                s.timestamp_ms,
                list(s.series),
                s.values.tobytes() if isinstance(s.values, array) else array("d", s.values).tobytes(),
                None if s.timestamps is None else list(s.timestamps),
            )
            for s in batch.scrapes
        ],
    }


def decode_error(data: bytes, limits: Limits = DEFAULT_LIMITS, *, peek: bool = False) -> DecodeError:
    fn = codec.peek_header if peek else codec.decode_batch
    with pytest.raises(DecodeError) as info:
        fn(data, limits)
    err = info.value
    assert err.reason in codec.REASONS
    # The catch-all in the codec must never be what produced the error.
    assert not err.message.startswith("unhandled"), err
    return err


def sample(index: int = 0, value: float = 1.0, t: int = T0) -> dict[str, Any]:
    return {"t": t, "s": struct.pack("<I", index), "v": struct.pack("<d", value)}


def env(labelsets: list[list[Any]], scrapes: list[dict[str, Any]], **fields: Any) -> bytes:
    """A raw envelope around this body; n / t0 / t1 follow the body unless given."""
    n = 0
    times: list[int] = []
    for sc in scrapes:
        if isinstance(sc, dict) and isinstance(sc.get("v"), bytes):
            count = len(sc["v"]) // 8
            n += count
            if isinstance(sc.get("ts"), bytes) and count:
                times += list(struct.unpack(f"<{len(sc['ts']) // 8}q", sc["ts"]))
            elif isinstance(sc.get("t"), int):
                times.append(sc["t"])
    auto = {"n": n, "t0": min(times, default=0), "t1": max(times, default=0)}
    auto.update(fields)
    return mg.raw_envelope(mg.header_for(mg.raw_body(labelsets, scrapes), **auto))


UP = ["__name__", "up"]


def small_batch() -> Batch:
    return mg.batch_small()


# --------------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize(
    "make", [mg.batch_small, mg.batch_special_values, mg.batch_timestamps, mg.batch_empty]
)
def test_round_trip_examples(make: Callable[[], Batch]) -> None:
    batch = make()
    data = codec.encode_batch(batch, version=codec.FORMAT_V1)
    assert data[:4] == b"ERB\x01"
    assert view(codec.decode_batch(data)) == view(batch)
    header = codec.peek_header(data)
    assert header == codec.Header(
        1,
        batch.cluster,
        batch.node,
        batch.seq,
        batch.first_timestamp_ms,
        batch.last_timestamp_ms,
        batch.sample_count,
        "msgpack+zstd",
    )


def test_stale_marker_survives_bit_exact() -> None:
    bits = [STALE_NAN_BITS, 0x7FF8000000000001, 0xFFF8000000000000, 0x7FF4DEADBEEF0001, 0x8000000000000000]
    batch = Batch(
        "c",
        "n",
        1,
        [mg.labels("m", i=str(i)) for i in range(len(bits))],
        [ScrapeBlock(T0, array("I", range(len(bits))), mg.values_from_bits(bits))],
    )
    out = codec.decode_batch(codec.encode_batch(batch)).scrapes[0].values
    assert list(struct.unpack(f"<{len(bits)}Q", out.tobytes())) == bits


def test_encoder_accepts_plain_sequences() -> None:
    batch = Batch("c", "n", 1, [mg.labels("up")], [ScrapeBlock(T0, [0], [2.5], [T0 - 1])])  # type: ignore[arg-type]
    decoded = codec.decode_batch(codec.encode_batch(batch, version=codec.FORMAT_V1))
    assert list(decoded.scrapes[0].values) == [2.5]
    assert list(decoded.scrapes[0].timestamps or []) == [T0 - 1]


def test_encoding_is_deterministic_and_levels_decode() -> None:
    batch = mg.batch_kepler()
    assert codec.encode_batch(batch) == codec.encode_batch(batch)
    for level in (1, 3, 9, 19):
        data = codec.encode_batch(batch, level, version=codec.FORMAT_V1)
        assert view(codec.decode_batch(data)) == view(batch)


label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True).filter(lambda s: s != "__name__")
metric_names = st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True)
label_values = st.text(min_size=1, max_size=24)
labelset_st = st.builds(
    lambda metric, extra: tuple(sorted({"__name__": metric, **extra}.items())),
    metric_names,
    st.dictionaries(label_names, label_values, max_size=5),
)
value_bits = st.one_of(
    st.integers(0, 2**64 - 1),
    st.sampled_from([b for _, b in mg.SPECIAL_BITS]),
    st.floats(allow_nan=False).map(float_bits),
)
timestamps_st = st.integers(0, 2**63 - 1)


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    labelsets = draw(st.lists(labelset_st, max_size=12, unique=True))
    scrapes = []
    for _ in range(draw(st.integers(0, 4))):
        order = draw(st.permutations(range(len(labelsets))))
        series = order[: draw(st.integers(0, len(order)))]
        bits = draw(st.lists(value_bits, min_size=len(series), max_size=len(series)))
        explicit = draw(st.booleans())
        ts = draw(st.lists(timestamps_st, min_size=len(series), max_size=len(series))) if explicit else None
        scrapes.append(
            ScrapeBlock(
                draw(timestamps_st),
                array("I", series),
                mg.values_from_bits(bits),
                None if ts is None else array("q", ts),
            )
        )
    cluster = draw(st.sampled_from(["lab", "prod-eu", "ü-cluster"]))
    return Batch(
        cluster, draw(st.sampled_from(["edge-01", "n"])), draw(st.integers(1, 2**63 - 1)), labelsets, scrapes
    )


@settings(max_examples=200, deadline=None)
@given(batches(), st.sampled_from([1, 3, 5]))
def test_property_round_trip(batch: Batch, level: int) -> None:
    data = codec.encode_batch(batch, level, version=codec.FORMAT_V1)
    header, decoded = codec.decode_batch_with_header(data)
    assert view(decoded) == view(batch)
    assert header == codec.peek_header(data)
    assert (header.first_ts_ms, header.last_ts_ms) == (batch.first_timestamp_ms, batch.last_timestamp_ms)
    assert header.sample_count == batch.sample_count
    assert codec.encode_batch(decoded, level, version=codec.FORMAT_V1) == data


@settings(max_examples=100, deadline=None)
@given(batches(), st.sampled_from([1, 3]))
def test_a_large_v1_body_is_compressed_piecewise_to_the_same_body(batch: Batch, level: int) -> None:
    """Above ``_JOIN_MAX_BYTES`` the raw body's parts go to the compressor one by one (never joined):
    the frame decodes to exactly the body one-shot compression would have held."""
    one_shot = codec.encode_batch(batch, level, version=codec.FORMAT_V1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(v1, "_JOIN_MAX_BYTES", 0)
        piecewise = codec.encode_batch(batch, level, version=codec.FORMAT_V1)
    assert _raw_body(piecewise) == _raw_body(one_shot)
    assert view(codec.decode_batch(piecewise)) == view(batch)
    assert codec.peek_header(piecewise) == codec.peek_header(one_shot)


@pytest.mark.parametrize("as_set", [True, False])
@pytest.mark.parametrize("with_distinct", [False, True])
def test_known_label_sets_skip_only_their_own_checks(as_set: bool, with_distinct: bool) -> None:
    """Label sets the caller checked before (``known``) are not checked again, whatever container holds
    them, and whether or not the caller hands over the batch's label sets as a set (``distinct``, one
    entry fewer when a series repeats); a batch of only known ones is still refused for a duplicate
    series, too many label pairs, or a new label set that breaks a rule."""
    good = [(("__name__", "up"), ("job", f"j{i}")) for i in range(4)]
    bad = (("__name__", "up"), ("job", "a"), ("0bad", "x"))
    known: Any = set([*good, bad]) if as_set else dict.fromkeys([*good, bad])

    def refused(labelsets: list[Labels], limits: Limits = DEFAULT_LIMITS, known: Any = known) -> str | None:
        batch = Batch(
            "c",
            "n",
            1,
            labelsets,
            [ScrapeBlock(T0, array("I", range(len(labelsets))), array("d", [1.0] * len(labelsets)))],
        )
        try:
            codec.validate_batch(batch, limits, known, set(labelsets) if with_distinct else None)
        except EncodeError as e:
            return e.reason
        return None

    assert refused(good) is None
    assert refused([*good, bad]) is None  # known: the check that would refuse it is not made again
    assert refused([*good, bad], known=()) == "invalid_label_name"
    assert refused([*good, good[0]]) == "duplicate_series"
    assert refused(good, Limits(max_label_pairs=7)) == "too_many_label_pairs"
    fresh = (("__name__", "up"), ("job", "z"), ("1bad", "x"))
    assert refused([*good, fresh]) == "invalid_label_name"
    # New label sets that pass beside known ones (a node's churn): checked, and the batch passes.
    new = [(("__name__", "up"), ("job", f"new{i}")) for i in range(3)]
    assert refused([*good, *new]) is None
    # Of several new ones that break rules, the first in batch order names the reason.
    unsorted = (("job", "u"), ("__name__", "up"))
    assert refused([*good, unsorted, fresh]) == "unsorted_labels"
    assert refused([*good, fresh, unsorted]) == "invalid_label_name"


def v1_body(batch: Batch) -> bytes:
    return b"".join(chain.from_iterable(v1.body_parts(batch)))


def test_v1_label_cache_holds_recent_label_sets_only() -> None:
    """The v1 packing cache keeps two generations of bodies' label sets: a node's churn over hours
    does not grow it."""
    for i in range(200):
        labelsets = [mg.labels("pod_cpu", pod=f"p{i}-{j}") for j in range(50)]
        batch = Batch(
            "c", "n", 1, labelsets, [ScrapeBlock(T0, array("I", range(50)), array("d", [1.0] * 50))]
        )
        v1_body(batch)
    assert v1.cached_label_sets() <= 2 * v1.GENERATION * 50


@settings(max_examples=200, deadline=None)
@given(batches(), st.booleans())
def test_v1_body_is_the_whole_map_packed_at_once(batch: Batch, as_lists: bool) -> None:
    """v1 writes its body piecewise, label sets from a cache; the bytes must be those of packing the
    whole map (the format's definition), label sets given as tuples or as (unhashable) lists."""
    if as_lists:
        batch.labelsets = [[list(pair) for pair in ls] for ls in batch.labelsets]  # type: ignore[misc]
    whole = {
        "labelsets": [[part for pair in ls for part in pair] for ls in batch.labelsets],
        "scrapes": [
            {"t": b.timestamp_ms, "s": b.series.tobytes(), "v": b.values.tobytes()}
            | ({} if b.timestamps is None else {"ts": b.timestamps.tobytes()})
            for b in batch.scrapes
        ],
    }
    assert v1_body(batch) == msgpack.packb(whole, use_bin_type=True)
    assert v1_body(batch) == msgpack.packb(whole, use_bin_type=True)  # again, from the cache


# --------------------------------------------------------------------------------------------------
# golden vectors


def golden_paths(prefix: str) -> list[Path]:
    found = sorted(GOLDEN.glob(f"{prefix}*.bin"))
    assert found, f"no golden vectors {prefix}*.bin in {GOLDEN}"
    return found


def golden_json(path: Path) -> dict[str, Any]:
    result: dict[str, Any] = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    return result


def _raw_body(data: bytes) -> bytes:
    _header, body, _decode_body = open_envelope(data, DEFAULT_LIMITS)
    return zstandard.ZstdDecompressor().decompress(body)


@pytest.mark.parametrize("path", golden_paths("batch_"), ids=lambda p: p.stem)
def test_golden_batch_decodes_to_its_json(path: Path) -> None:
    expected = golden_json(path)
    assert expected["kind"] == "batch"
    header, batch = codec.decode_batch_with_header(path.read_bytes())
    got = codec.batch_to_json(header, batch)
    assert got == {k: v for k, v in expected.items() if k not in ("kind", "description", "encoder")}
    # The readable values must agree with the authoritative bit patterns.
    for scrape in expected["scrapes"]:
        for bits, readable in zip(scrape["values_bits"], scrape["values"], strict=True):
            value = mg.f64(int(bits, 16))
            assert codec.float_repr(value) == readable
            if isinstance(readable, float):
                assert math.copysign(1, value) == math.copysign(1, readable)


@pytest.mark.parametrize("path", golden_paths("batch_"), ids=lambda p: p.stem)
def test_golden_batch_re_encodes(path: Path) -> None:
    data = path.read_bytes()
    expected = golden_json(path)
    header, batch = codec.decode_batch_with_header(data)
    again = codec.encode_batch(batch, expected["encoder"]["zstd_level"], version=codec.FORMAT_V1)
    assert codec.batch_to_json(*codec.decode_batch_with_header(again)) == codec.batch_to_json(header, batch)
    # zstd output may change between zstd releases, the msgpack inside must not.
    assert _raw_body(again) == _raw_body(data)


@pytest.mark.parametrize("path", golden_paths("batch_"), ids=lambda p: p.stem)
def test_golden_batch_bytes_stable(path: Path) -> None:
    encoder = golden_json(path)["encoder"]
    running = ".".join(map(str, zstandard.ZSTD_VERSION))
    if running != encoder["zstd"]:
        pytest.skip(f"vectors made with zstd {encoder['zstd']}, running {running}: bytes may differ")
    batch = codec.decode_batch(path.read_bytes())
    assert codec.encode_batch(batch, encoder["zstd_level"], version=codec.FORMAT_V1) == path.read_bytes()


@pytest.mark.parametrize("path", golden_paths("ack_"), ids=lambda p: p.stem)
def test_golden_ack(path: Path) -> None:
    expected = golden_json(path)["decoded"]
    ack = codec.decode_ack(path.read_bytes())
    assert mg.ack_view(ack) == expected
    results = [AckResult(*r) for r in expected["results"]]
    again = codec.encode_ack(expected["node"], results, incarnation=expected.get("inc", 0))
    assert again == path.read_bytes()


def test_golden_control_vectors_are_what_make_golden_makes() -> None:
    """The ack and status vectors on disk are the generator's output, JSON included (the ack JSONs
    had drifted: the generator wrote five fields per result, the files held three)."""
    made = {name: v for name, v in mg.vectors().items() if v[1]["kind"] in ("ack", "status")}
    on_disk = {p.stem for prefix in ("ack_", "status_") for p in GOLDEN.glob(f"{prefix}*.bin")}
    assert set(made) == on_disk
    acks = [golden_json(GOLDEN / f"{name}.bin")["decoded"] for name in made if name.startswith("ack_")]
    assert any("inc" in ack for ack in acks)  # every kind of result, with and without an incarnation
    assert {r[1] for ack in acks for r in ack["results"]} == {"ok", "rejected", "partial", "need_state"}
    for name, (data, view) in made.items():
        assert (GOLDEN / f"{name}.bin").read_bytes() == data, name
        assert golden_json(GOLDEN / f"{name}.bin") == json.loads(json.dumps(view)), name


@pytest.mark.parametrize("path", golden_paths("status_"), ids=lambda p: p.stem)
def test_golden_status(path: Path) -> None:
    expected = golden_json(path)["decoded"]
    assert codec.decode_status(path.read_bytes()) == expected
    assert codec.encode_status(expected) == path.read_bytes()


@pytest.mark.parametrize("path", golden_paths("invalid_"), ids=lambda p: p.stem)
def test_golden_invalid(path: Path) -> None:
    assert decode_error(path.read_bytes()).reason == golden_json(path)["error"]


def test_golden_vectors_are_paired() -> None:
    bins = {p.stem for p in GOLDEN.glob("*.bin")}
    jsons = {p.stem for p in GOLDEN.glob("*.json")}
    assert bins == jsons
    kinds = {golden_json(GOLDEN / f"{name}.bin")["kind"] for name in bins}
    assert kinds == {"batch", "ack", "status", "invalid_batch"}


# --------------------------------------------------------------------------------------------------
# every reason is reachable


def _bomb() -> bytes:
    return mg.raw_envelope(mg.header_for(mg.rle_zstd_frame(64 << 20)))


def _limits(**kw: int) -> Limits:
    return Limits(**kw)


REASON_CASES: dict[str, list[tuple[bytes, Limits]]] = {}


def _case(reason: str, data: bytes, limits: Limits = DEFAULT_LIMITS) -> None:
    REASON_CASES.setdefault(reason, []).append((data, limits))


_small = codec.encode_batch(mg.batch_small())
_case("truncated", b"")
_case("truncated", b"ER")
_case("truncated", b"ERB")
_case("truncated", _small[:20])
_case("bad_magic", b"XRB\x01" + _small[4:])
_case("bad_magic", b"\x00")
_case("unknown_version", b"ERB\x00" + _small[4:])
_case("unknown_version", b"ERB\x04" + _small[4:])
_case("oversized", _small, _limits(max_payload_bytes=len(_small) - 1))
_case("oversized", b"ERB\x01" + bytes(DEFAULT_LIMITS.max_payload_bytes))
_case("limit_exceeded", mg.raw_envelope(mg.header_for(b"x", extra="y" * 2000)))
_case("limit_exceeded", env([["__name__", "up", *["a"] * 200]], []))
_case("malformed", b"ERB\x01\x91\x01")
_case("malformed", _small + b"\x00")
_case("malformed", b"ERB\x01\xc1")
_case("malformed", env([UP], [sample()], n="1"))
_case("bad_header", env([UP], [sample()], seq=0))
_case("bad_header", env([UP], [sample()], node="a/b"))
_case("bad_header", env([UP], [sample()], cluster=""))
_case("bad_header", env([UP], [sample()], t0=T0 + 1, t1=T0))
_case("unknown_codec", env([UP], [sample()], codec="msgpack+lz4"))
_case("bad_compression", mg.raw_envelope(mg.header_for(b"not zstd at all")))
_case("bad_compression", mg.raw_envelope(mg.header_for(mg.raw_body([UP], [sample()])[:-5])))
_case("decompression_limit", _bomb())
_case("header_mismatch", env([UP], [sample()], n=2))
_case("header_mismatch", env([UP], [sample()], t1=T0 + 1))
_case("too_many_series", env([UP, ["__name__", "down"]], []), _limits(max_series=1))
_case("too_many_samples", env([UP], [sample()], n=5), _limits(max_samples=4))
_case("too_many_samples", env([UP], [sample(), sample(t=T0 + 1)], n=1), _limits(max_samples=1))
_case("too_many_scrapes", env([UP], [sample(), sample(t=T0 + 1)]), _limits(max_scrapes=1))
_case("too_many_labels", env([["__name__", "up", *[x for i in range(64) for x in (f"l{i:02d}", "v")]]], []))
_case("too_many_label_pairs", env([UP, ["__name__", "down"]], []), _limits(max_label_pairs=1))
_case("label_too_long", env([["__name__", "up", "a", "v" * 4097]], []))
_case("label_too_long", env([["__name__", "up", "a", "é" * 2049]], []))
_case("label_too_long", env([["__name__", "up", "a" * 257, "v"]], []))
_case("invalid_label_name", env([["__name__", "up", "a-b", "v"]], []))
_case("invalid_label_name", env([["0a", "v", "__name__", "up"]], []))
_case("invalid_metric_name", env([["__name__", "up-time"]], []))
_case("invalid_metric_name", env([["__name__", "0up"]], []))
_case("missing_metric_name", env([["job", "x"]], []))
_case("missing_metric_name", env([[]], []))
_case("empty_label_value", env([["__name__", "up", "job", ""]], []))
_case("unsorted_labels", env([["job", "x", "__name__", "up"]], []))
_case("duplicate_label_name", env([["__name__", "up", "job", "a", "job", "b"]], []))
_case("duplicate_series", env([UP, UP], []))
_case("duplicate_sample", env([UP], [{"t": T0, "s": struct.pack("<2I", 0, 0), "v": bytes(16)}]))
_case("bad_index", env([UP], [sample(1)]))
_case("bad_index", env([], [sample(0)]))
_case("length_mismatch", env([UP], [{"t": T0, "s": bytes(8), "v": bytes(8)}]))
_case("length_mismatch", env([UP], [{"t": T0, "s": bytes(3), "v": bytes(8)}]))
_case("length_mismatch", env([UP], [{"t": T0, "s": bytes(4), "v": bytes(9)}]))
_case("length_mismatch", env([UP], [{"t": T0, "s": bytes(4), "v": bytes(8), "ts": bytes(16)}]))
_case("bad_timestamp", env([UP], [sample(t=-1)], t0=0, t1=0))
_case("bad_timestamp", env([UP], [sample(t=2**64 - 1)], t0=0, t1=0))
_case("bad_timestamp", env([UP], [{**sample(), "ts": struct.pack("<q", -5)}], t0=0, t1=0))
# A v3 delta frame decodes only against its state (tests/wire/test_codec_v3.py has the rest of v3).
_case("need_state", (GOLDEN / "v3" / "v3_invalid_need_state.bin").read_bytes())


def test_every_reason_has_a_case() -> None:
    assert set(REASON_CASES) == codec.REASONS


def test_every_reason_is_documented() -> None:
    spec = schema_path("wire-format.md").read_text(encoding="utf-8")
    assert [r for r in sorted(codec.REASONS) if f"`{r}`" not in spec] == []


@pytest.mark.parametrize(
    ("reason", "data", "limits"),
    [(r, d, lim) for r, cases in REASON_CASES.items() for d, lim in cases],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_reason_reachable(reason: str, data: bytes, limits: Limits) -> None:
    assert decode_error(data, limits).reason == reason


def test_peek_header_does_not_decompress() -> None:
    header = codec.peek_header(_bomb())
    assert header.seq == 1 and header.sample_count == 1
    assert decode_error(b"ERB\x01\x91\x01", peek=True).reason == "malformed"


# --------------------------------------------------------------------------------------------------
# hostile input


@pytest.mark.parametrize("path", golden_paths("batch_"), ids=lambda p: p.stem)
def test_truncated_at_every_offset(path: Path) -> None:
    data = path.read_bytes()
    for cut in range(len(data)):
        decode_error(data[:cut])
        decode_error(data[:cut], peek=True)


@pytest.mark.parametrize("path", golden_paths("batch_"), ids=lambda p: p.stem)
def test_every_single_byte_corruption(path: Path) -> None:
    data = path.read_bytes()
    rnd = random.Random(path.stem)
    for pos in range(len(data)):
        mutated = bytearray(data)
        mutated[pos] ^= rnd.randrange(1, 256)
        try:
            codec.decode_batch(bytes(mutated))
        except DecodeError as err:
            assert not err.message.startswith("unhandled"), err
        # A flip inside an unused header key or a content-preserving spot may still decode: fine.


def test_random_bytes() -> None:
    rnd = random.Random(1)
    for _ in range(2000):
        size = rnd.randrange(0, 600)
        blob = bytes(rnd.randrange(256) for _ in range(size))
        decode_error(blob)
        decode_error(b"ERB\x01" + blob)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=4096))
def test_fuzz_decode_batch(blob: bytes) -> None:
    decode_error(blob)
    decode_error(b"ERB\x01" + blob)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_golden(data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(golden_paths("batch_")))
    blob = bytearray(path.read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    try:
        codec.decode_batch(bytes(blob))
    except DecodeError as err:
        assert not err.message.startswith("unhandled"), err


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text() | st.binary(),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=5), c, max_size=4),
        max_leaves=20,
    )
)
def test_fuzz_structured_bodies(obj: Any) -> None:
    # Well-formed msgpack and zstd, arbitrary structure: only the v1 validation stands in the way.
    body = zstandard.ZstdCompressor().compress(msgpack.packb(obj, use_bin_type=True))
    decode_error(mg.raw_envelope(mg.header_for(body)))
    decode_error(mg.raw_envelope(mg.header_for(mg.raw_body(obj, []))))  # labelsets
    decode_error(mg.raw_envelope(mg.header_for(mg.raw_body([UP], obj if isinstance(obj, list) else [obj]))))


def measure_refusal(fn: Callable[[], DecodeError]) -> tuple[DecodeError, float, int]:
    """Run a refusing decode under tracemalloc: (error, seconds, peak traced bytes)."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        err = fn()
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return err, elapsed, peak


def _streamed_zero_bomb(total: int) -> bytes:
    # Compress `total` zero bytes in 1 MiB pieces: the bomb is made without ever holding it.
    comp = zstandard.ZstdCompressor(level=1).compressobj()
    chunk = bytes(1 << 20)
    parts = [comp.compress(chunk) for _ in range(total >> 20)]
    parts.append(comp.flush())
    return b"".join(parts)


def test_decompression_bomb_1gib_streamed() -> None:
    body = _streamed_zero_bomb(1 << 30)
    assert len(body) < 64 << 10
    data = mg.raw_envelope(mg.header_for(body))
    err, elapsed, peak = measure_refusal(lambda: decode_error(data))
    assert err.reason == "decompression_limit"
    assert peak < DEFAULT_LIMITS.max_decompressed_bytes * 1.25, peak
    assert elapsed < 10, elapsed
    # The memory bound follows the cap, not the bomb.
    small = _limits(max_decompressed_bytes=1 << 20)
    err, elapsed, peak = measure_refusal(lambda: decode_error(data, small))
    assert err.reason == "decompression_limit"
    assert peak < 3 << 20, peak


@pytest.mark.parametrize(
    "frame",
    [
        pytest.param(lambda: mg.rle_zstd_frame(4 << 30), id="4GiB-rle-no-size"),
        pytest.param(lambda: mg.rle_zstd_frame(4 << 30, content_size=4 << 30), id="4GiB-declared"),
        pytest.param(lambda: mg.rle_zstd_frame(1 << 30, content_size=100), id="lying-size"),
        pytest.param(lambda: mg.rle_zstd_frame(1 << 30, content_size=0), id="lying-zero-size"),
        pytest.param(
            lambda: b"\x28\xb5\x2f\xfd\x00" + bytes([(31 - 10) << 3]) + b"\x03\x00\x00", id="2GiB-window"
        ),
    ],
)
def test_decompression_bombs_crafted(frame: Callable[[], bytes]) -> None:
    data = mg.raw_envelope(mg.header_for(frame()))
    assert len(data) <= DEFAULT_LIMITS.max_payload_bytes
    err, elapsed, peak = measure_refusal(lambda: decode_error(data))
    assert err.reason in {"decompression_limit", "bad_compression"}
    assert peak < DEFAULT_LIMITS.max_decompressed_bytes * 1.25, peak
    assert elapsed < 10, elapsed


def test_zstd_frame_rules() -> None:
    raw = msgpack.packb({"labelsets": [UP], "scrapes": [sample()]}, use_bin_type=True)
    good = zstandard.ZstdCompressor().compress(raw)
    assert codec.decode_batch(mg.raw_envelope(mg.header_for(good))).sample_count == 1
    no_size = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    assert codec.decode_batch(mg.raw_envelope(mg.header_for(no_size))).sample_count == 1
    for body in (good + good, good + b"\x00", good[:-1], b"", b"\x28\xb5\x2f"):
        assert decode_error(mg.raw_envelope(mg.header_for(body))).reason == "bad_compression"
    dict_data = zstandard.ZstdCompressionDict(b"labelsets scrapes __name__ up" * 10)
    with_dict = zstandard.ZstdCompressor(dict_data=dict_data).compress(raw)
    assert decode_error(mg.raw_envelope(mg.header_for(with_dict))).reason == "bad_compression"


WRONG = [
    None,
    True,
    False,
    1,
    -1,
    2**64 - 1,
    1.5,
    math.nan,
    "x",
    "",
    b"x",
    [1],
    {"a": 1},
    msgpack.ExtType(5, b"x"),
]


@pytest.mark.parametrize("key", ["cluster", "node", "seq", "t0", "t1", "n", "codec", "body"])
def test_wrong_type_in_every_header_field(key: str) -> None:
    good = mg.header_for(mg.raw_body([UP], [sample()]))
    for bad in WRONG:
        if type(bad) is type(good[key]):
            continue  # same-type bad values are covered by REASON_CASES
        decode_error(mg.raw_envelope({**good, key: bad}))
        decode_error(mg.raw_envelope({**good, key: bad}), peek=True)
    without = {k: v for k, v in good.items() if k != key}
    assert decode_error(mg.raw_envelope(without)).reason == "malformed"


def test_unknown_header_keys_are_ignored() -> None:
    good = mg.header_for(mg.raw_body([UP], [sample()]))
    assert codec.decode_batch(mg.raw_envelope({**good, "trace": "abc", "prio": 2})).sample_count == 1


def test_wrong_type_in_every_body_field() -> None:
    bodies: list[Any] = [
        [],
        None,
        1,
        "x",
        {"labelsets": []},
        {"scrapes": []},
        {"labelsets": [], "scrapes": [], "x": 1},
    ]
    for w in WRONG:
        bodies += [
            {"labelsets": w, "scrapes": []},
            {"labelsets": [UP], "scrapes": w},
            {"labelsets": [w], "scrapes": []},
            {"labelsets": [["__name__", w]], "scrapes": []},
            {"labelsets": [[w, "up"]], "scrapes": []},
            {"labelsets": [UP], "scrapes": [w]},
            {"labelsets": [UP], "scrapes": [{**sample(), "t": w}]},
            {"labelsets": [UP], "scrapes": [{**sample(), "s": w}]},
            {"labelsets": [UP], "scrapes": [{**sample(), "v": w}]},
            {"labelsets": [UP], "scrapes": [{**sample(), "ts": w}]},
            {"labelsets": [UP], "scrapes": [{**sample(), w if isinstance(w, str) else "k": 1}]},
        ]
    bodies += [
        {"labelsets": [UP], "scrapes": [{"t": T0, "s": bytes(4)}]},
        {"labelsets": [UP], "scrapes": [{"t": T0, "v": bytes(8)}]},
        {"labelsets": [UP], "scrapes": [{"s": bytes(4), "v": bytes(8)}]},
        {"labelsets": [["__name__", "up", "odd"]], "scrapes": []},
    ]
    decoded = 0
    for body in bodies:
        data = mg.raw_envelope(mg.header_for(zstandard.ZstdCompressor().compress(msgpack.packb(body))))
        try:
            codec.decode_batch(data)
            decoded += 1
        except DecodeError as err:
            assert not err.message.startswith("unhandled"), (body, err)
    assert decoded == 0


def test_duplicate_map_keys_are_malformed() -> None:
    key, empty = msgpack.packb("labelsets"), msgpack.packb([])
    raw = b"\x83" + key + empty + msgpack.packb("scrapes") + empty + key + empty
    data = mg.raw_envelope(mg.header_for(zstandard.ZstdCompressor().compress(raw), n=0, t0=0, t1=0))
    assert decode_error(data).reason == "malformed"
    head = mg.header_for(mg.raw_body([UP], [sample()]))
    packed = msgpack.packb(head)
    dup = b"\x89" + packed[1:] + msgpack.packb("seq") + msgpack.packb(2)
    assert decode_error(b"ERB\x01" + dup).reason == "malformed"
    raw_sc = b"\x84" + b"".join(
        msgpack.packb(x, use_bin_type=True) for x in ("t", T0, "s", bytes(4), "v", bytes(8), "t", T0)
    )
    body = b"\x82" + key + msgpack.packb([UP]) + msgpack.packb("scrapes") + b"\x91" + raw_sc
    data = mg.raw_envelope(mg.header_for(zstandard.ZstdCompressor().compress(body), n=1))
    assert decode_error(data).reason == "malformed"


def test_large_legal_batch_is_fast() -> None:
    batch = kepler_like_batch(n_series=20_000, n_scrapes=5)
    start = time.monotonic()
    data = codec.encode_batch(batch, limits=_limits(max_payload_bytes=16 << 20))
    decoded = codec.decode_batch(data, _limits(max_payload_bytes=16 << 20))
    assert decoded.sample_count == 100_000
    assert time.monotonic() - start < 10


def test_many_unique_labels_stay_bounded() -> None:
    # A body of a million unique label pairs compresses to a few hundred KiB: the pair budget caps it.
    names = sorted(["__name__"] + [f"a{i:02d}" for i in range(63)])
    labelsets = []
    k = 0
    for _ in range(1_100_000 // 64):
        flat = []
        for name in names:
            flat += [name, "m" if name == "__name__" else format(k, "x")]
            k += 1
        labelsets.append(flat)
    data = env(labelsets, [])
    assert len(data) < DEFAULT_LIMITS.max_payload_bytes
    err, elapsed, peak = measure_refusal(lambda: decode_error(data))
    assert err.reason == "too_many_label_pairs"
    assert peak < 400 << 20, peak
    assert elapsed < 30, elapsed


# --------------------------------------------------------------------------------------------------
# encoder-side validation


def bad_batch(**changes: Any) -> Batch:
    batch = mg.batch_small()
    for key, value in changes.items():
        setattr(batch, key, value)
    return batch


@pytest.mark.parametrize(
    ("batch", "reason"),
    [
        (bad_batch(seq=0), "bad_header"),
        (bad_batch(seq=True), "malformed"),
        (bad_batch(node="a+b"), "bad_header"),
        (bad_batch(cluster=5), "malformed"),
        (bad_batch(labelsets=[(("job", "x"), ("__name__", "up"))]), "unsorted_labels"),
        (
            bad_batch(labelsets=[(("__name__", "up"),), (("__name__", "up"),)], scrapes=[]),
            "duplicate_series",
        ),
        (bad_batch(labelsets=[(("__name__", "up"), ("a", ""))], scrapes=[]), "empty_label_value"),
        (bad_batch(labelsets=[[("__name__", "up")]], scrapes=[]), "malformed"),
        (bad_batch(labelsets=[(("__name__", "up", "x"),)], scrapes=[]), "malformed"),
        (bad_batch(labelsets=[(("__name__", b"up"),)], scrapes=[]), "malformed"),
        (bad_batch(labelsets=[(("__name__", "up"), ("a", "\udc80"))], scrapes=[]), "malformed"),
        (bad_batch(scrapes=[ScrapeBlock(T0, array("I", [5]), array("d", [1.0]))]), "bad_index"),
        (bad_batch(scrapes=[ScrapeBlock(T0, array("I", [0, 1]), array("d", [1.0]))]), "length_mismatch"),
        (
            bad_batch(scrapes=[ScrapeBlock(T0, array("I", [0, 0]), array("d", [1.0, 2.0]))]),
            "duplicate_sample",
        ),
        (bad_batch(scrapes=[ScrapeBlock(-1, array("I"), array("d"))]), "bad_timestamp"),
        (bad_batch(scrapes=[ScrapeBlock(T0, array("I", [0]), array("f", [1.0]))]), "malformed"),
        (bad_batch(scrapes=[ScrapeBlock(T0, [-1], [1.0])]), "bad_index"),  # type: ignore[arg-type]
        (bad_batch(scrapes=[ScrapeBlock(T0, [0], [1.0], [2**63])]), "bad_timestamp"),  # type: ignore[arg-type]
        (bad_batch(scrapes=[ScrapeBlock(T0, [0], ["x"])]), "malformed"),  # type: ignore[arg-type]
        (bad_batch(scrapes=[(T0, [0], [1.0])]), "malformed"),
    ],
)
@pytest.mark.parametrize("version", [codec.FORMAT_V1, codec.FORMAT_V2])
def test_encoder_refuses_what_the_decoder_would(batch: Batch, reason: str, version: int) -> None:
    # Both wire formats share the encoder-side validation.
    with pytest.raises(EncodeError) as info:
        codec.encode_batch(batch, version=version)
    assert info.value.reason == reason


def test_encoder_size_limits() -> None:
    batch = mg.batch_kepler()
    data = codec.encode_batch(batch)
    with pytest.raises(EncodeError) as info:
        codec.encode_batch(batch, limits=_limits(max_payload_bytes=len(data) - 1))
    assert info.value.reason == "oversized"
    with pytest.raises(EncodeError) as info:
        codec.encode_batch(batch, limits=_limits(max_decompressed_bytes=100))
    assert info.value.reason == "decompression_limit"
    with pytest.raises(EncodeError) as info:
        codec.encode_batch(batch, limits=_limits(max_samples=5))
    assert info.value.reason == "too_many_samples"


def test_surrogates_are_refused_by_the_encoder() -> None:
    batch = bad_batch(labelsets=[(("__name__", "up"), ("a", "\udc80"))], scrapes=[])
    with pytest.raises(EncodeError):
        codec.encode_batch(batch)


# --------------------------------------------------------------------------------------------------
# size and speed on Kepler-like data


def kepler_like_batch(n_series: int = 1000, n_scrapes: int = 10, seed: int = 7) -> Batch:
    """Container series as Kepler exposes them: 64-hex ids, joule counters and watt gauges."""
    rnd = random.Random(seed)
    labelsets: list[Labels] = []
    counters: list[bool] = []
    i = 0
    while len(labelsets) < n_series:
        cid = f"{rnd.getrandbits(256):064x}"
        pod = "-".join(f"{rnd.getrandbits(b):0{b // 4}x}" for b in (32, 16, 16, 16, 48))
        name = f"{rnd.choice(['analytics', 'coredns', 'kube-proxy', 'infer'])}-{i}"
        for metric in ("kepler_container_cpu_joules_total", "kepler_container_cpu_watts"):
            for zone in ("dram", "package"):
                extra = {
                    "container_id": cid,
                    "container_name": name,
                    "node_name": "edge-gpu-01",
                    "pod_id": pod,
                    "runtime": "containerd",
                    "state": "running",
                    "zone": zone,
                }
                labelsets.append(mg.labels(metric, **extra))
                counters.append(metric.endswith("_total"))
        i += 1
    labelsets, counters = labelsets[:n_series], counters[:n_series]
    watts = [rnd.uniform(0.01, 40) for _ in range(n_series)]
    joules = [rnd.uniform(1e3, 5e6) for _ in range(n_series)]
    scrapes = []
    for s in range(n_scrapes):
        values = array("d")
        for k in range(n_series):
            w = max(0.0, watts[k] + rnd.gauss(0, watts[k] * 0.05))
            joules[k] += w * 5
            values.append(round(joules[k], 3) if counters[k] else round(w, 3))
        scrapes.append(ScrapeBlock(T0 + s * 5000 + rnd.randint(0, 30), array("I", range(n_series)), values))
    return Batch("prod-eu", "edge-gpu-01", 42, labelsets, scrapes)


def test_kepler_like_size_and_speed() -> None:
    batch = kepler_like_batch()
    start = time.perf_counter()
    data = codec.encode_batch(batch, version=codec.FORMAT_V1)
    encode_s = time.perf_counter() - start
    start = time.perf_counter()
    decoded = codec.decode_batch(data)
    decode_s = time.perf_counter() - start
    per_sample = len(data) / batch.sample_count
    print(
        f"\nv1: {len(data)} B for {batch.sample_count} samples = {per_sample:.2f} B/sample, "
        f"encode {encode_s * 1e3:.1f} ms, decode {decode_s * 1e3:.1f} ms"
    )
    assert view(decoded) == view(batch)
    # Regression guard for v1 (measured 7.9 B/sample); the columnar v2 is meant to beat it.
    assert per_sample < 9
    assert encode_s < 1 and decode_s < 1


# --------------------------------------------------------------------------------------------------
# acks


def test_ack_round_trip_and_ranges() -> None:
    results = [AckResult(s, "ok") for s in (5, 1, 2, 3, 9, 3)] + [AckResult(4, "rejected", "bad_index")]
    data = codec.encode_ack("edge-01", results)
    assert json.loads(data) == {
        "v": 1,
        "node": "edge-01",
        "ok": [[1, 3], 5, 9],
        "rejected": [[4, "bad_index"]],
    }
    ack = codec.decode_ack(data)
    assert ack.node == "edge-01"
    assert ack.results == [
        AckResult(1, "ok"),
        AckResult(2, "ok"),
        AckResult(3, "ok"),
        AckResult(4, "rejected", "bad_index"),
        AckResult(5, "ok"),
        AckResult(9, "ok"),
    ]


_COUNT = st.integers(1, 2**63 - 1)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.integers(1, 2**63 - 1),
        st.one_of(
            st.just(("ok", None, 0, 0)),
            st.tuples(st.just("rejected"), st.text(min_size=1, max_size=20), st.just(0), st.just(0)),
            st.tuples(st.just("partial"), st.text(min_size=1, max_size=20), _COUNT, _COUNT),
            st.just(("need_state", None, 0, 0)),
        ),
        max_size=50,
    )
)
def test_ack_property(entries: dict[int, tuple[str, str | None, int, int]]) -> None:
    results = [AckResult(seq, *outcome) for seq, outcome in entries.items()]  # type: ignore[arg-type]
    ack = codec.decode_ack(codec.encode_ack("n", results))
    assert ack.results == sorted(results)


def test_partial_ack_wire_form() -> None:
    data = codec.encode_ack("edge-01", [AckResult(7, "partial", "out of bounds", 120, 3), AckResult(8, "ok")])
    assert json.loads(data) == {
        "v": 1,
        "node": "edge-01",
        "ok": [8],
        "partial": [[7, 120, 3, "out of bounds"]],
    }
    assert codec.decode_ack(data).results[0] == AckResult(7, "partial", "out of bounds", 120, 3)


def test_need_state_ack_wire_form() -> None:
    results = [AckResult(9, "need_state"), AckResult(3, "need_state", ""), AckResult(4, "ok")]
    data = codec.encode_ack("edge-01", results, incarnation=5)
    assert json.loads(data) == {"v": 1, "node": "edge-01", "ok": [4], "need_state": [3, 9], "inc": 5}
    ack = codec.decode_ack(data)
    assert ack.results == [AckResult(3, "need_state"), AckResult(4, "ok"), AckResult(9, "need_state")]
    assert "need_state" not in json.loads(codec.encode_ack("n", [AckResult(1, "ok")]))


@pytest.mark.parametrize(
    "result",
    [AckResult(1, "need_state", "why"), AckResult(1, "need_state", None, 1, 0), AckResult(0, "need_state")],
)
def test_encode_need_state_refuses(result: AckResult) -> None:
    with pytest.raises(EncodeError):
        codec.encode_ack("n", [result])


@pytest.mark.parametrize(
    ("wire", "reason"),
    [
        ({"need_state": [0]}, "bad_header"),
        ({"need_state": [2**63]}, "bad_header"),
        ({"need_state": [1.0]}, "malformed"),
        ({"need_state": [True]}, "malformed"),
        ({"need_state": ["1"]}, "malformed"),
        ({"need_state": [[1, 3]]}, "malformed"),  # no ranges: need_state is rare
        ({"need_state": [[1, "x"]]}, "malformed"),
        ({"need_state": [1, 1]}, "malformed"),
        ({"need_state": [1], "ok": [1]}, "malformed"),
        ({"need_state": [1], "partial": [[1, 5, 3, "x"]]}, "malformed"),
        ({"need_state": {"1": 1}}, "malformed"),
        ({"need_state": 1}, "malformed"),
        ({"need_state": None}, "malformed"),
        ({"need_states": [1]}, "malformed"),
        ({"need_state": list(range(1, 5002))}, "oversized"),
    ],
)
def test_need_state_ack_refused_when_malformed(wire: dict[str, object], reason: str) -> None:
    data = json.dumps({"v": 1, "node": "n", **wire}).encode()
    with pytest.raises(codec.DecodeError) as err:
        codec.decode_ack(data, Limits(max_ack_results=5000, max_ack_bytes=1 << 20))
    assert err.value.reason == reason
    assert not err.value.message.startswith("unhandled")


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.integers(-3, 2**63 + 3),
            st.booleans(),
            st.floats(allow_nan=False),
            st.text(max_size=4),
            st.none(),
            st.lists(st.integers(0, 9), max_size=3),
        ),
        max_size=20,
    ),
    st.lists(st.integers(1, 30), max_size=5),
)
def test_need_state_ack_hostile(entries: list[object], ok: list[int]) -> None:
    data = json.dumps({"v": 1, "node": "n", "ok": ok, "need_state": entries}).encode()
    try:
        ack = codec.decode_ack(data)
    except DecodeError as err:
        assert err.reason in {"malformed", "bad_header", "oversized"}
        assert not err.message.startswith("unhandled"), err
        return
    # Accepted only when every entry is a distinct valid seq, none also acked ok.
    assert all(type(e) is int and 0 < e < 2**63 for e in entries)
    assert len(set(entries)) == len(entries) and not set(entries) & set(ok)
    assert [r.seq for r in ack.results if r.result == "need_state"] == sorted(entries)  # type: ignore[type-var]
    assert codec.decode_ack(codec.encode_ack("n", ack.results)) == ack


@pytest.mark.parametrize(
    "wire",
    [
        {"partial": [[7, 0, 3, "x"]]},  # nothing written: that is a rejection
        {"partial": [[7, 5, 0, "x"]]},  # nothing refused: that is an ok
        {"partial": [[7, 5, True, "x"]]},
        {"partial": [[7, 5, 3]]},
        {"partial": [[7, 5, 3, ""]]},
        {"partial": [[7, 5, 3, "x"]], "ok": [7]},
        {"partial": {"7": [5, 3, "x"]}},
    ],
)
def test_partial_ack_refused_when_malformed(wire: dict[str, object]) -> None:
    data = json.dumps({"v": 1, "node": "n", **wire}).encode()
    with pytest.raises(codec.DecodeError) as err:
        codec.decode_ack(data)
    assert err.value.reason == "malformed"


@pytest.mark.parametrize(
    "result",
    [
        AckResult(1, "ok", None, 5, 0),
        AckResult(1, "rejected", "x", 0, 2),
        AckResult(1, "partial", None, 1, 1),
    ],
)
def test_counts_only_on_partial_results(result: AckResult) -> None:
    with pytest.raises(codec.EncodeError):
        codec.encode_ack("n", [result])


@pytest.mark.parametrize(
    ("results", "reason"),
    [
        ([AckResult(0, "ok")], "bad_header"),
        ([AckResult(1, "ok", "why")], "malformed"),
        ([AckResult(1, "rejected")], "malformed"),
        ([AckResult(1, "rejected", "")], "malformed"),
        ([AckResult(1, "maybe")], "malformed"),  # type: ignore[arg-type]
        ([AckResult(1, "ok"), AckResult(1, "rejected", "x")], "malformed"),
    ],
)
def test_encode_ack_refuses(results: list[AckResult], reason: str) -> None:
    with pytest.raises(EncodeError) as info:
        codec.encode_ack("n", results)
    assert info.value.reason == reason


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "malformed"),
        (b"\xff\xfe", "malformed"),
        (b"[]", "malformed"),
        (b'{"v":1}', "malformed"),
        (b'{"node":"n"}', "malformed"),
        (b'{"v":2,"node":"n"}', "unknown_version"),
        (b'{"v":true,"node":"n"}', "malformed"),
        (b'{"v":1,"node":"n/x"}', "bad_header"),
        (b'{"v":1,"node":"n","extra":1}', "malformed"),
        (b'{"v":1,"node":"n","node":"m"}', "malformed"),
        (b'{"v":1,"node":"n","ok":[0]}', "bad_header"),
        (b'{"v":1,"node":"n","ok":[1.0]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[true]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[NaN]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[[3,1]]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[[1,2,3]]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[1,[1,2]]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[[1,4611686018427387904]]}', "oversized"),
        (b'{"v":1,"node":"n","ok":[9223372036854775808]}', "bad_header"),
        (b'{"v":1,"node":"n","ok":{}}', "malformed"),
        (b'{"v":1,"node":"n","rejected":[[1]]}', "malformed"),
        (b'{"v":1,"node":"n","rejected":[[1,5]]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[1],"rejected":[[1,"x"]]}', "malformed"),
        (b'{"v":1,"node":"n","ok":[' + b"1" * 5000 + b"]}", "malformed"),
        (b"[" * 200_000 + b"]" * 200_000, "oversized"),
        (b"[" * 50_000 + b"]" * 50_000, "malformed"),
    ],
)
def test_decode_ack_refuses(payload: bytes, reason: str) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode_ack(payload)
    assert info.value.reason == reason
    assert not info.value.message.startswith("unhandled")


def test_huge_ack_range_is_cheap() -> None:
    start = time.monotonic()
    with pytest.raises(DecodeError):
        codec.decode_ack(b'{"v":1,"node":"n","ok":[[1,9223372036854775807]]}')
    assert time.monotonic() - start < 0.5


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")))
def test_fuzz_ack_and_status(blob: bytes) -> None:
    for fn in (codec.decode_ack, codec.decode_status):
        try:
            fn(blob)
        except DecodeError as err:
            assert not err.message.startswith("unhandled"), err


# --------------------------------------------------------------------------------------------------
# status


def _status(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"v": 1, "node": "edge-01", "cluster": "lab", "state": "online", "ts_ms": T0}
    base.update(changes)
    return {k: v for k, v in base.items() if v is not _DROP}


_DROP = object()


def test_status_round_trip() -> None:
    status = _status(spool_rows=3, oldest_unsent_ms=None, budget_state="ok", ratio=0.5, paused=False)
    data = codec.encode_status(status)
    assert codec.decode_status(data) == status
    assert data.startswith(b'{"v":1,"node":"edge-01","cluster":"lab","state":"online","ts_ms":')
    without_v = {k: v for k, v in status.items() if k != "v"}
    assert codec.encode_status(without_v) == data


@pytest.mark.parametrize(
    ("status", "reason"),
    [
        (_status(v=2), "unknown_version"),
        (_status(node=_DROP), "malformed"),
        (_status(node="a#b"), "bad_header"),
        (_status(cluster=3), "malformed"),
        (_status(state="sleeping"), "malformed"),
        (_status(state=["online"]), "malformed"),
        (_status(ts_ms=-1), "bad_timestamp"),
        (_status(ts_ms=1.5), "malformed"),
        (_status(spool_rows=-1), "malformed"),
        (_status(spool_rows="3"), "malformed"),
        (_status(spool_rows=True), "malformed"),
        (_status(nested={"a": 1}), "malformed"),
        (_status(items=[1]), "malformed"),
        (_status(Upper=1), "malformed"),
        (_status(big=2**64), "malformed"),
        (_status(text="x" * 300), "malformed"),
    ],
)
def test_status_refused(status: dict[str, Any], reason: str) -> None:
    with pytest.raises(EncodeError) as enc:
        codec.encode_status(status)
    assert enc.value.reason == reason
    payload = json.dumps(status).encode()
    with pytest.raises(DecodeError) as dec:
        codec.decode_status(payload)
    assert dec.value.reason == reason


@pytest.mark.parametrize(
    "payload",
    [
        b'{"v":1,"node":"n","cluster":"c","state":"online","ts_ms":1,"x":NaN}',
        b'{"node":"n","cluster":"c","state":"online","ts_ms":1}',
        b"null",
        b"\x00",
        b"{" * 10,
    ],
)
def test_decode_status_malformed(payload: bytes) -> None:
    with pytest.raises(DecodeError) as info:
        codec.decode_status(payload)
    assert info.value.reason == "malformed"


def test_status_size_limit() -> None:
    status = _status(**{f"k{i}": "é" * 250 for i in range(50)})
    with pytest.raises(EncodeError) as info:
        codec.encode_status(status)
    assert info.value.reason == "oversized"
    with pytest.raises(DecodeError) as dec:
        codec.decode_status(json.dumps(status).encode())
    assert dec.value.reason == "oversized"


# --------------------------------------------------------------------------------------------------
# spool incarnation (optional header key "inc", echoed in acks)


@pytest.mark.parametrize("version", [codec.FORMAT_V1, codec.FORMAT_V2])
def test_incarnation_travels_in_the_header_and_only_when_given(version: int) -> None:
    batch = small_batch()
    plain = codec.encode_batch(batch, version=version)
    assert codec.peek_header(plain).incarnation == 0 and codec.decode_batch(plain).incarnation == 0
    batch.incarnation = 2**62 + 7
    stamped = codec.encode_batch(batch, version=version)
    assert codec.peek_header(stamped).incarnation == 2**62 + 7
    assert codec.decode_batch(stamped).incarnation == 2**62 + 7
    assert codec.peek_header(codec.with_seq(stamped, 99)).incarnation == 2**62 + 7
    # A batch without one encodes exactly as before (the golden vectors stay valid).
    assert b"inc" not in plain


@pytest.mark.parametrize("bad", [0, -1, 2**63, "7", True, 1.5])
def test_a_bad_incarnation_is_refused(bad: object) -> None:
    header = msgpack.unpackb(codec.encode_batch(small_batch())[4:], raw=False)
    header["inc"] = bad
    data = codec.MAGIC + bytes((codec.FORMAT_V2,)) + msgpack.packb(header, use_bin_type=True)
    with pytest.raises(codec.DecodeError) as e:
        codec.decode_batch(data)
    assert e.value.reason == "bad_header"


def test_ack_carries_the_incarnation_only_when_given() -> None:
    results = [AckResult(1, "ok"), AckResult(2, "rejected", "bad_index")]
    assert "inc" not in json.loads(codec.encode_ack("n", results))  # older relays refuse unknown keys
    data = codec.encode_ack("n", results, incarnation=12345)
    assert json.loads(data)["inc"] == 12345
    ack = codec.decode_ack(data)
    assert (ack.incarnation, ack.results) == (12345, results)
    for bad in (0, -3, 2**63, "12", None):
        with pytest.raises(codec.DecodeError):
            codec.decode_ack(json.dumps({"v": 1, "node": "n", "ok": [1], "inc": bad}).encode())
