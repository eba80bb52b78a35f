"""The rules of a label set, shared by encoder and decoders so the edge never spools what the cloud refuses.

A series is a tuple of (name, value) pairs: at most ``max_labels_per_series``, names matching the
Prometheus label name pattern and sorted, none twice, values non-empty and within their byte cap,
a ``__name__`` that is a valid metric name.  :class:`LabelChecker` checks whole label sets (v1 bodies
and encoding); the column decoders (v2 bodies, v3 frames) check the same rules column by column with
:func:`check_label_names`, :func:`check_metric_names` and :func:`check_schema`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Final

from schemas.codec.errors import Invalid, refuse
from schemas.codec.limits import DEFAULT_LIMITS, Limits

LABEL_NAME_RE: Final = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
METRIC_NAME_RE: Final = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


class LabelChecker:
    """Validates label sets given as parallel name/value tuples.

    The checks run as C-level set/sort/max calls per label set rather than a Python loop per label.
    Tuples of label names already checked are remembered (most series share theirs with their
    metric family), and so are metric names.
    """

    __slots__ = ("_good_metrics", "_good_names", "_limits", "_schemas")

    def __init__(self, limits: Limits) -> None:
        self._limits = limits
        self._good_names: set[str] = set()
        self._good_metrics: set[str] = set()
        # names tuple -> position of __name__ in it (-1: none); only tuples that passed the checks.
        self._schemas: dict[tuple[Any, ...], int] = {}

    def _check_names(self, names: tuple[Any, ...]) -> int:
        limits = self._limits
        n = len(names)
        if n > limits.max_labels_per_series:
            refuse("too_many_labels", f"{n} labels in one series")
        if not set(map(type, names)) <= _STR_TYPE:
            refuse("malformed", "label names and values must be strings")
        name_set = set(names)
        for name in name_set - self._good_names:
            if len(name) > limits.max_label_name_bytes:
                refuse("label_too_long", f"label name of {len(name)} characters")
            if not LABEL_NAME_RE.fullmatch(name):
                refuse("invalid_label_name", f"invalid label name {name[:64]!r}")
            self._good_names.add(name)
        if len(name_set) != n:
            refuse("duplicate_label_name", "a label name appears twice in one series")
        if list(names) != sorted(names):
            refuse("unsorted_labels", f"label names not sorted: {list(names)[:8]!r}")
        return names.index("__name__") if "__name__" in name_set else -1

    def check(self, names: tuple[Any, ...], values: tuple[Any, ...]) -> None:
        try:
            metric_at = self._schemas.get(names)
        except TypeError:  # unhashable, so not all strings: _check_names says so
            metric_at = None
        if metric_at is None:
            metric_at = self._schemas[names] = self._check_names(names)
        if not set(map(type, values)) <= _STR_TYPE:
            refuse("malformed", "label names and values must be strings")
        if "" in values:
            refuse("empty_label_value", f"label {names[values.index('')]!r} has an empty value")
        max_value = self._limits.max_label_value_bytes
        # Only encode long values: len(str) <= max/4 guarantees <= max UTF-8 bytes.
        if values and max(map(len, values)) * 4 > max_value:
            for name, value in zip(names, values, strict=True):
                if len(value) * 4 > max_value and len(value.encode("utf-8", "surrogatepass")) > max_value:
                    refuse("label_too_long", f"value of label {name!r} is longer than {max_value} bytes")
        if metric_at < 0:
            refuse("missing_metric_name", "a series has no __name__ label")
        metric = values[metric_at]
        if metric not in self._good_metrics:
            if not METRIC_NAME_RE.fullmatch(metric):
                refuse("invalid_metric_name", f"invalid metric name {metric[:64]!r}")
            self._good_metrics.add(metric)

    def check_labels(self, labels: object) -> None:
        """Check a model label set: a tuple of (name, value) tuples."""
        if type(labels) is not tuple or not set(map(type, labels)) <= _TUPLE_TYPE:
            refuse("malformed", "a label set must be a tuple of (name, value) tuples")
        if not set(map(len, labels)) <= _PAIR_LEN:
            refuse("malformed", "a label must be a (name, value) pair")
        names, values = tuple(zip(*labels, strict=True)) or ((), ())
        self.check(names, values)


_STR_TYPE: Final = frozenset({str})
_TUPLE_TYPE: Final = frozenset({tuple})
_PAIR_LEN: Final = frozenset({2})


class SeriesChecker:
    """The codec's rules for one series and one sample, for a producer that drops what breaks them one
    by one instead of failing the whole batch (the edge's shape stage), so both sides keep one rule.

    Label names and schemas that passed are remembered, as in the batch check; the memory grows with
    the distinct label names seen, so a long-lived owner replaces the checker now and then.
    """

    __slots__ = ("_checker",)

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._checker = LabelChecker(limits)

    def labels_error(self, labels: object) -> str | None:
        """The ``reason`` slug the codec would refuse this label set with, or None if it takes it."""
        try:
            self._checker.check_labels(labels)
        except Invalid as exc:
            return exc.reason
        return None


def check_label_names(names: Iterable[str]) -> None:
    for name in names:
        if not LABEL_NAME_RE.fullmatch(name):
            refuse("invalid_label_name", f"invalid label name {name[:64]!r}")


def check_metric_names(metrics: Iterable[str]) -> None:
    for metric in metrics:
        if not METRIC_NAME_RE.fullmatch(metric):
            refuse("invalid_metric_name", f"invalid metric name {metric[:64]!r}")


def check_schema(names: list[str]) -> None:
    """The label names of one series: the same rules as LabelChecker, once per schema."""
    if len(set(names)) != len(names):
        refuse("duplicate_label_name", "a label name appears twice in one series")
    if names != sorted(names):
        refuse("unsorted_labels", f"label names not sorted: {names[:8]!r}")
    if "__name__" not in names:
        refuse("missing_metric_name", "a series has no __name__ label")
