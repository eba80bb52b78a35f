"""The golden vectors of format versions 1 and 2 and of the control messages, and how they are made.

The fixed batches (``BATCHES``; ``V2_BATCHES`` adds the window v2 is built for), the ack and status
messages, and the invalid envelopes with the reason a decoder must refuse each with.  ``vectors()``
makes them all and checks each against the decoders; ``make_golden`` writes them.  Everything is
fixed (content, zstd level 3, no dictionary), so with the same zstd library the bytes are identical.

The crafting helpers build what the encoder refuses to produce (raw and hostile envelopes, v2 bodies
with a stream replaced, decompression bombs); ``vectors_v3`` and the codec tests use them too.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence
from typing import Any

import msgpack
import zstandard

from schemas import codec, columnar
from schemas.codec.envelope import open_envelope
from schemas.codec.v2 import pack_streams, split_streams
from schemas.model import STALE_NAN_BITS, Batch, Labels, ScrapeBlock

LEVEL = 3
T0 = 1_700_000_000_000  # 2023-11-14T22:13:20Z


# ------------------------------------------------------------------------------------------------
# Crafting helpers (also used by the tests to build inputs the encoder refuses to produce)


def f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def values_from_bits(bits: list[int]) -> array:
    # Build the column from bytes so signalling-NaN payloads never pass through a Python float.
    col = array("d")
    col.frombytes(struct.pack(f"<{len(bits)}Q", *bits))
    return col


def labels(name: str, **extra: str) -> Labels:
    return tuple(sorted({"__name__": name, **extra}.items()))


def raw_body(labelsets: list[list[Any]], scrapes: list[dict[str, Any]], level: int = LEVEL) -> bytes:
    raw = msgpack.packb({"labelsets": labelsets, "scrapes": scrapes}, use_bin_type=True)
    return zstandard.ZstdCompressor(level=level, write_checksum=True).compress(raw)


def raw_envelope(
    header: dict[str, Any], *, version: int = codec.FORMAT_V1, magic: bytes = codec.MAGIC
) -> bytes:
    """An envelope with exactly these header fields (body included), no validation."""
    return magic + bytes((version,)) + msgpack.packb(header, use_bin_type=True)


def header_for(body: bytes, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "cluster": "lab",
        "node": "edge-01",
        "seq": 1,
        "t0": T0,
        "t1": T0,
        "n": 1,
        "codec": codec.CODEC_V1,
        "body": body,
    }
    base.update(fields)
    return base


def rle_zstd_frame(total: int, byte: int = 0, content_size: int | None = None) -> bytes:
    """A zstd frame of RLE blocks producing ``total`` bytes: ~32 KiB of input per GiB of output.

    Built by hand so a multi-gigabyte decompression bomb costs nothing to make.  ``content_size``
    (if given) is written into the frame header, truthfully or not.
    """
    block = 128 << 10
    out = bytearray(b"\x28\xb5\x2f\xfd")
    if content_size is None:
        out.append(0x00)  # no content size, not single-segment, no checksum, no dictionary
        out.append((17 - 10) << 3)  # window descriptor: 2^17 = 128 KiB
    else:
        out.append(0xC0)  # 8-byte content size field, not single-segment
        out.append((17 - 10) << 3)
        out += struct.pack("<Q", content_size)
    remaining = total
    while True:
        size = min(block, remaining)
        remaining -= size
        last = 1 if remaining == 0 else 0
        out += (last | (1 << 1) | (size << 3)).to_bytes(3, "little")  # block type 1 = RLE
        out.append(byte)
        if last:
            return bytes(out)


def v2_streams(batch: Batch, level: int = LEVEL) -> list[bytes]:
    """The decompressed streams of ``batch``'s v2 encoding, in wire order (codec.V2_STREAMS)."""
    data = codec.encode_batch(batch, level, version=codec.FORMAT_V2)
    _header, body, _decode_body = open_envelope(data, codec.DEFAULT_LIMITS)
    return split_streams(body, codec.DEFAULT_LIMITS)


def with_streams(streams: Sequence[bytes], **changes: bytes) -> list[bytes]:
    """A copy of ``streams`` with some replaced by name (``LIDS=b"..."``)."""
    out = list(streams)
    for name, raw in changes.items():
        out[codec.V2_STREAMS.index(name)] = raw
    return out


def v2_envelope(streams: Sequence[bytes], *, level: int = LEVEL, **fields: Any) -> bytes:
    """A v2 envelope around these (uncompressed) streams, no validation; header fields as given."""
    body = pack_streams(streams, level)
    return raw_envelope(header_for(body, **{"codec": codec.CODEC_V2, **fields}), version=codec.FORMAT_V2)


def uv(*values: int) -> bytes:
    """Unsigned LEB128 varints."""
    return bytes(columnar.uvarints(values))


# ------------------------------------------------------------------------------------------------
# The vectors


def batch_small() -> Batch:
    ls = [
        labels("kepler_node_cpu_joules_total", zone="package"),
        labels("node_cpu_seconds_total", cpu="0", mode="idle"),
        labels("up", instance="localhost:9100", job="node"),
    ]
    scrapes = [
        ScrapeBlock(T0, array("I", [0, 1, 2]), array("d", [1234.5, 98765.43, 1.0])),
        ScrapeBlock(T0 + 5000, array("I", [0, 1, 2]), array("d", [1240.25, 98770.01, 1.0])),
    ]
    return Batch("lab", "edge-01", 1, ls, scrapes)


SPECIAL_BITS: list[tuple[str, int]] = [
    ("stale", STALE_NAN_BITS),
    ("nan", 0x7FF8000000000001),  # Prometheus' value.NormalNaN
    ("nan_quiet", 0x7FF8000000000000),
    ("nan_negative", 0xFFF8000000000000),
    ("nan_payload", 0x7FF4DEADBEEF0001),
    ("pos_inf", 0x7FF0000000000000),
    ("neg_inf", 0xFFF0000000000000),
    ("neg_zero", 0x8000000000000000),
    ("zero", 0x0000000000000000),
    ("max", 0x7FEFFFFFFFFFFFFF),
    ("neg_max", 0xFFEFFFFFFFFFFFFF),
    ("min_normal", 0x0010000000000000),
    ("min_subnormal", 0x0000000000000001),
    ("huge", struct.unpack("<Q", struct.pack("<d", 1e300))[0]),
    ("tiny", struct.unpack("<Q", struct.pack("<d", 1e-300))[0]),
    ("tenth", struct.unpack("<Q", struct.pack("<d", 0.1))[0]),
    ("int_2_53_plus_1", struct.unpack("<Q", struct.pack("<d", 2.0**53))[0] + 1),
]


def batch_special_values() -> Batch:
    ls = [labels("special_value", case=case) for case, _ in SPECIAL_BITS]
    order = sorted(range(len(ls)), key=lambda i: ls[i])
    ls = [ls[i] for i in order]
    bits = [SPECIAL_BITS[i][1] for i in order]
    n = len(ls)
    scrapes = [
        ScrapeBlock(T0, array("I", range(n)), values_from_bits(bits)),
        # Every series goes stale in the next scrape, in reverse index order.
        ScrapeBlock(T0 + 15000, array("I", reversed(range(n))), values_from_bits([STALE_NAN_BITS] * n)),
    ]
    return Batch("lab", "edge-02", 7, ls, scrapes)


def batch_timestamps() -> Batch:
    ls = [
        labels("exporter_event_total", source="a"),
        labels("exporter_event_total", source="b"),
        labels("up"),
    ]
    scrapes = [
        ScrapeBlock(
            T0 + 10_000,
            array("I", [0, 1]),
            array("d", [3.0, 4.0]),
            timestamps=array("q", [T0 - 60_000, T0 + 9_999]),
        ),
        ScrapeBlock(T0 + 10_000, array("I", [2]), array("d", [1.0])),
        # Per-sample timestamps far from the scrape time, at 0 and 2^53: kept exactly as written.
        ScrapeBlock(
            T0 + 20_000, array("I", [1, 0]), array("d", [5.0, 6.0]), timestamps=array("q", [0, 2**53])
        ),
    ]
    return Batch("lab", "edge-03", 2**40 + 3, ls, scrapes)


def batch_unicode_labels() -> Batch:
    values = {
        "utf8": "Grüße aus Köln — 日本語 🔥",
        "quotes": "say \"hi\" 'there'",
        "backslash": "C:\\temp\\new",
        "newline": "line1\nline2\r\n",
        "tab": "a\tb",
        "braces": '{job="x",a=b}',
        "nul": "before\x00after",
        "long": "x" * 4096,  # the longest legal value (max_label_value_bytes)
        "long_utf8": "é" * 2048,  # 4096 bytes in 2048 characters
    }
    ls = [
        labels("unicode_labels_info", case=case, value=value)
        for case, value in values.items()
        if case not in ("long", "long_utf8")
    ]
    ls.append(labels("unicode_labels_info", case="long", value=values["long"]))
    ls.append(labels("unicode_labels_info", case="long_utf8", value=values["long_utf8"]))
    # Upper-case names sort before "__name__" in byte order; names and metric names at their edges.
    ls.append((("Zone", "A"), ("_", "underscore"), ("__name__", "job:rate5m:sum"), ("a1", "v")))
    ls.append((("__name__", "_"), ("le", "+Inf")))
    ls.sort()
    n = len(ls)
    scrapes = [ScrapeBlock(T0, array("I", range(n)), array("d", [float(i) for i in range(n)]))]
    return Batch("lab-ü", "edge-04", 3, ls, scrapes)


def batch_empty() -> Batch:
    return Batch("lab", "edge-05", 1, [], [])


def batch_kepler() -> Batch:
    ls = []
    for cid, name, pod in (
        ("12e86ce1e53111cbfa9a1924a03198c5eca14588b38cf3a6d63bb908b5345c1e", "analytics", "5afd5bd4"),
        ("17a32246559db81bd4661401597622e4c36eb3fdc9611c959c24cd8f441d9906", "nvidia-plugin", "7e57b76e"),
    ):
        for metric in ("kepler_container_cpu_joules_total", "kepler_container_cpu_watts"):
            for zone in ("dram", "package"):
                ls.append(
                    labels(
                        metric,
                        container_id=cid,
                        container_name=name,
                        node_name="edge-gpu-01",
                        pod_id=pod,
                        runtime="containerd",
                        state="running",
                        zone=zone,
                    )
                )
    ls.sort()
    n = len(ls)
    scrapes = []
    for k in range(3):
        vals = [
            round(1000.0 * (i + 1) + 17.125 * k, 3) if "joules" in dict(s)["__name__"] else 3.25 + i + k / 8
            for i, s in enumerate(ls)
        ]
        scrapes.append(ScrapeBlock(T0 + 5000 * k + k, array("I", range(n)), array("d", vals)))
    return Batch("prod-eu", "edge-gpu-01", 1001, ls, scrapes)


def batch_window() -> Batch:
    """What v2 is for: several scrapes of two targets in one batch, every kind of value column.

    Target node is scraped at T0 + 5 s * k, target kepler 1.25 s later; one series goes stale, one
    appears late, one block carries explicit timestamps, and one label set has no samples.
    """
    node = ("instance", "edge:9100"), ("job", "node")
    kepler = ("instance", "edge:28282"), ("job", "kepler")
    ls = [
        (("__name__", "node_load1"), *node),  # decimal gauge, 2 places
        (("__name__", "node_cpu_seconds_total"), ("cpu", "0"), *node),  # float counter: raw bits
        (("__name__", "node_boot_time_seconds"), *node),  # integer constant: width 0
        (("__name__", "node_random_walk"), *node),  # sign flips, full precision: XOR
        (("__name__", "kepler_container_joules_total"), ("container_id", "a1"), *kepler),  # order 2
        (("__name__", "kepler_container_joules_total"), ("container_id", "b2"), *kepler),  # goes stale
        (("__name__", "kepler_container_joules_total"), ("container_id", "c3"), *kepler),  # appears
        (("__name__", "kepler_event_total"), *kepler),  # explicit timestamps
        (("__name__", "up"), ("instance", "edge:9400"), ("job", "dcgm")),  # no samples
    ]
    load = [0.52, 0.61, 0.58, 1.07]
    cpu = [1234.5678901234567, 1239.5712345678901, 1244.5799999999999, 1249.5887654321]
    walk = [-0.1234567891, 2.718281828459045, -3.141592653589793, 1e-300]
    joules = [[1000.0, 1017.125, 1034.25, 1051.375], [73.5, 75.0, 76.5], [0.25, 17.5]]
    scrapes = []
    for k in range(4):
        t = T0 + 5000 * k
        scrapes.append(
            ScrapeBlock(t, array("I", [0, 1, 2, 3]), array("d", [load[k], cpu[k], 1.7e9, walk[k]]))
        )
        series = [4, 5]
        values = [joules[0][k], joules[1][k] if k < 3 else f64(STALE_NAN_BITS)]
        if k >= 2:
            series.append(6)
            values.append(joules[2][k - 2])
        scrapes.append(ScrapeBlock(t + 1250, array("I", series), array("d", values)))
    scrapes.append(
        ScrapeBlock(
            T0 + 20_000,
            array("I", [7]),
            array("d", [42.0]),
            timestamps=array("q", [T0 + 17_000]),
        )
    )
    return Batch("lab", "edge-06", 99, ls, scrapes)


BATCHES = {
    "batch_small": (batch_small, "three series, two scrapes"),
    "batch_special_values": (batch_special_values, "stale marker, NaN payloads, ±Inf, ±0, extremes"),
    "batch_timestamps": (batch_timestamps, "explicit per-sample timestamps beside a plain block"),
    "batch_unicode_labels": (batch_unicode_labels, "UTF-8, quotes, backslashes, newlines, NUL, max length"),
    "batch_empty": (batch_empty, "no series, no scrapes: t0 = t1 = n = 0"),
    "batch_kepler": (batch_kepler, "Kepler-like container series, three scrapes"),
}

# v2 vectors: the v1 batches plus the window, as "v2_<name>".  Their JSON is the decoded v2 batch:
# label sets in v2 table order, one block per distinct timestamp.
V2_BATCHES = {**BATCHES, "batch_window": (batch_window, "two targets, four scrapes, every value column")}


def ack_vectors() -> dict[str, tuple[str, list[codec.AckResult], int, str]]:
    """(node, results, incarnation, description); incarnation 0: no ``inc`` key (older relays)."""
    ok = [codec.AckResult(s, "ok") for s in (1, 2, 3, 4, 5, 7, 9, 10)]
    rej = [codec.AckResult(6, "rejected", "bad_index"), codec.AckResult(8, "rejected", "decompression_limit")]
    partial = codec.AckResult(12, "partial", "remote write 400: out of bounds", written=1998, refused=2)
    return {
        "ack_mixed": ("edge-01", ok + rej, 0, "ok ranges and single seqs, two rejects"),
        "ack_single": ("edge-gpu-01", [codec.AckResult(42, "ok")], 0, "one acked seq"),
        "ack_reject_only": ("edge-01", [codec.AckResult(2**40, "rejected", "remote write 400")], 0, "reject"),
        "ack_partial": (
            "edge-01",
            [codec.AckResult(11, "ok"), partial],
            1733097600123456,
            "an ok and a partial result (samples written and refused), for a spool incarnation",
        ),
        "ack_need_state": (
            "edge-01",
            [codec.AckResult(20, "ok"), codec.AckResult(21, "need_state"), codec.AckResult(22, "need_state")],
            1733097600123456,
            "v3 frames whose base state the replica lacks: publish them again self-contained",
        ),
    }


def ack_view(ack: codec.Ack) -> dict[str, Any]:
    """An ack's golden JSON: every result as [seq, result, reason, written, refused]; ``inc`` if given."""
    view: dict[str, Any] = {"v": ack.v, "node": ack.node, "results": [list(r) for r in ack.results]}
    if ack.incarnation:
        view["inc"] = ack.incarnation
    return view


def status_vectors() -> dict[str, tuple[dict[str, Any], str]]:
    online = {
        "node": "edge-01",
        "cluster": "lab",
        "state": "online",
        "ts_ms": T0,
        "spool_rows": 12,
        "spool_bytes": 345678,
        "oldest_unsent_ms": T0 - 3_600_000,
        "budget_state": "degraded",
        "wire_bytes_per_s": 1250.5,
        "version": "0.1.0",
    }
    offline = {"node": "edge-01", "cluster": "lab", "state": "offline", "ts_ms": T0}
    return {
        "status_online": (online, "periodic status with optional fields"),
        "status_offline": (offline, "last-will message"),
    }


def invalid_vectors() -> dict[str, tuple[bytes, str, str]]:
    small = codec.encode_batch(batch_small(), LEVEL, version=codec.FORMAT_V1)
    one = [["__name__", "up"]]
    sample = {"t": T0, "s": struct.pack("<I", 0), "v": struct.pack("<d", 1.0)}

    def env(labelsets: list[list[Any]], scrapes: list[dict[str, Any]], **fields: Any) -> bytes:
        return raw_envelope(header_for(raw_body(labelsets, scrapes), **fields))

    corrupt = bytearray(small)
    corrupt[-3] ^= 0xFF  # inside the zstd checksum
    bomb = raw_envelope(header_for(rle_zstd_frame(33 << 20)))
    return {
        "invalid_bad_magic": (b"ERX" + small[3:], "bad_magic", "wrong magic"),
        "invalid_unknown_version": (small[:3] + b"\xff" + small[4:], "unknown_version", "version 255"),
        "invalid_truncated": (small[: len(small) // 2], "truncated", "cut in half"),
        "invalid_header_mismatch": (env(one, [sample], n=2), "header_mismatch", "n says 2, body has 1"),
        "invalid_unsorted_labels": (
            env([["job", "x", "__name__", "up"]], [sample]),
            "unsorted_labels",
            "job before __name__",
        ),
        "invalid_bad_index": (
            env(one, [{**sample, "s": struct.pack("<I", 1)}]),
            "bad_index",
            "index 1 with one label set",
        ),
        "invalid_duplicate_series": (env([*one, *one], [sample]), "duplicate_series", "same label set twice"),
        "invalid_bad_compression": (bytes(corrupt), "bad_compression", "zstd checksum mismatch"),
        "invalid_decompression_limit": (bomb, "decompression_limit", "33 MiB of zeros in 1 KiB"),
    }


def invalid_v2_vectors() -> dict[str, tuple[bytes, str, str]]:
    small = batch_small()
    streams = v2_streams(small)
    n, t0, t1 = small.sample_count, small.first_timestamp_ms, small.last_timestamp_ms
    frame = bytearray(pack_streams(streams[:1], LEVEL))
    frame[-1] ^= 0xFF  # inside the TIMES frame's checksum
    corrupt = raw_envelope(
        header_for(bytes(frame) + pack_streams(streams[1:], LEVEL), codec=codec.CODEC_V2, n=n, t0=t0, t1=t1),
        version=codec.FORMAT_V2,
    )
    bomb = rle_zstd_frame(33 << 20)

    def env(changed: Sequence[bytes], **fields: Any) -> bytes:
        return v2_envelope(changed, **{"n": n, "t0": t0, "t1": t1, **fields})

    return {
        "v2_invalid_v1_codec": (
            env(streams, codec=codec.CODEC_V1),
            "unknown_codec",
            "a v2 envelope whose codec is v1's",
        ),
        "v2_invalid_header_mismatch": (env(streams, n=n + 1), "header_mismatch", "n one too many"),
        "v2_invalid_bad_compression": (bytes(corrupt), "bad_compression", "zstd checksum mismatch"),
        "v2_invalid_bad_index": (
            env(with_streams(streams, LSCHEMA=bytes([0, 1, 9]))),
            "bad_index",
            "a series refers to label schema 9 of 3",
        ),
        "v2_invalid_length_mismatch": (
            env(with_streams(streams, VFIRST=streams[codec.V2_STREAMS.index("VFIRST")][:-1])),
            "length_mismatch",
            "VFIRST one byte short",
        ),
        "v2_invalid_run_past_table": (
            env(with_streams(streams, GROUPS=uv(1, 3, 1, 0, 10**9))),
            "bad_index",
            "a run of 10^9 timestamps in a table of two",
        ),
        "v2_invalid_too_many_samples": (
            env(
                with_streams(streams, TIMES=uv(21, T0, *[1] * 20), GROUPS=uv(1, 100_000, 1, 0, 21)),
                t1=T0 + 20,
            ),
            "too_many_samples",
            "100 000 series at 21 timestamps claimed in 11 bytes",
        ),
        "v2_invalid_too_many_series": (
            env(with_streams(streams, GROUPS=uv(1, 10**9, 0))),
            "too_many_series",
            "a group claims 10^9 series",
        ),
        "v2_invalid_bad_timestamp": (
            env(with_streams(streams, TIMES=uv(2, T0, 0)), t1=T0),
            "bad_timestamp",
            "two equal timestamps in the table",
        ),
        "v2_invalid_decompression_limit": (
            raw_envelope(header_for(uv(len(bomb)) + bomb + uv(0) * 14, codec=codec.CODEC_V2), version=2),
            "decompression_limit",
            "a TIMES stream of 33 MiB of zeros",
        ),
    }


def encoder_info() -> dict[str, Any]:
    return {
        "zstd_level": LEVEL,
        "zstd": ".".join(map(str, zstandard.ZSTD_VERSION)),
        "python_zstandard": zstandard.__version__,
        "msgpack": ".".join(map(str, msgpack.version)),
    }


def vectors() -> dict[str, tuple[bytes, dict[str, Any]]]:
    """Every vector as name -> (wire bytes, JSON view), checked against the decoders."""
    out: dict[str, tuple[bytes, dict[str, Any]]] = {}
    for name, (make, description) in BATCHES.items():
        data = codec.encode_batch(make(), LEVEL, version=codec.FORMAT_V1)
        header, decoded = codec.decode_batch_with_header(data)
        view = {"kind": "batch", "description": description, "encoder": encoder_info()}
        view.update(codec.batch_to_json(header, decoded))
        out[name] = (data, view)
    for name, (make, description) in V2_BATCHES.items():
        data = codec.encode_batch(make(), LEVEL, version=codec.FORMAT_V2)
        header, decoded = codec.decode_batch_with_header(data)
        view = {"kind": "batch", "description": description, "encoder": encoder_info()}
        view.update(codec.batch_to_json(header, decoded))
        out[f"v2_{name}"] = (data, view)
    for name, (node, results, incarnation, description) in ack_vectors().items():
        data = codec.encode_ack(node, results, incarnation=incarnation)
        out[name] = (
            data,
            {"kind": "ack", "description": description, "decoded": ack_view(codec.decode_ack(data))},
        )
    for name, (status, description) in status_vectors().items():
        data = codec.encode_status(status)
        out[name] = (
            data,
            {"kind": "status", "description": description, "decoded": codec.decode_status(data)},
        )
    for name, (data, reason, description) in {**invalid_vectors(), **invalid_v2_vectors()}.items():
        out[name] = refused_vector(name, data, reason, description)
    return out


def refused_vector(name: str, data: bytes, reason: str, description: str) -> tuple[bytes, dict[str, Any]]:
    """An invalid-batch vector, after checking that the codec refuses ``data`` with ``reason``."""
    try:
        codec.decode_batch(data)
    except codec.DecodeError as exc:
        assert exc.reason == reason, (name, exc.reason, reason)
    else:
        raise AssertionError(f"{name} decoded")
    return data, {"kind": "invalid_batch", "description": description, "error": reason}
