"""An aggregation window open at a SIGKILL (issue 12 item 9): what it held ends in the loss ledger.

Unit level: ``BudgetShaper.held`` counts exactly the samples taken into windows still open. End to end:
a real relay with a 300 s ``avg`` class is SIGKILLed mid-window; its next start records those samples as
``open_window_at_kill`` (once), and a clean stop after that records nothing more.
"""

from __future__ import annotations

import re
import time
from array import array
from pathlib import Path

import pytest
import requests
import yaml

from edge_relay.budget import Budget, ClassPolicy, Matcher, UplinkBudget
from edge_relay.budget.shaper import BudgetShaper
from edge_relay.collect.shape import ShapedScrape
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.store.held import HeldWindows
from edge_relay.store.spool import Spool
from schemas.model import Labels
from testkit.exporters import ScriptedExporter
from testkit.services import Mosquitto, wait_until
from testkit.stack import Program, ledger_totals, metrics_url, program, relay_config

INTERVAL_S = 5.0
WINDOW_MS = 60_000
T0 = 1_800_000_000_000 // WINDOW_MS * WINDOW_MS  # aligned: the first window opens with the first scrape


def L(name: str, **labels: str) -> Labels:
    return tuple(sorted({"__name__": name, "job": "kepler", **labels}.items()))


def scrape(ts: int, items: list[tuple[Labels, float]]) -> ShapedScrape:
    return ShapedScrape("kepler", ts, [lab for lab, _ in items], array("d", [v for _, v in items]))


def test_held_counts_the_samples_of_open_windows_only() -> None:
    slow = ClassPolicy(
        "slow", (Matcher(name=re.compile("gauge|energy_total")),), resolution_s=60, aggregation="avg"
    )
    uplink = UplinkBudget(sustained_bytes_per_second=10_000, burst_bytes=100_000)
    shaper = BudgetShaper(Budget("test", uplink, (slow, ClassPolicy("rest"))), INTERVAL_S)
    gauges = [L("gauge", i=str(i)) for i in range(3)]
    counter, other = L("energy_total"), L("other")
    assert shaper.held(T0) == (0, T0 - WINDOW_MS)
    for k in range(12):
        ts = T0 + 5000 * k
        items = [(g, float(k + i)) for i, g in enumerate(gauges)] + [(counter, 10.0 * k), (other, 1.0)]
        shaper.shape(scrape(ts, items))
        shaper.flush(ts + 1)
        # The counter's first sample goes out at once (increase() over its life stays exact); `other`
        # passes through. Everything else of this window is held.
        assert shaper.held(ts + 1)[0] == 3 * (k + 1) + k
    # The next window's first scrape closes them all (and holds its own samples).
    shaper.shape(scrape(T0 + WINDOW_MS, [(g, 0.0) for g in gauges] + [(counter, 200.0)]))
    shaper.flush(T0 + WINDOW_MS + 1)
    assert shaper.held(T0 + WINDOW_MS + 1)[0] == 4
    shaper.flush(2**62)
    assert shaper.held(2**62)[0] == 0


def test_recorded_once_and_cleared(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db", synchronous="OFF")
    ledger = LossLedger(spool.losses)
    held = HeldWindows(spool.meta, ledger)
    assert held.recover(["kepler"]) == 0
    held.update(42, 1000, 5000)
    spool.close()  # ... as if killed: nothing cleared it

    spool = Spool(tmp_path / "spool.db", synchronous="OFF")
    ledger = LossLedger(spool.losses)
    assert HeldWindows(spool.meta, ledger).recover(["dcgm", "kepler"]) == 42
    entry = spool.losses.entries()[0]
    assert (entry.reason, entry.series, entry.samples) == (
        LossReason.OPEN_WINDOW_AT_KILL,
        '{job=~"dcgm|kepler"}',
        42,
    )
    assert (entry.first_ts_ms, entry.last_ts_ms) == (1000, 5000)
    assert HeldWindows(spool.meta, ledger).recover(["kepler"]) == 0  # once
    spool.close()


SERIES = 5
RESOLUTION_S = 300


@pytest.mark.timeout(120)
def test_a_killed_relay_records_its_open_windows(tmp_path: Path, mosquitto: Mosquitto) -> None:
    # A 300 s window boundary inside the run would close windows: start well clear of one.
    if time.time() % RESOLUTION_S > RESOLUTION_S - 25:
        time.sleep(RESOLUTION_S - time.time() % RESOLUTION_S + 1)
    budget_path = tmp_path / "budget.yaml"
    budget_path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "uplink": {"sustained_bytes_per_second": 1_000_000, "batch_window_seconds": 1},
                "classes": [
                    {"name": "health", "preset": "scrape-health"},
                    {
                        "name": "slow",
                        "match": [{"name": "gpu_temp"}],
                        "resolution_seconds": RESOLUTION_S,
                        "aggregation": "avg",
                    },
                ],
            }
        )
    )

    def body(n: int) -> str:
        return "".join(f'gpu_temp{{gpu="{i}"}} {40 + n + i}\n' for i in range(SERIES))

    with ScriptedExporter(body) as exporter:
        cfg = relay_config(
            tmp_path, urls={"gpu": exporter.url}, mqtt_port=mosquitto.port, budget_file=str(budget_path)
        )
        relay_metrics = metrics_url(cfg)

        def relay_run() -> Program:
            return program("edge-relay", "edge_relay.cli", cfg, tmp_path).start()

        relay = relay_run()
        try:
            assert wait_until(lambda: exporter.requests >= 4, 30), relay.log_tail()
            # After a cycle's spool write the record follows within milliseconds: let one land.
            time.sleep(0.5)
            relay.kill()
            scrapes = exporter.requests
        finally:
            relay.kill()
        assert "open_window_at_kill" not in ledger_totals(cfg)

        relay = relay_run()  # the next start records what the killed one held
        try:
            assert wait_until(lambda: _up(relay_metrics), 30), relay.log_tail()
            assert relay.stop() == 0, relay.log_tail()
        finally:
            relay.kill()
        held = ledger_totals(cfg)["open_window_at_kill"]
        # Every sample of every scrape that reached the spool; the scrape under way at the kill may not.
        assert held in {SERIES * scrapes, SERIES * (scrapes - 1)}, (held, scrapes)

        relay = relay_run()  # that run stopped cleanly: its windows were sent, nothing more recorded
        try:
            assert wait_until(lambda: _up(relay_metrics), 30), relay.log_tail()
            assert relay.stop() == 0, relay.log_tail()
        finally:
            relay.kill()
        assert ledger_totals(cfg) == {"open_window_at_kill": held}


def _up(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
