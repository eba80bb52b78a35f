"""What a v3 frame is coded against (:class:`State`), its id, and the integers its values are coded as.

A state is the series dictionary, the blocks of the last cycle and, per series, its value history:
a *kind* (a decimal exponent 0..22, or raw bits) and the last integer ``m`` and delta ``d`` of that
kind.  A float is coded as such an integer (``as_decimal``, or its bit pattern as int64) when its
series' kind can carry it; ``restart`` picks the kind of a series whose history cannot.  Both layouts
and the state messages share these, so they are here, below all of them.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Final

from schemas import columnar
from schemas.codec.limits import INT64_MAX
from schemas.model import Labels
from schemas.values import decimals

SID_BYTES: Final = 16
NO_BASE: Final = bytes(SID_BYTES)  # the "state" a key frame is coded against

# Per-series value kind (state) and exception kind bytes: 0..22 decimal exponent, RAW the int64
# reading of the bit pattern, STALE (exceptions only) the stale marker, NONE (state only) no history.
KIND_RAW: Final = 0x1F
KIND_STALE: Final = 0x40
KIND_NONE: Final = 0xFF

POW10: Final = columnar.POW10
MAX_K: Final = columnar.MAX_EXPONENT  # the largest decimal exponent a kind names
MANTISSA: Final = columnar.MAX_MANTISSA  # a decimal integer's bound (exclusive, either sign)
U64_SPAN: Final = 1 << 64  # the number of 64-bit patterns: raw integers are taken modulo it
I64_MIN: Final = -(1 << 63)
U64_STRUCT: Final = struct.Struct("<Q")
F64_STRUCT: Final = struct.Struct("<d")


@dataclass(slots=True)
class State:
    """What a delta frame is coded against: the dictionary, the blocks and the value history.

    ``sid`` names it (``state_id``): a chain hash of every frame since the key frame, so a frame
    meets exactly the state it was coded against or none at all.  Treated as immutable once built:
    coding a frame makes a new State (``derive``), so a failed frame leaves its base untouched.
    """

    node: str
    sid: bytes = NO_BASE
    labels: list[Labels] = field(default_factory=list)  # id -> label set
    index: dict[Labels, int] = field(default_factory=dict)  # label set -> id
    pairs: int = 0  # label pairs summed over the dictionary (bounded by max_label_pairs)
    blocks: list[tuple[int, list[int]]] = field(default_factory=list)  # (timestamp, coded ids)
    kinds: bytearray = field(default_factory=bytearray)  # id -> KIND_*
    ms: list[int] = field(default_factory=list)  # id -> last integer
    ds: list[int] = field(default_factory=list)  # id -> last delta

    def derive(self) -> State:
        return State(
            self.node,
            self.sid,
            list(self.labels),
            dict(self.index),
            self.pairs,
            list(self.blocks),
            bytearray(self.kinds),
            list(self.ms),
            list(self.ds),
        )

    def add_series(self, labels: Labels) -> int:
        i = len(self.labels)
        self.labels.append(labels)
        self.index[labels] = i
        self.pairs += len(labels)
        self.kinds.append(KIND_NONE)
        self.ms.append(0)
        self.ds.append(0)
        return i


def state_id(node: str, base: bytes, content: bytes) -> bytes:
    """The id of the state a frame leaves: blake2b-128 over node, base state id and frame content."""
    h = hashlib.blake2b(digest_size=SID_BYTES, person=b"erb-v3-state")
    h.update(node.encode("utf-8"))
    h.update(b"\x00")
    h.update(base)
    h.update(content)
    return h.digest()


def zigzag_int(x: int) -> int:
    # zigzag for any Python int (columnar.zigzag assumes int64); callers bound the result.
    return x << 1 if x >= 0 else (-x << 1) - 1


def as_decimal(v: float, bits: int, k: int) -> int | None:
    """m with m / 10**k bit-identical to v (bits), or None."""
    try:
        m = round(v * POW10[k])
    except (ValueError, OverflowError):  # NaN, ±Inf
        return None
    if -MANTISSA < m < MANTISSA and m / POW10[k] == v and (m or not bits):  # bits: -0.0 == 0.0
        return m
    return None


def restart(v: float, bits: int, old: int) -> tuple[int, int]:
    """(kind, m) of a series whose history does not code this value: a decimal exponent no smaller
    than the old one (so 1.5 after 1.25 keeps k=2 and the next delta stays small), else raw bits."""
    need = decimals(v)
    if need is not None and need <= MAX_K:
        for k in dict.fromkeys((max(need, old if old <= MAX_K else 0), need)):
            m = as_decimal(v, bits, k) if k <= MAX_K else None
            if m is not None:
                return k, m
    return KIND_RAW, bits - U64_SPAN if bits >> 63 else bits


def in_range(kind: int, m: int) -> bool:
    """Whether ``m`` is an integer a series of ``kind`` can hold (a decoder checks every one it reads)."""
    if kind <= MAX_K:
        return -MANTISSA < m < MANTISSA
    return kind == KIND_RAW and I64_MIN <= m <= INT64_MAX
