"""Retry policy shared by the edge (MQTT reconnect) and the cloud (remote-write HTTP writer).

Capped exponential backoff with jitter, after "Exponential Backoff And Jitter" (AWS architecture
blog): jitter spreads the reconnects of many edge nodes after a cloud outage instead of letting them
arrive in lock-step.
"""

from __future__ import annotations

import datetime
import email.utils
import math
import random
import re
import time
from typing import Literal, Protocol

__all__ = ["DEFAULT_RETRY_AFTER_CAP_S", "Backoff", "parse_retry_after"]

Jitter = Literal["full", "equal"]

# A server asking for more than an hour is almost certainly misconfigured; callers cap further.
DEFAULT_RETRY_AFTER_CAP_S = 3600.0


class _Rng(Protocol):
    def random(self) -> float: ...


class Backoff:
    """Delays for successive retries: ceiling = min(max_s, initial_s * multiplier**n), then jitter.

    ``jitter="full"``: uniform in [0, ceiling) (best spread, may retry almost at once).
    ``jitter="equal"``: uniform in [ceiling/2, ceiling) (keeps a floor of half the ceiling).

    Not thread-safe: give each retry loop its own instance (see :meth:`clone`).
    """

    __slots__ = ("_ceiling", "_jitter", "_rng", "attempts", "initial_s", "max_s", "multiplier")

    def __init__(
        self,
        initial_s: float,
        max_s: float,
        multiplier: float = 2.0,
        jitter: Jitter = "full",
        rng: _Rng | None = None,
    ) -> None:
        if not (math.isfinite(initial_s) and initial_s > 0):
            raise ValueError(f"initial_s must be a positive finite number, got {initial_s!r}")
        if not (math.isfinite(max_s) and max_s >= initial_s):
            raise ValueError(f"max_s must be finite and >= initial_s, got {max_s!r}")
        if not (math.isfinite(multiplier) and multiplier >= 1.0):
            raise ValueError(f"multiplier must be >= 1, got {multiplier!r}")
        if jitter not in ("full", "equal"):
            raise ValueError(f"jitter must be 'full' or 'equal', got {jitter!r}")
        self.initial_s = float(initial_s)
        self.max_s = float(max_s)
        self.multiplier = float(multiplier)
        self._jitter: Jitter = jitter
        self._rng: _Rng = rng if rng is not None else random.Random()
        self._ceiling = self.initial_s
        self.attempts = 0

    def next_delay(self) -> float:
        """Delay before the next retry, in seconds; advances the exponent."""
        ceiling = self._ceiling
        # Grow the ceiling iteratively rather than initial * multiplier**n: no float overflow after
        # thousands of retries during a long outage.
        self._ceiling = min(self.max_s, ceiling * self.multiplier)
        self.attempts += 1
        r = self._rng.random()
        if self._jitter == "full":
            return ceiling * r
        half = ceiling / 2.0
        return half + half * r

    @property
    def ceiling_s(self) -> float:
        """Upper bound of the next delay (before jitter)."""
        return self._ceiling

    def reset(self) -> None:
        """Call after a success so the next failure starts again from ``initial_s``."""
        self._ceiling = self.initial_s
        self.attempts = 0

    def clone(self) -> Backoff:
        """A fresh instance with the same parameters (and the same rng), for another retry loop."""
        return Backoff(self.initial_s, self.max_s, self.multiplier, self._jitter, self._rng)

    def __repr__(self) -> str:
        return (
            f"Backoff(initial_s={self.initial_s}, max_s={self.max_s}, multiplier={self.multiplier}, "
            f"jitter={self._jitter!r}, attempts={self.attempts})"
        )


# RFC 9110 delay-seconds is 1*DIGIT; we also accept a sign and a fraction because some proxies send
# them, and treat a negative delay as "now".
_DELTA_RE = re.compile(r"[+-]?\d+(?:\.\d+)?")


def parse_retry_after(
    header_value: str | None,
    now: float | None = None,
    *,
    cap_s: float = DEFAULT_RETRY_AFTER_CAP_S,
) -> float | None:
    """Seconds to wait according to a ``Retry-After`` header, or None when absent or unparseable.

    Accepts delay-seconds (``"120"``) and HTTP-date (``"Wed, 21 Oct 2015 07:28:00 GMT"``).  ``now``
    is Unix time (default ``time.time()``), used for the HTTP-date form.  The result is clamped to
    ``[0, cap_s]``: dates in the past and negative deltas mean "retry now".
    """
    if header_value is None:
        return None
    text = header_value.strip()
    if not text:
        return None
    if _DELTA_RE.fullmatch(text):
        delay = float(text)
    else:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        if when.tzinfo is None:
            # HTTP-dates are always GMT; parsedate gives a naive datetime for "-0000".
            when = when.replace(tzinfo=datetime.UTC)
        delay = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(delay):
        return cap_s if delay > 0 else None
    return min(max(delay, 0.0), cap_s)
