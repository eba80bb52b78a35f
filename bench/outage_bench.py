"""Outage bench (issue 3): what a long uplink outage costs us, Prometheus agent and vmagent, and the
fault report of our stack.  Not a test: it prints markdown tables for the README and writes them to
``bench/results/<timestamp>-<mode>.md``.  See ``bench/README.md`` for how every number is measured.

    python bench/outage_bench.py                      # 1 min warm-up, 30 min outage, drain (~35-50 min)
    python bench/outage_bench.py --outage-minutes 1 --warmup-minutes 0.5   # quick run
    python bench/outage_bench.py --faults             # fault report of our stack (~8 min)

Long-outage mode: three systems scrape identical simulated exporters (2,000 series, 5 s) and write
to a receiver of their own (a real Prometheus with a 2 h out-of-order window), each through a TCP
``LinkProxy`` that is cut (new connections refused, open ones reset) for the outage:

    ours:   simulator -> edge-relay -> LinkProxy -> mosquitto -> cloud-ingest -> tap -> Prometheus A
    agent:  simulator -> prometheus --enable-feature=agent -> LinkProxy -> tap -> Prometheus B
    vmagent simulator -> vmagent -> LinkProxy -> tap -> Prometheus C

The tap is an HTTP proxy that decodes every write the receiver accepted (duplicates, drain time).
The systems, proxy and tap are in ``testkit`` (``edge_systems``, ``netfaults``, ``rw_tap``); the
measuring and the report are here.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import itertools
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testkit.benchkit import ROOT, log, table, workspace, write_results
from testkit.edge_systems import CLUSTER, EXTERNAL, Agent, Ours, System, Vm
from testkit.oracle import (
    SYNTHETIC,
    SampleCounts,
    Score,
    expected_samples,
    read_served_log,
    same_value,
    score,
)
from testkit.readings import ProcStats, fmt_bytes
from testkit.rw_tap import DrainWatch
from testkit.services import Prometheus, RawSamples, now_ms
from testkit.stack import EXPORTERS

# ------------------------------------------------------------------------------------------ measuring


@dataclass
class Result:
    """One row: a system in the long outage, or a scenario of the fault report."""

    name: str
    score: Score
    failed_scrape_samples: int
    lost_by_intent: int | None
    duplicated: int
    drain_s: float | None
    drain_complete: bool
    missing_window_scrapes: int
    in_flight_at_kill: int = 0
    lost_by_operator: int = 0  # samples in a spool file the operator deleted (spool recreated)
    buffer_bytes: int | None = None
    peak_buffer_bytes: int | None = None
    uplink_bytes: int | None = None
    stats: dict[str, ProcStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def lost_otherwise(self) -> int:
        intent = self.lost_by_intent or 0
        return (
            self.score.missing
            - intent
            - self.failed_scrape_samples
            - self.in_flight_at_kill
            - self.lost_by_operator
        )


def window_watch(
    system: System,
    counts: SampleCounts,
    start_ms: int,
    end_ms: int,
    heal: float,
    stamp: Callable[[int], int] | None = None,
) -> DrainWatch:
    """Every scrape the simulator served to ``system`` in [start_ms, end_ms), to be found whole
    (``stamp``: as in ``evaluate``)."""
    wanted = [
        (rec.exporter, rec.t_ms if stamp is None else stamp(rec.t_ms), counts(rec))
        for rec in read_served_log(system.sim.served_log)
        if start_ms <= rec.t_ms < end_ms
    ]
    return DrainWatch(system.tap, wanted, system.skew_before_ms, system.skew_after_ms, heal)


def wait_drained(
    watches: dict[str, DrainWatch],
    *,
    timeout: float,
    settle: float,
    alive: Callable[[], None] | None = None,
    progress_every: float = 30,
) -> dict[str, bool]:
    """Poll every second until every watch is complete, or made no progress for ``settle`` seconds
    (once something arrived after the heal, or ``settle`` after the heal if nothing did), or timeout."""
    start = time.monotonic()
    done: dict[str, bool] = {}
    next_report = start + progress_every
    while True:
        now = time.monotonic()
        for key, watch in watches.items():
            if key in done:
                continue
            if watch.poll():
                done[key] = True
                log(f"{key}: backlog delivered, drain {watch.drain_seconds():.1f} s")
                continue
            last = watch.last_progress
            quiet_since = max(last if last is not None else watch.since, watch.since)
            if now - quiet_since > settle:
                done[key] = False
                log(f"{key}: no progress for {settle:g} s, {watch.missing} scrapes of the window missing")
        if len(done) == len(watches):
            return done
        if now - start > timeout:
            for key in watches:
                done.setdefault(key, False)
            log(f"drain timeout after {timeout:g} s")
            return done
        if alive is not None:
            alive()
        if now >= next_report:
            next_report = now + progress_every
            log("draining: " + ", ".join(f"{k} {w.missing} scrapes to go" for k, w in watches.items()))
        time.sleep(1.0)


def receiver_samples(receiver: Prometheus, lookback_s: int, at: float) -> RawSamples:
    actual: RawSamples = {}
    for job in EXPORTERS:  # one query per job keeps each answer a manageable size
        actual.update(receiver.raw_samples(f'{{job="{job}"}}', lookback=f"{lookback_s}s", at=at))
    return actual


def evaluate(
    system: System,
    *,
    until_ms: int,
    lookback_s: int,
    at: float,
    kills_ms: list[int] | None = None,
    deleted_ms: tuple[int, int] | None = None,
    stamp: Callable[[int], int] | None = None,
) -> tuple[Score, int, int, int]:
    """(score, samples of failed scrapes, samples of scrapes in flight at a SIGKILL, samples of scrapes
    served in ``deleted_ms`` = [from, to): in the spool file the operator deleted). ``stamp`` maps the
    time a request was served (the simulator's clock, unix ms) to the scraper's clock (a stepped edge
    clock): the times matched, and those of ``score().missing_by_scrape``, are the mapped ones."""
    served = [r for r in read_served_log(system.sim.served_log) if r.t_ms <= until_ms]
    if stamp is not None:
        served = [dataclasses.replace(r, t_ms=stamp(r.t_ms)) for r in served]
    expected = expected_samples(
        system.sim.simulator,
        served,
        jobs={e: e for e in EXPORTERS},
        instances=system.instances(),
        extra=EXTERNAL,
    )
    actual = receiver_samples(system.receiver, lookback_s, at)
    real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
    result = score(
        expected,
        real,
        skew_before_ms=system.skew_before_ms,
        skew_after_ms=system.skew_after_ms,
        until_ms=until_ms,
        same_value=same_value,
    )
    # A served request whose scrape the scraper itself recorded as failed (up 0: it timed out waiting
    # for the answer) was never collected: not a delivery loss.
    down: dict[str, list[int]] = {}
    for key, samples in actual.items():
        labels = dict(key)
        if labels["__name__"] == "up":
            down.setdefault(labels["job"], []).extend(t for t, v in samples if v == 0)
    failed = killed = deleted = 0
    for (job, t_served), n in result.missing_by_scrape.items():
        if any(
            t_served - system.skew_before_ms <= t <= t_served + system.skew_after_ms
            for t in down.get(job, [])
        ):
            failed += n
        elif kills_ms and any(k - system.skew_before_ms - 200 <= t_served <= k + 200 for k in kills_ms):
            killed += n
        elif deleted_ms is not None and deleted_ms[0] <= t_served < deleted_ms[1]:
            deleted += n
    return result, failed, killed, deleted


def served_counts(system: System, until_ms: int) -> int:
    return sum(1 for r in read_served_log(system.sim.served_log) if r.t_ms <= until_ms)


# ------------------------------------------------------------------------------------------ formatting


def fmt_int(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"


def fmt_drain(r: Result) -> str:
    if r.drain_s is None:
        return "n/a"
    return f"{r.drain_s:.1f} s" + (
        "" if r.drain_complete else f" (incomplete: {r.missing_window_scrapes} scrapes)"
    )


def fmt_lost_otherwise(r: Result) -> str:
    text = fmt_int(r.lost_otherwise)
    if r.in_flight_at_kill:
        text += f" (+{r.in_flight_at_kill:,} in flight at SIGKILL)"
    if r.failed_scrape_samples:
        text += f" (+{r.failed_scrape_samples:,} in failed scrapes)"
    if r.lost_by_operator:
        text += f" (+{r.lost_by_operator:,} in the deleted spool)"
    return text


# ------------------------------------------------------------------------------------------ long outage


def run_outage(args: argparse.Namespace) -> str:
    interval = args.interval
    with workspace(args.workdir, args.keep, "outage-bench-") as work:
        ours = Ours(
            "ours",
            "edge-relay (ours)",
            work / "ours",
            interval,
            args.series,
            # Product defaults, except the reconnect ceiling, which all three get the same.
            relay_overrides={
                "mqtt__keepalive_seconds": 30,
                "mqtt__ack_timeout_seconds": 60,
                "mqtt__reconnect_min_seconds": 1,
                "mqtt__reconnect_max_seconds": args.backoff_max,
                "mqtt__status_interval_seconds": 30,
            },
            ingest_overrides={"mqtt__reconnect_min_seconds": 0.5, "mqtt__reconnect_max_seconds": 5},
        )
        agent = Agent(
            "agent", "Prometheus agent 2.42", work / "agent", interval, args.series, args.backoff_max
        )
        vm = Vm("vmagent", "vmagent 1.79", work / "vmagent", interval, args.series)
        systems: list[System] = [ours, agent, vm]
        try:
            return _outage(args, systems, ours)
        finally:
            for s in systems:
                s.close()


def _outage(args: argparse.Namespace, systems: list[System], ours: Ours) -> str:
    interval = args.interval
    for s in systems:
        s.start_common()
    for s in systems:
        s.start_edge()
    start_ms = int(time.time() * 1000)
    log(f"started: {', '.join(f'{s.key} receiver :{s.receiver.port}' for s in systems)}")
    counts = SampleCounts(systems[0].sim.simulator)

    def alive() -> None:
        if not ours.relay.alive():
            raise RuntimeError(f"edge-relay died:\n{ours.relay.log_tail()}")
        if not ours.ingest.alive():
            raise RuntimeError(f"cloud-ingest died:\n{ours.ingest.log_tail()}")
        for s in systems:
            for svc in s.services:
                if not svc.is_running():
                    raise RuntimeError(f"{svc.name} of {s.key} died:\n{svc.log_tail()}")

    warmup_end = time.monotonic() + args.warmup_minutes * 60
    while time.monotonic() < warmup_end:
        alive()
        time.sleep(1)
    for s in systems:
        if s.tap.requests_ok == 0:
            raise RuntimeError(f"{s.key}: nothing reached the receiver during the warm-up")

    log(f"outage: cutting all three uplinks for {args.outage_minutes:g} min")
    for s in systems:
        s.proxy.cut()
    cut_ms = int(time.time() * 1000)
    peak: dict[str, int] = {s.key: 0 for s in systems}
    outage_end = time.monotonic() + args.outage_minutes * 60
    next_report = time.monotonic() + 60
    while time.monotonic() < outage_end:
        alive()
        for s in systems:
            peak[s.key] = max(peak[s.key], s.buffer_bytes())
        if time.monotonic() >= next_report:
            next_report += 60
            log("buffers: " + ", ".join(f"{s.key} {fmt_bytes(s.buffer_bytes())}" for s in systems))
        time.sleep(min(5.0, max(0.0, outage_end - time.monotonic())))
    buffers = {s.key: s.buffer_bytes() for s in systems}
    for s in systems:
        if detail := s.buffer_detail():
            s.notes.append(f"at the end of the outage: {detail}")
    for s in systems:
        peak[s.key] = max(peak[s.key], buffers[s.key])

    back_ms = int(time.time() * 1000)
    heal = time.monotonic()
    for s in systems:
        s.proxy.heal()
    log("link back: " + ", ".join(f"{s.key} buffer {fmt_bytes(buffers[s.key])}" for s in systems))
    watches = {s.key: window_watch(s, counts, cut_ms, back_ms, heal) for s in systems}
    complete = wait_drained(
        watches, timeout=args.drain_timeout_minutes * 60, settle=args.settle_seconds, alive=alive
    )

    # Live data after the drain; then the evaluation window ends; then time for its last samples.
    time.sleep(2 * interval)
    until_ms = int(time.time() * 1000)
    time.sleep(3 * interval + 5)
    stats = {s.key: s.stats() for s in systems}
    for s in systems:
        s.read_counters()
    for s in systems:
        s.stop_edge()
    lookback = int(time.time() - start_ms / 1000) + 120
    at = time.time()
    results = []
    for s in systems:
        log(f"{s.key}: comparing the receiver with what the simulator served")
        sc, failed, _, _ = evaluate(s, until_ms=until_ms, lookback_s=lookback, at=at)
        r = Result(
            s.title,
            sc,
            failed,
            s.lost_by_intent(),
            s.tap.duplicates,
            watches[s.key].drain_seconds(),
            complete[s.key],
            watches[s.key].missing,
            buffer_bytes=buffers[s.key],
            peak_buffer_bytes=peak[s.key],
            uplink_bytes=s.proxy.bytes_total,
            stats=stats[s.key],
            notes=list(s.notes),
        )
        if sc.value_mismatches:
            r.notes.append(
                f"{sc.value_mismatches:,} delivered samples with another value "
                f"(largest relative difference {sc.max_rel_error:.1e})"
            )
        if sc.extra:
            r.notes.append(f"{sc.extra:,} samples in the receiver that match no served scrape")
        if isinstance(s, Ours):
            r.notes.append(f"ledger: {s.ledger_note()}")
        elif isinstance(s, Agent | Vm):
            r.notes.append(", ".join(f"{k.split('_', 1)[1]}={v:g}" for k, v in s.counters.items()))
        results.append(r)
    return outage_report(args, systems, results, start_ms, cut_ms, back_ms, until_ms)


def outage_report(
    args: argparse.Namespace,
    systems: list[System],
    results: list[Result],
    start_ms: int,
    cut_ms: int,
    back_ms: int,
    until_ms: int,
) -> str:
    series = args.series or "natural"
    sample_total = results[0].score.expected
    head = (
        f"## Long outage: {series} series at {args.interval:g} s, {args.warmup_minutes:g} min warm-up, "
        f"{args.outage_minutes:g} min without uplink\n\n"
        f"Run {dt.datetime.fromtimestamp(start_ms / 1000).isoformat(timespec='seconds')}, "
        f"outage {(back_ms - cut_ms) / 1000:.0f} s, evaluated window {(until_ms - start_ms) / 1000:.0f} s "
        f"({sample_total:,} samples served to ours); exporter samples only (synthetic `up`/`scrape_*` "
        f"series left out); reconnect/retry ceiling {args.backoff_max:g} s where configurable.\n"
    )
    rows = []
    for r in results:
        edge = next(iter(r.stats.values()), None)
        rows.append(
            [
                r.name,
                fmt_int(r.score.expected),
                fmt_int(r.score.delivered),
                fmt_int(r.duplicated),
                fmt_int(r.lost_by_intent),
                fmt_lost_otherwise(r),
                fmt_drain(r),
                fmt_bytes(r.buffer_bytes),
                fmt_bytes(edge.peak_rss_bytes if edge else None),
                f"{edge.cpu_seconds:.1f}" if edge else "n/a",
                fmt_bytes(r.uplink_bytes),
            ]
        )
    main = table(
        [
            "system",
            "samples expected",
            "delivered",
            "duplicated",
            "lost by intent",
            "lost otherwise",
            "time to drain",
            "buffer at end of outage",
            "peak RSS",
            "CPU s",
            "uplink bytes",
        ],
        rows,
    )
    ours = results[0]
    cloud_rows = [
        [name, fmt_bytes(st.peak_rss_bytes), f"{st.cpu_seconds:.1f}"]
        for name, st in ours.stats.items()
        if name != "edge-relay"
    ]
    cloud = (
        table(["our cloud side (not an edge cost)", "peak RSS", "CPU s"], cloud_rows) if cloud_rows else ""
    )
    notes = "\n".join(
        f"- {r.name}: peak buffer during the outage {fmt_bytes(r.peak_buffer_bytes)}; " + "; ".join(r.notes)
        for r in results
    )
    return f"{head}\n{main}\n\n{cloud}\n\n{notes}\n"


# ------------------------------------------------------------------------------------------ fault report


@dataclass
class FaultWindow:
    """What a scenario's fault did: its start and end (unix ms; the scrapes served in between are the
    backlog whose drain is timed), the SIGKILL instants, and the scrapes (served [from, to) ms) a
    deleted spool file may have held."""

    start_ms: int
    end_ms: int
    kills_ms: list[int] = field(default_factory=list)
    deleted_ms: tuple[int, int] | None = None


class Scenario:
    """A scenario of the fault report, as hooks around ``run_fault``'s common run (a fresh stack,
    warm-up, the fault, the drain, a clean stop, the comparison with the simulator's served log)."""

    def configure(self, s: Ours) -> None:
        """After the simulator and the receiver started, before the edge (mosquitto, relay, ingester)."""

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        raise NotImplementedError

    def before_stop(self, s: Ours) -> None:
        """After the drain, while everything still runs (read counters here)."""

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        """After the comparison: adjust ``r`` (the scenario's own accounting) and add notes."""

    # Seconds further back the receiver is read (samples stamped by a clock stepped back).
    lookback_extra_s = 0

    def relay_env(self) -> dict[str, str]:
        """Environment variables of the relay's process (set in ``configure``)."""
        return {}

    def stamp(self, served_ms: int) -> int:
        """The relay's clock when it scraped the request the simulator served at ``served_ms``."""
        return served_ms

    def close(self) -> None:
        pass


class Simple(Scenario):
    """A fault that only breaks and heals the stack: ``run`` returns (start ms, end ms, kill times)."""

    def __init__(self, fn: Callable[[Ours, float, random.Random], tuple[int, int, list[int]]]) -> None:
        self.fn = fn

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        w0, w1, kills = self.fn(s, seconds, rng)
        return FaultWindow(w0, w1, kills)


@dataclass(frozen=True)
class Fault:
    name: str
    # Breaks the stack, waits, heals; returns (window start ms, window end ms, kill times ms).
    run: Callable[[Ours, float, random.Random], tuple[int, int, list[int]]] | None = None
    # Or a scenario with hooks of its own (made fresh for each run).
    scenario: Callable[[], Scenario] | None = None

    def make(self) -> Scenario:
        if self.scenario is not None:
            return self.scenario()
        assert self.run is not None
        return Simple(self.run)


@contextlib.contextmanager
def _relay_env(env: dict[str, str]) -> Iterator[None]:
    """While ``Ours.start_edge`` runs: the relay's ``Program`` gets ``env`` (kept for its restarts)."""
    if not env:
        yield
        return
    from testkit import edge_systems

    made = edge_systems._program

    def with_env(name: str, *args: Any) -> Any:
        prog = made(name, *args)
        if name == "edge-relay":
            prog.env.update(env)
        return prog

    edge_systems._program = with_env
    try:
        yield
    finally:
        edge_systems._program = made


def _fault_window(
    begin: Callable[[], object], end: Callable[[], object], seconds: float
) -> tuple[int, int, list[int]]:
    """``begin()``, wait ``seconds``, ``end()``; returns the fault's start and end (unix ms)."""
    t0 = now_ms()
    begin()
    time.sleep(seconds)
    end()
    return t0, now_ms(), []


def fault_broker_restart(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    return _fault_window(s.mosquitto.stop, s.mosquitto.restart, seconds)


def fault_partition(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    return _fault_window(s.proxy.stall, s.proxy.heal, seconds)


def fault_cut(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    return _fault_window(s.proxy.cut, s.proxy.heal, seconds)


def fault_ingester_kill(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    return _fault_window(s.ingest.kill, s.ingest.start, seconds)


def fault_receiver_down(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    return _fault_window(s.receiver.stop, s.receiver.restart, seconds)


RELAY_KILLS = 5


def fault_relay_sigkill(s: Ours, seconds: float, rng: random.Random) -> tuple[int, int, list[int]]:
    """SIGKILL the relay at a random instant in each fifth of the window; restart it at once."""
    t0 = now_ms()
    kills = []
    slot = seconds / RELAY_KILLS
    for _ in range(RELAY_KILLS):
        delay = rng.uniform(0.3, slot)
        time.sleep(delay)
        if not s.relay.alive():
            raise RuntimeError(f"edge-relay died by itself:\n{s.relay.log_tail()}")
        kills.append(now_ms())
        s.relay.kill()
        s.relay.start()
        time.sleep(max(0.0, slot - delay))
    return t0, now_ms(), kills


# --- bad data, hostile peers and bounds (issue 12) ---------------------------------------------------

HOUR_MS = 3_600_000


def add_target(s: Ours, name: str, url: str) -> None:
    """A fifth target beside the simulator's four (relay_config's target list, plus this one)."""
    targets = [
        {"name": n, "url": u, "format": "openmetrics" if n == "kepler" else "text"}
        for n, u in s.sim.urls.items()
    ]
    s.relay_overrides["targets"] = [*targets, {"name": name, "url": url, "format": "text"}]


def _quiet_window(seconds: float) -> FaultWindow:
    t0 = now_ms()
    time.sleep(seconds)
    return FaultWindow(t0, now_ms())


def _by_name(samples: RawSamples) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for key, got in samples.items():
        out.setdefault(dict(key)["__name__"], []).extend(got)
    for got in out.values():
        got.sort()
    return out


class BadSamples(Scenario):
    """A fifth target (``TimedScriptedExporter``, job ``bad-data``) serves, each scrape, two good series
    and three samples that must cost only themselves: ``bad_metric 1 -1`` (the edge drops it,
    ``invalid_timestamp``), ``ahead_metric`` stamped an hour ahead (the ingester splits it off and
    dead-letters it) and ``dup_metric`` at one fixed timestamp with a new value each scrape (Prometheus
    answers 400 "duplicate sample for timestamp" from the second on; the ingester bisects the batch and
    dead-letters that sample). Both cloud refusals come back in ``partial`` acks: ``rejected_by_cloud``."""

    JOB = "bad-data"

    def configure(self, s: Ours) -> None:
        from testkit.hostile import TimedScriptedExporter

        dup_ts = now_ms() - 1000

        def body(n: int) -> str:
            now = now_ms()
            return (
                f"ok_before {n}\nbad_metric 1 -1\nahead_metric 1 {now + HOUR_MS}\n"
                f'dup_metric {n} {dup_ts}\nok_after{{a="b"}} {n / 2}\n'
            )

        self.exporter = TimedScriptedExporter(body)
        add_target(s, self.JOB, self.exporter.url)

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        return _quiet_window(seconds)

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        from testkit.hostile import dead_letters_by_job, ledger_by_series

        scrapes = self.exporter.requests
        in_window = [n for n, t in self.exporter.served if t <= until_ms]
        series = _by_name(s.receiver.raw_samples(f'{{job="{self.JOB}"}}', lookback=f"{lookback_s}s"))
        before = {v for _, v in series.get("ok_before", [])}
        after = {v for _, v in series.get("ok_after", [])}
        good_expected = 2 * len(in_window)
        good_found = sum(float(n) in before for n in in_window) + sum(n / 2 in after for n in in_window)
        ups = [v for _, v in series.get("up", [])]
        wrong = sorted({"bad_metric", "ahead_metric"} & set(series))
        dup_written = series.get("dup_metric", [])

        ledger = ledger_by_series(s.relay_cfg)
        letters, reasons = dead_letters_by_job(s.workdir / "dead-letter.db")
        mine = f'{{job="{self.JOB}"}}'
        edge_own = {reason: n for (reason, ser), n in ledger.items() if ser == mine}
        cloud_own = sum(n for (job, _), n in letters.items() if job == self.JOB)
        cloud_other = sum(n for (job, _), n in letters.items() if job != self.JOB)
        rbc_total = sum(n for (reason, _), n in ledger.items() if reason == "rejected_by_cloud")
        # rejected_by_cloud rows name the jobs of the whole batch: the dead letters say whose samples.
        own_in_ledger = sum(edge_own.values()) + max(0, cloud_own - edge_own.get("rejected_by_cloud", 0))
        total = sum(ledger.values())
        r.lost_by_intent = total - own_in_ledger
        by_metric = {name: n for (job, name), n in letters.items() if job == self.JOB}
        want = {"invalid_timestamp": scrapes, "ahead_metric": scrapes, "dup_metric": max(0, scrapes - 1)}
        got = {
            "invalid_timestamp": edge_own.get("invalid_timestamp", 0),
            "ahead_metric": by_metric.get("ahead_metric", 0),
            "dup_metric": by_metric.get("dup_metric", 0),
        }
        note = (
            f"fifth target `{self.JOB}` (not in the columns): {scrapes} scrapes, up 1 in {ups.count(1.0)} "
            f"of {len(ups)}; its good series {good_found:,} of {good_expected:,} samples in Prometheus "
            f"(value n and n/2 of every scrape served up to the window's end); refused by design "
            f"{own_in_ledger:,} samples, all in the loss ledger: "
            f"invalid_timestamp {got['invalid_timestamp']:,} "
            f"(dropped at the edge), rejected_by_cloud {cloud_own:,} via partial acks (dead letters: "
            f"ahead_metric {got['ahead_metric']:,}, dup_metric {got['dup_metric']:,}; "
            f"letters by reason {dict(reasons)})"
        )
        if got != want:
            note += f"; EXPECTED {want}"
        if rbc_total != cloud_own + cloud_other:
            dead = cloud_own + cloud_other
            note += f"; ledger rejected_by_cloud {rbc_total:,} != {dead:,} dead-lettered samples"
        if cloud_other:
            note += f"; {cloud_other:,} dead-lettered samples of the simulator's jobs"
        if wrong or len(dup_written) != 1:
            note += f"; UNEXPECTED in Prometheus: {wrong}, dup_metric {dup_written[:3]}"
        if good_found != good_expected:
            note += f"; {good_expected - good_found:,} GOOD SAMPLES OF THE FIFTH TARGET MISSING"
        r.notes.append(note)

    def close(self) -> None:
        self.exporter.close()


class SlowTarget(Scenario):
    """A fifth target (``TricklingExporter``, job ``slow``) announces 1,000,000 bytes and sends one every
    0.5 s: each of its scrapes must end at the relay's deadline (``up`` 0) and hold nobody else up."""

    JOB = "slow"

    def configure(self, s: Ours) -> None:
        from testkit.hostile import TricklingExporter

        self.exporter = TricklingExporter(every=0.5, content_length=1_000_000)
        add_target(s, self.JOB, self.exporter.url)

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        return _quiet_window(seconds)

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        slow = _by_name(s.receiver.raw_samples(f'{{job="{self.JOB}"}}', lookback=f"{lookback_s}s"))
        ups = [v for _, v in slow.get("up", [])]
        slow_dur = max((v for _, v in slow.get("scrape_duration_seconds", [])), default=float("nan"))
        r.notes.append(
            f"fifth target `{self.JOB}` (not in the columns): {self.exporter.requests} requests, up 0 in "
            f"{ups.count(0.0)} of {len(ups)} scrapes, scrape_duration_seconds up to {slow_dur:.2f} s; "
            + _others_on_time(s, w, lookback_s)
        )

    def close(self) -> None:
        self.exporter.close()


FLOOD_BATCHES = 3000
FLOOD_BURSTS = 10
FLOOD_NODE = "edge-gpu-99"


class HostileFlood(Scenario):
    """Another client (not the relay) floods the batch topic of another node with QoS 0 batches,
    ``FLOOD_BATCHES`` well-formed ones in ``FLOOD_BURSTS`` bursts over the window, straight into the
    broker (not through the relay's link). The ingester takes batches with QoS 1 only."""

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        import threading

        from testkit.hostile import hostile_batch, qos0_flood

        topic = f"edgemetrics/v1/{CLUSTER}/{FLOOD_NODE}/batch"
        payloads = [hostile_batch(FLOOD_NODE, i + 1) for i in range(FLOOD_BATCHES)]
        per = FLOOD_BATCHES // FLOOD_BURSTS
        self.sent = 0
        self.errors: list[str] = []

        def flood() -> None:
            for k in range(FLOOD_BURSTS):
                try:
                    self.sent += qos0_flood(
                        s.mosquitto.port, topic, payloads[k * per : (k + 1) * per], client_id=f"hostile-{k}"
                    )
                except Exception as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(max(0.0, seconds / FLOOD_BURSTS - 0.5))

        t0 = now_ms()
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        time.sleep(seconds)
        flooder.join(30)
        return FaultWindow(t0, now_ms())

    def before_stop(self, s: Ours) -> None:
        from testkit.readings import metric_sum, read_metrics

        try:
            m = read_metrics(s.ingest_metrics_url)
            self.refused = {
                lab.get("reason", ""): v for n, lab, v in m if n == "cloud_ingest_batches_refused_total" and v
            }
            self.written = metric_sum(m, "cloud_ingest_samples_written_total")
        except Exception as exc:
            self.refused = {"(ingester metrics unavailable)": 0.0}
            self.errors.append(f"metrics: {type(exc).__name__}")

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        hostile = s.receiver.raw_samples('{__name__="hostile_metric"}', lookback=f"{lookback_s}s")
        refused = ", ".join(f"{k}={v:,.0f}" for k, v in sorted(self.refused.items())) or "none"
        r.notes.append(
            f"hostile client: {self.sent:,} QoS 0 batches published to `.../{FLOOD_NODE}/batch` "
            f"({FLOOD_BURSTS} connections of its own); ingester's cloud_ingest_batches_refused_total: "
            f"{refused}; hostile samples in Prometheus: {sum(len(v) for v in hostile.values())}"
            + (f"; flooder errors: {self.errors[:3]}" if self.errors else "")
            + "; no takeover attempt with the relay's client id: the bench's broker (testkit Mosquitto: "
            "anonymous, no ACL, no use_username_as_clientid) pins nothing, so it would be let in by "
            "design (the shipped broker's pinning is tests/system/test_mqtt_tls.py's)"
        )


class SpoolRecreated(Scenario):
    """The receiver goes down (so published batches stay unacknowledged: their acks come later, to
    whoever then holds the relay's session); 5 s in the uplink is cut too (so the spool also holds
    batches never published); 8 s in the relay is stopped (SIGTERM, a 3 s drain that cannot finish),
    its spool file deleted (an emptyDir after a rollout), the link healed and the relay started again
    at once, with a new spool (new incarnation, seqs from 1 again); the receiver comes back at the end
    of the window, and the ingester's acks of the old incarnation's batches reach the new relay."""

    DOWN_BEFORE_CUT_S = 5.0
    DOWN_BEFORE_STOP_S = 8.0
    FIRST_DRAIN_S = 3
    DRAIN_S = 30

    def configure(self, s: Ours) -> None:
        s.drain_seconds = self.FIRST_DRAIN_S

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        from testkit.hostile import spool_waiting

        t0 = time.monotonic()
        # Unacknowledged from the receiver's stop on; what was in flight then was published already.
        since_ms = now_ms() - 2000
        s.receiver.stop()
        time.sleep(self.DOWN_BEFORE_CUT_S)
        s.proxy.cut()
        self.cut_ms = now_ms()
        time.sleep(self.DOWN_BEFORE_STOP_S - self.DOWN_BEFORE_CUT_S)
        self.exit_code = s.relay.stop(timeout=self.FIRST_DRAIN_S + 30)
        self.waiting = spool_waiting(s.relay_cfg)
        p = s.spool_path
        for f in (p, Path(f"{p}-wal"), Path(f"{p}-shm"), Path(f"{p}-journal")):
            f.unlink(missing_ok=True)
        argv = s.relay.argv
        argv[argv.index("--drain-seconds") + 1] = str(self.DRAIN_S)
        s.drain_seconds = self.DRAIN_S
        s.proxy.heal()
        s.relay.start()
        restart_ms = now_ms()
        self.log_mark = s.relay.log_path.stat().st_size
        time.sleep(max(0.0, seconds - (time.monotonic() - t0)))
        s.receiver.restart()
        return FaultWindow(restart_ms, now_ms(), deleted_ms=(since_ms, restart_ms))

    def before_stop(self, s: Ours) -> None:
        from testkit.readings import metric_sum, read_metrics

        try:
            m = read_metrics(s.relay_metrics_url)
            self.ignored: float | None = metric_sum(
                m, "edge_relay_acks_ignored_total", reason="other_incarnation"
            )
        except Exception:
            self.ignored = None

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        with s.relay.log_path.open("rb") as f:
            f.seek(self.log_mark)
            warned = f.read().decode(errors="replace").count("of spool incarnation")
        batches, samples = self.waiting
        gone = sorted(
            t
            for (_, t) in r.score.missing_by_scrape
            if w.deleted_ms and w.deleted_ms[0] <= t < w.deleted_ms[1]
        )
        served = ""
        if gone:
            first, last = ((t - self.cut_ms) / 1000 for t in (gone[0], gone[-1]))
            served = f", served {first:+.1f} to {last:+.1f} s from the cut"
        r.notes.append(
            f"first relay exited {self.exit_code} after SIGTERM (drain {self.FIRST_DRAIN_S} s, receiver "
            f"down for {self.DOWN_BEFORE_STOP_S:g} s, uplink cut for the last "
            f"{self.DOWN_BEFORE_STOP_S - self.DOWN_BEFORE_CUT_S:g} s); its spool held {batches} batches "
            f"({samples:,} samples) when deleted; "
            f"{r.lost_by_operator:,} samples of {len(gone)} responses (target x cycle) served between the "
            f"receiver's stop and the restart are not in "
            f"Prometheus{served} "
            f"(lost with the deleted spool: in brackets, not in 'lost otherwise'); the new relay ignored "
            f"{'n/a' if self.ignored is None else f'{self.ignored:.0f}'} acks of the old incarnation "
            f"({warned} warnings in its log); time to drain counts from the receiver's return"
        )
        if r.lost_by_operator > samples:
            r.notes.append(f"MORE MISSING ({r.lost_by_operator:,}) THAN THE DELETED SPOOL HELD ({samples:,})")


class Skipped(Exception):
    """A scenario that cannot run here (a tool missing): reported as skipped, with the reason."""


def _others_on_time(s: Ours, w: FaultWindow, lookback_s: int) -> str:
    """The simulator's four targets in the window: scrapes each, largest gap, largest scrape duration."""
    gaps: list[float] = []
    durations: list[float] = []
    counts: list[int] = []
    for job in EXPORTERS:
        got = _by_name(s.receiver.raw_samples(f'{{job="{job}"}}', lookback=f"{lookback_s}s"))
        stamps = [t for t, _ in got.get("up", []) if w.start_ms <= t <= w.end_ms]
        counts.append(len(stamps))
        gaps += [(b - a) / 1000 for a, b in itertools.pairwise(stamps)]
        durations += [v for t, v in got.get("scrape_duration_seconds", []) if w.start_ms <= t <= w.end_ms]
    return (
        f"the simulator's four targets in the {(w.end_ms - w.start_ms) / 1000:.0f} s window: "
        f"{min(counts)}-{max(counts)} scrapes each, largest gap between two scrapes "
        f"{max(gaps, default=0):.2f} s, scrape_duration_seconds up to {max(durations, default=0):.3f} s"
    )


def _peak_rss(prog: Any) -> int | None:
    from testkit.readings import proc_stats

    try:
        return proc_stats(prog.proc.pid).peak_rss_bytes
    except (OSError, AttributeError):
        return None


HUGE_BYTES = 60 << 20
CONTAINER_LIMIT = "256 Mi (deploy/: the relay container's memory limit)"
DEPLOY_RELAY_CONFIG = ROOT / "deploy" / "kubernetes" / "base" / "edge" / "config" / "edge-relay.yaml"


class HugeTarget(Scenario):
    """A fifth target (``ScriptedExporter``, job ``huge``) answers every scrape with ``HUGE_BYTES`` of
    ``a_N 1`` lines, every name its own series: under the relay's ``scrape.body_limit_bytes`` (64 MiB by
    default), some 5.3 million samples, far over its ``sample_limit`` (200,000): each of its scrapes
    must fail (``up`` 0) at a bounded cost in memory, and hold nobody else up. The relay's scrape
    limits are its defaults."""

    JOB = "huge"
    limits = "the relay's defaults"

    def body_bytes(self, s: Ours) -> int:
        return HUGE_BYTES

    def configure(self, s: Ours) -> None:
        from testkit.exporters import ScriptedExporter
        from testkit.hostile import numbered_exposition

        self.body = numbered_exposition(self.body_bytes(s))
        self.lines = self.body.count(b"\n")
        self.exporter = ScriptedExporter(lambda n: self.body)
        self.exporter.server.handle_error = lambda request, address: None  # the relay hung up: fine
        add_target(s, self.JOB, self.exporter.url)

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        self.hwm_before = _peak_rss(s.relay)
        return _quiet_window(seconds)

    def before_stop(self, s: Ours) -> None:
        from testkit.readings import proc_stats, read_metrics

        self.hwm = _peak_rss(s.relay)
        self.ingest_hwm = _peak_rss(s.ingest)
        try:
            self.rss: int | None = proc_stats(s.relay.proc.pid).rss_bytes  # type: ignore[union-attr]
        except (OSError, AttributeError):
            self.rss = None
        try:
            m = read_metrics(s.relay_metrics_url)
            self.results = {
                lab["result"]: v
                for n, lab, v in m
                if n == "edge_relay_scrapes_total" and lab.get("target") == self.JOB and v
            }
        except Exception as exc:
            self.results = {f"(relay metrics unavailable: {type(exc).__name__})": 0.0}

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        import re

        from testkit.hostile import ledger_by_series

        huge = _by_name(s.receiver.raw_samples(f'{{job="{self.JOB}"}}', lookback=f"{lookback_s}s"))
        ups = [v for _, v in huge.get("up", [])]
        durations = [v for _, v in huge.get("scrape_duration_seconds", [])]
        overran = re.findall(r"overran the \S+ interval; skipping (\d+) tick", s.relay.log_path.read_text())
        others = sorted(n for n in huge if n not in SYNTHETIC)
        mine = f'{{job="{self.JOB}"}}'
        own = {reason: n for (reason, ser), n in ledger_by_series(s.relay_cfg).items() if ser == mine}
        if own and r.lost_by_intent is not None:
            r.lost_by_intent -= sum(own.values())
        results = ", ".join(f"{k}={v:.0f}" for k, v in sorted(self.results.items()))
        r.notes.append(
            f"fifth target `{self.JOB}` (not in the columns): {fmt_bytes(len(self.body))} body, "
            f"{self.lines:,} samples, scrape limits {self.limits}; {self.exporter.requests} requests, "
            f"up 0 in {ups.count(0.0)} of "
            f"{len(ups)} scrapes (edge_relay_scrapes_total: {results}), its scrape_duration_seconds "
            f"(fetch and parse) {min(durations, default=0):.2f}-{max(durations, default=0):.2f} s; "
            f"relay cycles that overran the interval: {len(overran)}, skipping "
            f"{sum(map(int, overran))} ticks (all targets); "
            f"its series in Prometheus: {len(others)}; loss-ledger entries of its own: {own or 'none'}; "
            f"edge-relay peak RSS (VmHWM) {fmt_bytes(self.hwm)} at the end, {fmt_bytes(self.hwm_before)} "
            f"after the warm-up (VmRSS {fmt_bytes(self.rss)} at the end), against the {CONTAINER_LIMIT}; "
            f"cloud-ingest VmHWM "
            f"{fmt_bytes(self.ingest_hwm)}; " + _others_on_time(s, w, lookback_s)
        )
        if others:
            r.notes.append(f"UNEXPECTED series of `{self.JOB}` in Prometheus: {others[:5]}")

    def close(self) -> None:
        if hasattr(self, "exporter"):
            self.exporter.close()


class HugeTargetDeployLimits(HugeTarget):
    """``HugeTarget`` with the scrape limits of ``deploy/``'s relay (``scrape.body_limit_bytes`` and
    ``sample_limit`` of ``DEPLOY_RELAY_CONFIG``: 16 MiB, 50,000) and a body 64 KiB under that body
    limit: the most a scrape can take in that container (a larger body is refused by its
    Content-Length before a byte is read)."""

    def body_bytes(self, s: Ours) -> int:
        import yaml

        scrape = yaml.safe_load(DEPLOY_RELAY_CONFIG.read_text())["scrape"]
        s.relay_overrides["scrape__body_limit_bytes"] = scrape["body_limit_bytes"]
        s.relay_overrides["scrape__sample_limit"] = scrape["sample_limit"]
        body_limit, sample_limit = scrape["body_limit_bytes"], scrape["sample_limit"]
        self.limits = f"of deploy/ (body_limit_bytes {body_limit:,}, sample_limit {sample_limit:,})"
        return int(scrape["body_limit_bytes"]) - (64 << 10)


BOMB_BATCHES = 5
BOMB_NODE = "edge-gpu-98"


class ExpansionBomb(Scenario):
    """A client of its own publishes, with QoS 1, ``BOMB_BATCHES`` small legal v2 batches to another
    node's batch topic over the window (straight into the broker), each of 50,000 series sharing four
    label values of 4,000 bytes (``testkit.hostile.expansion_batch``): as a remote-write request each
    would be 800 MB. The ingester must refuse them (``expansion_limit``) before building anything."""

    def configure(self, s: Ours) -> None:
        from testkit.hostile import expansion_batch

        self.payloads = [expansion_batch(BOMB_NODE, i + 1, cluster=CLUSTER) for i in range(BOMB_BATCHES)]

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        import threading

        from testkit.hostile import qos1_publish

        topic = f"edgemetrics/v1/{CLUSTER}/{BOMB_NODE}/batch"
        self.hwm_before = _peak_rss(s.ingest)
        self.acked = 0
        self.errors: list[str] = []

        def publish() -> None:
            try:
                self.acked = qos1_publish(
                    s.mosquitto.port,
                    topic,
                    self.payloads,
                    client_id="hostile-bomb",
                    every=seconds / BOMB_BATCHES,
                )
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")

        t0 = now_ms()
        publisher = threading.Thread(target=publish, daemon=True)
        publisher.start()
        time.sleep(seconds)
        publisher.join(30)
        return FaultWindow(t0, now_ms())

    def before_stop(self, s: Ours) -> None:
        from testkit.readings import read_metrics

        self.hwm = _peak_rss(s.ingest)
        self.relay_hwm = _peak_rss(s.relay)
        try:
            m = read_metrics(s.ingest_metrics_url)
            self.refused = {
                lab.get("reason", ""): v for n, lab, v in m if n == "cloud_ingest_batches_refused_total" and v
            }
        except Exception as exc:
            self.refused = {"(ingester metrics unavailable)": 0.0}
            self.errors.append(f"metrics: {type(exc).__name__}")

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        from testkit.hostile import dead_letters_by_job

        bombs = s.receiver.raw_samples('{__name__="expansion_metric"}', lookback=f"{lookback_s}s")
        _, reasons = dead_letters_by_job(s.workdir / "dead-letter.db")
        refused = ", ".join(f"{k}={v:,.0f}" for k, v in sorted(self.refused.items())) or "none"
        sizes = sorted({len(p) for p in self.payloads})
        r.notes.append(
            f"hostile client: {self.acked} of {BOMB_BATCHES} QoS 1 batches acknowledged by the broker on "
            f"`.../{BOMB_NODE}/batch` ({'-'.join(fmt_bytes(n) for n in sorted({sizes[0], sizes[-1]}))} "
            f"each, 50,000 series x "
            f"4 shared label values of 4,000 B: an 800 MB remote-write request each); ingester's "
            f"cloud_ingest_batches_refused_total: {refused}; dead letters by reason {dict(reasons)}; "
            f"their series in Prometheus: {len(bombs)}; cloud-ingest peak RSS (VmHWM) "
            f"{fmt_bytes(self.hwm_before)} before the first, {fmt_bytes(self.hwm)} at the end; edge-relay "
            f"VmHWM {fmt_bytes(self.relay_hwm)}"
            + (f"; publisher errors: {self.errors[:3]}" if self.errors else "")
        )
        if self.refused.get("expansion_limit", 0) != self.acked:
            r.notes.append(f"EXPECTED {self.acked} expansion_limit refusals")

    def close(self) -> None:
        self.payloads = []


CLOCK_STEP_S = 600


class ClockStep(Scenario):
    """The relay runs under libfaketime (``testkit.hostile.Faketime``: realtime clock only, monotonic
    untouched). A quarter into the window its clock steps back ``CLOCK_STEP_S`` (NTP on a device
    without RTC), three quarters in forward again to the true time; each step half-way between two
    scrape cycles, so each scrape is stamped wholly by one clock. The relay has a budget file: class
    ``health`` (preset scrape-health: up, scrape_duration_seconds, scrape_samples_scraped) at 2 s
    resolution with suppression of unchanged values (heartbeat 10 s), stateful, so its open windows and
    per-series state meet the step back; the exporters' series in a lossless catch-all class; 1 s batch
    windows. The oracle matches each served request to the scrape stamped by the relay's clock then."""

    lookback_extra_s = CLOCK_STEP_S

    def configure(self, s: Ours) -> None:
        from testkit.hostile import Faketime
        from testkit.stack import write_budget

        self.ft = Faketime(s.workdir / "faketime-offset")
        problem = self.ft.problem()
        if problem:
            raise Skipped(problem)
        self.interval_ms = round(s.interval * 1000)
        budget = write_budget(
            s.workdir / "budget.yaml",
            bytes_per_second=50_000_000,
            burst_bytes=None,
            batch_window_seconds=s.interval,
            classes=[
                {
                    "name": "health",
                    "preset": "scrape-health",
                    "resolution_seconds": 2 * s.interval,
                    "suppress_unchanged": {"heartbeat_seconds": 10},
                },
                {"name": "exporters"},
            ],
        )
        s.relay_overrides["budget_file"] = str(budget)

    def relay_env(self) -> dict[str, str]:
        return self.ft.env()

    def _step_between_scrapes(self, s: Ours, offset_s: int) -> int:
        last = max(rec.t_ms for rec in read_served_log(s.sim.served_log))
        at = last + self.interval_ms // 2
        while at < now_ms() + 20:
            at += self.interval_ms
        time.sleep((at - now_ms()) / 1000)
        return self.ft.step(offset_s)

    def run(self, s: Ours, seconds: float, rng: random.Random) -> FaultWindow:
        t0 = now_ms()
        time.sleep(seconds / 4)
        self.back_ms = self._step_between_scrapes(s, -CLOCK_STEP_S)
        time.sleep(max(0.0, seconds / 2 - (now_ms() - self.back_ms) / 1000))
        self.forward_ms = self._step_between_scrapes(s, 0)
        time.sleep(max(0.0, seconds - (now_ms() - t0) / 1000))
        return FaultWindow(t0, now_ms())

    def stamp(self, served_ms: int) -> int:
        steps = getattr(self, "ft", None)
        offset = 0
        for at, off in steps.steps if steps else []:
            # A request served a quarter interval after a step was scraped after it (steps fall half-way
            # between two cycles, and a cycle's requests are served within milliseconds of its start).
            if served_ms - self.interval_ms // 4 >= at:
                offset = off
        return served_ms + offset * 1000

    def before_stop(self, s: Ours) -> None:
        from testkit.readings import read_metrics

        try:
            m = read_metrics(s.relay_metrics_url)
            self.shaped = {
                (lab["class"], lab["outcome"]): v for n, lab, v in m if n == "edge_relay_budget_samples_total"
            }
        except Exception as exc:
            self.shaped = {(f"(relay metrics unavailable: {type(exc).__name__})", ""): 0.0}

    def account(self, s: Ours, r: Result, w: FaultWindow, until_ms: int, lookback_s: int) -> None:
        step_ms = CLOCK_STEP_S * 1000
        span = (self.back_ms - step_ms, self.forward_ms - step_ms)  # relay clock while stepped back
        stepped: list[int] = []
        ups: list[int] = []
        durations: list[int] = []
        for job in EXPORTERS:
            got = _by_name(s.receiver.raw_samples(f'{{job="{job}"}}', lookback=f"{lookback_s}s"))
            stepped.append(
                sum(1 for n, xs in got.items() if n not in SYNTHETIC for t, _ in xs if span[0] <= t < span[1])
            )
            ups.append(sum(1 for t, _ in got.get("up", []) if span[0] <= t < span[1]))
            durations.append(
                sum(1 for t, _ in got.get("scrape_duration_seconds", []) if span[0] <= t < span[1])
            )
        served_stepped = sum(
            1 for rec in read_served_log(s.sim.served_log) if span[0] <= self.stamp(rec.t_ms) < span[1]
        )
        shaped = ", ".join(f"{c} {o}={v:,.0f}" for (c, o), v in sorted(self.shaped.items()) if v)
        text = s.relay.log_path.read_text(errors="replace")
        clock_lines = [ln for ln in text.splitlines() if "clock" in ln.lower()]
        r.notes.append(
            f"relay clock stepped back {CLOCK_STEP_S} s at +{(self.back_ms - w.start_ms) / 1000:.1f} s into "
            f"the window and forward again at +{(self.forward_ms - w.start_ms) / 1000:.1f} s "
            f"(libfaketime {self.ft.lib}); {served_stepped} requests (target x cycle) served while stepped "
            f"back; exporter samples stamped in the stepped-back span per target in Prometheus: "
            f"{', '.join(f'{n:,}' for n in stepped)}; `up` samples there (class health, 2 s windows, "
            f"heartbeat 10 s): {', '.join(map(str, ups))} per target, `scrape_duration_seconds`: "
            f"{', '.join(map(str, durations))}; "
            f"edge_relay_budget_samples_total: {shaped or 'none'}; ledger: {s.ledger_note()}; "
            f"relay log lines about the clock: {len(clock_lines)}"
            + (f" (first: {clock_lines[0][-160:]!r})" if clock_lines else "")
        )

    def close(self) -> None:
        pass


FAULTS = [
    Fault("broker restart (mosquitto stopped, started)", fault_broker_restart),
    Fault("network partition (silent blackhole)", fault_partition),
    Fault("uplink cut (refused + reset)", fault_cut),
    Fault("ingester kill (SIGKILL, restarted)", fault_ingester_kill),
    Fault("Prometheus down (stopped, restarted)", fault_receiver_down),
    Fault(f"relay SIGKILL x{RELAY_KILLS} (restarted at once)", fault_relay_sigkill),
    Fault("bad samples beside the simulator", scenario=BadSamples),
    Fault("slow exporter beside the others", scenario=SlowTarget),
    Fault(f"QoS 0 flood from another client ({FLOOD_BATCHES:,})", scenario=HostileFlood),
    Fault("spool recreated (SIGTERM, file deleted)", scenario=SpoolRecreated),
    Fault("huge exposition beside the others (60 MiB)", scenario=HugeTarget),
    Fault("huge exposition, deploy/ limits", scenario=HugeTargetDeployLimits),
    Fault("expansion bomb from another node (QoS 1)", scenario=ExpansionBomb),
    Fault(f"edge clock steps back {CLOCK_STEP_S // 60} min (and forward)", scenario=ClockStep),
]


def run_faults(args: argparse.Namespace) -> str:
    rows: list[Result] = []
    errors: list[str] = []
    skipped: list[str] = []
    rng = random.Random(args.seed)
    with workspace(args.workdir, args.keep, "fault-bench-") as work:
        selected = [f for f in FAULTS if not args.only or any(o in f.name for o in args.only)]
        for i, fault in enumerate(selected):
            log(f"scenario {i + 1}/{len(selected)}: {fault.name}")
            try:
                rows.append(run_fault(args, fault, work / f"fault-{i}", rng))
            except Skipped as exc:
                log(f"{fault.name}: SKIPPED: {exc}")
                skipped.append(f"- {fault.name}: skipped: {exc}")
            except Exception as exc:
                log(f"{fault.name}: FAILED: {exc}")
                errors.append(f"- {fault.name}: {type(exc).__name__}: {exc}".splitlines()[0])
    return fault_report(args, rows, errors, skipped)


def run_fault(args: argparse.Namespace, fault: Fault, workdir: Path, rng: random.Random) -> Result:
    ours = Ours(
        "ours",
        fault.name,
        workdir,
        args.fault_interval,
        args.fault_series,
        relay_overrides={"mqtt__ack_timeout_seconds": 10},  # relay_config: keepalive 5 s, reconnect 0.2-2 s
        ingest_overrides={"mqtt__reconnect_min_seconds": 0.2, "mqtt__reconnect_max_seconds": 2},
        drain_seconds=30,
        broker_autosave=True,
    )
    scenario = fault.make()
    try:
        ours.start_common()
        scenario.configure(ours)
        with _relay_env(scenario.relay_env()):
            ours.start_edge()
        start_ms = now_ms()
        time.sleep(args.fault_warmup)
        if ours.tap.requests_ok == 0:
            raise RuntimeError(f"nothing reached the receiver during the warm-up:\n{ours.relay.log_tail()}")
        w = scenario.run(ours, args.fault_seconds, rng)
        heal = time.monotonic()
        counts = SampleCounts(ours.sim.simulator)
        watch = window_watch(ours, counts, w.start_ms, w.end_ms, heal, scenario.stamp)

        def alive() -> None:
            if not ours.relay.alive():
                raise RuntimeError(f"edge-relay died:\n{ours.relay.log_tail()}")

        done = wait_drained(
            {"ours": watch}, timeout=args.fault_timeout, settle=args.fault_settle, alive=alive
        )
        time.sleep(2 * args.fault_interval)
        until_ms = now_ms()
        time.sleep(3 * args.fault_interval + 2)
        scenario.before_stop(ours)
        ours.read_counters()
        ours.stop_edge()
        lookback = int(time.time() - start_ms / 1000) + 60 + scenario.lookback_extra_s
        sc, failed, killed, deleted = evaluate(
            ours,
            until_ms=until_ms,
            lookback_s=lookback,
            at=time.time(),
            kills_ms=w.kills_ms,
            deleted_ms=w.deleted_ms,
            stamp=scenario.stamp,
        )
        r = Result(
            fault.name,
            sc,
            failed,
            ours.lost_by_intent(),
            ours.tap.duplicates,
            watch.drain_seconds(),
            done["ours"],
            watch.missing,
            in_flight_at_kill=killed,
            lost_by_operator=deleted,
            notes=list(ours.notes),
        )
        if killed:
            r.drain_complete = True  # the missing scrapes are the ones that died with the relay
        if sc.value_mismatches:
            r.notes.append(f"{sc.value_mismatches} samples with another value")
        if sc.extra:
            r.notes.append(f"{sc.extra} unexpected samples")
        scenario.account(ours, r, w, until_ms, lookback)
        log(
            f"{fault.name}: expected {sc.expected:,}, delivered {sc.delivered:,}, duplicated "
            f"{ours.tap.duplicates:,}, lost otherwise {r.lost_otherwise:,}, drain {fmt_drain(r)}"
        )
        for note in r.notes:
            log(f"  {note}")
        return r
    finally:
        ours.close()
        scenario.close()


def fault_report(
    args: argparse.Namespace, rows: list[Result], errors: list[str], skipped: list[str] | None = None
) -> str:
    series = args.fault_series or "natural"
    head = (
        f"## Fault report: our stack, {series} series at {args.fault_interval:g} s, "
        f"{args.fault_seconds:g} s per fault\n\n"
        "Each scenario on a fresh stack (simulator -> edge-relay -> mosquitto -> cloud-ingest -> Prometheus "
        f"with a 2 h out-of-order window): {args.fault_warmup:g} s warm-up, the fault, recovery, a clean "
        "stop (SIGTERM, drain); exporter samples only.\n"
    )
    body = (
        "(no scenario ran)\n"
        if not rows
        else table(
            [
                "scenario",
                "samples expected",
                "delivered",
                "duplicated",
                "lost by intent",
                "lost otherwise",
                "time to drain",
            ],
            [
                [
                    r.name,
                    fmt_int(r.score.expected),
                    fmt_int(r.score.delivered),
                    fmt_int(r.duplicated),
                    fmt_int(r.lost_by_intent),
                    fmt_lost_otherwise(r),
                    fmt_drain(r),
                ]
                for r in rows
            ],
        )
    )
    notes = "\n".join(f"- {r.name}: {'; '.join(r.notes)}" for r in rows if r.notes)
    failed = ("\nScenarios that failed:\n" + "\n".join(errors) + "\n") if errors else ""
    if skipped:
        failed += "\nScenarios skipped:\n" + "\n".join(skipped) + "\n"
    return f"{head}\n{body}\n{notes and chr(10) + notes}\n{failed}"


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", action="store_true", help="run the fault report of our stack instead")
    ap.add_argument("--series", type=int, default=2000, help="simulated series (default 2000)")
    ap.add_argument("--interval", type=float, default=5.0, help="scrape interval, s (default 5)")
    ap.add_argument("--warmup-minutes", type=float, default=1.0, help="before the outage (default 1)")
    ap.add_argument("--outage-minutes", type=float, default=30.0, help="without uplink (default 30)")
    ap.add_argument(
        "--drain-timeout-minutes", type=float, default=15.0, help="longest wait for the backlog (default 15)"
    )
    ap.add_argument(
        "--settle-seconds",
        type=float,
        default=120.0,
        help="give up on a system whose backlog made no progress for this long (default 120)",
    )
    ap.add_argument(
        "--backoff-max",
        type=float,
        default=5.0,
        help="reconnect/retry ceiling for ours and Prometheus agent (vmagent 1.79 has no flag; default 5)",
    )
    ap.add_argument("--fault-series", type=int, default=2000, help="series in fault mode (default 2000)")
    ap.add_argument(
        "--fault-interval", type=float, default=1.0, help="scrape interval in fault mode (default 1)"
    )
    ap.add_argument("--fault-seconds", type=float, default=20.0, help="length of each fault (default 20)")
    ap.add_argument("--fault-warmup", type=float, default=8.0, help="seconds before each fault (default 8)")
    ap.add_argument("--fault-settle", type=float, default=15.0, help="no-progress limit after a fault (15)")
    ap.add_argument("--fault-timeout", type=float, default=180.0, help="longest drain wait per fault (180)")
    ap.add_argument(
        "--only", nargs="*", help="fault mode: run only scenarios whose name contains one of these"
    )
    ap.add_argument("--seed", type=int, default=20240603, help="seed of the SIGKILL instants")
    ap.add_argument("--workdir", help="working directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()

    started = time.monotonic()
    report = run_faults(args) if args.faults else run_outage(args)
    write_results("faults" if args.faults else "outage", report, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
