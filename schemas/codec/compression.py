"""zstd for the bodies: a cached compressor per thread and level, and a bounded decompressor.

Every body format uses it (v1 compresses its body as one frame, v2 each stream as one, v3 a frame's
content as one, and v3 state messages their sections as one), so it sits below them.  The
decompressor never holds much more output than the cap it is given, whatever a hostile frame claims.
"""

from __future__ import annotations

import threading
from typing import Final

import zstandard

from schemas.codec.errors import refuse

DEFAULT_ZSTD_LEVEL: Final = 3
_ZSTD_MAGIC: Final = b"\x28\xb5\x2f\xfd"
# Largest output one input byte of a zstd frame can produce: an RLE block is 4 bytes for 128 KiB.
_ZSTD_MAX_RATIO: Final = 1 << 15
_MIN_FEED: Final = 16

_tls = threading.local()


def compressor(level: int) -> zstandard.ZstdCompressor:
    # ZstdCompressor objects are not thread-safe and costly to build: one per thread and level.
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_tls, "compressors", None)
    if cache is None:
        cache = _tls.compressors = {}
    comp = cache.get(level)
    if comp is None:
        # Content size in the frame lets the decoder refuse oversized bodies before decompressing;
        # the checksum catches spool corruption.
        comp = cache[level] = zstandard.ZstdCompressor(
            level=level, write_content_size=True, write_checksum=True
        )
    return comp


def _window_cap(cap: int) -> int:
    # zstd window sizes are powers of two; never let a frame demand a window above the output cap.
    return 1 << max(zstandard.WINDOWLOG_MIN, (cap - 1).bit_length())


def bounded_decompress(body: bytes, cap: int) -> bytes | bytearray:
    """Decompress exactly one zstd frame, never holding much more than ``cap`` output bytes."""
    if len(body) < 4:
        refuse("bad_compression", "body too short for a zstd frame")
    if body[:4] != _ZSTD_MAGIC:
        refuse("bad_compression", "body is not a zstd frame")
    try:
        params = zstandard.get_frame_parameters(body)
    except zstandard.ZstdError as exc:
        refuse("bad_compression", f"bad zstd frame header: {exc}")
    if params.dict_id:
        refuse("bad_compression", "zstd frames with a dictionary are not v1")
    known_size = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
    if known_size and params.content_size > cap:
        refuse("decompression_limit", f"frame declares {params.content_size} bytes > {cap}")
    if params.window_size > _window_cap(cap):
        refuse("decompression_limit", f"frame window of {params.window_size} bytes")
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=_window_cap(cap))
        if known_size and params.content_size:
            # One allocation of the declared size; zstd fails a frame that produces more or less.
            # (A declared size of 0 takes the streaming path: the one-shot call would skip the frame.)
            return dctx.decompress(body, max_output_size=params.content_size, allow_extra_data=False)
        return _stream_decompress(dctx, body, cap)
    except zstandard.ZstdError as exc:
        refuse("bad_compression", f"zstd: {exc}")


def _stream_decompress(dctx: zstandard.ZstdDecompressor, body: bytes, cap: int) -> bytearray:
    # Frames without a content size (other encoders' streaming mode) are fed a little input at a
    # time: never more than can expand to an eighth of the remaining budget, so the peak stays
    # near the cap whatever the frame claims.
    dobj = dctx.decompressobj()
    out = bytearray()
    pos = 0
    view = memoryview(body)
    while pos < len(body) and not dobj.eof:
        step = max(_MIN_FEED, (cap - len(out)) // (8 * _ZSTD_MAX_RATIO))
        out += dobj.decompress(view[pos : pos + step])
        pos += step
        if len(out) > cap:
            refuse("decompression_limit", f"body decompresses to more than {cap} bytes")
    if not dobj.eof:
        refuse("bad_compression", "zstd frame is incomplete")
    if dobj.unused_data or pos < len(body):
        refuse("bad_compression", "bytes after the zstd frame")
    return out
