"""The flight recorder (issue 14): raw scrapes kept at full resolution in the spool file, second to the
backlog.

Unit tests on a real SQLite spool: the round trip is bit-exact (stale markers, NaN payloads, explicit
timestamps), in both forms a cycle is stored in (alone while its block is open, then in the block's v2
envelope); the caps evict and count; the backlog wins (a spool at its cap gives up recorder blocks
before any batch); the read API's boundaries and what it says it could not supply. Then the relay's
cycle in-process, and one real relay process under a budget that degrades everything to 300 s, killed
with SIGKILL: the recorder, reopened, holds every raw scrape served before the last completed cycle.
"""

from __future__ import annotations

import random
import sqlite3
import struct
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_relay import settings as relay_settings
from edge_relay.app import Relay
from edge_relay.collect.shape import ShapedScrape
from edge_relay.commands import status as status_cmd
from edge_relay.commands import statusview
from edge_relay.encode.batches import BatchEncoder, decode_stage, to_batch
from edge_relay.ledger import LossLedger
from edge_relay.recorder import flight as recorder_mod
from edge_relay.recorder.flight import (
    COMPACT_RECHECK_BLOCKS,
    KIND_CYCLE,
    KIND_ENVELOPE,
    FlightRecorder,
    Gap,
    gaps,
)
from edge_relay.selfmetrics import RelayMetrics
from edge_relay.store.retention import Policy, Retention
from edge_relay.store.sink import SpoolSink
from edge_relay.store.spool import Spool
from edge_relay.store.spool.recorder import NewBlock, free_bytes
from edge_relay.uplink.status import StatusReport
from schemas import codec
from schemas.model import STALE_NAN, Batch, Labels, ScrapeBlock, float_bits, is_stale
from testkit.exporters import ScriptedExporter
from testkit.oracle import expected_samples, read_served_log
from testkit.stack import SimulatorProcess, program, relay_config, write_budget

T0 = 1_700_000_000_000
INTERVAL_MS = 1000
Key = tuple[Labels, int]  # (series, timestamp)


class Clock:
    def __init__(self, ms: int = T0) -> None:
        self.ms = ms

    def __call__(self) -> int:
        return self.ms


def labels(name: str, **extra: str) -> Labels:
    return tuple(sorted({"__name__": name, "job": "j", "instance": "n:1", **extra}.items()))


def scrape(
    target: str, ts: int, samples: list[tuple[Labels, float]], stamps: list[int] | None = None
) -> ShapedScrape:
    return ShapedScrape(target, ts, [ls for ls, _ in samples], array("d", [v for _, v in samples]), stamps)


def bits_of(batches: Iterator[Batch]) -> dict[Key, int]:
    """(series, timestamp) -> value bits of every sample read back; a duplicate key fails."""
    out: dict[Key, int] = {}
    for b in batches:
        for block in b.scrapes:
            for i, idx in enumerate(block.series):
                key = (b.labelsets[idx], block.sample_timestamp(i))
                assert key not in out, f"sample {key} read twice"
                out[key] = float_bits(block.values[i])
    return out


def bits_in(cycles: list[list[ShapedScrape]]) -> dict[Key, int]:
    out: dict[Key, int] = {}
    for cycle in cycles:
        for s in cycle:
            for i, ls in enumerate(s.labels):
                ts = s.timestamp_ms if s.timestamps is None else s.timestamps[i]
                out[(ls, ts)] = float_bits(s.values[i])
    return out


def recorder(
    spool: Spool,
    clock: Clock,
    metrics: RelayMetrics | None = None,
    *,
    max_bytes: int = 64 << 20,
    max_age_ms: int = 0,
    block_ms: int = 3 * INTERVAL_MS,
    reserve_bytes: int = 0,
    spool_max_bytes: int = 0,
) -> FlightRecorder:
    return FlightRecorder(
        spool.recorder,
        cluster="c",
        node="n",
        max_bytes=max_bytes,
        max_age_ms=max_age_ms,
        interval_ms=INTERVAL_MS,
        block_ms=block_ms,
        reserve_bytes=reserve_bytes,
        spool_max_bytes=spool_max_bytes,
        metrics=metrics,
        clock_ms=clock,
    )


def gpu_cycle(tick: int, series: int = 50, rng: random.Random | None = None) -> list[ShapedScrape]:
    rng = rng or random.Random(tick)
    ts = T0 + tick * INTERVAL_MS
    gauges = [(labels("gpu_temp", gpu=str(g)), 40 + rng.random() * 30) for g in range(series)]
    counters = [(labels("xid_total", gpu=str(g)), float(tick // 3 + g)) for g in range(series)]
    return [scrape("dcgm", ts, gauges), scrape("kepler", ts + 7, counters)]


@pytest.fixture
def spool(tmp_path: Path) -> Iterator[Spool]:
    """conftest's spool without fsync (``synchronous=OFF``): these tests commit many blocks and check
    what is kept, not what survives a power cut."""
    with Spool(tmp_path / "spool.db", synchronous="OFF") as s:
        yield s


# --- round trip -------------------------------------------------------------------------------------


def test_round_trip_is_bit_exact_in_both_forms(spool: Spool) -> None:
    clock = Clock()
    rec = recorder(spool, clock)
    odd_nan = struct.unpack("<d", struct.pack("<Q", 0x7FF8DEADBEEF0001))[0]
    cycles = [gpu_cycle(t) for t in range(7)]
    # Stale markers, an odd NaN payload, -0.0, infinities, and a scrape with explicit timestamps.
    cycles[2].append(scrape("node", T0 + 2000, [(labels("gone"), STALE_NAN), (labels("nan"), odd_nan)]))
    cycles[4].append(scrape("node", T0 + 4000, [(labels("neg"), -0.0), (labels("inf"), float("inf"))]))
    cycles[5].append(scrape("exp", T0 + 5000, [(labels("own_ts"), 3.25)], stamps=[T0 + 1234]))
    for cycle in cycles:
        assert rec.record(cycle)
    kinds = spool.store.run(
        "kinds", lambda c: [k for (k,) in c.execute("SELECT kind FROM recorder ORDER BY id")]
    )
    assert kinds == [KIND_ENVELOPE, KIND_ENVELOPE, KIND_CYCLE]  # 3 cycles a block; the 7th is open
    readout = rec.read(T0 - 10_000, T0 + 60_000)
    got = bits_of(readout)
    assert got == bits_in(cycles)
    assert float_bits(STALE_NAN) in got.values() and float_bits(odd_nan) in got.values()
    assert rec.span() == (T0, T0 + 6007)


def test_label_sets_of_churned_series_are_forgotten_within_a_few_blocks(spool: Spool) -> None:
    """The label sets the recorder remembers as checked (one batch a block) are those of about the
    last 16 cycles, not of 16 blocks: under churn they would otherwise keep 192 cycles of gone series
    alive at 12 cycles a block."""
    clock = Clock()
    rec = recorder(spool, clock, block_ms=12 * INTERVAL_MS)
    live = [(labels("gpu_temp", gpu=str(g)), 50.0) for g in range(10)]
    for tick in range(12 * 20):
        ts = T0 + tick * INTERVAL_MS
        churn = [(labels("pod_cpu", pod=f"p{tick}-{j}"), 1.0) for j in range(5)]
        assert rec.record([scrape("kepler", ts, live + churn)])
        # Two generations of two blocks each at most: 48 cycles of churn beside the live series.
        assert len(rec._valid) <= len(live) + 48 * 5


@pytest.mark.parametrize("version", [codec.FORMAT_V1, codec.FORMAT_V2])
def test_a_cycle_spooled_as_a_whole_is_kept_as_those_bytes_until_its_block_completes(
    spool: Spool, version: int
) -> None:
    """The live lane hands the recorder the envelopes it just spooled: the open block's cycles are
    stored as those very bytes (no second encoding), the completed block as one v2 envelope, and a
    read gives every sample back bit-exact either way."""
    rec = recorder(spool, Clock())
    cycles = [gpu_cycle(t) for t in range(5)]
    cycles[1].append(scrape("node", T0 + 1000, [(labels("gone"), STALE_NAN), (labels("neg"), -0.0)]))
    payloads = []
    for i, cycle in enumerate(cycles):
        batch = to_batch("c", "n", cycle)
        batch.seq = i + 1
        payloads.append(codec.encode_batch(batch, version=version))
        assert rec.record(cycle, [payloads[-1]])

    def rows(c: sqlite3.Connection) -> list[tuple[int, bytes]]:
        return list(c.execute("SELECT kind, payload FROM recorder ORDER BY id"))

    stored = spool.store.run("rows", rows)
    assert [k for k, _ in stored] == [KIND_ENVELOPE] * 3  # one block of 3 cycles, 2 cycles open
    assert [p for _, p in stored[1:]] == payloads[3:]
    assert codec.peek_header(stored[0][1]).version == codec.FORMAT_V2
    assert bits_of(rec.read(T0 - 10_000, T0 + 60_000)) == bits_in(cycles)


def block_versions(spool: Spool) -> list[int]:
    def versions(c: sqlite3.Connection) -> list[int]:
        rows = c.execute("SELECT payload FROM recorder WHERE kind = ? ORDER BY id", (KIND_ENVELOPE,))
        return [codec.peek_header(p).version for (p,) in rows]

    return spool.store.run("versions", versions)


HOUR_MS = 3_600_000


@pytest.mark.parametrize(
    ("max_bytes", "spool_max_bytes", "max_age_ms", "version"),
    [
        (64 << 20, 0, HOUR_MS, codec.FORMAT_V1),  # an hour of v1 blocks is ~20 MB: half the room holds it
        (8 << 20, 0, HOUR_MS, codec.FORMAT_V2),  # ~20 MB would not fit: the compact form
        (64 << 20, 8 << 20, HOUR_MS, codec.FORMAT_V2),  # the spool's cap is the room
        (64 << 20, 0, 0, codec.FORMAT_V2),  # no age cap: the room sets the span, so pack it tight
    ],
)
def test_blocks_are_v1_while_half_the_room_holds_max_age_of_them(
    spool: Spool, max_bytes: int, spool_max_bytes: int, max_age_ms: int, version: int
) -> None:
    """v1 costs about a fifth of v2's CPU and three times its bytes: the recorder packs v1 blocks only
    where the room affords them for the whole max_age; every sample reads back bit-exact either way."""
    clock = Clock()
    rec = recorder(spool, clock, max_bytes=max_bytes, spool_max_bytes=spool_max_bytes, max_age_ms=max_age_ms)
    cycles = [gpu_cycle(t, series=200) for t in range(6)]
    for cycle in cycles:
        assert rec.record(cycle)
    assert block_versions(spool) == [version, version]
    assert bits_of(rec.read(T0 - 10_000, T0 + 60_000)) == bits_in(cycles)


def test_the_block_form_follows_the_series_count(spool: Spool) -> None:
    """A node whose series grow past what the room holds in v1 turns to v2 at once; when they shrink
    again, v1 comes back at the next weighing, not before."""
    rec = recorder(spool, Clock(), max_bytes=16 << 20, max_age_ms=HOUR_MS)
    versions = []
    tick = 0
    for series in [20] * 3 + [400] * 3 + [20] * COMPACT_RECHECK_BLOCKS:
        for _ in range(3):  # one block
            assert rec.record(gpu_cycle(tick, series=series))
            tick += 1
        versions.append(block_versions(spool)[-1])
    v1, v2 = codec.FORMAT_V1, codec.FORMAT_V2
    # 400 series: v2 from their first block on, and for COMPACT_RECHECK_BLOCKS blocks after it.
    assert versions == [v1] * 3 + [v2] * (1 + COMPACT_RECHECK_BLOCKS) + [v1] * 2


def test_a_weighing_the_last_v1_block_rules_out_packs_no_v1(
    spool: Spool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a v1 block was too big for the room, the next weighing estimates from its bytes a sample
    and skips the v1 packing while the estimate still does not fit (it would be made and thrown away);
    a node that shrinks enough is weighed with a real v1 packing again."""
    packed: list[int] = []
    real = recorder_mod.encode_checked

    def counting(batch: Batch, valid: object, **options: object) -> bytes:
        packed.append(int(options["version"]))  # type: ignore[call-overload]
        return real(batch, valid, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(recorder_mod, "encode_checked", counting)
    rec = recorder(spool, Clock(), max_bytes=16 << 20, max_age_ms=HOUR_MS)
    tick = 0
    r = COMPACT_RECHECK_BLOCKS
    for series in [400] * (r + 2) + [20] * (r + 1):
        for _ in range(3):  # one block
            assert rec.record(gpu_cycle(tick, series=series))
            tick += 1
    v1, v2 = codec.FORMAT_V1, codec.FORMAT_V2
    # Block 0 tried v1 and took v2; the weighing at block r + 1 packed no v1 (400 series still); the
    # one at block 2r + 2 (20 series) did, and kept it.
    assert packed == [v1, v2] + [v2] * (r + 1) + [v2] * r + [v1]
    assert block_versions(spool)[-1] == v1


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    values=st.lists(st.integers(min_value=0, max_value=2**64 - 1), min_size=1, max_size=40),
    cycles=st.integers(min_value=1, max_value=7),
)
def test_any_float_bits_survive(
    tmp_path_factory: pytest.TempPathFactory, values: list[int], cycles: int
) -> None:
    path = tmp_path_factory.mktemp("rec") / "spool.db"
    with Spool(path, synchronous="OFF") as spool:
        rec = recorder(spool, Clock())
        recorded: list[list[ShapedScrape]] = []
        for t in range(cycles):
            floats = [struct.unpack("<d", struct.pack("<Q", v))[0] for v in values]
            samples = [(labels("m", i=str(i)), f) for i, f in enumerate(floats[t:] + floats[:t])]
            recorded.append([scrape("t", T0 + t * INTERVAL_MS, samples)])
            assert rec.record(recorded[-1])
        assert bits_of(rec.read(T0, T0 + cycles * INTERVAL_MS)) == bits_in(recorded)


# --- caps -------------------------------------------------------------------------------------------


def test_max_age_evicts_and_counts(spool: Spool) -> None:
    clock, metrics = Clock(), RelayMetrics()
    rec = recorder(spool, clock, metrics, max_age_ms=10_000, block_ms=INTERVAL_MS)
    for t in range(20):
        clock.ms = T0 + t * INTERVAL_MS
        rec.record(gpu_cycle(t, series=5))
    per_cycle = 10
    span = rec.span()
    assert span is not None and span[0] >= clock.ms - 10_000
    evicted = metrics.registry.get_sample_value(
        "edge_relay_recorder_evicted_samples_total", {"reason": "max_age"}
    )
    held = rec.stats().samples
    assert evicted == 20 * per_cycle - held and evicted > 0
    assert metrics.registry.get_sample_value("edge_relay_recorder_samples_total") == 20 * per_cycle
    assert metrics.registry.get_sample_value("edge_relay_recorder_oldest_timestamp_seconds") == span[0] / 1000


def test_max_bytes_evicts_oldest_and_counts(spool: Spool) -> None:
    clock, metrics = Clock(), RelayMetrics()
    rec = recorder(spool, clock, metrics, max_bytes=40_000, block_ms=INTERVAL_MS)
    for t in range(60):
        rec.record(gpu_cycle(t, series=40))
    st_ = rec.stats()
    assert 0 < st_.bytes <= 40_000
    assert metrics.registry.get_sample_value("edge_relay_recorder_bytes") == st_.bytes
    evicted = metrics.registry.get_sample_value(
        "edge_relay_recorder_evicted_samples_total", {"reason": "max_bytes"}
    )
    assert evicted == 60 * 80 - st_.samples
    # What is left is the newest: oldest first out.
    span = rec.span()
    assert span is not None and span[1] == T0 + 59 * INTERVAL_MS + 7
    assert rec.read(T0, T0 + 60_000).missing[0] == Gap(T0, span[0] - 1, "older_than_recorder")


def test_disabled_records_nothing_and_frees_what_it_held(spool: Spool) -> None:
    clock = Clock()
    rec = recorder(spool, clock)
    rec.record(gpu_cycle(0))
    assert rec.stats().blocks == 1
    off = recorder(spool, clock, max_bytes=0)
    assert not off.enabled and off.stats().blocks == 0
    assert not off.record(gpu_cycle(1))
    readout = off.read(T0, T0 + 5000)
    assert list(readout) == [] and readout.missing == (Gap(T0, T0 + 5000, "disabled"),)


# --- the backlog wins -------------------------------------------------------------------------------


def random_batch(rng: random.Random, ts: int, n: int = 2000) -> Batch:
    """About 16 KB of incompressible values."""
    table = [labels("noise", i=str(i)) for i in range(n)]
    values = array("d", (rng.random() for _ in range(n)))
    return Batch("c", "n", 0, table, [ScrapeBlock(ts, array("I", range(n)), values)])


def test_a_full_spool_gives_up_recorder_blocks_before_any_batch(tmp_path: Path) -> None:
    rng = random.Random(7)
    cap = 4 << 20
    with Spool(tmp_path / "spool.db", synchronous="OFF", max_bytes=cap) as spool:
        ledger = LossLedger(spool.losses)
        encoder = BatchEncoder("c", "n", max_bytes=1 << 20, version=codec.FORMAT_V2)
        policy = Policy(cap_bytes=0, max_age_ms=0, max_factor=1, interval_ms=1000, busy_ms=0)
        retention = Retention(spool, policy, encoder=encoder)
        metrics = RelayMetrics()
        sink = SpoolSink(spool, retention, ledger, encoder, metrics)
        # The recorder fills everything the cap leaves (no reserve): the worst case for the backlog.
        blocks = 0
        while not spool.recorder.evicted_samples["backlog_room"]:
            ids = spool.recorder.write(
                [NewBlock(KIND_ENVELOPE, rng.randbytes(32 * 1024), T0 + blocks, T0 + blocks, 100)],
                max_bytes=1 << 40,
                oldest_ms=0,
                reserve_bytes=0,
            )
            assert ids
            blocks += 1
        assert spool.recorder.stats().blocks > 50
        appended = 0
        while spool.recorder.stats().blocks:
            assert sink.append(random_batch(rng, T0 + appended)) is not None
            appended += 1
            # Not one batch lost while the recorder still held a block.
            assert spool.stats().rows == appended
            assert ledger.totals() == {}
        assert spool.recorder.evicted_samples["backlog_room"] == 100 * blocks
        # Once the recorder is empty, the spool behaves as before: the oldest batches make room.
        for _ in range(40):
            sink.append(random_batch(rng, T0 + appended))
            appended += 1
        assert ledger.totals().get("spool_full", 0) > 0


def test_the_recorder_leaves_the_reserve_free(tmp_path: Path) -> None:
    cap, reserve = 4 << 20, 1 << 20
    with Spool(tmp_path / "spool.db", synchronous="OFF", max_bytes=cap) as spool:
        metrics = RelayMetrics()
        rec = recorder(spool, Clock(), metrics, block_ms=INTERVAL_MS, reserve_bytes=reserve)
        rng = random.Random(3)
        for t in range(200):
            rec.record(
                [scrape("t", T0 + t * 1000, [(labels("n", i=str(i)), rng.random()) for i in range(2000)])]
            )
        assert spool.store.run("free", free_bytes) >= reserve - 64 * 1024
        assert metrics.registry.get_sample_value(
            "edge_relay_recorder_evicted_samples_total", {"reason": "backlog_room"}
        )
        assert rec.stats().blocks > 10


def test_a_spool_too_small_for_the_reserve_records_nothing(tmp_path: Path) -> None:
    with Spool(tmp_path / "spool.db", synchronous="OFF", max_bytes=256 * 1024) as spool:
        metrics = RelayMetrics()
        rec = recorder(spool, Clock(), metrics, reserve_bytes=2 << 20)
        assert rec.record(gpu_cycle(0)) is False
        assert rec.stats().blocks == 0
        assert metrics.registry.get_sample_value("edge_relay_recorder_errors_total", {"op": "no_room"}) == 1


def test_a_failing_recorder_costs_nothing_but_its_own_write(spool: Spool) -> None:
    metrics = RelayMetrics()
    rec = recorder(spool, Clock(), metrics)
    spool.close()
    assert rec.record(gpu_cycle(0)) is False  # no exception
    assert metrics.registry.get_sample_value("edge_relay_recorder_errors_total", {"op": "write"}) == 1


# --- the read API -----------------------------------------------------------------------------------


def test_read_boundaries_match_and_what_it_could_not_supply(spool: Spool) -> None:
    clock = Clock()
    rec = recorder(spool, clock)
    cycles = [gpu_cycle(t, series=4) for t in range(10)]
    for t, cycle in enumerate(cycles):
        if t in (5, 6):  # the relay was down: nothing recorded for two cycles
            continue
        rec.record(cycle)
    # Inclusive at both ends, sample timestamps.
    got = bits_of(rec.read(T0 + 1000, T0 + 3007))
    want = {k: v for k, v in bits_in(cycles).items() if T0 + 1000 <= k[1] <= T0 + 3007}
    assert got == want and min(k[1] for k in got) == T0 + 1000 and max(k[1] for k in got) == T0 + 3007
    # A series matcher.
    gpu2 = rec.read(T0, T0 + 20_000, match=lambda ls: dict(ls).get("gpu") == "2")
    assert {dict(k[0])["gpu"] for k in bits_of(gpu2)} == {"2"}
    # What it could not supply, by reason.
    readout = rec.read(T0 - 5000, T0 + 15_000)
    assert readout.span == (T0, T0 + 9007)
    assert readout.missing == (
        Gap(T0 - 5000, T0 - 1, "older_than_recorder"),
        Gap(T0 + 4008, T0 + 6999, "not_recorded"),
        Gap(T0 + 9008, T0 + 15_000, "newer_than_recorder"),
    )
    assert rec.read(T0, T0 + 4007).complete
    assert list(rec.read(T0 + 5000, T0 + 6500)) == []
    with pytest.raises(ValueError):
        rec.read(T0 + 1, T0)


def test_gaps_of_an_empty_recorder() -> None:
    assert gaps([], 1, 2, 10) == [Gap(1, 2, "not_recorded")]
    assert gaps([(0, 10), (15, 20)], 0, 20, 10) == []


# --- the relay -------------------------------------------------------------------------------------


def test_the_relay_records_raw_cycles_and_a_recorder_failure_costs_it_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ScriptedExporter(lambda n: f'# TYPE g gauge\ng{{i="1"}} {n}.5\ng{{i="2"}} NaN\n') as ex:
        config = tmp_path / "relay.yaml"
        config.write_text(
            f"node: n1\ncluster: c1\nscrape: {{interval_seconds: 1, timeout_seconds: 0.8}}\n"
            f"targets: [{{name: t, url: '{ex.url}'}}]\nspool: {{path: {tmp_path / 'spool.db'}}}\n"
            "mqtt: {port: 9}\nmetrics: {listen: ''}\nrecorder: {max_bytes: 4194304}\n"
        )
        relay = Relay(relay_settings.load(str(config)), RelayMetrics())
        try:
            assert relay.cycle() == 5 and relay.cycle() == 5
            # Without a budget the relay sends exactly what it records.
            sent = bits_of(iter([codec.decode_batch(r.payload) for r in relay.spool.batches.pending(100)]))
            assert bits_of(relay.recorder.read(0, 2**62)) == sent and len(sent) == 10

            def broken(*args: object, **kwargs: object) -> None:
                raise OSError("disk on fire")

            monkeypatch.setattr(relay.spool.recorder, "write", broken)
            assert relay.cycle() == 5
            assert relay.spool.stats().rows == 3
            errors = relay.metrics.registry.get_sample_value
            assert errors("edge_relay_recorder_errors_total", {"op": "write"}) == 1
        finally:
            relay.collector.pool.shutdown(wait=True)
            for loop in relay.collector.loops:
                loop.scraper.close()
            relay.spool.close()


def recorded_samples(spool_path: Path) -> dict[frozenset[tuple[str, str]], list[tuple[int, float]]]:
    with Spool(spool_path) as spool:
        rec = FlightRecorder(
            spool.recorder,
            cluster="test",
            node="edge-gpu-01",
            max_bytes=1 << 30,
            max_age_ms=0,
            interval_ms=1000,
        )
        out: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = {}
        for b in rec.read(0, 2**62):
            for block in b.scrapes:
                for i, idx in enumerate(block.series):
                    out.setdefault(frozenset(b.labelsets[idx]), []).append(
                        (block.sample_timestamp(i), block.values[i])
                    )
        return {k: sorted(v) for k, v in out.items()}


def spool_series_counts(spool_path: Path) -> dict[frozenset[tuple[str, str]], int]:
    """Samples per series the relay has for the uplink: its batches and its staged window."""
    counts: dict[frozenset[tuple[str, str]], int] = {}
    with Spool(spool_path) as spool:
        for row in spool.batches.pending(10_000):
            b = codec.decode_batch(row.payload)
            for block in b.scrapes:
                for idx in block.series:
                    key = frozenset(b.labelsets[idx])
                    counts[key] = counts.get(key, 0) + 1
        for staged in spool.staging.staged():
            for s in decode_stage(staged.payload):
                for ls in s.labels:
                    counts[frozenset(ls)] = counts.get(frozenset(ls), 0) + 1
    return counts


@pytest.mark.timeout(90)
def test_relay_records_every_raw_scrape_under_a_300s_budget_and_survives_kill_9(tmp_path: Path) -> None:
    sim = SimulatorProcess(tmp_path, interval=1.0, churn_ticks=0).start()
    try:
        budget = write_budget(
            tmp_path / "budget.yaml",
            bytes_per_second=2000,
            burst_bytes=None,
            batch_window_seconds=60,
            classes=[
                {"name": "health", "preset": "scrape-health"},
                {"name": "rest", "resolution_seconds": 300},
            ],
        )
        cfg = relay_config(
            tmp_path,
            urls=sim.urls,
            mqtt_port=9,  # no broker: everything stays on the node
            interval=1.0,
            budget_file=str(budget),
            recorder={"block_seconds": 3},
        )
        relay = program("edge-relay", "edge_relay.cli", cfg, tmp_path).start()
        try:
            deadline = time.monotonic() + 40
            while time.monotonic() < deadline:
                time.sleep(0.5)
                assert relay.alive(), relay.log_tail()
                if len(read_served_log(sim.served_log)) >= 8 * len(sim.urls):
                    break
        finally:
            relay.kill()  # SIGKILL: no shutdown, no flush
    finally:
        sim.stop()
    recorded = recorded_samples(tmp_path / "spool.db")
    up = {k: v for k, v in recorded.items() if dict(k)["__name__"] == "up"}
    last_cycle = {dict(k)["job"]: max(ts for ts, _ in v) for k, v in up.items()}
    assert min(len(v) for v in up.values()) >= 6, relay.log_tail()
    # Every scrape served before the last completed cycle, at full resolution and bit-exact.
    served = [r for r in read_served_log(sim.served_log) if r.t_ms <= last_cycle[r.exporter] + 500]
    instances = {name: f"edge-gpu-01:{url.split(':')[2].split('/')[0]}" for name, url in sim.urls.items()}
    expected = expected_samples(
        sim.simulator,
        served,
        jobs={e: e for e in sim.urls},
        instances=instances,
        extra={"cluster": "test", "node": "edge-gpu-01"},
    )
    synthetic = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
    raw = {
        k: [(ts, v) for ts, v in vals if not is_stale(v)]
        for k, vals in recorded.items()
        if dict(k)["__name__"] not in synthetic
    }
    assert set(raw) == set(expected)
    for key, want in expected.items():
        got = raw[key]
        assert len(got) == len(want), (dict(key), got, want)
        for (t_served, v_want), (t_got, v_got) in zip(want, got, strict=True):
            assert float_bits(v_got) == float_bits(v_want) or (v_got != v_got and v_want != v_want), dict(key)
            assert t_served - 1000 <= t_got <= t_served
    # ... while what the budget lets through is a sample or two per series of the 300 s class.
    sent = spool_series_counts(tmp_path / "spool.db")
    gauge = next(k for k in raw if dict(k)["__name__"].startswith("DCGM_FI_DEV_GPU_TEMP"))
    assert len(raw[gauge]) >= 6 and sent.get(gauge, 0) <= 2


def test_status_shows_the_recorder_span(tmp_path: Path) -> None:
    path = tmp_path / "spool.db"
    with Spool(path, synchronous="OFF") as spool:
        rec = recorder(spool, Clock())
        for t in range(4):
            rec.record(gpu_cycle(t, series=3))
        fields = StatusReport(spool, LossLedger(spool.losses), None).fields()
        assert fields["recorder_oldest_ms"] == T0 and fields["recorder_bytes"] == rec.stats().bytes
    config = tmp_path / "relay.yaml"
    config.write_text(
        f"node: n1\ncluster: c1\ntargets: [{{name: t, url: 'http://127.0.0.1:9/metrics'}}]\n"
        f"spool: {{path: {path}}}\nmetrics: {{listen: ''}}\n"
    )
    s = relay_settings.load(str(config))
    snap = status_cmd.snapshot(s, [status_cmd.read(s)])
    assert snap["spool"]["recorder_oldest_timestamp_seconds"] == T0 / 1000
    assert snap["spool"]["recorder_newest_timestamp_seconds"] == (T0 + 3007) / 1000
    assert "recorder 608 B at full resolution, 2023-11-14 22:13:20 UTC to" in statusview.render_plain(snap)
