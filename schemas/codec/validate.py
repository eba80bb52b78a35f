"""Every rule the decoders enforce, checked on a :class:`Batch` before it is encoded.

The edge runs it before anything is spooled, so a batch the cloud would refuse fails at the edge,
with the decoder's reason.  Label sets a caller checked before (a v3 stream's dictionary, the relay's
cache) are not checked again.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from schemas.codec.columns import U32, check_block_columns
from schemas.codec.errors import EncodeError, Invalid, refuse
from schemas.codec.header import check_header_names, check_seq, check_timestamp
from schemas.codec.labels import LabelChecker
from schemas.codec.limits import DEFAULT_LIMITS, Limits
from schemas.model import Batch, Labels, ScrapeBlock


def validate_batch(
    batch: Batch,
    limits: Limits = DEFAULT_LIMITS,
    known: Container[Labels] = (),
    distinct: AbstractSet[Labels] | None = None,
) -> None:
    """Check a Batch against every rule the decoder enforces; raise EncodeError if it breaks one.
    Label sets in ``known`` passed the label checks before and are not checked again. ``distinct``:
    the batch's label sets as a set, when the caller built one anyway (from a dict, whose stored
    hashes the set reuses): the checks then hash no label set again."""
    try:
        _validate_batch(batch, limits, known, distinct)
    except Invalid as exc:
        raise EncodeError(exc.reason, exc.message) from None


def _validate_batch(
    batch: Batch, limits: Limits, known: Container[Labels] = (), distinct: AbstractSet[Labels] | None = None
) -> None:
    # ``known``: label sets checked before (a v3 stream's dictionary), so only new ones cost a check.
    check_header_names(batch.cluster, batch.node)
    check_seq(batch.seq)
    labelsets = batch.labelsets
    if len(labelsets) > limits.max_series:
        refuse("too_many_series", f"{len(labelsets)} series > {limits.max_series}")
    if len(batch.scrapes) > limits.max_scrapes:
        refuse("too_many_scrapes", f"{len(batch.scrapes)} scrapes > {limits.max_scrapes}")
    if not _labels_pass(labelsets, known, limits, distinct):
        checker = LabelChecker(limits)
        pairs = 0
        for labels in labelsets:
            try:
                fresh = labels not in known
            except TypeError:  # unhashable, so not a label set: check_labels says why
                fresh = True
            if fresh:
                checker.check_labels(labels)
            pairs += len(labels)
            if pairs > limits.max_label_pairs:
                refuse("too_many_label_pairs", f"more than {limits.max_label_pairs} labels in the batch")
        if len(set(labelsets)) != len(labelsets):
            refuse("duplicate_series", "the same label set appears twice")
    total = 0
    for i, block in enumerate(batch.scrapes):
        if not isinstance(block, ScrapeBlock):
            refuse("malformed", f"scrape {i} is not a ScrapeBlock")
        check_timestamp(block.timestamp_ms, f"scrape {i} timestamp")
        series = _as_array(block.series, U32, "bad_index", i)
        values = _as_array(block.values, "d", "malformed", i)
        timestamps = (
            None if block.timestamps is None else _as_array(block.timestamps, "q", "bad_timestamp", i)
        )
        if series.typecode not in ("B", "H", "I", "L", "Q") or values.typecode != "d":
            refuse("malformed", f"scrape {i}: series must be unsigned ints and values float64")
        if timestamps is not None and (timestamps.typecode not in ("q", "l") or timestamps.itemsize != 8):
            refuse("malformed", f"scrape {i}: timestamps must be int64")
        check_block_columns(series, values, timestamps, len(labelsets), i)
        total += len(values)
        if total > limits.max_samples:
            refuse("too_many_samples", f"more than {limits.max_samples} samples")


def _as_array(column: Any, typecode: str, overflow_reason: str, index: int) -> array:
    if isinstance(column, array):
        return column
    try:
        return array(typecode, column)
    except OverflowError as exc:
        refuse(overflow_reason, f"scrape {index}: {exc}")
    except (TypeError, ValueError) as exc:
        refuse("malformed", f"scrape {index}: {exc}")


def _labels_pass(
    labelsets: Sequence[Labels],
    known: Container[Labels],
    limits: Limits,
    distinct: AbstractSet[Labels] | None,
) -> bool:
    """True when the label checks of ``_validate_batch`` pass: none twice, the pairs within the limit,
    and every label set checked before or passing its checks now. C-level set passes, for the common
    case of a node's next cycle, with a few series new to it (churn); a problem takes the loop, which
    finds the first one in order."""
    if not known:
        return False
    if distinct is not None and len(distinct) == len(labelsets):
        unique = distinct
    else:
        try:
            unique = set(labelsets)
        except TypeError:
            return False
    if len(unique) != len(labelsets) or sum(map(len, labelsets)) > limits.max_label_pairs:
        return False
    if not isinstance(known, (set, frozenset)):
        return all(map(known.__contains__, unique))
    # Set against set compares the hashes it holds: no label set is hashed a second time.
    fresh = unique - known
    if fresh:
        checker = LabelChecker(limits)
        try:
            for labels in fresh:
                checker.check_labels(labels)
        except Invalid:
            return False
    return True
