"""The value codec of one series in a v2 batch body (columns of ``schemas/columnar.py``).

"Decimal scaling" (``v == m / 10**k`` bit-exactly, integers ``m`` delta coded), deltas of the raw
64-bit patterns read as integers, or their XOR: :class:`ValueEncoder` / :class:`ValueDecoder`.
``schemas/wire-format.md`` (section "Body, version 2") specifies the streams. Decoders treat their
input as hostile, as everything in ``columnar`` does.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from itertools import accumulate, repeat
from operator import sub, xor
from typing import Final

from schemas.columnar import (
    BIG_ENDIAN,
    KIND_BITS,
    KIND_EXPONENT,
    KIND_ORDER2,
    KIND_STALE,
    KIND_XOR,
    MAX_EXPONENT,
    MAX_MANTISSA,
    POW10,
    WIDTHS,
    Reader,
    f64_bits,
    f64_bytes,
    fail,
    pack_ints,
    put_uvarint,
    shuffle,
    unpack_ints,
    unzigzag,
    width_for,
    zigzag,
)
from schemas.model import STALE_NAN, STALE_NAN_BITS

# --------------------------------------------------------------------------------------------------
# Decimal scaling


_MOD10: Final = (10).__rmod__  # m % 10
_DIV10: Final = (10).__rfloordiv__  # m // 10


def decimals(value: float) -> int | None:
    """Fewest decimal places that spell ``value`` (from the shortest round-trip repr); None if none."""
    text = repr(value)
    if "n" in text:  # nan, inf
        return None
    mantissa, _, exponent = text.partition("e")
    fraction = mantissa.partition(".")[2].rstrip("0")
    return max(len(fraction) - int(exponent or 0), 0)


def decimal_scale(values: list[float], k_hint: int) -> tuple[int, list[int]] | None:
    """(k, [m...]) with ``m / 10**k`` bit-identical to each value and ``|m| < 2**53``, or None.

    ``k_hint`` is the exponent of the previous series: neighbours in a metric family share it, so the
    first try usually succeeds.  Otherwise the exponent the most precise value needs (from its
    shortest repr) is tried once: a hint that was too small, or so large that ``|m|`` passed 2**53.
    Common factors of ten are stripped, so k is never larger than the series needs.  Every candidate
    is verified by comparing bit patterns, so a wrong guess costs time, never correctness; -0.0, NaN,
    ±Inf and huge integers never verify and return None.
    """
    if not values:
        return 0, []
    original = f64_bytes(values)
    k = k_hint
    for attempt in range(2):
        p = POW10[k]
        try:
            ms = list(map(round, map(p.__mul__, values)))
        except (ValueError, OverflowError):  # NaN, ±Inf
            return None
        if (
            max(ms) < MAX_MANTISSA
            and min(ms) > -MAX_MANTISSA
            and f64_bytes(list(map(p.__rtruediv__, ms))) == original
        ):
            # m/10^k == (m/10)/10^(k-1) exactly as rationals, so both divisions round alike.
            while k and not any(map(_MOD10, ms)):
                ms = list(map(_DIV10, ms))
                k -= 1
            return k, ms
        if attempt:
            return None
        needed = list(map(decimals, values))
        if None in needed:
            return None
        need = max(n for n in needed if n is not None)
        if need == k or need > MAX_EXPONENT:
            return None
        k = need
    return None


# --------------------------------------------------------------------------------------------------
# Values of one series


_INT64_MIN: Final = -(2**63)
_INT64_LIMIT: Final = 2**63


def _plan_deltas(ms: list[int]) -> tuple[bool, int, list[int], int] | None:
    """(order 2?, width, deltas, cost in bits) for the integers of a series; None if too wide.

    The order whose deltas have fewer significant bits wins: smaller numbers compress better even
    when both orders need the same width.  Order 2 also pays for its first delta (a varint in VFIRST).
    """
    if len(ms) < 2:
        return False, 0, [], 0
    d1 = list(map(sub, ms[1:], ms))
    lo, hi = min(d1), max(d1)
    best = (False, width_for(lo, hi), d1, sum(map(int.bit_length, d1)))
    # Order 2 writes the first delta as a zigzag varint, which must fit 64 bits: between the raw bits
    # of -0.0 (-2**63 read as int64) and a positive value it does not.
    if len(ms) >= 3 and (lo or hi) and _INT64_MIN <= d1[0] < _INT64_LIMIT:
        d2 = list(map(sub, d1[1:], d1))
        cost2 = sum(map(int.bit_length, d2)) + zigzag(d1[0]).bit_length()
        if cost2 < best[3]:
            best = (True, width_for(min(d2), max(d2)), d2, cost2)
    return None if best[1] > 8 else best


class ValueEncoder:
    """Collects the value streams of the series of a batch, one series at a time.

    Every series with samples gets a kind byte in VKIND (see KIND_*) followed, unless it is XOR, by
    the byte width of its deltas (0, 1, 2, 4 or 8).  Integer series (decimal or raw bits) store their
    first integer (and for order 2 the first delta) as zigzag varints in VFIRST and the remaining
    deltas as fixed-width signed integers in VDELTA<width> (width 0: all deltas are 0, none stored).

    - *decimal*: every value but stale markers passes :func:`decimal_scale`; stale marker positions
      go to VSTALE.
    - *raw bits*: the int64 reading of each bit pattern; smooth full-precision floats (a float
      counter) have second differences well under the 64-bit XOR of neighbours.
    - *XOR*: the 64-bit XOR of each pattern with the previous one (0 before the first) in VXOR:
      the fallback for anything else (sign flips, NaN payloads, values jumping binades).
    """

    __slots__ = ("_k", "deltas", "first", "kinds", "stale", "xor")

    def __init__(self) -> None:
        self.kinds = bytearray()
        self.first = bytearray()
        # int64 columns, not lists: 8 bytes a delta instead of an int object and its slot.
        self.deltas: dict[int, array] = {w: array("q") for w in (1, 2, 4, 8)}
        self.stale = bytearray()
        self.xor = array("Q")
        self._k = 0

    def add_one(self, value: float) -> None:
        """``add([value])``, byte for byte, without its lists when the previous series' exponent
        fits (a batch of one scrape has one value per series: most series of a live cycle)."""
        k = self._k
        p = POW10[k]
        try:
            m = round(value * p)
        except (ValueError, OverflowError):  # NaN, ±Inf
            self.add([value])
            return
        # `==` on floats is bit-identity except for ±0 (and NaN, which never gets here): -0.0 must
        # take the general path, which refuses it as a decimal.
        if -MAX_MANTISSA < m < MAX_MANTISSA and m / p == value and (m or str(value)[0] != "-"):
            while k and not m % 10:
                m //= 10
                k -= 1
            self._k = k
            self.kinds.append(k)
            self.kinds.append(0)  # width 0: one value has no deltas
            put_uvarint(self.first, zigzag(m))
            return
        self.add([value])

    def add(self, values: Sequence[float]) -> None:
        scaled = decimal_scale(values, self._k)
        if scaled is not None:
            k, ms = scaled
            self._k = k
            self._integers(k, ms)
            return
        bits = f64_bits(values)
        if STALE_NAN_BITS in bits:
            rest = [v for v, b in zip(values, bits, strict=True) if b != STALE_NAN_BITS]
            scaled = decimal_scale(rest, self._k)
            if scaled is not None:
                k, ms = scaled
                put_uvarint(self.stale, len(values) - len(rest))
                prev = -1
                for pos, b in enumerate(bits):
                    if b == STALE_NAN_BITS:
                        put_uvarint(self.stale, pos - prev - 1)
                        prev = pos
                if ms:
                    self._k = k
                self._integers(k | KIND_STALE, ms)
                return
        signed = array("q")
        signed.frombytes(bits.tobytes())
        patterns = signed.tolist()
        plan = _plan_deltas(patterns)
        words = list(map(xor, bits, [0, *bits[:-1]]))
        if plan is not None and plan[3] < sum(map(int.bit_length, words[1:])):
            self._integers(KIND_BITS, patterns, plan)
            return
        self.kinds.append(KIND_XOR)
        self.xor.extend(words)

    def _integers(
        self, kind: int, ms: list[int], plan: tuple[bool, int, list[int], int] | None = None
    ) -> None:
        if plan is None:
            plan = _plan_deltas(ms)
            assert plan is not None  # |m| < 2**53: deltas of order 2 stay far below 2**63
        order2, width, deltas, _cost = plan
        self.kinds.append(kind | KIND_ORDER2 if order2 else kind)
        self.kinds.append(width)
        if ms:
            put_uvarint(self.first, zigzag(ms[0]))
        if order2:
            put_uvarint(self.first, zigzag(ms[1] - ms[0]))
        if width:
            self.deltas[width].extend(deltas)

    def streams(self) -> tuple[bytes, bytes, bytes, bytes, bytes, bytes, bytes, bytes]:
        """VKIND, VFIRST, VDELTA1, VDELTA2, VDELTA4, VDELTA8, VSTALE, VXOR."""
        d = self.deltas
        xor_col = array("Q", self.xor)
        if BIG_ENDIAN:
            xor_col.byteswap()
        return (
            bytes(self.kinds),
            bytes(self.first),
            pack_ints(d[1], 1),
            pack_ints(d[2], 2),
            pack_ints(d[4], 4),
            pack_ints(d[8], 8),
            bytes(self.stale),
            shuffle(xor_col.tobytes(), 8),
        )


class ValueDecoder:
    """Reads back what :class:`ValueEncoder` wrote, series by series, into float64 columns."""

    __slots__ = ("_delta_pos", "_deltas", "_kind_pos", "first", "kinds", "stale", "xor", "xor_pos")

    def __init__(self, streams: Sequence[bytes]) -> None:
        kinds, first, d1, d2, d4, d8, stale, xor_words = streams
        self.kinds = kinds
        self.first = Reader(first, "VFIRST")
        self._deltas = {
            1: unpack_ints(d1, 1, name="VDELTA1"),
            2: unpack_ints(d2, 2, name="VDELTA2"),
            4: unpack_ints(d4, 4, name="VDELTA4"),
            8: unpack_ints(d8, 8, name="VDELTA8"),
        }
        self._delta_pos = {1: 0, 2: 0, 4: 0, 8: 0}
        self.stale = Reader(stale, "VSTALE")
        self.xor = unpack_ints(xor_words, 8, signed=False, name="VXOR")
        self.xor_pos = 0
        self._kind_pos = 0

    def series(self, count: int, out: array) -> None:
        """Append the ``count`` (>= 1) values of the next series to ``out`` (an array('d'))."""
        kinds = self.kinds
        pos = self._kind_pos
        if pos >= len(kinds):
            fail("length_mismatch", "VKIND: fewer kind bytes than series with samples")
        kind = kinds[pos]
        if kind == KIND_XOR:
            self._kind_pos = pos + 1
            start = self.xor_pos
            words = self.xor[start : start + count]
            if len(words) != count:
                fail("length_mismatch", "VXOR: fewer words than XOR-coded samples")
            self.xor_pos = start + count
            out.frombytes(array("Q", accumulate(words, xor)).tobytes())
            return
        if pos + 1 >= len(kinds):
            fail("length_mismatch", "VKIND: a kind byte without its width byte")
        width = kinds[pos + 1]
        self._kind_pos = pos + 2
        k = kind & KIND_EXPONENT
        raw_bits = k == KIND_BITS
        if kind & KIND_XOR or (k > MAX_EXPONENT and not raw_bits) or (raw_bits and kind & KIND_STALE):
            fail("malformed", f"VKIND: unknown series kind 0x{kind:02x}")
        if width not in WIDTHS:
            fail("malformed", f"VKIND: delta width {width} is not one of {WIDTHS}")
        stale = self._stale_positions(count) if kind & KIND_STALE else []
        ms = self._integers(count - len(stale), bool(kind & KIND_ORDER2), width)
        if raw_bits:
            if ms and (min(ms) < _INT64_MIN or max(ms) >= _INT64_LIMIT):
                fail("malformed", "a raw-bits series leaves int64")
            out.frombytes(array("q", ms).tobytes())
            return
        if ms and (max(ms) >= MAX_MANTISSA or min(ms) <= -MAX_MANTISSA):
            fail("malformed", "a decimal series leaves |m| < 2^53")
        values = list(map(POW10[k].__rtruediv__, ms))
        for at in stale:
            values.insert(at, STALE_NAN)
        out.extend(values)

    def _integers(self, n: int, order2: bool, width: int) -> list[int]:
        if n == 0:
            if width or order2:
                fail("malformed", "VKIND: deltas for a series of stale markers only")
            return []
        m0 = unzigzag(self.first.uvarint())
        if order2 and n < 3:
            fail("malformed", "VKIND: order 2 needs at least three values")
        ndeltas = n - 2 if order2 else n - 1
        if width and not ndeltas:
            fail("malformed", "VKIND: a delta width for a series without deltas")
        deltas: Iterable[int]
        if width:
            start = self._delta_pos[width]
            deltas = self._deltas[width][start : start + ndeltas]
            if len(deltas) != ndeltas:
                fail("length_mismatch", f"VDELTA{width}: fewer deltas than samples")
            self._delta_pos[width] = start + ndeltas
        else:
            deltas = repeat(0, ndeltas)
        if order2:
            deltas = accumulate(deltas, initial=unzigzag(self.first.uvarint()))
        return list(accumulate(deltas, initial=m0))

    def _stale_positions(self, count: int) -> list[int]:
        n = self.stale.uvarint()
        if not 1 <= n <= count:
            fail("malformed", f"VSTALE: {n} stale markers in a series of {count} samples")
        gaps = self.stale.uvarints(n)
        positions = list(accumulate((g + 1 for g in gaps), initial=-1))[1:]
        if positions[-1] >= count:
            fail("bad_index", f"VSTALE: stale marker at {positions[-1]} in a series of {count} samples")
        return positions

    def done(self) -> None:
        """Every stream must be used up exactly."""
        if self._kind_pos != len(self.kinds):
            fail("length_mismatch", "VKIND: more kind bytes than series with samples")
        self.first.done()
        self.stale.done()
        for width, col in self._deltas.items():
            if self._delta_pos[width] != len(col):
                fail("length_mismatch", f"VDELTA{width}: deltas left over")
        if self.xor_pos != len(self.xor):
            fail("length_mismatch", "VXOR: words left over")
