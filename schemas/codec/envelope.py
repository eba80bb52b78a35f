"""The envelope: ``b"ERB"`` + one format-version byte + a msgpack map (header fields and the ``body``).

The top of the batch path: ``encode_batch`` validates (``validate``), has the version's body encoded
(``v1``, ``v2``, or a ``v3`` key frame) and frames it; the decoders check magic, version byte and
header map, then hand the body to that version's decoder (``_VERSIONS``), so every version stays
decodable (v3 delta frames need state: ``stream.StreamDecoder``).  The version table lives here, above
the bodies, so imports run one way (no registry the bodies fill in).  ``open_envelope`` is that first
half of decoding (header checked, body not yet decoded), for ``stream`` and for tools that look inside
an envelope.  Also the exact JSON view of a decoded batch that the golden vectors use.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Container
from collections.abc import Set as AbstractSet
from typing import Any, Final, NamedTuple

import msgpack

from schemas.codec import v1, v2, v3
from schemas.codec.columns import column_to_bytes
from schemas.codec.compression import DEFAULT_ZSTD_LEVEL
from schemas.codec.errors import EncodeError, Invalid, refuse, run_decoder
from schemas.codec.header import Header, check_header_names, check_seq, is_int
from schemas.codec.limits import DEFAULT_LIMITS, INT64_MAX, Limits
from schemas.codec.parsing import refuse_msgpack_error, strict_map
from schemas.codec.v1 import CODEC_V1, FORMAT_V1
from schemas.codec.v2 import CODEC_V2, FORMAT_V2
from schemas.codec.v3 import CODEC_V3, FORMAT_V3
from schemas.codec.validate import validate_batch
from schemas.columnar import BIG_ENDIAN
from schemas.model import STALE_NAN_BITS, Batch, Labels, float_bits

MAGIC: Final = b"ERB"
CURRENT_FORMAT_VERSION: Final = FORMAT_V2
_HEADER_MAX_STR: Final = 1024
_HEADER_MAX_CONTAINER: Final = 32
_REQUIRED_HEADER: Final = ("cluster", "node", "seq", "t0", "t1", "n", "codec", "body")


def encode_batch(
    batch: Batch,
    level: int = DEFAULT_ZSTD_LEVEL,
    *,
    limits: Limits = DEFAULT_LIMITS,
    validate: bool = True,
    version: int = CURRENT_FORMAT_VERSION,
    known: Container[Labels] = (),
    distinct: AbstractSet[Labels] | None = None,
) -> bytes:
    """Encode a batch as an envelope of format ``version`` (FORMAT_V1, or FORMAT_V2: the default).

    With ``validate`` (the default) the batch is first checked against every decoder rule, so an
    invalid batch fails here, at the edge, rather than being refused by the cloud after spooling.
    Raises EncodeError (a ValueError).  A v2 batch decodes to the same set of samples as v1 but not
    to the same blocks: one block per distinct timestamp, series in the v2 table order.
    """
    if version not in _FORMAT_VERSIONS:
        raise EncodeError("unknown_version", f"format version {version!r}")
    if validate:
        # ``known``: label sets that passed these checks before (the caller's cache), not re-checked.
        # ``distinct``: the batch's label sets as a set, when the caller has one (see validate_batch).
        validate_batch(batch, limits, known, distinct)
    fmt = _VERSIONS[version]
    try:
        body, n, t0, t1 = fmt.encode_body(batch, level, limits)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    except (TypeError, ValueError, OverflowError, IndexError, KeyError, AttributeError) as exc:
        raise EncodeError("malformed", f"cannot encode batch: {exc}") from None
    header = {
        "cluster": batch.cluster,
        "node": batch.node,
        "seq": batch.seq,
        "t0": t0,
        "t1": t1,
        "n": n,
        "codec": fmt.codec,
        "body": body,
    }
    if batch.incarnation:
        header["inc"] = batch.incarnation
    try:
        packed = msgpack.packb(header, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise EncodeError("malformed", f"cannot encode header: {exc}") from None
    out = MAGIC + bytes((version,)) + packed
    if len(out) > limits.max_payload_bytes:
        raise EncodeError("oversized", f"encoded batch of {len(out)} bytes > {limits.max_payload_bytes}")
    return out


def with_seq(payload: bytes, seq: int) -> bytes:
    """``payload`` (an envelope this module encoded) with another ``seq``: the body is reused as is,
    so a batch sized with a placeholder seq is not encoded a second time."""
    try:
        check_seq(seq)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None
    header = msgpack.unpackb(payload[len(MAGIC) + 1 :], raw=False)
    header["seq"] = seq
    return payload[: len(MAGIC) + 1] + msgpack.packb(header, use_bin_type=True)


def _decode_envelope_v1(payload: memoryview, limits: Limits) -> tuple[Header, bytes]:
    return _decode_envelope(payload, limits, FORMAT_V1, CODEC_V1)


def _decode_envelope_v2(payload: memoryview, limits: Limits) -> tuple[Header, bytes]:
    # v2 keeps the v1 header map; only the codec (and so the body) differs.
    return _decode_envelope(payload, limits, FORMAT_V2, CODEC_V2)


def _decode_envelope_v3(payload: memoryview, limits: Limits) -> tuple[Header, bytes]:
    # v3 keeps the v1 header map too; whether a frame is a key frame is in its body's first byte.
    return _decode_envelope(payload, limits, FORMAT_V3, CODEC_V3)


def _decode_envelope(
    payload: memoryview, limits: Limits, version: int, expected_codec: str
) -> tuple[Header, bytes]:
    unpacker = msgpack.Unpacker(
        None,
        max_buffer_size=max(len(payload), 1),
        raw=False,
        strict_map_key=True,
        use_list=False,
        object_pairs_hook=strict_map,
        max_bin_len=limits.max_payload_bytes,
        max_str_len=_HEADER_MAX_STR,
        max_array_len=_HEADER_MAX_CONTAINER,
        max_map_len=_HEADER_MAX_CONTAINER,
        max_ext_len=_HEADER_MAX_CONTAINER,
    )
    unpacker.feed(payload)
    try:
        fields = unpacker.unpack()
    except (msgpack.OutOfData, msgpack.exceptions.BufferFull):
        refuse("truncated", "envelope ends inside the header")
    except ValueError as exc:
        refuse_msgpack_error(exc, "header")
    if unpacker.tell() != len(payload):
        refuse("malformed", f"{len(payload) - unpacker.tell()} bytes after the envelope")
    if type(fields) is not dict:
        refuse("malformed", "header is not a map")
    missing = [key for key in _REQUIRED_HEADER if key not in fields]
    if missing:
        refuse("malformed", f"header lacks {', '.join(missing)}")
    # Unknown header keys are ignored: v1 may grow optional header fields without a version bump.
    check_header_names(fields["cluster"], fields["node"])
    seq = check_seq(fields["seq"])
    for key in ("t0", "t1", "n"):
        if not is_int(fields[key]):
            refuse("malformed", f"{key} must be an integer, not {type(fields[key]).__name__}")
    t0, t1, n = fields["t0"], fields["t1"], fields["n"]
    if not (0 <= t0 <= t1 <= INT64_MAX):
        refuse("bad_header", f"t0={t0} t1={t1}: need 0 <= t0 <= t1 < 2^63")
    if n < 0:
        refuse("bad_header", f"negative sample count {n}")
    if n > limits.max_samples:
        refuse("too_many_samples", f"header announces {n} samples > {limits.max_samples}")
    codec = fields["codec"]
    if type(codec) is not str:
        refuse("malformed", "codec must be a string")
    if codec != expected_codec:
        refuse("unknown_codec", f"codec {codec[:64]!r} in a v{version} envelope")
    body = fields["body"]
    if type(body) is not bytes:
        refuse("malformed", f"body must be bytes, not {type(body).__name__}")
    incarnation = 0
    if "inc" in fields:  # optional: the spool incarnation of relays that send it
        incarnation = fields["inc"]
        if not is_int(incarnation) or not 0 < incarnation <= INT64_MAX:
            refuse("bad_header", f"inc must be an integer in 1..2^63-1, not {str(incarnation)[:32]!r}")
    header = Header(version, fields["cluster"], fields["node"], seq, t0, t1, n, codec, incarnation)
    return header, body


_BodyEncoder = Callable[[Batch, int, Limits], tuple[bytes, int, int, int]]
_EnvelopeDecoder = Callable[[memoryview, Limits], tuple[Header, bytes]]
_BodyDecoder = Callable[[Header, bytes, Limits], Batch]


class _Format(NamedTuple):
    codec: str
    encode_body: _BodyEncoder
    decode_envelope: _EnvelopeDecoder
    decode_body: _BodyDecoder


# Format version byte -> its codec; v1 stays decodable for as long as spools may hold v1 rows.
_VERSIONS: Final[dict[int, _Format]] = {
    FORMAT_V1: _Format(CODEC_V1, v1.encode_body, _decode_envelope_v1, v1.decode_body),
    FORMAT_V2: _Format(CODEC_V2, v2.encode_body, _decode_envelope_v2, v2.decode_body),
    # v3 alone: key frames (encode_batch writes one); delta frames need a stream.StreamDecoder.
    FORMAT_V3: _Format(CODEC_V3, v3.encode_body, _decode_envelope_v3, v3.decode_body),
}
# A tuple, not the dict: ``in`` then compares an unhashable ``version`` instead of raising TypeError.
_FORMAT_VERSIONS: Final = tuple(_VERSIONS)


def open_envelope(data: bytes, limits: Limits) -> tuple[Header, bytes, _BodyDecoder]:
    """(header, body, the version's body decoder) of an envelope, its header checked; refuses with
    ``Invalid`` (callers run it through ``run_decoder``)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        refuse("malformed", f"expected bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B")
    if len(view) > limits.max_payload_bytes:
        refuse("oversized", f"payload of {len(view)} bytes > {limits.max_payload_bytes}")
    head = bytes(view[:4])
    if head[:3] != MAGIC[: len(head)]:
        refuse("bad_magic", "not an edge-relay batch")
    if len(head) < 4:
        refuse("truncated", f"{len(head)} bytes")
    fmt = _VERSIONS.get(head[3])
    if fmt is None:
        refuse("unknown_version", f"format version {head[3]}")
    header, body = fmt.decode_envelope(view[4:], limits)
    return header, body, fmt.decode_body


def peek_header(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Validate and return the envelope header without decompressing the body."""
    header: Header = run_decoder(lambda: open_envelope(data, limits)[0])
    return header


def decode_batch(data: bytes, limits: Limits = DEFAULT_LIMITS) -> Batch:
    """Decode and fully validate an envelope; raise DecodeError for anything wrong with it."""

    def go() -> Batch:
        header, body, decode_body = open_envelope(data, limits)
        batch = decode_body(header, body, limits)
        batch.incarnation = header.incarnation
        return batch

    batch: Batch = run_decoder(go)
    return batch


def decode_batch_with_header(data: bytes, limits: Limits = DEFAULT_LIMITS) -> tuple[Header, Batch]:
    """Like decode_batch, also returning the header (format version, codec)."""

    def go() -> tuple[Header, Batch]:
        header, body, decode_body = open_envelope(data, limits)
        batch = decode_body(header, body, limits)
        batch.incarnation = header.incarnation
        return header, batch

    result: tuple[Header, Batch] = run_decoder(go)
    return result


# --------------------------------------------------------------------------------------------------
# JSON view of a batch, as used by the golden vectors (schemas/golden/*.json).


def float_repr(value: float) -> float | str:
    """A readable value: the float itself when finite, else Prometheus' spelling of it."""
    if math.isnan(value):
        return "StaleNaN" if float_bits(value) == STALE_NAN_BITS else "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return value


def _value_bits(values: array) -> array:
    # Reinterpret the column's bytes rather than round-trip each float through Python.
    bits = array("Q")
    bits.frombytes(column_to_bytes("d", values))
    if BIG_ENDIAN:
        bits.byteswap()
    return bits


def batch_to_json(header: Header, batch: Batch) -> dict[str, Any]:
    """Exact JSON view of a decoded batch: values as 16-hex-digit bit patterns plus readable floats."""
    return {
        "header": {
            "version": header.version,
            "cluster": header.cluster,
            "node": header.node,
            "seq": header.seq,
            "first_ts_ms": header.first_ts_ms,
            "last_ts_ms": header.last_ts_ms,
            "sample_count": header.sample_count,
            "codec": header.codec,
        },
        "labelsets": [[list(pair) for pair in labels] for labels in batch.labelsets],
        "scrapes": [
            {
                "t": block.timestamp_ms,
                "series": list(block.series),
                "values_bits": [f"{bits:016x}" for bits in _value_bits(block.values)],
                "values": [float_repr(x) for x in block.values],
                "timestamps": None if block.timestamps is None else list(block.timestamps),
            }
            for block in batch.scrapes
        ],
    }
