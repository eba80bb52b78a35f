"""Wire codec shared by the edge relay (encoder) and the cloud ingester (decoder).

The prose specification is ``schemas/wire-format.md``; golden vectors live in ``schemas/golden/``.
Import from ``schemas.codec`` itself; its modules are layers, each importing only the ones above it
in this list:

- ``errors``: the refusal reasons (``REASONS``), ``WireError`` / ``DecodeError`` / ``EncodeError``,
  and ``Invalid``, which every check raises (``refuse``) and the entry points turn into those two
  (``run_decoder`` holds the "DecodeError only" contract).
- ``limits``: the caps (``Limits``) and the integer range of seqs and timestamps.
- ``header``: the envelope ``Header`` and the checks of the fields every message carries (names,
  seqs, timestamps, strict integers).
- ``labels``: the rules of a label set, as a checker of whole label sets and as column checks.
- ``columns``: sample columns as little-endian bytes, and the checks of a block's columns.
- ``parsing``: strict msgpack/JSON maps (no key twice) and msgpack's errors as refusals.
- ``validate``: ``validate_batch``, every decoder rule checked on a batch before it is encoded.
- ``compression``: zstd for the bodies (cached compressors, a bounded decompressor).
- ``label_columns``: label sets as dictionary columns, the sections v2 bodies and v3 frames share.
- ``lastlabels``: a one-entry cache of what the last batch's label sets encoded to.
- ``v1``: body v1, "msgpack+zstd": zstd(msgpack({"labelsets": [...], "scrapes": [...]})) with
  sample columns as raw little-endian bytes, so every float64 bit pattern survives unchanged.
- ``v2``: body v2, "columnar+zstd": 15 separately compressed streams (timestamp table, series
  groups, dictionary-coded labels, delta/XOR values); transforms in ``schemas/columnar.py``.
- ``v3`` (a package: state, frame, single, multicycle, body): body v3, "stream+zstd": one live frame
  coded against the previous frame's state (series dictionary by id, delta-of-delta values); key
  frames decode alone.
- ``envelope``: ``b"ERB"`` + format-version byte + msgpack header map; ``encode_batch``,
  ``with_seq``, the decoders' dispatch on the version byte, and the JSON view of a batch.
- ``stream``: the v3 encoder/decoder state (``StreamEncoder``, ``StreamDecoder``) and state messages.
- ``control``: ack (cloud -> edge) and status (edge -> cloud) messages, versioned JSON.
- ``command``: backfill requests (cloud -> edge, ``cmd`` topic) and their results (``cmd_result``),
  versioned JSON on their own; imports ``control``'s JSON helpers.

Encode: ``validate_batch`` -> the version's ``encode_body`` -> envelope header around the body.
Decode: envelope (size, magic, version byte, header) -> the version's ``decode_body`` -> ``Batch``.
``encode_batch`` writes ``CURRENT_FORMAT_VERSION`` (v2) unless given another ``version`` (v1, or a v3
key frame); every version stays decodable.

The decoders treat their input as hostile: every size is capped before it is allocated, every field
is type-checked, and any bad input raises :class:`DecodeError` (never another exception type;
``MemoryError`` is deliberately not swallowed since it says nothing about the input).  The checks
are split by what they check, not by side: the encoder runs the same ones, so the edge never spools
a batch the cloud refuses.
"""

from __future__ import annotations

from schemas.codec.command import (
    COMMAND_VERSION,
    BackfillRequest,
    CommandResult,
    MissingRange,
    decode_request,
    decode_result,
    encode_request,
    encode_result,
)
from schemas.codec.compression import DEFAULT_ZSTD_LEVEL
from schemas.codec.control import (
    ACK_VERSION,
    MAX_REASON_CHARS,
    STATUS_NUMERIC_FIELDS,
    STATUS_STATES,
    STATUS_VERSION,
    Ack,
    AckResult,
    AckResultKind,
    StatusState,
    decode_ack,
    decode_status,
    encode_ack,
    encode_status,
)
from schemas.codec.envelope import (
    CURRENT_FORMAT_VERSION,
    MAGIC,
    batch_to_json,
    decode_batch,
    decode_batch_with_header,
    encode_batch,
    float_repr,
    peek_header,
    with_seq,
)
from schemas.codec.errors import REASONS, DecodeError, EncodeError, WireError
from schemas.codec.header import Header
from schemas.codec.labels import SeriesChecker
from schemas.codec.limits import DEFAULT_LIMITS, INT64_MAX, Limits, timestamp_in_range
from schemas.codec.stream import STATE_MAGIC, StreamDecoder, StreamEncoder, decode_state, frame_base
from schemas.codec.v1 import CODEC_V1, FORMAT_V1
from schemas.codec.v2 import CODEC_V2, FORMAT_V2, V2_STREAMS
from schemas.codec.v3 import CODEC_V3, FORMAT_V3
from schemas.codec.validate import validate_batch

__all__ = [
    "ACK_VERSION",
    "CODEC_V1",
    "CODEC_V2",
    "CODEC_V3",
    "COMMAND_VERSION",
    "CURRENT_FORMAT_VERSION",
    "DEFAULT_LIMITS",
    "DEFAULT_ZSTD_LEVEL",
    "FORMAT_V1",
    "FORMAT_V2",
    "FORMAT_V3",
    "INT64_MAX",
    "MAGIC",
    "MAX_REASON_CHARS",
    "REASONS",
    "STATE_MAGIC",
    "STATUS_NUMERIC_FIELDS",
    "STATUS_STATES",
    "STATUS_VERSION",
    "V2_STREAMS",
    "Ack",
    "AckResult",
    "AckResultKind",
    "BackfillRequest",
    "CommandResult",
    "DecodeError",
    "EncodeError",
    "Header",
    "Limits",
    "MissingRange",
    "SeriesChecker",
    "StatusState",
    "StreamDecoder",
    "StreamEncoder",
    "WireError",
    "batch_to_json",
    "decode_ack",
    "decode_batch",
    "decode_batch_with_header",
    "decode_request",
    "decode_result",
    "decode_state",
    "decode_status",
    "encode_ack",
    "encode_batch",
    "encode_request",
    "encode_result",
    "encode_status",
    "float_repr",
    "frame_base",
    "peek_header",
    "timestamp_in_range",
    "validate_batch",
    "with_seq",
]
