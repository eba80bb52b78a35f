"""The v3 body as the envelope and the stream decoder see it: a key frame, and a decoder per frame kind.

``envelope`` dispatches version 3 here: ``encode_body`` writes a self-contained key frame (what
``encode_batch`` makes), ``decode_body`` decodes key frames only, since a delta frame needs state
(it raises ``need_state``; ``stream.StreamDecoder`` holds states).  ``decode_kind`` picks the layout
of a frame kind, for both.  It sits above both layouts, so neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable

from schemas.codec.errors import refuse
from schemas.codec.header import Header
from schemas.codec.limits import Limits
from schemas.codec.v3.frame import FRAME_MC_DELTA, FRAME_MC_KEY, content_of, pack_body, split_frame
from schemas.codec.v3.multicycle import decode_frame as decode_multicycle
from schemas.codec.v3.single import decode_frame as decode_single
from schemas.codec.v3.single import encode_frame as encode_single
from schemas.codec.v3.state import State
from schemas.model import Batch

FrameDecoder = Callable[[State | None, Header, bytes, Limits], tuple[Batch, State]]


def encode_body(batch: Batch, level: int, limits: Limits) -> tuple[bytes, int, int, int]:
    """(body, n, t0, t1) of a v3 key frame."""
    content, _ = encode_single(None, batch, limits)
    return (
        pack_body(None, content, level),
        batch.sample_count,
        batch.first_timestamp_ms,
        batch.last_timestamp_ms,
    )


def decode_body(header: Header, body: bytes, limits: Limits) -> Batch:
    kind, base, compressed = split_frame(body)
    if base is not None:
        refuse("need_state", f"delta frame against state {base.hex()}: decode it with a StreamDecoder")
    batch, _ = decode_kind(kind)(None, header, content_of(compressed, limits), limits)
    return batch


def decode_kind(kind: int) -> FrameDecoder:
    """The content decoder of frame ``kind`` (one of FRAME_KINDS, as ``split_frame`` returns)."""
    if kind in (FRAME_MC_KEY, FRAME_MC_DELTA):
        return decode_multicycle
    return decode_single
