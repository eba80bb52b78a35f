"""Unit tests of edge_relay/budget/controller.py: allowed rate (windows, quota), degrade/restore order,
status.

The shaper is a stand-in with the BudgetShaper's level interface (the real one is tested in
tests/edge/test_shape_budget.py; the closed loop on real services in
tests/system/test_budget_e2e.py), and so is
the pacer: the test drives its wire and payload totals and records what the controller configures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from edge_relay.budget import Budget, ClassPolicy, RateWindow, UplinkBudget
from edge_relay.budget.controller import Controller
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.spool import Spool


@dataclass
class Stats:
    samples_out: int = 0


@dataclass
class FakeShaper:
    budget: Budget
    interval_s: float
    levels: dict[int, int] = field(default_factory=dict)
    stats: list[Stats] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.stats = [Stats() for _ in self.budget.classes]

    def level(self, i: int) -> int:
        return self.levels.get(i, 0)

    def set_level(self, i: int, level: int) -> None:
        c = self.budget.classes[i]
        self.levels[i] = level if c.degradable else 0

    def resolution_s(self, i: int) -> float:
        c = self.budget.classes[i]
        base = max(c.resolution_s, self.interval_s)
        return min(base * 2 ** self.level(i), max(c.max_resolution_s, base))


@dataclass
class FakePacer:
    """The pacer's controller-side interface: totals the test sets, configurations it records."""

    wire_total: int = 0
    published_payload_bytes: int = 0
    pacing: list[tuple[float | None, float]] = field(default_factory=list)

    def configure(self, rate: float | None, burst: float) -> None:
        self.pacing.append((rate, burst))


CLASSES = (
    ClassPolicy("critical"),  # never degrades
    ClassPolicy("kepler", resolution_s=5, max_resolution_s=20),
    ClassPolicy("rest", resolution_s=5, max_resolution_s=40),
)
NOON = datetime(2026, 11, 30, 12, 0, tzinfo=UTC).timestamp()


def budget(rate: int = 10_000, *, quota: int = 0, windows: tuple[RateWindow, ...] = ()) -> Budget:
    up = UplinkBudget(
        sustained_bytes_per_second=rate,
        burst_bytes=4 * rate,
        daily_quota_bytes=quota,
        windows=windows,
        batch_window_seconds=10,
    )
    return Budget("budget.yaml", up, CLASSES)


class Rig:
    def __init__(self, tmp_path: Path, b: Budget, start: float = NOON) -> None:
        self.now = start
        self.pacer = FakePacer()
        self.pacing = self.pacer.pacing
        self.spool = Spool(tmp_path / "spool.db")
        self.shaper = FakeShaper(b, 5.0)
        self.metrics = RelayMetrics()
        self.controller = self.make(b)

    def make(self, b: Budget) -> Controller:
        return Controller(
            b,
            self.shaper,  # type: ignore[arg-type]
            self.spool.meta,
            self.metrics,
            interval_s=5.0,
            pacer=self.pacer,  # type: ignore[arg-type]
            clock=lambda: self.now,
        )

    def run(self, seconds: float, produce_per_s: float, backlog: int = 0) -> None:
        """Cycles of 5 s producing ``produce_per_s`` bytes/s of batches, all of it on the wire."""
        for _ in range(int(seconds / 5)):
            self.now += 5
            self.controller.produced(int(produce_per_s * 5))
            self.pacer.wire_total += int(produce_per_s * 5)
            self.pacer.published_payload_bytes = self.pacer.wire_total
            for s in self.shaper.stats:
                s.samples_out += 100
            self.controller.tick(backlog)


def test_slightly_over_budget_takes_one_step_on_the_lowest_class(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    rig.run(25, 9_500)  # over 90%; one step on `rest` (a third of the samples) predicts 7,917: enough
    assert rig.shaper.levels == {2: 1}
    assert rig.controller.state == "degraded"


def test_far_over_budget_steps_lowest_class_first_several_at_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    rig.run(25, 20_000)  # the first hold period (2 batch windows = 20 s) has passed once
    # rest 5 s -> 10 -> 20 -> 40 (its max), then kepler once: four steps, the most at once
    assert rig.shaper.levels == {2: 3, 1: 1}
    rig.run(20, 20_000)
    assert rig.shaper.levels == {2: 3, 1: 2}  # kepler at its max 20 s
    rig.run(100, 20_000)
    assert rig.shaper.levels == {2: 3, 1: 2}  # critical never
    assert rig.shaper.level(0) == 0
    assert rig.controller.state == "degraded"
    value = rig.metrics.registry.get_sample_value
    assert value("edge_relay_budget_degrade_steps_total", {"class": "rest", "direction": "degrade"}) == 3
    assert value("edge_relay_budget_resolution_seconds", {"class": "rest"}) == 40
    assert value("edge_relay_budget_degrade_level", {"class": "kepler"}) == 2


def test_under_budget_restores_most_important_class_first(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    rig.shaper.levels = {1: 2, 2: 3}
    rig.run(25, 2_000)
    assert rig.shaper.levels == {1: 1, 2: 3}
    rig.run(20, 2_000)
    assert rig.shaper.levels == {1: 0, 2: 3}
    rig.run(20, 2_000)
    assert rig.shaper.levels == {1: 0, 2: 2}


def test_restore_waits_when_the_restored_demand_would_not_fit(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    rig.shaper.levels = {2: 1}
    # 55% of the budget: below the restore threshold, but rest's share (1/3 of samples) would make it
    # 55% x 4/3 = 73%: fits under 80%, so it is restored...
    rig.run(25, 5_500)
    assert rig.shaper.levels == {2: 0}
    rig.shaper.levels = {2: 1}
    rig.shaper.stats[2].samples_out += 10**6  # ...while a class carrying nearly all samples is not
    rig.run(25, 5_500)
    assert rig.shaper.levels == {2: 1}


def test_growing_backlog_degrades_even_when_demand_fits(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    for i in range(6):
        rig.run(5, 5_000, backlog=200_000 + i * 10_000)
    assert rig.shaper.levels == {2: 1}
    assert rig.controller.state == "backlogged"


def test_time_window_rate(tmp_path: Path) -> None:
    night = RateWindow(start_minute=22 * 60, end_minute=6 * 60, bytes_per_second=50_000)
    rig = Rig(tmp_path, budget(10_000, windows=(night,)))
    assert rig.controller.allowed_rate(NOON) == 10_000
    at_23 = datetime(2026, 11, 30, 23, 0, tzinfo=UTC).timestamp()
    assert rig.controller.allowed_rate(at_23) == 50_000
    assert rig.controller.allowed_rate(at_23 + 6 * 3600) == 50_000  # 05:00: still the night window
    assert rig.controller.allowed_rate(at_23 + 8 * 3600) == 10_000  # 07:00
    rig.now = at_23
    rig.run(5, 100)
    assert rig.pacing[-1][0] == 50_000


def test_daily_quota_spreads_what_is_left_and_persists(tmp_path: Path) -> None:
    quota = 12 * 3600 * 1000  # 1000 B/s over the 12 h left at noon
    rig = Rig(tmp_path, budget(10_000, quota=quota))
    assert rig.controller.allowed_rate(NOON) == pytest.approx(1000)
    rig.run(5, 0)
    rig.pacer.wire_total += quota // 2
    rig.run(60, 0)  # saved once a minute
    assert rig.controller.used_today == quota // 2
    assert rig.pacing[-1][0] == pytest.approx(500, rel=0.01)
    # a restart keeps today's use
    again = rig.make(budget(10_000, quota=quota))
    assert again.used_today == quota // 2
    # used up: nothing more today, and the state says so
    rig.pacer.wire_total += quota
    rig.run(5, 0)
    assert rig.pacing[-1] == (0.0, 0.0)
    assert rig.controller.state == "quota_exhausted"
    # a new day starts with a fresh quota
    rig.now = datetime(2026, 12, 1, 0, 0, 5, tzinfo=UTC).timestamp()
    rig.run(5, 0)
    assert rig.controller.used_today == 0
    assert rig.pacing[-1][0] == pytest.approx(quota / 86400, rel=0.01)


def test_status_fields_for_the_fleet_view(tmp_path: Path) -> None:
    rig = Rig(tmp_path, budget(10_000))
    rig.run(30, 4_000)
    st = rig.controller.status()
    assert st["budget_state"] == "ok"
    assert st["budget_bytes_per_s"] == 10_000
    assert st["wire_bytes_per_s"] == pytest.approx(4_000, rel=0.01)
    assert st["degrade_level"] == 0
