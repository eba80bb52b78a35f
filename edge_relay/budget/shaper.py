"""The shape stage's bandwidth-budget part: ``BudgetShaper`` applies the budget's classes to scrapes.

It runs after ``edge_relay.collect.shape.TargetShaper`` on every target's output: per series,
wall-clock-aligned windows of the class resolution (doubled by the controller's level) emit one
aggregate at the time of the window's last sample; counters keep the samples that make ``rate()`` and
``increase()`` exact across resets; precision rounding and heartbeat suppression of unchanged values.
A scrape block may hold a series only once (codec rule ``duplicate_sample``), so when a series has two
samples to send at once, the later one is carried into the next output (``flush`` of the same cycle).

Timestamps must increase per series. A sample whose own (exporter) timestamp does not advance past its
series' last one is dropped and counted in the output's ``repeated_timestamps``, which the relay
records in the loss ledger as ``duplicate_sample``: it is not shaping, so it is never ``merged``.

The edge clock stepping back (NTP after boot on a device without RTC, a manual fix) would otherwise
make every scrape of the next hour "older" than its series' state. The shaper therefore watches each
target's scrape time: when it goes back, every open window of that target's series is closed and sent
(its samples are real, at their real timestamps) and the series' state is forgotten (last timestamp,
suppression's last sent value, the counter's reset bookkeeping), so the scrapes after the step are
shaped as those of new series: a counter's first value and every unsuppressed value go out again, and
nothing is dropped. The receiver then holds samples of both clocks for the overlapping time; with
Prometheus, that needs its out-of-order window, as after an outage.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

from edge_relay.budget.model import Budget, ClassPolicy
from edge_relay.collect.shape import ShapedScrape
from schemas.model import Labels, is_counter, is_stale, metric_name

_NAN = float("nan")
# How an open window folds its samples.
_LAST, _AVG, _MIN, _MAX, _COUNTER = range(5)
_KINDS = {"last": _LAST, "avg": _AVG, "min": _MIN, "max": _MAX}
# A series unseen this long is forgotten (Prometheus itself forgets it after 5 minutes).
_FORGET_MS = 600_000
_SWEEP_EVERY_MS = 30_000


@dataclass(slots=True)
class ClassStats:
    """Cumulative sample counts of one class; kept by class name across budget reloads.

    Once no window is open: ``samples_in == samples_out + suppressed + merged``.
    """

    samples_in: int = 0
    samples_out: int = 0
    suppressed: int = 0  # unchanged value within the heartbeat
    merged: int = 0  # folded into an aggregate (a repeated timestamp is a loss, not counted here)
    precision_rounded: int = 0  # sent (or suppressed) values that rounding changed


class _Class:
    """One budget class as the shaper runs it: its policy, the controller's level and what they give."""

    __slots__ = (
        "base_ms",
        "buffered",
        "counters",
        "decimals",
        "digits",
        "fast",
        "forget_ms",
        "heartbeat_ms",
        "interval_ms",
        "kind",
        "level",
        "max_level",
        "max_ms",
        "name",
        "nstates",
        "res_ms",
        "rounds",
        "stateful",
        "stats",
    )

    def __init__(self, policy: ClassPolicy, interval_ms: int, stats: ClassStats, level: int) -> None:
        self.name = policy.name
        self.stats = stats
        self.kind = _KINDS[policy.aggregation]
        self.counters = policy.counters
        self.digits = policy.significant_digits
        self.decimals = policy.decimals
        self.rounds = self.digits > 0 or self.decimals is not None
        self.heartbeat_ms = round(policy.heartbeat_s * 1000) if policy.heartbeat_s > 0 else 0
        self.interval_ms = interval_ms
        self.base_ms = max(round(policy.resolution_s * 1000), interval_ms)
        self.max_ms = self.base_ms
        if policy.degradable:
            self.max_ms = max(round(policy.max_resolution_s * 1000), self.base_ms)
        self.max_level = 0
        while self.base_ms << self.max_level < self.max_ms:
            self.max_level += 1
        self.nstates = 0  # series with state that classify here: while any, no fast path
        self.set_level(level)

    def set_level(self, level: int) -> None:
        # Clamped, so a controller sees that one more step would change nothing.
        self.level = min(max(level, 0), self.max_level)
        self.res_ms = min(self.base_ms << self.level, self.max_ms)
        self.buffered = self.res_ms > self.interval_ms
        self.stateful = self.buffered or self.heartbeat_ms > 0
        self.fast = not self.stateful and not self.rounds  # passes through untouched
        self.forget_ms = min(2 * self.res_ms, _FORGET_MS)


class _Series:
    """Per-series state: what was sent last, the open window, the counter's reset bookkeeping."""

    __slots__ = (
        "call",
        "cls",
        "counter",
        "eager",
        "end",
        "kind",
        "labels",
        "last_ts",
        "n",
        "pend",
        "prev_v",
        "sent_ts",
        "sent_v",
        "target",
        "w_ts",
        "w_v",
        "wslot",
    )

    def __init__(self, labels: Labels, target: str, cls: int, counter: bool) -> None:
        self.labels = labels
        self.target = target
        self.cls = cls  # class index under the current budget
        self.counter = counter
        self.last_ts = -(1 << 62)  # last sample taken in (timestamps must increase)
        self.sent_v = _NAN  # NaN never equals: nothing to suppress against
        self.sent_ts = 0
        self.prev_v = _NAN  # last raw value, for counter resets
        self.end = 0  # end of the open window (ms), 0: none
        self.kind = _LAST
        self.wslot: _Class | None = None  # the class the open window was opened under
        self.n = 0
        self.w_ts = 0  # timestamp of the window's last sample
        self.w_v = 0.0  # last / sum / min / max so far
        self.eager = 0  # window samples already sent (counter resets)
        self.pend: tuple[int, float, float] | None = None  # after a reset: (ts, value, value before)
        self.call = 0  # the output this series last went into


class _Out:
    """The output being built: one sample per series at most."""

    __slots__ = ("base", "call", "labels", "repeated", "stamps", "target", "values")

    def __init__(
        self,
        target: str,
        base: int | None,
        call: int,
        labels: list[Labels],
        values: array,
        stamps: list[int] | None,
    ) -> None:
        self.target = target
        self.base = base
        self.call = call
        self.labels = labels
        self.values = values
        self.stamps = stamps
        self.repeated = 0  # samples dropped: their own timestamp did not advance

    def add(self, labels: Labels, ts: int, value: float) -> None:
        self.labels.append(labels)
        self.values.append(value)
        stamps = self.stamps
        if stamps is not None:
            stamps.append(ts)
        elif ts != self.base:
            stamps = self.stamps = [self.base] * (len(self.values) - 1)  # type: ignore[list-item]
            stamps.append(ts)


def _round(value: float, digits: int, decimals: int | None) -> float:
    """``value`` (finite) to ``digits`` significant digits, then to ``decimals`` decimals."""
    if digits and value:
        try:
            # round() is exact (correctly rounded) and several times cheaper than formatting.
            value = round(value, digits - 1 - math.floor(math.log10(abs(value))))
        except OverflowError:  # rounds past the largest float
            value = float(f"{value:.{digits - 1}e}")
    if decimals is not None:
        value = round(value, decimals)
    return value


class BudgetShaper:
    """Applies the budget's classes to shaped scrapes. One instance serves every target.

    Call ``shape`` once per target scrape and then ``flush(now)`` once per cycle, and send the outputs
    in that order: a series' second sample of a cycle (the stale marker after its window's aggregate)
    goes out in the next output, which is the cycle's ``flush``.
    """

    def __init__(self, budget: Budget, interval_s: float) -> None:
        self._interval_ms = max(1, round(interval_s * 1000))
        self._slots: list[_Class] = []
        self._by_name: dict[str, ClassStats] = {}
        self.stats: list[ClassStats] = []  # per class index of the current budget
        self._states: dict[Labels, _Series] = {}
        self._ends: dict[int, list[_Series]] = {}  # window end -> series that opened one ending then
        self._carry: list[tuple[str, Labels, int, float]] = []  # (target, labels, ts, value), in order
        self._blocked: set[Labels] = set()  # series already in (or still carried past) this output
        self._clock: dict[str, int] = {}  # target -> its last scrape time: a step back resets it
        self._call = 0
        self._swept = 0
        self._all_fast = True
        # Series an anomaly window holds at full resolution (``edge_relay.anomaly.detector``): exact label
        # sets, so every other series pays one test of an (almost always empty) set, on the stateful
        # path only.
        self.override: frozenset[Labels] = frozenset()
        self.override_samples = 0  # sent at full resolution because of the override
        self.set_budget(budget)

    # --- configuration ----------------------------------------------------------------------------

    def set_budget(self, budget: Budget) -> None:
        if not budget.classes:
            raise ValueError(f"{budget.source}: a budget needs at least one class")
        old = self._slots
        levels = {c.name: c.level for c in old}
        slots = [
            _Class(
                p, self._interval_ms, self._by_name.setdefault(p.name, ClassStats()), levels.get(p.name, 0)
            )
            for p in budget.classes
        ]
        names = {c.name for c in slots}
        for st in self._states.values():
            if old[st.cls].name not in names:
                st.sent_v = _NAN  # its class is gone: the new rules start from a sent value
            # Open windows finish under the class they were opened with (st.wslot).
            st.cls = budget.classify(st.labels)
            slot = slots[st.cls]
            slot.nstates += 1
            st.counter = is_counter(metric_name(st.labels), slot.counters)
        self._budget = budget
        self._slots = slots
        self.stats = [c.stats for c in slots]
        self._all_fast = all(c.fast for c in slots)

    def set_level(self, class_index: int, level: int) -> None:
        self._slots[class_index].set_level(level)
        self._all_fast = all(c.fast for c in self._slots)

    def level(self, class_index: int) -> int:
        return self._slots[class_index].level

    def resolution_s(self, class_index: int) -> float:
        return self._slots[class_index].res_ms / 1000

    def held(self, now_ms: int) -> tuple[int, int]:
        """Samples taken into windows still open (gone with the process if it is killed now), and the
        earliest time they can be from: a window open at ``now_ms`` ends after it, so it started less
        than one resolution before."""
        samples = sum(s.samples_in - s.samples_out - s.suppressed - s.merged for s in self._by_name.values())
        widest = max((slot.res_ms for slot in self._slots if slot.stateful), default=0)
        return samples, now_ms - widest

    # --- the stage --------------------------------------------------------------------------------

    def shape(self, scrape: ShapedScrape) -> ShapedScrape:
        """What to send now for this scrape; ``scrape`` itself when every class passes through."""
        slots = self._slots
        classify = self._budget.classify
        counts = [0] * len(slots)
        base = scrape.timestamp_ms
        stepped_back = base < self._clock.get(scrape.target, base)
        self._clock[scrape.target] = base
        if self._all_fast and not self._states and not self._carry:
            if len(slots) == 1:
                counts[0] = len(scrape)
            else:
                for labels in scrape.labels:
                    counts[classify(labels)] += 1
            self._count_passed(counts)
            return scrape
        ts_in = scrape.timestamps
        out = ShapedScrape(
            scrape.target,
            base,
            stale_markers=scrape.stale_markers,
            duplicates=scrape.duplicates,
            over_label_limits=scrape.over_label_limits,
        )
        self._call += 1
        em = _Out(scrape.target, base, self._call, out.labels, out.values, None if ts_in is None else [])
        if stepped_back:
            self._restart(em, scrape.target)
        if self._carry:
            self._drain(em, scrape.target)
        blocked = self._blocked
        labels_out, values_out, values_in = out.labels, out.values, scrape.values
        stamps = em.stamps
        feed = self._feed
        override = self.override
        for i, labels in enumerate(scrape.labels):
            cls = classify(labels)
            slot = slots[cls]
            ts = base if ts_in is None else ts_in[i]
            if not slot.stateful and not slot.nstates and not blocked:
                value = values_in[i]
                if slot.rounds and value - value == 0:  # finite only
                    rounded = _round(value, slot.digits, slot.decimals)
                    if rounded != value:
                        slot.stats.precision_rounded += 1
                        value = rounded
                labels_out.append(labels)
                values_out.append(value)
                if stamps is not None:
                    stamps.append(ts)
                counts[cls] += 1
                continue
            if override and labels in override:
                self._exempt(em, labels, slot, ts, values_in[i])
            else:
                feed(em, labels, cls, slot, ts, values_in[i])
            stamps = em.stamps
        blocked.clear()
        self._count_passed(counts)
        out.timestamps = em.stamps
        out.repeated_timestamps = em.repeated
        return out

    def flush(self, now_ms: int) -> ShapedScrape | None:
        """Close every open window that ended by ``now_ms``; the output mixes targets (target "")."""
        self._call += 1
        em = _Out("", None, self._call, [], array("d"), None)
        if self._carry:
            self._drain(em, None)
        ends = self._ends
        due = sorted(end for end in ends if end <= now_ms)
        slots = self._slots
        for end in due:
            for st in ends.pop(end):
                if st.end == end:  # else that window closed already and the series moved on
                    self._close(em, st)
                    if not slots[st.cls].stateful:
                        self._drop(st)
        if not 0 <= now_ms - self._swept < _SWEEP_EVERY_MS:
            self._sweep(now_ms)
        self._blocked.clear()
        if not em.values:
            return None
        assert em.stamps is not None
        newest = max(em.stamps)
        stamps = None if all(t == newest for t in em.stamps) else em.stamps
        return ShapedScrape("", newest, em.labels, em.values, stamps)

    # --- internals --------------------------------------------------------------------------------

    def _count_passed(self, counts: list[int]) -> None:
        for slot, n in zip(self._slots, counts, strict=True):
            if n:
                slot.stats.samples_in += n
                slot.stats.samples_out += n

    def _drain(self, em: _Out, target: str | None) -> None:
        """Carried samples first, one per series; the rest wait for the next output."""
        keep: list[tuple[str, Labels, int, float]] = []
        blocked = self._blocked
        for item in self._carry:
            if (target is not None and item[0] != target) or item[1] in blocked:
                keep.append(item)
            else:
                blocked.add(item[1])
                em.add(item[1], item[2], item[3])
        self._carry = keep

    def _put(self, em: _Out, st: _Series | None, labels: Labels, ts: int, value: float) -> None:
        if st is not None:
            if st.call == em.call:
                self._carry.append((st.target, labels, ts, value))
                return
            st.call = em.call
        if self._blocked and labels in self._blocked:
            self._carry.append((em.target, labels, ts, value))
            return
        em.add(labels, ts, value)

    def _emit(
        self, em: _Out, st: _Series | None, slot: _Class, labels: Labels, ts: int, value: float
    ) -> None:
        """Precision, then suppression, then out."""
        stats = slot.stats
        if slot.rounds and value - value == 0:  # finite only
            rounded = _round(value, slot.digits, slot.decimals)
            if rounded != value:
                stats.precision_rounded += 1
                value = rounded
        if st is not None:
            hb = slot.heartbeat_ms
            if hb and value == st.sent_v and ts - st.sent_ts < hb:
                stats.suppressed += 1
                return
            st.sent_v = value
            st.sent_ts = ts
        stats.samples_out += 1
        self._put(em, st, labels, ts, value)

    def _feed(self, em: _Out, labels: Labels, cls: int, slot: _Class, ts: int, value: float) -> None:
        st = self._states.get(labels)
        if st is not None:
            if ts <= st.last_ts:
                # A repeated or older own timestamp: the receiver would refuse it. A loss, not shaping:
                # counted for the ledger, and not in the class's samples at all.
                em.repeated += 1
                return
            if st.end:
                if ts < st.end and value == value:
                    self._join(em, st, ts, value)
                    return
                self._close(em, st)
        if value != value:  # NaN, the stale marker among them: never folded nor suppressed
            slot.stats.samples_in += 1
            slot.stats.samples_out += 1
            self._put(em, st, labels, ts, value)
            if st is not None:
                if not slot.stateful or is_stale(value):
                    self._drop(st)
                else:
                    st.last_ts = st.sent_ts = ts
                    st.sent_v = st.prev_v = value
            return
        slot.stats.samples_in += 1
        if not slot.stateful:
            if st is not None:
                self._drop(st)  # left over from a coarser level or another budget
            self._emit(em, st, slot, labels, ts, value)
            return
        new = st is None
        if st is None:
            st = _Series(labels, em.target, cls, is_counter(metric_name(labels), slot.counters))
            self._states[labels] = st
            slot.nstates += 1
        elif ts - st.last_ts >= slot.forget_ms:
            st.sent_v = _NAN  # gone for long: Prometheus forgot it too, so the value goes out
        st.last_ts = ts
        if not slot.buffered or (new and st.counter):
            # Every scrape (suppression only); or a counter's first sample, so that increase() over the
            # series' whole life stays exact.
            self._emit(em, st, slot, labels, ts, value)
            st.prev_v = value
            return
        res = slot.res_ms
        end = (ts // res + 1) * res
        st.end = end
        st.wslot = slot
        st.n = 1
        st.w_ts = ts
        st.w_v = value
        st.eager = 0
        if st.counter:
            st.kind = _COUNTER
            # A reset since the last window: the value before it went out as that window's last.
            st.pend = (ts, value, st.prev_v) if value < st.prev_v else None
        else:
            st.kind = slot.kind
        st.prev_v = value
        bucket = self._ends.get(end)
        if bucket is None:
            self._ends[end] = [st]
        else:
            bucket.append(st)

    def _exempt(self, em: _Out, labels: Labels, slot: _Class, ts: int, value: float) -> None:
        """A series under an anomaly window: its open window closes (its aggregate is a real sample at
        its own timestamp) and the raw sample goes out as scraped: no rounding, no suppression, so the
        recorder's past part and the live part agree bit for bit. Its state is forgotten: when the
        window ends it is shaped as a new series (a counter's first value goes out again)."""
        st = self._states.get(labels)
        if st is not None:
            if ts <= st.last_ts:
                em.repeated += 1  # as in _feed: the receiver would refuse it
                return
            if st.end:
                self._close(em, st)
        slot.stats.samples_in += 1
        slot.stats.samples_out += 1
        self.override_samples += 1
        # With a state, _put carries the sample to the next output when the aggregate took this one.
        self._put(em, st, labels, ts, value)
        if st is not None:
            self._drop(st)

    def _join(self, em: _Out, st: _Series, ts: int, value: float) -> None:
        slot = st.wslot
        assert slot is not None
        slot.stats.samples_in += 1
        kind = st.kind
        if kind == _COUNTER:
            before = st.prev_v
            if value < before:
                # A reset: the sample before it goes out now, so increase() keeps what was counted.
                st.eager += 1
                self._emit(em, st, slot, st.labels, st.w_ts, before)
                st.pend = (ts, value, before)
            elif st.pend is not None and value >= st.pend[2]:
                # Back above the value before the reset: without the first sample after the reset,
                # the receiver would see no reset at all.
                pts, pvalue, _ = st.pend
                st.pend = None
                st.eager += 1
                self._emit(em, st, slot, st.labels, pts, pvalue)
            st.w_v = value
        elif kind == _LAST:
            st.w_v = value
        elif kind == _AVG:
            st.w_v += value
        elif kind == _MAX:
            if value > st.w_v:
                st.w_v = value
        elif value < st.w_v:
            st.w_v = value
        st.n += 1
        st.w_ts = st.last_ts = ts
        st.prev_v = value

    def _close(self, em: _Out, st: _Series) -> None:
        slot = st.wslot
        assert slot is not None
        n = st.n
        value = st.w_v / n if st.kind == _AVG else st.w_v
        st.end = 0
        st.wslot = None
        st.pend = None
        slot.stats.merged += n - 1 - st.eager
        self._emit(em, st, slot, st.labels, st.w_ts, value)

    def _restart(self, em: _Out, target: str) -> None:
        """The clock stepped back under ``target``: close its series' open windows into this output and
        forget their state, so this scrape and the ones after it are shaped as those of new series."""
        gone = [st for st in self._states.values() if st.target == target]
        for st in gone:
            if st.end:
                self._close(em, st)
                # The series' sample of this scrape follows in the cycle's flush: one per output.
                self._blocked.add(st.labels)
            self._drop(st)
        if gone:
            # Closed windows would otherwise wait in their (now future) end buckets for the old clock.
            for end in list(self._ends):
                alive = [st for st in self._ends[end] if st.end == end]
                if alive:
                    self._ends[end] = alive
                else:
                    del self._ends[end]

    def _drop(self, st: _Series) -> None:
        del self._states[st.labels]
        self._slots[st.cls].nstates -= 1

    def _sweep(self, now_ms: int) -> None:
        """Forget series without an open window that vanished (or whose class needs no state now)."""
        self._swept = now_ms
        slots = self._slots
        gone = [
            st
            for st in self._states.values()
            if not st.end and (not slots[st.cls].stateful or now_ms - st.last_ts >= slots[st.cls].forget_ms)
        ]
        for st in gone:
            self._drop(st)
