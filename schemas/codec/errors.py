"""The codec's errors: the refusal reasons, the exceptions callers see, and the one the checks raise.

Every check in the package refuses with :func:`refuse`, which raises :class:`Invalid` (a reason slug
and a message, nothing else).  The public entry points turn it into what their callers catch: the
decoders into :class:`DecodeError` (:func:`run_decoder`, which also holds the "DecodeError only"
contract), the encoders into :class:`EncodeError`.  So a check is written once and serves both
sides, and the edge never spools what the cloud would refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, NoReturn

from schemas import columnar

# Stable slugs for DecodeError.reason / EncodeError.reason (usable as a metrics label).
REASONS: Final = frozenset(
    {
        "truncated",  # input ends before the envelope does
        "bad_magic",
        "unknown_version",
        "oversized",  # payload (or ack/status message) larger than the limit
        "limit_exceeded",  # a msgpack container/string larger than any legal one
        "malformed",  # not valid msgpack/JSON, wrong types, missing/unknown/duplicate keys
        "bad_header",  # header field with a legal type but an illegal value
        "unknown_codec",
        "bad_compression",  # not exactly one valid, dictionary-less zstd frame
        "decompression_limit",
        "header_mismatch",  # header n/t0/t1 disagree with the body
        "too_many_series",
        "too_many_samples",
        "too_many_scrapes",
        "too_many_labels",
        "too_many_label_pairs",  # label pairs summed over all series of the batch
        "label_too_long",
        "invalid_label_name",
        "invalid_metric_name",
        "missing_metric_name",
        "empty_label_value",
        "unsorted_labels",
        "duplicate_label_name",
        "duplicate_series",
        "duplicate_sample",
        "bad_index",
        "length_mismatch",
        "bad_timestamp",
        "need_state",  # v3 delta frame whose base state the decoder does not hold
    }
)


class WireError(ValueError):
    """Base of codec errors: ``reason`` is a stable slug, ``message`` is for humans."""

    def __init__(self, reason: str, message: str = "") -> None:
        self.reason = reason
        self.message = message or reason
        super().__init__(f"{reason}: {self.message}")


class DecodeError(WireError):
    """Raised by every decoder for any input it refuses."""


class EncodeError(WireError):
    """Raised by encoders for data the decoders would refuse (same reasons)."""


class Invalid(Exception):
    """A check's refusal inside the codec, re-raised as DecodeError or EncodeError by the entry point."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def refuse(reason: str, message: str) -> NoReturn:
    raise Invalid(reason, message)


def run_decoder(fn: Callable[[], Any]) -> Any:
    """``fn()``, with any refusal raised as DecodeError: the one exception type a decoder raises."""
    try:
        return fn()
    except (Invalid, columnar.ColumnError) as exc:
        raise DecodeError(exc.reason, exc.message) from None
    except MemoryError:
        raise
    except Exception as exc:
        # Safety net for the "DecodeError only" contract; the tests assert it is never reached.
        raise DecodeError("malformed", f"unhandled {type(exc).__name__}: {exc}") from None
