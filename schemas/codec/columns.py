"""A scrape block's sample columns as the wire carries them: little-endian bytes, and their checks.

Series indices are uint32, values float64 (read as bytes, so every bit pattern survives, the stale
marker and NaN payloads included), explicit timestamps int64.  ``array`` is native-endian, so the
columns are byte-swapped on a big-endian host.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Final

from schemas.codec.errors import refuse
from schemas.columnar import BIG_ENDIAN

# The array typecode of a uint32 column, whatever the platform's C int sizes are.
U32: Final = "I" if array("I").itemsize == 4 else "L"
assert array(U32).itemsize == 4 and array("d").itemsize == 8 and array("q").itemsize == 8


def column_from_bytes(typecode: str, data: bytes) -> array:
    col = array(typecode)
    col.frombytes(data)
    if BIG_ENDIAN:
        col.byteswap()
    return col


def column_to_bytes(typecode: str, values: Sequence[Any]) -> bytes:
    col = values if isinstance(values, array) and values.typecode == typecode else array(typecode, values)
    if BIG_ENDIAN:
        col = array(typecode, col)
        col.byteswap()
    return col.tobytes()


def check_block_columns(
    series: array, values: array, timestamps: array | None, n_labelsets: int, index: int
) -> None:
    """Scrape block ``index``: columns of one length, indices into the label sets, none twice."""
    n = len(values)
    if len(series) != n:
        refuse("length_mismatch", f"scrape {index}: {len(series)} series indices for {n} values")
    if timestamps is not None and len(timestamps) != n:
        refuse("length_mismatch", f"scrape {index}: {len(timestamps)} timestamps for {n} values")
    if not n:
        return
    if max(series) >= n_labelsets:
        refuse("bad_index", f"scrape {index}: series index {max(series)} >= {n_labelsets} label sets")
    # Indices are < n_labelsets <= max_series, so this set stays small whatever the sample count.
    if len(set(series)) != n:
        refuse("duplicate_sample", f"scrape {index}: a series appears twice in one scrape")
    if timestamps is not None and min(timestamps) < 0:
        refuse("bad_timestamp", f"scrape {index}: negative per-sample timestamp")
