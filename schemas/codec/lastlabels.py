"""One cached result per body format for the label sets of the last batch it encoded.

A node's next cycle usually carries the same series in the same order, so the label part of the body
it encoded last is usually the one it needs next. Comparing the two lists (element by element,
identity first) costs far less than a cache keyed by label set, which hashes each of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from schemas.model import Labels

T = TypeVar("T")


class LastLabels(Generic[T]):
    """``build(labelsets)``, kept while the next list of label sets equals the last one. One entry,
    swapped whole, so threads sharing it at worst build again."""

    def __init__(self, build: Callable[[Sequence[Labels]], T]) -> None:
        self._build = build
        self._last: tuple[list[Labels], T] | None = None

    def __call__(self, labelsets: Sequence[Labels]) -> T:
        last = self._last
        if last is not None and last[0] == labelsets:
            return last[1]
        result = self._build(labelsets)
        self._last = (list(labelsets), result)  # a copy: the caller's list may change afterwards
        return result
