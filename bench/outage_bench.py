"""Outage bench (issue 3): what a long uplink outage costs us, Prometheus agent and vmagent, and the
fault report of our stack.  Not a test: it prints markdown tables for the README and writes them to
``bench/results/<timestamp>-<mode>.md``.  See ``bench/README.md`` for how every number is measured.

    python bench/outage_bench.py                      # 1 min warm-up, 30 min outage, drain (~35-50 min)
    python bench/outage_bench.py --outage-minutes 1 --warmup-minutes 0.5   # quick run
    python bench/outage_bench.py --faults             # fault report of our stack (~7 min)

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
import datetime as dt
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from testkit.edge_systems import EXTERNAL, Agent, Ours, System, Vm
from testkit.oracle import (
    SYNTHETIC,
    DrainWatch,
    SampleCounts,
    Score,
    expected_samples,
    read_served_log,
    same_value,
    score,
)
from testkit.readings import ProcStats, fmt_bytes
from testkit.services import Prometheus, RawSamples
from testkit.stack import EXPORTERS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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
    buffer_bytes: int | None = None
    peak_buffer_bytes: int | None = None
    uplink_bytes: int | None = None
    stats: dict[str, ProcStats] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    @property
    def lost_otherwise(self) -> int:
        intent = self.lost_by_intent or 0
        return self.score.missing - intent - self.failed_scrape_samples - self.in_flight_at_kill


def window_watch(system: System, counts: SampleCounts, start_ms: int, end_ms: int, heal: float) -> DrainWatch:
    """Every scrape the simulator served to ``system`` in [start_ms, end_ms), to be found whole."""
    wanted = [
        (rec.exporter, rec.t_ms, counts(rec))
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
) -> tuple[Score, int, int]:
    """(score, samples of failed scrapes, samples of scrapes in flight at a SIGKILL)."""
    served = [r for r in read_served_log(system.sim.served_log) if r.t_ms <= until_ms]
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
    failed = killed = 0
    for (job, t_served), n in result.missing_by_scrape.items():
        if any(
            t_served - system.skew_before_ms <= t <= t_served + system.skew_after_ms
            for t in down.get(job, [])
        ):
            failed += n
        elif kills_ms and any(k - system.skew_before_ms - 200 <= t_served <= k + 200 for k in kills_ms):
            killed += n
    return result, failed, killed


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
    return text


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        out = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return "| " + " | ".join(out) + " |"

    sep = "| " + " | ".join(["-" * widths[0]] + ["-" * (w - 1) + ":" for w in widths[1:]]) + " |"
    return "\n".join([line(headers), sep, *(line(r) for r in rows)])


def write_results(mode: str, report: str, started: float) -> Path:
    """Print ``report`` with the bench's wall time (since monotonic ``started``) and command line, and
    write it to ``bench/results/<timestamp>-<mode>.md``."""
    report += f"\nBench wall time {(time.monotonic() - started) / 60:.1f} min; `{' '.join(sys.argv)}`.\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{mode}.md"
    path.write_text(report)
    print(report)
    log(f"written to {path.relative_to(ROOT)}")
    return path


@contextlib.contextmanager
def workspace(arg: str | None, keep: bool, prefix: str) -> Iterator[Path]:
    path = Path(arg) if arg else Path(tempfile.mkdtemp(prefix=prefix))
    path.mkdir(parents=True, exist_ok=True)
    ok = False
    try:
        yield path
        ok = True
    finally:
        if ok and not keep and not arg:
            shutil.rmtree(path, ignore_errors=True)
        else:
            log(f"working directory kept: {path}")


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
        sc, failed, _ = evaluate(s, until_ms=until_ms, lookback_s=lookback, at=at)
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


@dataclass(frozen=True)
class Fault:
    name: str
    # Breaks the stack, waits, heals; returns (window start ms, window end ms, kill times ms).
    run: Callable[[Ours, float, random.Random], tuple[int, int, list[int]]]


def _now_ms() -> int:
    return int(time.time() * 1000)


def _fault_window(
    begin: Callable[[], object], end: Callable[[], object], seconds: float
) -> tuple[int, int, list[int]]:
    """``begin()``, wait ``seconds``, ``end()``; returns the fault's start and end (unix ms)."""
    t0 = _now_ms()
    begin()
    time.sleep(seconds)
    end()
    return t0, _now_ms(), []


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
    t0 = _now_ms()
    kills = []
    slot = seconds / RELAY_KILLS
    for _ in range(RELAY_KILLS):
        delay = rng.uniform(0.3, slot)
        time.sleep(delay)
        if not s.relay.alive():
            raise RuntimeError(f"edge-relay died by itself:\n{s.relay.log_tail()}")
        kills.append(_now_ms())
        s.relay.kill()
        s.relay.start()
        time.sleep(max(0.0, slot - delay))
    return t0, _now_ms(), kills


FAULTS = [
    Fault("broker restart (mosquitto stopped, started)", fault_broker_restart),
    Fault("network partition (silent blackhole)", fault_partition),
    Fault("uplink cut (refused + reset)", fault_cut),
    Fault("ingester kill (SIGKILL, restarted)", fault_ingester_kill),
    Fault("Prometheus down (stopped, restarted)", fault_receiver_down),
    Fault(f"relay SIGKILL x{RELAY_KILLS} (restarted at once)", fault_relay_sigkill),
]


def run_faults(args: argparse.Namespace) -> str:
    rows: list[Result] = []
    errors: list[str] = []
    rng = random.Random(args.seed)
    with workspace(args.workdir, args.keep, "fault-bench-") as work:
        selected = [f for f in FAULTS if not args.only or any(o in f.name for o in args.only)]
        for i, fault in enumerate(selected):
            log(f"scenario {i + 1}/{len(selected)}: {fault.name}")
            try:
                rows.append(run_fault(args, fault, work / f"fault-{i}", rng))
            except Exception as exc:
                log(f"{fault.name}: FAILED: {exc}")
                errors.append(f"- {fault.name}: {type(exc).__name__}: {exc}".splitlines()[0])
    return fault_report(args, rows, errors)


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
    try:
        ours.start_common()
        ours.start_edge()
        start_ms = _now_ms()
        time.sleep(args.fault_warmup)
        if ours.tap.requests_ok == 0:
            raise RuntimeError(f"nothing reached the receiver during the warm-up:\n{ours.relay.log_tail()}")
        w0, w1, kills = fault.run(ours, args.fault_seconds, rng)
        heal = time.monotonic()
        counts = SampleCounts(ours.sim.simulator)
        watch = window_watch(ours, counts, w0, w1, heal)

        def alive() -> None:
            if not ours.relay.alive():
                raise RuntimeError(f"edge-relay died:\n{ours.relay.log_tail()}")

        done = wait_drained(
            {"ours": watch}, timeout=args.fault_timeout, settle=args.fault_settle, alive=alive
        )
        time.sleep(2 * args.fault_interval)
        until_ms = _now_ms()
        time.sleep(3 * args.fault_interval + 2)
        ours.read_counters()
        ours.stop_edge()
        lookback = int(time.time() - start_ms / 1000) + 60
        sc, failed, killed = evaluate(
            ours, until_ms=until_ms, lookback_s=lookback, at=time.time(), kills_ms=kills
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
            notes=list(ours.notes),
        )
        if killed:
            r.drain_complete = True  # the missing scrapes are the ones that died with the relay
        if sc.value_mismatches:
            r.notes.append(f"{sc.value_mismatches} samples with another value")
        if sc.extra:
            r.notes.append(f"{sc.extra} unexpected samples")
        log(
            f"{fault.name}: expected {sc.expected:,}, delivered {sc.delivered:,}, duplicated "
            f"{ours.tap.duplicates:,}, lost otherwise {r.lost_otherwise:,}, drain {fmt_drain(r)}"
        )
        return r
    finally:
        ours.close()


def fault_report(args: argparse.Namespace, rows: list[Result], errors: list[str]) -> str:
    series = args.fault_series or "natural"
    head = (
        f"## Fault report: our stack, {series} series at {args.fault_interval:g} s, "
        f"{args.fault_seconds:g} s per fault\n\n"
        "Each scenario on a fresh stack (simulator -> edge-relay -> mosquitto -> cloud-ingest -> Prometheus "
        f"with a 2 h out-of-order window): {args.fault_warmup:g} s warm-up, the fault, recovery, a clean "
        "stop (SIGTERM, drain); exporter samples only.\n"
    )
    body = table(
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
    notes = "\n".join(f"- {r.name}: {'; '.join(r.notes)}" for r in rows if r.notes)
    failed = ("\nScenarios that failed:\n" + "\n".join(errors) + "\n") if errors else ""
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
