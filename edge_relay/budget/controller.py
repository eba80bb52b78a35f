"""The bandwidth-budget controller: keeps what the relay produces inside what the uplink may carry.

Two mechanisms, one hard and one adaptive:

- **Pacing (hard).** The uplink publishes through the pacer (``edge_relay.uplink.pacer``), a token
  bucket of the rate and burst this controller sets every cycle, charged with the bytes the kernel
  counted on the broker connection (both directions: batches, MQTT framing, acks, status messages,
  retransmissions, TLS). Over any period T the connection carries at most ``burst + rate x T`` plus one
  batch. Data the budget cannot carry yet waits in the spool: late, not lost.
- **Degrading (adaptive).** Every cycle the controller compares the *demand* (bytes/s of new batches in
  the spool over the last two batch windows, times the measured wire/payload overhead) with the allowed
  rate. Above 90%, or with a backlog that keeps growing, it doubles the resolution of the lowest-priority
  class that may still degrade (the last class first; a class whose ``degrade.max_resolution_seconds``
  is not above its resolution, the critical class, never degrades); far over, it takes up to four such
  steps at once, while the demand it predicts from the classes' shares of the samples is still over.
  Below 60%, with no backlog, it restores the most important degraded class first, but only when the
  restored demand (estimated from that class's share of the samples) stays below 80%. After a step it
  waits two batch windows (at least three intervals) for the effect to show before the next one.

The allowed rate is the budget's rate for the time window in force, lowered by a daily quota to what is
left of it spread over the rest of the day. Quota use is the connection's bytes since local midnight of
the budget's timezone, kept in the spool's meta table so a restart does not reset it.

From the pacer the controller reads ``wire_total`` (quota use, wire rate) and
``published_payload_bytes`` (the wire/payload overhead), and it calls ``configure(rate, burst)``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from edge_relay.budget.model import Budget
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.spool import MetaTable

if TYPE_CHECKING:
    from edge_relay.budget.shaper import BudgetShaper
    from edge_relay.uplink.pacer import Pacer

log = logging.getLogger("edge_relay.budget.controller")

DEGRADE_ABOVE = 0.9
RESTORE_BELOW = 0.6
RESTORE_TARGET = 0.8
# Per MQTT message: topic, framing and PUBACK, our ack message back; used until overhead is measured.
DEFAULT_OVERHEAD = 1.05
QUOTA_SAVE_EVERY_S = 60.0
MAX_STEPS_AT_ONCE = 4


class Controller:
    def __init__(
        self,
        budget: Budget,
        shaper: BudgetShaper,
        meta: MetaTable,
        metrics: RelayMetrics,
        *,
        interval_s: float,
        pacer: Pacer,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.shaper = shaper
        self.meta = meta
        self.metrics = metrics
        self.interval_s = interval_s
        self.pacer = pacer
        self.clock = clock
        self.budget = budget
        now = clock()
        self._day = self._day_of(now)
        stored_day = meta.get("budget_day", -1)
        self.used_today = meta.get("budget_used_bytes", 0) if stored_day == self._day else 0
        self._last_wire = pacer.wire_total
        self._saved_at = -QUOTA_SAVE_EVERY_S
        self._produced: deque[tuple[float, int]] = deque([(now, 0)])
        self._produced_total = 0
        self._payload_wire: deque[tuple[float, int, int]] = deque(
            [(now, self._last_wire, pacer.published_payload_bytes)]
        )
        self._last_step = now
        self._out_at_step: list[int] = []
        self._last_backlog = 0
        self.rate = 0.0
        self.demand = 0.0
        self.wire_rate = 0.0
        self.state = "ok"
        self._apply_levels_metrics()

    # --- inputs -------------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        self.budget = budget
        self._apply_levels_metrics()

    def produced(self, nbytes: int) -> None:
        """Encoded bytes of batches just added to the spool."""
        self._produced_total += nbytes

    # --- the loop -----------------------------------------------------------------------------

    def _day_of(self, now: float) -> int:
        return self.budget.local_time(now).date().toordinal()

    def allowed_rate(self, now: float) -> float:
        return float(self.budget.allowed_bytes_per_second(now, self.used_today))

    def _window_s(self) -> float:
        return max(self.budget.uplink.batch_window_seconds, self.interval_s)

    def _rate_over(self, samples: deque[tuple[float, int]], now: float, value: int) -> float:
        samples.append((now, value))
        horizon = now - 2 * self._window_s() - self.interval_s
        while len(samples) > 2 and samples[1][0] <= horizon:
            samples.popleft()
        t0, v0 = samples[0]
        return (value - v0) / (now - t0) if now > t0 else 0.0

    def tick(self, backlog_bytes: int) -> None:
        """Once per cycle, after the cycle's batches are spooled."""
        now = self.clock()
        published = self.pacer.published_payload_bytes
        wire = self.pacer.wire_total
        day = self._day_of(now)
        if day != self._day:
            self._day, self.used_today = day, 0
        self.used_today += max(0, wire - self._last_wire)
        self._last_wire = wire
        quota = self.budget.uplink.daily_quota_bytes
        # A write (and fsync) per minute at most: a restart may forget under a minute of use.
        if quota and (now - self._saved_at >= QUOTA_SAVE_EVERY_S or self.used_today >= quota):
            self.meta.set({"budget_day": self._day, "budget_used_bytes": self.used_today})
            self._saved_at = now

        self.rate = self.allowed_rate(now)
        up = self.budget.uplink
        burst = float(up.burst_bytes)
        if up.daily_quota_bytes:
            burst = min(burst, max(0.0, float(up.daily_quota_bytes - self.used_today)))
        self.pacer.configure(self.rate, burst)

        produced = self._rate_over(self._produced, now, self._produced_total)
        self._payload_wire.append((now, wire, published))
        horizon = now - 2 * self._window_s() - self.interval_s
        while len(self._payload_wire) > 2 and self._payload_wire[1][0] <= horizon:
            self._payload_wire.popleft()
        t0, w0, p0 = self._payload_wire[0]
        self.wire_rate = (wire - w0) / (now - t0) if now > t0 else 0.0
        payload = published - p0
        overhead = (wire - w0) / payload if payload > 4096 else DEFAULT_OVERHEAD
        self.demand = produced * max(1.0, min(overhead, 3.0))

        growing = backlog_bytes > self._last_backlog
        self._last_backlog = backlog_bytes
        backlog_big = backlog_bytes > max(burst, self.rate * self._window_s()) * 2
        if now - self._last_step >= max(2 * self._window_s(), 3 * self.interval_s):
            over = self.demand > DEGRADE_ABOVE * self.rate or (backlog_big and growing)
            under = self.demand < RESTORE_BELOW * self.rate and not backlog_big
            if (over and self._step(+1)) or (not over and under and self._step(-1)):
                self._last_step = now
        degraded = any(self.shaper.level(i) for i in range(len(self.budget.classes)))
        if up.daily_quota_bytes and self.used_today >= up.daily_quota_bytes:
            self.state = "quota_exhausted"
        elif backlog_big:
            self.state = "backlogged"
        elif degraded:
            self.state = "degraded"
        else:
            self.state = "ok"
        self.metrics.budget_rate.set(self.rate)
        self.metrics.budget_burst.set(burst)
        self.metrics.budget_quota_used.set(self.used_today)

    def _out_shares(self) -> list[float]:
        """Each class's share of the samples sent since the last step (restoring a class doubles it)."""
        totals = [self.shaper.stats[i].samples_out for i in range(len(self.budget.classes))]
        prev = self._out_at_step if len(self._out_at_step) == len(totals) else [0] * len(totals)
        deltas = [max(0, t - p) for t, p in zip(totals, prev, strict=True)]
        whole = sum(deltas) or 1
        return [d / whole for d in deltas]

    def _step(self, direction: int) -> bool:
        classes = self.budget.classes
        shaper = self.shaper
        shares = self._out_shares()
        if direction > 0:
            # Far over the budget, one step per hold would take many windows (the backlog grows
            # meanwhile): take steps, lowest class first, until the demand they predict fits, up to
            # MAX_STEPS_AT_ONCE. Halving a class's samples is assumed to halve its share of the bytes
            # (optimistic: its label table stays), so the next decision corrects what is left.
            predicted, steps = self.demand, 0
            while steps < MAX_STEPS_AT_ONCE and (steps == 0 or predicted > DEGRADE_ABOVE * self.rate):
                i = next(
                    (
                        j
                        for j in reversed(range(len(classes)))
                        if classes[j].degradable and shaper.resolution_s(j) < classes[j].max_resolution_s
                    ),
                    None,
                )
                if i is None:
                    break
                self._set(i, shaper.level(i) + 1, "degrade")
                cut = shares[i] / 2
                predicted *= 1 - cut
                shares = [(x if j != i else x / 2) / (1 - cut) for j, x in enumerate(shares)]
                steps += 1
            return steps > 0
        for i in range(len(classes)):
            level = shaper.level(i)
            if level > 0:
                # Restoring doubles this class's samples: estimate the demand that follows.
                predicted = self.demand * (1 + shares[i])
                if predicted < RESTORE_TARGET * self.rate:
                    return self._set(i, level - 1, "restore")
                return False
        return False

    def _set(self, i: int, level: int, direction: str) -> bool:
        name = self.budget.classes[i].name
        before = self.shaper.resolution_s(i)
        self.shaper.set_level(i, level)
        after = self.shaper.resolution_s(i)
        log.info(
            "budget: %s class %s: resolution %gs -> %gs (demand %.0f B/s, allowed %.0f B/s)",
            direction,
            name,
            before,
            after,
            self.demand,
            self.rate,
        )
        self.metrics.budget_steps.labels(name, direction).inc()
        self._out_at_step = [self.shaper.stats[j].samples_out for j in range(len(self.budget.classes))]
        self._apply_levels_metrics()
        return True

    def _apply_levels_metrics(self) -> None:
        for i, c in enumerate(self.budget.classes):
            self.metrics.budget_level.labels(c.name).set(self.shaper.level(i))
            self.metrics.budget_resolution.labels(c.name).set(self.shaper.resolution_s(i))

    def status(self) -> dict[str, object]:
        return {
            "budget_state": self.state,
            "budget_bytes_per_s": round(self.rate, 1),
            "wire_bytes_per_s": round(self.wire_rate, 1),
            "degrade_level": sum(self.shaper.level(i) for i in range(len(self.budget.classes))),
            "budget_quota_used_bytes": self.used_today,
        }
