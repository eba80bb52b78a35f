"""The relay's cycle on a real spool, without services: what one bad sample costs (issue 12 item 1),
what the budget drops and records (item 6), and staged cycles that must never be stranded (item 7).

The exporters are static bodies on a loopback HTTP server; the uplink is never started, so what the
relay did is read back from its spool: the batches (decoded with the shared codec), the staging table
and the loss ledger.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_relay import settings as relay_settings
from edge_relay.app import Relay
from edge_relay.collect.shape import ShapedScrape
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.uplink.mqtt import Uplink
from schemas import codec
from schemas.model import Labels
from testkit.exporters import ScriptedExporter

GOOD_BODY = '# TYPE good_gauge gauge\ngood_gauge{i="0"} 1.5\ngood_gauge{i="1"} 2.5\ngood_total 7\n'
# One sample with an explicit negative timestamp between good ones (issue 12 item 1).
FAULTY_BODY = 'ok_before 1\nbad_metric 1 -1\nok_after{a="b"} 3\n'
SYNTHETIC = ("up", "scrape_duration_seconds", "scrape_samples_scraped")


@pytest.fixture
def exporters() -> Iterator[ScriptedExporter]:
    with ScriptedExporter(bodies={"good": GOOD_BODY, "faulty": FAULTY_BODY}) as ex:
        yield ex


def write_config(
    tmp_path: Path, exporters: ScriptedExporter, *, budget: str | None, names: tuple[str, ...]
) -> Path:
    targets = ", ".join(f"{{name: {n}, url: '{exporters.url_of(n)}'}}" for n in names)
    text = (
        "node: n1\ncluster: c1\nscrape: {interval_seconds: 1, timeout_seconds: 0.8}\n"
        f"targets: [{targets}]\nspool: {{path: {tmp_path / 'spool.db'}}}\n"
        "mqtt: {port: 9}\nmetrics: {listen: ''}\n"
    )
    if budget is not None:
        (tmp_path / "budget.yaml").write_text(budget)
        text += "budget_file: budget.yaml\n"
    config = tmp_path / "relay.yaml"
    config.write_text(text)
    return config


def open_relay(config: Path) -> Relay:
    return Relay(relay_settings.load(str(config)), RelayMetrics())


def close(relay: Relay) -> None:
    """Like a kill: nothing flushed, nothing packed (``shutdown`` would stop an uplink never started)."""
    relay.collector.pool.shutdown(wait=True)
    for loop in relay.collector.loops:
        loop.scraper.close()
    relay.spool.close()


def spooled(relay: Relay) -> dict[Labels, list[tuple[int, float]]]:
    """Every sample in the spool's batches, per series, from the decoded payloads."""
    out: dict[Labels, list[tuple[int, float]]] = {}
    for row in relay.spool.batches.pending(10_000):
        batch = codec.decode_batch(row.payload)
        for block in batch.scrapes:
            stamps = (
                block.timestamps if block.timestamps is not None else [block.timestamp_ms] * len(block.values)
            )
            for idx, ts, value in zip(block.series, stamps, block.values, strict=True):
                out.setdefault(batch.labelsets[idx], []).append((ts, value))
    return out


def names(samples: dict[Labels, list[tuple[int, float]]], job: str) -> dict[str, int]:
    """Samples per metric name of one job."""
    counts: dict[str, int] = {}
    for labels, got in samples.items():
        d = dict(labels)
        if d["job"] == job:
            counts[d["__name__"]] = counts.get(d["__name__"], 0) + len(got)
    return counts


# --------------------------------------------------------------------------------------------------
# Item 1: one bad sample is dropped alone, with a ledger reason; the cycle goes through


def test_a_negative_timestamp_costs_its_sample_only(tmp_path: Path, exporters: ScriptedExporter) -> None:
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("faulty", "good")))
    try:
        cycles = 3
        for _ in range(cycles):
            relay.cycle()
        samples = spooled(relay)
        # Every good sample of both targets, every cycle; bad_metric nowhere.
        assert names(samples, "good") == dict.fromkeys(("good_gauge",), 2 * cycles) | dict.fromkeys(
            ("good_total", *SYNTHETIC), cycles
        )
        assert names(samples, "faulty") == dict.fromkeys(("ok_before", "ok_after", *SYNTHETIC), cycles)
        assert relay.ledger.totals() == {"invalid_timestamp": cycles}
        (entry,) = relay.spool.losses.entries()
        assert entry.series == '{job="faulty"}'
    finally:
        close(relay)


def test_a_cycle_the_codec_refuses_goes_scrape_by_scrape(tmp_path: Path, exporters: ScriptedExporter) -> None:
    """Whatever still gets past the shape stage: the other scrapes of the cycle are spooled, the refused
    one is recorded as encode_error, as a batch window does."""
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("good",)))
    try:
        good = ShapedScrape(
            "good", 1_700_000_000_000, [(("__name__", "m"), ("job", "good"))], array("d", [1.0])
        )
        labels: list[Labels] = [(("__name__", "x"), ("job", "bad")), (("__name__", "y"), ("job", "bad"))]
        # Built by hand, past TargetShaper's checks: the encoder refuses the negative timestamp.
        bad = ShapedScrape("bad", 1_700_000_000_000, labels, array("d", [1.0, 2.0]), [1_700_000_000_000, -5])
        assert relay.lanes.spool([bad, good]) == (1, [])  # not the whole cycle: the recorder encodes it
        assert spooled(relay) == {good.labels[0]: [(1_700_000_000_000, 1.0)]}
        assert relay.ledger.totals() == {"encode_error": 2}
        (entry,) = relay.spool.losses.entries()
        assert entry.series == '{job="bad"}'
    finally:
        close(relay)


def test_two_targets_with_the_same_series_in_one_millisecond_keep_one_sample(
    tmp_path: Path, exporters: ScriptedExporter
) -> None:
    """The live lane: a series two targets share at one timestamp is spooled once (the first), the
    other sample is in the ledger as duplicate_sample for its target, not handed to the receiver."""
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("good",)))
    try:
        ts = 1_700_000_000_000
        shared: Labels = (("__name__", "m"), ("job", "same"))
        a = ShapedScrape("a", ts, [shared, (("__name__", "a_only"), ("job", "same"))], array("d", [1.0, 2.0]))
        b = ShapedScrape("b", ts, [shared], array("d", [3.0]))
        assert relay.lanes.spool([a, b])[0] == 2
        assert spooled(relay) == {shared: [(ts, 1.0)], a.labels[1]: [(ts, 2.0)]}
        assert relay.ledger.totals() == {"duplicate_sample": 1}
        (entry,) = relay.spool.losses.entries()
        assert entry.series == '{job="b"}'
    finally:
        close(relay)


# --------------------------------------------------------------------------------------------------
# Item 6: what a stateful budget class drops is in the ledger


def test_a_repeated_own_timestamp_under_a_stateful_class_is_in_the_ledger(
    tmp_path: Path, exporters: ScriptedExporter
) -> None:
    # A minute ahead: the shaper forgets a series whose last sample is older than two resolutions.
    exporters.bodies["good"] = f"fixed 1 {int(time.time() * 1000) + 60_000}\n"
    budget = "version: 1\nuplink: {sustained_bytes_per_second: 100000, batch_window_seconds: 1}\n"
    budget += "classes: [{name: all, suppress_unchanged: {heartbeat_seconds: 60}}]\n"
    relay = open_relay(write_config(tmp_path, exporters, budget=budget, names=("good",)))
    try:
        relay.cycle()
        relay.cycle()  # the same sample again: its timestamp did not advance
        assert names(spooled(relay), "good")["fixed"] == 1
        assert relay.ledger.totals() == {"duplicate_sample": 1}
        stats = relay.budget.shaper.stats[0] if relay.budget is not None else None
        assert stats is not None and stats.merged == 0
    finally:
        close(relay)


# --------------------------------------------------------------------------------------------------
# Item 7: staged cycles are shipped whatever happens to the budget

# The longest window the budget file allows, so that two cycles a few ms apart never fall on both sides
# of a window boundary.
WINDOWED = "version: 1\nuplink: {sustained_bytes_per_second: 100000, batch_window_seconds: 3600}\n"


def stage_two_cycles(tmp_path: Path, exporters: ScriptedExporter) -> tuple[Path, int]:
    """A relay with a batch window stages two cycles and is killed; returns its config and the
    oldest staged sample's timestamp."""
    config = write_config(tmp_path, exporters, budget=WINDOWED, names=("good",))
    relay = open_relay(config)
    try:
        relay.cycle()
        relay.cycle()
        stats = relay.spool.stats()
        assert (stats.rows, stats.staged_rows) == (0, 2)
        assert stats.oldest_first_ts_ms is not None
        return config, stats.oldest_first_ts_ms
    finally:
        close(relay)


def test_staged_cycles_go_out_after_a_restart_without_a_budget(
    tmp_path: Path, exporters: ScriptedExporter
) -> None:
    config, oldest = stage_two_cycles(tmp_path, exporters)
    config.write_text(config.read_text().replace("budget_file: budget.yaml\n", ""))
    relay = open_relay(config)
    try:
        assert relay.budget is None
        relay.cycle()
        stats = relay.spool.stats()
        assert stats.staged_rows == 0
        # The two staged cycles (packed as their window) and this cycle's own batch, oldest first.
        assert stats.rows == 2 and stats.oldest_first_ts_ms == oldest
        rows = relay.spool.batches.pending(10)
        assert rows[0].first_ts_ms == oldest
        assert names(spooled(relay), "good")["good_total"] == 3
        assert relay.ledger.totals() == {}
    finally:
        close(relay)


def test_staged_cycles_go_out_when_the_window_is_reloaded_down_to_the_interval(
    tmp_path: Path, exporters: ScriptedExporter
) -> None:
    config, oldest = stage_two_cycles(tmp_path, exporters)
    relay = open_relay(config)
    try:
        assert relay.window.open  # resumed
        (tmp_path / "budget.yaml").write_text(WINDOWED.replace("3600", "1"))
        relay.cycle()  # reloads the budget: no longer windowed
        assert relay.budget is not None and not relay.budget.windowed
        stats = relay.spool.stats()
        assert stats.staged_rows == 0 and stats.rows == 2 and stats.oldest_first_ts_ms == oldest
        assert names(spooled(relay), "good")["good_total"] == 3
    finally:
        close(relay)


def test_a_removed_budget_file_keeps_the_budget_and_its_window(
    tmp_path: Path, exporters: ScriptedExporter, caplog: pytest.LogCaptureFixture
) -> None:
    config = write_config(tmp_path, exporters, budget=WINDOWED, names=("good",))
    relay = open_relay(config)
    try:
        relay.cycle()
        (tmp_path / "budget.yaml").unlink()
        with caplog.at_level(logging.WARNING, logger="edge_relay.budget"):
            relay.cycle()
            relay.cycle()
        gone = [r for r in caplog.records if "is gone" in r.getMessage()]
        assert len(gone) == 1  # logged once, not every cycle
        assert relay.budget is not None and relay.budget.windowed
        assert relay.spool.stats().staged_rows == 3
        relay.window.pack()  # as on a clean stop, or when the window closes
        stats = relay.spool.stats()
        assert stats.staged_rows == 0 and stats.rows == 1
    finally:
        close(relay)


def test_a_clock_step_back_is_logged_and_counted(
    tmp_path: Path, exporters: ScriptedExporter, caplog: pytest.LogCaptureFixture
) -> None:
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("good",)))
    try:
        relay.collector.watch_clock(1_800_000_000.0)
        relay.collector.watch_clock(1_800_000_005.0)
        relay.collector.watch_clock(1_800_000_005.5)  # jitter below a second is no step
        assert relay.metrics.clock_steps_back._value.get() == 0
        with caplog.at_level(logging.WARNING, logger="edge_relay"):
            relay.collector.watch_clock(1_799_999_405.0)  # NTP after boot: ten minutes back
        assert relay.metrics.clock_steps_back._value.get() == 1
        assert "the wall clock went back by 600.5s" in caplog.text
    finally:
        close(relay)


LANES_BUDGET = """version: 1
uplink: {sustained_bytes_per_second: 100000, batch_window_seconds: 60}
classes:
  - {name: critical, match: [{name: 'good_total'}], latency: live}
  - {name: gauges, match: [{name: 'good_gauge'}], latency: live}
  - {name: rest}
"""


def test_live_classes_leave_every_cycle_and_the_rest_waits_for_the_window(
    tmp_path: Path, exporters: ScriptedExporter
) -> None:
    """`latency: live` classes are spooled as a batch per cycle, the rest (windowed, the default) is
    staged for the batch window; together they are every sample, once."""
    relay = open_relay(write_config(tmp_path, exporters, budget=LANES_BUDGET, names=("good",)))
    try:
        assert [c.live for c in relay.budget.budget.classes] == [True, True, False]
        for _ in range(3):
            relay.cycle()
            time.sleep(0.05)
        stats = relay.spool.stats()
        assert stats.rows == 3 and stats.staged_rows == 3
        live = spooled(relay)
        assert {labels_name(k) for k in live} == {"good_total", "good_gauge"}
        assert all(len(points) == 3 for points in live.values())
        relay.window.pack()
        everything = spooled(relay)
        assert {labels_name(k) for k in everything} == {"good_total", "good_gauge", *SYNTHETIC}
        assert all(len(points) == 3 for points in everything.values())
        assert relay.ledger.totals() == {}
    finally:
        close(relay)


def labels_name(labels: Labels) -> str:
    return dict(labels)["__name__"]


def test_the_live_lane_spools_the_quick_form_only_for_rows_that_go_out_at_once(
    tmp_path: Path, exporters: ScriptedExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cycle the uplink publishes at once (connected, few rows waiting, stream coding on) is spooled
    as v1, which the stream re-codes anyway; a row that will wait is spooled as v2, half v1's size.
    Either way every sample is in the spool once, and the flight recorder keeps the spooled bytes
    themselves for the cycles of its open block."""
    connected = [False]
    monkeypatch.setattr(Uplink, "connected", property(lambda self: connected[0]))
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("good",)))
    try:

        def cycle() -> None:
            relay.cycle()
            time.sleep(0.05)

        cycle()  # no connection: the row will wait
        connected[0] = True
        for _ in range(5):  # rows waiting after each: 2, 3, 4, 5 (above the limit), 6
            cycle()
        relay.stream.configured = False
        cycle()  # the stream coder off: the row goes out as spooled, in the configured format
        rows = relay.spool.batches.pending(100)
        assert [codec.peek_header(r.payload).version for r in rows] == [2, 1, 1, 1, 1, 2, 2]
        got = spooled(relay)
        assert {labels_name(k) for k in got} == {"good_total", "good_gauge", *SYNTHETIC}
        assert all(len(points) == 7 for points in got.values())

        def recorded(c: sqlite3.Connection) -> list[bytes]:
            return [p for (p,) in c.execute("SELECT payload FROM recorder ORDER BY id")]

        assert relay.spool.store.run("recorded", recorded) == [r.payload for r in rows]
    finally:
        close(relay)


def test_the_uplink_is_kicked_before_the_flight_recorder_packs(
    tmp_path: Path, exporters: ScriptedExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live row is published before the cycle goes on: the recorder (whose block packing takes
    1.5-2 s at 20,000 series on a slow core) runs after the uplink was told and waited for (bounded),
    with the row in the spool already."""
    events: list[str] = []
    monkeypatch.setattr(Uplink, "kick", lambda self: events.append("kick"))
    monkeypatch.setattr(
        Uplink, "kick_and_wait", lambda self, timeout_s: events.append(f"kick, wait {timeout_s:g} s")
    )
    relay = open_relay(write_config(tmp_path, exporters, budget=None, names=("good",)))
    try:
        record = relay.recorder.record

        def recording(*args: object, **kwargs: object) -> bool:
            events.append(f"record with {len(relay.spool.batches.pending(10))} row(s) spooled")
            return record(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(relay.recorder, "record", recording)
        relay.cycle()
        assert events[:2] == ["kick, wait 0.5 s", "record with 1 row(s) spooled"]
    finally:
        close(relay)
