"""Bandwidth bench (issue 4): bytes, CPU and memory per sample of our relay, Prometheus agent and
vmagent side by side on the same workload.  Not a test: it prints a markdown table and writes it to
``bench/results/<timestamp>-bandwidth.md``.  See ``bench/README.md`` for how every number is measured.

    python bench/bandwidth_bench.py                              # 2000 series, 5 s, 10 min measured
    python bench/bandwidth_bench.py --series 500 --minutes 1     # quick check (~4 min)

One simulator serves all of them the same payloads; each one's uplink goes through a byte-counting
TCP proxy (``CutProxy``, never cut here) and each writes to a receiver of its own behind a tap:

    ours:     simulator -> edge-relay -> proxy -> mosquitto -> cloud-ingest -> tap -> Prometheus
    agent:    simulator -> prometheus --enable-feature=agent -> proxy -> tap -> Prometheus
    vmagent:  simulator -> vmagent -> proxy -> tap -> Prometheus
    vmagent:  simulator -> vmagent -> proxy -> tap -> VictoriaMetrics
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from outage_bench import (  # noqa: E402
    CHURN_TICKS,
    NODE,
    SEED,
    Agent,
    Ours,
    System,
    Vm,
    log,
    table,
    workspace,
    write_results,
)
from outage_harness import (  # noqa: E402
    ProcStats,
    ReplayTap,
    check_relay_config,
    die_with_parent,
    metric_sum,
    read_metrics,
    relay_schema_defaults,
    samples_stamped,
    tool_version,
    write_budget,
)
from services import Prometheus, RawSamples, VictoriaMetrics  # noqa: E402
from stack import EXPORTERS, SimulatorProcess, relay_config  # noqa: E402

RECEIVERS: dict[str, type[Prometheus] | type[VictoriaMetrics]] = {
    "prometheus": Prometheus,
    "victoriametrics": VictoriaMetrics,
}
RECEIVER_TITLES = {"prometheus": "Prometheus", "victoriametrics": "VictoriaMetrics"}
# relay_config() sets the test suite's short MQTT timers; the bench runs the product defaults.
MQTT_TIMERS = (
    "keepalive_seconds",
    "ack_timeout_seconds",
    "reconnect_min_seconds",
    "reconnect_max_seconds",
    "status_interval_seconds",
)


# ------------------------------------------------------------------------------------------ systems


@dataclass
class Row:
    """One system of the table: the edge agent, its receiver and what was read from it."""

    system: System
    receiver_kind: str
    receiver: Prometheus | VictoriaMetrics
    protocol: str = ""
    start: Reading | None = None
    end: Reading | None = None
    final_stats: dict[str, ProcStats] = field(default_factory=dict)
    scraped: int = 0  # samples stamped in the window that reached the receiver
    receiver_count: int | None = None  # the receiver's own count of them (cross-check)
    notes: list[str] = field(default_factory=list)

    @property
    def edge(self) -> str:
        """Name of the edge agent's process in ``system.edge_processes()`` (the first one)."""
        if isinstance(self.system, Ours):
            return "edge-relay"
        return "prometheus-agent" if isinstance(self.system, Agent) else "vmagent"


@dataclass(frozen=True)
class Reading:
    """Counters at one edge of the measured window."""

    at_ms: int
    up: int
    down: int
    arrived: int  # distinct exporter samples the receiver accepted so far (tap)
    requests: int  # remote-write requests the receiver accepted so far (tap)
    cpu: dict[str, float]  # process name -> utime + stime seconds
    metrics: dict[str, float]  # ours: the relay's own counters


def reading(row: Row) -> Reading:
    s = row.system
    cpu = {name: st.cpu_seconds for name, st in s.stats().items()}
    metrics: dict[str, float] = {}
    if isinstance(s, Ours):
        try:
            m = read_metrics(s.relay_metrics_url)
        except Exception as exc:
            row.notes.append(f"relay metrics unavailable: {type(exc).__name__}")
        else:
            metrics = {
                "batches": metric_sum(m, "edge_relay_batches_published_total"),
                "payload": metric_sum(m, "edge_relay_publish_payload_bytes_total"),
            }
            if any(n == "edge_relay_wire_bytes_total" for n, _, _ in m):
                metrics["wire"] = metric_sum(m, "edge_relay_wire_bytes_total")
    return Reading(
        at_ms=int(time.time() * 1000),
        up=s.proxy.bytes_up,
        down=s.proxy.bytes_down,
        arrived=s.tap.distinct_samples(),
        requests=s.tap.requests_ok,
        cpu=cpu,
        metrics=metrics,
    )


def attach(system: System, sim: SimulatorProcess, receiver: Prometheus | VictoriaMetrics) -> None:
    """What ``System.start_common`` does, with the shared simulator and a byte-transparent tap."""
    system.workdir.mkdir(parents=True, exist_ok=True)
    system.sim = sim
    system._service(receiver)
    system.tap = ReplayTap(receiver.remote_write_url, name=f"{system.key}-tap")


def short_version(line: str) -> str:
    match = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
    return match.group(1) if match else "?"


# ------------------------------------------------------------------------------------------ relay config


def relay_overrides(
    args: argparse.Namespace, work: Path, urls: dict[str, str], budget: Path | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The relay's config overrides: product MQTT timers, the batch format and a budget file:
    ``budget``, or by default a lossless one (one catch-all class, ``--budget-bytes-per-second``).

    ``batch.format_version`` and ``budget_file`` are new keys: whichever the relay refuses
    (``edge-relay check-config``) is left out, with a warning line for the report.
    """
    defaults = relay_schema_defaults("mqtt")
    base: dict[str, Any] = {f"mqtt__{key}": defaults[key] for key in MQTT_TIMERS}
    if budget is None:
        budget = write_budget(
            work / "budget.yaml",
            bytes_per_second=args.budget_bytes_per_second,
            burst_bytes=10 * args.budget_bytes_per_second,
            batch_window_seconds=args.batch_window,
            classes=[{"name": "all", "resolution_seconds": 0}],
        )
    wanted: dict[str, Any] = {"batch__format_version": args.format_version, "budget_file": str(budget)}
    warnings: list[str] = []
    check_dir = work / "config-check"
    check_dir.mkdir(parents=True, exist_ok=True)
    while True:
        path = relay_config(
            check_dir, urls=urls, mqtt_port=1883, interval=args.interval, node=NODE, **base, **wanted
        )
        error = check_relay_config(path)
        if error is None:
            return {**base, **wanted}, warnings
        if not wanted:
            raise RuntimeError(f"edge-relay refuses the bench's config {path}: {error}")
        # Drop the keys the message names; if it names neither (a budget file it cannot use), the budget.
        # (The relay quotes a key it refuses in backticks: "unknown key `budget_file`".)
        lines = error.splitlines()
        quoted = {k: f"`{k.rsplit('__', 1)[-1]}`" for k in wanted}
        named = [k for k in wanted if quoted[k] in error] or [list(wanted)[-1]]
        for key in named:
            why = " / ".join([line for line in lines if quoted[key] in line] or lines)
            warnings.append(
                f"WARNING: the relay refuses `{key.replace('__', '.')}`, running without it: {why}"
            )
            log(warnings[-1])
            del wanted[key]


def describe_relay(overrides: dict[str, Any], args: argparse.Namespace) -> str:
    fmt = overrides.get("batch__format_version")
    parts = [
        f"`batch.format_version: {fmt}`" if fmt is not None else "batch format: the relay's default",
        (
            "`budget_file` with one class at full resolution "
            "(`classes: [{name: all, resolution_seconds: 0}]`), "
            f"{args.budget_bytes_per_second:,} B/s sustained, {10 * args.budget_bytes_per_second:,} B burst, "
            f"`batch_window_seconds: {args.batch_window:g}`"
            if "budget_file" in overrides
            else "no budget file (one batch per scrape cycle)"
        ),
        "MQTT timers at the product defaults ("
        + ", ".join(f"{k.removeprefix('mqtt__')} {v}" for k, v in overrides.items() if k.startswith("mqtt__"))
        + ")",
    ]
    return "; ".join(parts)


# ------------------------------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> str:
    interval = args.interval
    prom_version = tool_version(["/usr/bin/prometheus", "--version"], "prometheus")
    vm_version = tool_version(["/usr/bin/vmagent", "-version"], "victoria-metrics")
    pv, vv = short_version(prom_version), short_version(vm_version)
    with workspace(args.workdir, args.keep, "bandwidth-bench-") as work:
        (work / "simulator").mkdir(parents=True, exist_ok=True)
        sim = SimulatorProcess(
            work / "simulator", seed=SEED, interval=interval, churn_ticks=CHURN_TICKS, series=args.series
        )
        sim.argv = die_with_parent(sim.argv)
        sim.start()
        rows: list[Row] = []
        try:
            log(f"simulator: {', '.join(f'{k} {v}' for k, v in sim.urls.items())}")
            overrides, warnings = relay_overrides(args, work, sim.urls)
            rows += systems(args, work, overrides, pv, vv)
            return measure(args, rows, sim, overrides, warnings, prom_version, vm_version)
        finally:
            for row in rows:
                row.system.close()
            sim.stop()


def systems(args: argparse.Namespace, work: Path, overrides: dict[str, Any], pv: str, vv: str) -> list[Row]:
    """Ours and the agent write to a Prometheus; one vmagent per ``--vmagent-receivers`` kind."""
    interval = args.interval
    rows = [
        Row(
            Ours(
                "ours",
                "edge-relay (ours)",
                work / "ours",
                interval,
                args.series,
                relay_overrides=overrides,
                ingest_overrides={"mqtt__reconnect_min_seconds": 0.5, "mqtt__reconnect_max_seconds": 5},
            ),
            "prometheus",
            Prometheus(work / "ours" / "receiver"),
        ),
        Row(
            Agent("agent", f"Prometheus agent {pv}", work / "agent", interval, args.series),
            "prometheus",
            Prometheus(work / "agent" / "receiver"),
        ),
    ]
    for kind in args.vmagent_receivers:
        key = f"vmagent-{kind}"
        title = f"vmagent {vv} -> {RECEIVER_TITLES[kind]}"
        rows.append(
            Row(
                Vm(key, title, work / key, interval, args.series),
                kind,
                RECEIVERS[kind](work / key / "receiver"),
            )
        )
    return rows


def measure(
    args: argparse.Namespace,
    rows: list[Row],
    sim: SimulatorProcess,
    overrides: dict[str, Any],
    warnings: list[str],
    prom_version: str,
    vm_version: str,
) -> str:
    interval = args.interval
    for row in rows:
        attach(row.system, sim, row.receiver)
    for row in rows:
        row.system.start_edge()
        log(f"{row.system.key}: started, receiver {row.receiver_kind} :{row.receiver.port}")
    started = time.monotonic()
    run_start = dt.datetime.now()
    ours = rows[0].system
    assert isinstance(ours, Ours)

    def alive() -> None:
        if not ours.relay.alive():
            raise RuntimeError(f"edge-relay died:\n{ours.relay.log_tail()}")
        if not ours.ingest.alive():
            raise RuntimeError(f"cloud-ingest died:\n{ours.ingest.log_tail()}")
        for row in rows:
            for svc in row.system.services:
                if not svc.is_running():
                    raise RuntimeError(f"{svc.name} of {row.system.key} died:\n{svc.log_tail()}")

    # Warm-up: at least --warmup seconds, and until every system has delivered something (ours may
    # hold a whole batch window first).
    batch_window = args.batch_window if "budget_file" in overrides else 0.0
    give_up = started + args.warmup + batch_window + 6 * interval + 60
    while True:
        alive()
        waiting = [r.system.key for r in rows if r.system.tap.requests_ok == 0]
        if time.monotonic() >= started + args.warmup and not waiting:
            break
        if time.monotonic() > give_up:
            detail = ours.relay.log_tail(30) if "ours" in waiting else ""
            hint = " (try --format-version 1)" if "ours" in waiting else ""
            raise RuntimeError(f"nothing reached the receiver of {', '.join(waiting)}{hint}\n{detail}")
        time.sleep(1)

    log(f"measuring for {args.minutes:g} min")
    for row in rows:
        row.start = reading(row)
    window_end = time.monotonic() + args.minutes * 60
    next_report = time.monotonic() + 60
    while time.monotonic() < window_end:
        alive()
        if time.monotonic() >= next_report:
            next_report += 60
            log("so far: " + ", ".join(f"{r.system.key} {r.system.proxy.bytes_total:,} B" for r in rows))
        time.sleep(min(1.0, max(0.0, window_end - time.monotonic())))
    for row in rows:
        row.end = reading(row)
    t0_ms = min(r.start.at_ms for r in rows if r.start)
    t1_ms = max(r.end.at_ms for r in rows if r.end)

    # Every sample stamped before the end of the window must arrive: wait until each receiver has one
    # stamped after it (batches go out in order), then two intervals for the other shards/workers.
    log("waiting for the window's last samples")
    deadline = time.monotonic() + batch_window + 6 * interval + 60
    while time.monotonic() < deadline:
        alive()
        if all(samples_stamped(r.system.tap, r.end.at_ms) > 0 for r in rows if r.end):
            break
        time.sleep(1)
    else:
        log("some systems delivered nothing stamped after the window; counting what arrived")
    time.sleep(2 * interval + 3)

    for row in rows:
        s = row.system
        assert row.start is not None and row.end is not None
        row.final_stats = s.stats()
        row.scraped = samples_stamped(s.tap, row.start.at_ms, row.end.at_ms)
        row.receiver_count = receiver_count(row, row.start.at_ms, row.end.at_ms)
        row.protocol = protocol(row, overrides)
        row.notes += notes(row)
    return report(args, rows, overrides, warnings, prom_version, vm_version, run_start, t0_ms, t1_ms)


def receiver_count(row: Row, start_ms: int, end_ms: int) -> int | None:
    """The receiver's own count of exporter samples stamped in [start, end): the tap's, checked.

    Raw samples per job (a ``sum(count_over_time(...))`` fails in Prometheus 2.x: dropping the
    metric names leaves duplicate label sets); NaNs (stale markers) are not counted, as in the tap.
    """
    got: RawSamples = {}
    try:
        for job in EXPORTERS:
            selector = f'{{job="{job}",__name__!~"up|scrape_.+"}}'
            if isinstance(row.receiver, VictoriaMetrics):
                row.receiver.flush()
                got.update(row.receiver.raw_samples(selector, start_ms, end_ms - 1))
            else:
                lookback = f"{end_ms - 1 - start_ms}ms"  # [at - lookback, at], both ends included
                got.update(row.receiver.raw_samples(selector, lookback, (end_ms - 1) / 1000))
    except Exception as exc:
        row.notes.append(f"receiver query failed: {type(exc).__name__}: {exc}")
        return None
    return sum(
        1 for samples in got.values() for t, v in samples if start_ms <= t < end_ms and not math.isnan(v)
    )


def protocol(row: Row, overrides: dict[str, Any]) -> str:
    if isinstance(row.system, Ours):
        fmt = overrides.get("batch__format_version")
        return "MQTT, batch format " + (f"v{fmt}" if fmt is not None else "default")
    encodings = row.system.tap.encodings
    if not encodings:
        return "n/a"
    (top, _), *rest = encodings.most_common()
    return top + (f" (+{len(rest)} other)" if rest else "")


def notes(row: Row) -> list[str]:
    s, a, b = row.system, row.start, row.end
    assert a is not None and b is not None
    out: list[str] = []
    requests = b.requests - a.requests
    arrived = b.arrived - a.arrived
    if isinstance(s, Ours):
        batches = b.metrics.get("batches", 0) - a.metrics.get("batches", 0)
        payload = b.metrics.get("payload", 0) - a.metrics.get("payload", 0)
        up = b.up - a.up
        if batches:
            out.append(
                f"batches published in the window: {batches:,.0f}, {arrived / batches:,.0f} samples each; "
                f"MQTT payload {payload:,.0f} B of the {up:,} B up "
                f"({up - payload:,.0f} B framing, status, pings)"
            )
        if "wire" in b.metrics and "wire" in a.metrics:
            wire = b.metrics["wire"] - a.metrics["wire"]
            out.append(
                f"the relay's own edge_relay_wire_bytes_total: {wire:,.0f} B "
                f"(proxy: {up + b.down - a.down:,} B)"
            )
        out.append(f"remote-write requests of cloud-ingest in the window: {requests:,}")
    else:
        if requests:
            out.append(
                f"remote-write requests in the window: {requests:,}, {arrived / requests:,.0f} samples each"
            )
        out.append(
            "requests by Content-Encoding: "
            + ", ".join(f"{k} x{v:,}" for k, v in sorted(s.tap.encodings.items()))
        )
    if s.tap.requests_failed or s.tap.decode_errors:
        out.append(
            f"tap: {s.tap.requests_failed} requests refused by the receiver, "
            f"{s.tap.decode_errors} undecodable"
        )
    if row.receiver_count is not None and row.receiver_count != row.scraped:
        out.append(
            f"the receiver counts {row.receiver_count:,} exporter samples stamped in the window, the tap "
            f"{row.scraped:,}"
        )
    return out


# ------------------------------------------------------------------------------------------ report


def cpu_us(row: Row, name: str) -> float | None:
    a, b = row.start, row.end
    if a is None or b is None or name not in a.cpu or name not in b.cpu or not row.scraped:
        return None
    return (b.cpu[name] - a.cpu[name]) * 1e6 / row.scraped


def bytes_per_sample(row: Row) -> float | None:
    a, b = row.start, row.end
    if a is None or b is None or b.arrived == a.arrived:
        return None
    return (b.up - a.up + b.down - a.down) / (b.arrived - a.arrived)


def rss_mib(row: Row, name: str) -> float | None:
    st = row.final_stats.get(name)
    return None if st is None else st.peak_rss_bytes / (1024 * 1024)


def ratio(theirs: float | None, ours: float | None) -> str:
    if theirs is None or not ours:
        return "n/a"
    return f"{theirs / ours:.2f}x"


def num(x: float | None, digits: int) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def report(
    args: argparse.Namespace,
    rows: list[Row],
    overrides: dict[str, Any],
    warnings: list[str],
    prom_version: str,
    vm_version: str,
    run_start: dt.datetime,
    t0_ms: int,
    t1_ms: int,
) -> str:
    series = args.series or "natural"
    warmup_s = t0_ms / 1000 - run_start.timestamp()
    head = (
        f"## Bandwidth: {series} series at {args.interval:g} s, {args.minutes:g} min measured\n\n"
        f"Run {run_start.isoformat(timespec='seconds')}, window "
        f"{dt.datetime.fromtimestamp(t0_ms / 1000).strftime('%H:%M:%S')}-"
        f"{dt.datetime.fromtimestamp(t1_ms / 1000).strftime('%H:%M:%S')} after a {warmup_s:.0f} s warm-up. "
        f"One simulator (seed {SEED}, pods replaced every {CHURN_TICKS} scrapes) serves all {len(rows)} "
        "systems; each one's uplink goes through a byte-counting TCP proxy on 127.0.0.1 (ours: relay to "
        "broker, MQTT; the agents: remote-write HTTP requests and responses). Exporter samples only "
        "(the scrapers' `up`/`scrape_*` series are not counted, their bytes are).\n\n"
        f"Our relay: {describe_relay(overrides, args)}.\n"
    )
    if warnings:
        head += "\n" + "\n".join(f"**{w}**" for w in warnings) + "\n"
    ours = rows[0]
    ours_bps, ours_cpu, ours_rss = bytes_per_sample(ours), cpu_us(ours, ours.edge), rss_mib(ours, ours.edge)
    body = []
    for row in rows:
        a, b = row.start, row.end
        assert a is not None and b is not None
        bps, cpu, rss = bytes_per_sample(row), cpu_us(row, row.edge), rss_mib(row, row.edge)
        body.append(
            [
                row.system.title,
                row.protocol,
                f"{row.scraped:,}",
                f"{b.arrived - a.arrived:,}",
                f"{b.up - a.up:,}",
                f"{b.down - a.down:,}",
                num(bps, 2),
                num(cpu, 1),
                num(rss, 1),
                ratio(bps, ours_bps),
                ratio(cpu, ours_cpu),
                ratio(rss, ours_rss),
            ]
        )
    main = table(
        [
            "agent",
            "protocol",
            "samples scraped",
            "samples arrived",
            "bytes up",
            "bytes down",
            "bytes/sample",
            "CPU us/sample",
            "peak RSS MiB",
            "bytes/sample vs ours",
            "CPU vs ours",
            "RSS vs ours",
        ],
        body,
    )
    cloud = table(
        ["our cloud side (not an edge cost)", "CPU us/sample", "peak RSS MiB"],
        [
            [name, num(cpu_us(ours, name), 1), num(rss_mib(ours, name), 1)]
            for name in ("cloud-ingest", "mosquitto")
            if name in ours.final_stats
        ],
    )
    legend = (
        "- **samples scraped**: exporter samples stamped in the window that reached the receiver (what "
        "the CPU is divided by); **samples arrived**: exporter samples the receiver accepted during the "
        "window, whatever their timestamp (what the bytes are divided by: the bytes and these samples "
        "crossed the proxy in the same interval, so a batch is either in both or in neither).\n"
        "- **bytes up / down**: forwarded by the proxy during the window (TCP payload, both directions).\n"
        "- **CPU us/sample**: utime + stime of the edge process over the window (ours: the relay only). "
        "**peak RSS**: VmHWM at the end.\n"
        "- **vs ours**: theirs / ours.\n"
    )
    row_notes = "\n".join(f"- {r.system.title}: {'; '.join(r.notes)}" for r in rows if r.notes)
    versions = (
        f"Versions: `prometheus --version`: {prom_version}; `vmagent -version`: {vm_version}; "
        f"Python {platform.python_version()}.\n"
    )
    return f"{head}\n{main}\n\n{cloud}\n\n{legend}\n{row_notes}\n\n{versions}"


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, default=2000, help="simulated series (default 2000)")
    ap.add_argument("--minutes", type=float, default=10.0, help="measured window, min (default 10)")
    ap.add_argument("--interval", type=float, default=5.0, help="scrape interval, s (default 5)")
    ap.add_argument(
        "--warmup",
        type=float,
        default=30.0,
        help="seconds before the window, at least (default 30; also until every system delivered)",
    )
    ap.add_argument(
        "--format-version", type=int, choices=(1, 2), default=2, help="relay batch.format_version (default 2)"
    )
    ap.add_argument(
        "--batch-window", type=float, default=60.0, help="relay budget batch_window_seconds (default 60)"
    )
    ap.add_argument(
        "--budget-bytes-per-second",
        type=int,
        default=10_000_000,
        help="relay budget's sustained rate, generous so nothing degrades (default 10,000,000)",
    )
    ap.add_argument(
        "--vmagent-receivers",
        nargs="+",
        choices=sorted(RECEIVERS),
        default=["prometheus", "victoriametrics"],
        help="one vmagent row per receiver kind (default both)",
    )
    ap.add_argument("--workdir", help="working directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()

    started = time.monotonic()
    report = run(args)
    report += f"\nBench wall time {(time.monotonic() - started) / 60:.1f} min; `{' '.join(sys.argv)}`.\n"
    path = write_results("bandwidth", report)
    print(report)
    log(f"written to {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
