"""Body of wire format version 3, "stream+zstd": one live frame coded against the state of the previous one.

A frame is one scrape cycle of a node (normally one block per target), or in windowed mode several.
Label sets are named by ids of a per-node dictionary that grows by the frame's additions; block
membership, timestamps and values are coded against the *reference state* (:class:`State`: what
decoding the previous frame left behind): values as decimal-scaled (or raw-bit) integers coded
against the series' last ones; anything else is an *exception* carrying the full integer.  A *key
frame* is coded against the empty state, so it decodes on its own.  Layout and choices:
``schemas/wire-format.md`` section 11 and ``docs/stream-codec.md``.

The modules, each importing only those above it:

- ``state``: :class:`State`, its id (a chain hash over every frame since the key frame), the value
  kinds and the float <-> integer conversions both layouts and the state messages use.
- ``frame``: the container (frame kind byte, base state id, one zstd frame of content; ``pack_body``,
  ``split_frame``) and the sections both layouts start with (dictionary additions, blocks, exceptions),
  with ``seal`` / ``finish`` closing an encoding / a decoding.
- ``single``: the single-cycle layout (kinds 0x00 key / 0x01 delta): block j against the state's
  block j, values time-major, each the delta of its delta.  Its ``encode_frame`` / ``decode_frame``
  are the package's.
- ``multicycle``: the multi-cycle layout (kinds 0x02 / 0x03): several cycles, block j against block
  j - P, values series-major with a predictor order per series, residuals in byte planes.
- ``body``: what ``envelope`` dispatches to (``encode_body`` writes a key frame; ``decode_body``
  decodes key frames only and refuses a delta frame with ``need_state``) and ``decode_kind``, the
  layout of a frame kind.  It is the only module that knows both layouts, so neither imports the other.

The states themselves (the per-node encoder and decoder, the state message) are ``codec.stream``'s.
Coding never modifies a state it is given: it derives a new one, so a frame that fails leaves its base
untouched, and a decoder checks every count against its limit before anything of that size is built.
"""

from __future__ import annotations

from schemas.codec.v3.body import decode_body, decode_kind, encode_body
from schemas.codec.v3.frame import (
    CODEC_V3,
    FORMAT_V3,
    FRAME_DELTA,
    FRAME_KEY,
    FRAME_KINDS,
    FRAME_MC_DELTA,
    FRAME_MC_KEY,
    UNKNOWN_FRAME_KIND,
    content_of,
    join_sections,
    pack_body,
    read_sections,
    split_body,
    split_frame,
)
from schemas.codec.v3.single import V3_SECTIONS, decode_frame, encode_frame
from schemas.codec.v3.state import KIND_NONE, KIND_RAW, KIND_STALE, NO_BASE, SID_BYTES, State, state_id

__all__ = [
    "CODEC_V3",
    "FORMAT_V3",
    "FRAME_DELTA",
    "FRAME_KEY",
    "FRAME_KINDS",
    "FRAME_MC_DELTA",
    "FRAME_MC_KEY",
    "KIND_NONE",
    "KIND_RAW",
    "KIND_STALE",
    "NO_BASE",
    "SID_BYTES",
    "UNKNOWN_FRAME_KIND",
    "V3_SECTIONS",
    "State",
    "content_of",
    "decode_body",
    "decode_frame",
    "decode_kind",
    "encode_body",
    "encode_frame",
    "join_sections",
    "pack_body",
    "read_sections",
    "split_body",
    "split_frame",
    "state_id",
]
