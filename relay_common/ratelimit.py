"""A log line that may repeat every few milliseconds (a retry loop) is logged at most once an interval."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class RateLimitedLog:
    """At most one record at ``level`` per ``interval_s``; the rest go to DEBUG and are counted in the
    next one. Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        clock: Callable[[], float],
        level: int = logging.WARNING,
    ) -> None:
        self._logger = logger
        self._level = level
        self._interval_s = interval_s
        self._clock = clock
        self._last = -float("inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args: object) -> None:
        with self._lock:
            now = self._clock()
            loud = now - self._last >= self._interval_s
            if loud:
                if self._suppressed:
                    msg += " (%d similar warnings suppressed)"
                    args = (*args, self._suppressed)
                self._last = now
                self._suppressed = 0
            else:
                self._suppressed += 1
        self._logger.log(self._level if loud else logging.DEBUG, msg, *args)
