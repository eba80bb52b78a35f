"""Messages logged once per key (a node and a reason): a node that sends the same garbage a thousand times
costs one log line, the rest is counted in the metrics."""

from __future__ import annotations

import threading
from collections.abc import Hashable


class OncePerKey:
    """``first(key)``: True the first time ``key`` comes, False ever after. Thread-safe (workers of
    different nodes may ask at the same moment)."""

    def __init__(self) -> None:
        self._seen: set[Hashable] = set()
        self._lock = threading.Lock()

    def first(self, key: Hashable) -> bool:
        with self._lock:
            if key in self._seen:
                return False
            self._seen.add(key)
            return True
