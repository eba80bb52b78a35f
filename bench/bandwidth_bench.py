"""Bandwidth bench (issues 4 and 13): bytes, CPU, memory per sample and freshness of our relay (live
and windowed), Prometheus agent and vmagent side by side on the same workload.  Not a test: it prints a
markdown table and writes it to ``bench/results/<timestamp>-bandwidth.md``.  See ``bench/README.md``
for how every number is measured.

    python bench/bandwidth_bench.py                              # 2000 series, 5 s, 10 min measured
    python bench/bandwidth_bench.py --series 500 --minutes 1     # quick check (~4 min)
    python bench/bandwidth_bench.py --rows live agent --minutes 1   # some rows only
    python bench/bandwidth_bench.py --budget-scenario            # ours alone under a too-small budget

One simulator serves all of them the same payloads; each one's uplink goes through a byte-counting
TCP proxy (``testkit.netfaults.LinkProxy``, never cut here) and each writes to a receiver of its own
behind a tap (``--rows``, default all):

    live:     simulator -> edge-relay -> proxy -> mosquitto -> cloud-ingest -> tap -> Prometheus
    windowed: simulator -> edge-relay -> proxy -> mosquitto -> cloud-ingest -> tap -> Prometheus
    agent:    simulator -> prometheus --enable-feature=agent -> proxy -> tap -> Prometheus
    vmagent:  simulator -> vmagent -> proxy -> tap -> Prometheus
    vmagent:  simulator -> vmagent -> proxy -> tap -> VictoriaMetrics

"ours, live" runs the relay without a budget file (it publishes every scrape cycle at once; with
``stream.enabled``, the default, the v3 stream codec where the relay has it); "ours, windowed" with a
lossless budget file (one class at full resolution, ``--batch-window`` s windows).  Each has a stack
of its own (relay, mosquitto, cloud-ingest, receiver).

Freshness: every ``--freshness-every`` (2) s of the measured window a thread asks each receiver, in
turn, for the newest exporter sample's timestamp of each job, an instant query at ``time`` = now, and
records now - that timestamp per job: ``max by (job) (timestamp({__name__="<m1>",job="<job1>"}) or
...)``, one metric per exporter job, the one with the most series (picked from the receivers at the
window's start: Prometheus 2.42's ``timestamp()`` refuses a selector over several metric names,
"vector cannot contain metrics with the same labelset"); VictoriaMetrics: ``tlast_over_time(...[5m])``,
the same 5 min lookback as Prometheus' instant query.  The timestamp is the scrape's start, so this is
the age of the newest scrape one can query: scrape duration, batching (a whole batch window for
"windowed") and delivery, plus the receiver's own delay before a write is searchable (VictoriaMetrics
buffers about 1 s).  Per job, not the newest of all jobs: the agents spread their targets over the
scrape interval, the relay scrapes them together.  The table gives p50 and p99 over the window's
readings of all jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import math
import platform
import re
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

from testkit.agents import tool_version
from testkit.benchkit import ROOT, log, table, workspace, write_results
from testkit.edge_systems import CHURN_TICKS, EXTERNAL, NODE, SEED, Agent, Ours, System, Vm
from testkit.netfaults import LinkProxy
from testkit.oracle import Score, expected_samples, read_served_log, same_value, score
from testkit.readings import ProcStats, bucket_quantile, histogram_buckets, metric_sum, read_metrics
from testkit.rw_tap import RemoteWriteTap, samples_stamped
from testkit.services import Prometheus, RawSamples, VictoriaMetrics, die_with_parent
from testkit.stack import (
    EXPORTERS,
    SimulatorProcess,
    check_relay_config,
    ledger_totals,
    relay_config,
    relay_schema_defaults,
    write_budget,
)

RECEIVERS: dict[str, type[Prometheus] | type[VictoriaMetrics]] = {
    "prometheus": Prometheus,
    "victoriametrics": VictoriaMetrics,
}
RECEIVER_TITLES = {"prometheus": "Prometheus", "victoriametrics": "VictoriaMetrics"}
ROWS = ("live", "windowed", "agent", "vmagent")  # --rows, in the table's order
# relay_config() sets the test suite's short MQTT timers; the bench runs the product defaults.
MQTT_TIMERS = (
    "keepalive_seconds",
    "ack_timeout_seconds",
    "reconnect_min_seconds",
    "reconnect_max_seconds",
    "status_interval_seconds",
)
# cloud-ingest: reconnect within 0.5-5 s (product default 1-30 s), as the bandwidth bench always did.
INGEST_OVERRIDES: dict[str, Any] = {"mqtt__reconnect_min_seconds": 0.5, "mqtt__reconnect_max_seconds": 5}


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
    lags: list[float] = field(default_factory=list)  # freshness: now - newest sample's timestamp, s
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
    histograms: dict[str, dict[float, float]] = field(default_factory=dict)  # ours: STAGE_HISTOGRAMS


# Ours: scrape-to-queryable by stage, from the relay's and the ingester's own histograms.
STAGE_HISTOGRAMS = {
    "edge_relay_scrape_duration_seconds": "fetch + parse of one target (relay)",
    "edge_relay_publish_delay_seconds": "scrape start -> first publish (relay)",
    "edge_relay_ack_latency_seconds": "publish -> ack (broker, ingester, receiver)",
    "cloud_ingest_batch_age_seconds:decoded": "scrape start -> decoded (ingester)",
    "cloud_ingest_batch_age_seconds:written": "scrape start -> written (ingester)",
}


def reading(row: Row) -> Reading:
    s = row.system
    cpu = {name: st.cpu_seconds for name, st in s.stats().items()}
    metrics: dict[str, float] = {}
    histograms: dict[str, dict[float, float]] = {}
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
            if any(n == "edge_relay_stream_enabled" for n, _, _ in m):  # the v3 stream codec
                metrics["stream_enabled"] = metric_sum(m, "edge_relay_stream_enabled")
                metrics["need_state"] = metric_sum(m, "edge_relay_stream_need_state_total")
                for kind in ("delta", "key", "batch"):
                    metrics[kind] = metric_sum(m, "edge_relay_stream_frames_total", kind=kind)
            histograms = {k: histogram_buckets(m, k) for k in STAGE_HISTOGRAMS if k.startswith("edge_")}
        try:
            ingest = read_metrics(s.ingest_metrics_url)
        except Exception as exc:
            row.notes.append(f"ingester metrics unavailable: {type(exc).__name__}")
        else:
            for stage in ("decoded", "written"):
                key = f"cloud_ingest_batch_age_seconds:{stage}"
                histograms[key] = histogram_buckets(ingest, "cloud_ingest_batch_age_seconds", stage=stage)
    return Reading(
        at_ms=int(time.time() * 1000),
        up=s.proxy.bytes_up,
        down=s.proxy.bytes_down,
        arrived=s.tap.distinct_samples(),
        requests=s.tap.requests_ok,
        cpu=cpu,
        metrics=metrics,
        histograms=histograms,
    )


def attach(system: System, sim: SimulatorProcess, receiver: Prometheus | VictoriaMetrics) -> None:
    """What ``System.start_common`` does, with the shared simulator and a byte-transparent tap."""
    system.workdir.mkdir(parents=True, exist_ok=True)
    system.sim = sim
    system._service(receiver)
    system.tap = RemoteWriteTap(
        receiver.remote_write_url, name=f"{system.key}-tap", transparent=True, deferred=True
    )


def short_version(line: str) -> str:
    match = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
    return match.group(1) if match else "?"


# ------------------------------------------------------------------------------------------ freshness

EXPORTER_SAMPLES = f'{{job=~"{"|".join(EXPORTERS)}",__name__!~"up|scrape_.+"}}'


class FreshnessSampler:
    """Every ``every`` s, in a thread: for each row in turn, an instant query at now for the newest
    exporter sample's timestamp of each job in its receiver; appends now - that timestamp, one per job,
    to ``row.lags`` (per job: the agents spread their targets over the interval, the relay scrapes
    them together, so the newest of all jobs would favour the agents).

    Prometheus 2.x refuses ``timestamp()`` over several metric names ("vector cannot contain metrics
    with the same labelset": it drops the names), so the query takes one metric per job, the one with
    the most series in the receivers at the start, and ``or``s them together."""

    def __init__(self, rows: list[Row], every: float) -> None:
        self.rows = rows
        self.every = every
        self.failed: dict[str, list[str]] = {row.system.key: [] for row in rows}
        self._session = requests.Session()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="freshness", daemon=True)
        self.selectors = self.pick()
        self.queries = {  # Prometheus: an instant query's 5 min lookback; VictoriaMetrics: the same
            "prometheus": "max by (job) (" + " or ".join(f"timestamp({sel})" for sel in self.selectors) + ")",
            "victoriametrics": "max by (job) ("
            + " or ".join(f"tlast_over_time({sel}[5m])" for sel in self.selectors)
            + ")",
        }

    def pick(self) -> list[str]:
        """Per job, the exporter metric with the most series: ``{__name__="...",job="..."}`` (from the
        first receiver that has every job, else from all of them)."""
        best: dict[str, tuple[float, str]] = {}
        for row in self.rows:
            with contextlib.suppress(Exception):
                for r in self.get(row, f"count by (job, __name__) ({EXPORTER_SAMPLES})", time.time()):
                    job, name, n = r["metric"]["job"], r["metric"]["__name__"], float(r["value"][1])
                    best[job] = max(best.get(job, (0.0, "")), (n, name))
            if len(best) == len(EXPORTERS):
                break
        if not best:
            raise RuntimeError("freshness: no exporter series in any receiver")
        return [f'{{__name__="{name}",job="{job}"}}' for job, (_, name) in sorted(best.items())]

    def get(self, row: Row, query: str, at: float) -> list[dict[str, Any]]:
        params = {"query": query, "time": f"{at:.3f}"}
        resp = self._session.get(f"{row.receiver.url}/api/v1/query", params=params, timeout=5)
        body = resp.json()
        if body.get("status") != "success":
            raise RuntimeError(f"HTTP {resp.status_code}: {body.get('error', resp.text[:200])}")
        return body["data"]["result"]

    def start(self) -> FreshnessSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for row in self.rows:
            if failed := self.failed[row.system.key]:
                row.notes.append(
                    f"freshness: {len(failed)} of {len(failed) + len(row.lags)} readings (job x query) "
                    f"gave no timestamp (first: {failed[0]})"
                )

    def probe(self, row: Row) -> None:
        at = time.time()
        try:
            result = self.get(row, self.queries[row.receiver_kind], at)
        except Exception as exc:  # counted and reported, the run goes on
            self.failed[row.system.key] += [f"{type(exc).__name__}: {str(exc)[:100]}"] * len(self.selectors)
            return
        row.lags += [at - float(r["value"][1]) for r in result]
        self.failed[row.system.key] += ["no sample in the last 5 min"] * (len(self.selectors) - len(result))

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            for row in self.rows:
                self.probe(row)
            next_at += self.every
            self._stop.wait(max(0.0, next_at - time.monotonic()))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0-1) of ``values``, interpolated between the closest ranks."""
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo = math.floor(k)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (k - lo)


# ------------------------------------------------------------------------------------------ relay config


def relay_overrides(
    args: argparse.Namespace, work: Path, urls: dict[str, str], budget: Path | None = None, live: bool = False
) -> tuple[dict[str, Any], list[str]]:
    """The relay's config overrides: product MQTT timers, and either (``live``) no budget file and
    ``stream.enabled: true``, or the batch format and a budget file: ``budget``, or by default a
    lossless one (one catch-all class, ``--budget-bytes-per-second``).

    ``stream.enabled``, ``batch.format_version`` and ``budget_file`` are new keys: whichever the relay
    refuses (``edge-relay check-config``) is left out, with a warning line for the report.
    """
    defaults = relay_schema_defaults("mqtt")
    base: dict[str, Any] = {f"mqtt__{key}": defaults[key] for key in MQTT_TIMERS}
    wanted: dict[str, Any]
    if live:
        wanted = {"stream__enabled": True}
    else:
        if budget is None:
            budget = write_budget(
                work / "budget.yaml",
                bytes_per_second=args.budget_bytes_per_second,
                burst_bytes=10 * args.budget_bytes_per_second,
                batch_window_seconds=args.batch_window,
                classes=[{"name": "all", "resolution_seconds": 0}],
            )
        wanted = {"batch__format_version": args.format_version, "budget_file": str(budget)}
    warnings: list[str] = []
    check_dir = work / ("config-check-live" if live else "config-check")
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
        # Drop the keys the message names; if it names none (a budget file it cannot use), the last.
        # (The relay quotes a key it refuses in backticks: "unknown key `budget_file`", or its section:
        # "unknown key `stream`; expected one of ...".)
        lines = error.splitlines()
        quoted = {k: (f"`{k.rsplit('__', 1)[-1]}`", f"unknown key `{k.split('__')[0]}`;") for k in wanted}
        named = [k for k in wanted if any(q in error for q in quoted[k])] or [list(wanted)[-1]]
        for key in named:
            why = " / ".join([line for line in lines if any(q in line for q in quoted[key])] or lines)
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
            else "no budget file (publishes every scrape cycle)"
        ),
    ]
    stream = overrides.get("stream__enabled")
    parts.insert(
        0, f"`stream.enabled: {str(stream).lower()}`" if stream is not None else "stream: the default"
    )
    return "; ".join(parts)


def mqtt_timers(overrides: dict[str, Any]) -> str:
    return (
        "MQTT timers at the product defaults ("
        + ", ".join(f"{k.removeprefix('mqtt__')} {v}" for k, v in overrides.items() if k.startswith("mqtt__"))
        + ")"
    )


# ------------------------------------------------------------------------------------------ the run


def run(args: argparse.Namespace) -> str:
    interval = args.interval
    prom_version = tool_version(["/usr/bin/prometheus", "--version"], "prometheus")
    vm_version = tool_version(["/usr/bin/vmagent", "-version"], "victoria-metrics")
    pv, vv = short_version(prom_version), short_version(vm_version)
    with workspace(args.workdir, args.keep, "bandwidth-bench-") as work:
        (work / "simulator").mkdir(parents=True, exist_ok=True)
        sim = SimulatorProcess(
            work / "simulator",
            seed=SEED,
            interval=interval,
            churn_ticks=CHURN_TICKS,
            series=args.series,
            vendor=args.vendor,
            prerender=True,  # no scraper waits for the Python renderer (simulator/server.py)
        )
        sim.argv = die_with_parent(sim.argv)
        sim.start()
        rows: list[Row] = []
        try:
            log(f"simulator: {', '.join(f'{k} {v}' for k, v in sim.urls.items())}")
            warnings: list[str] = []
            rows += systems(args, work, sim.urls, warnings, pv, vv)
            return measure(args, rows, sim, warnings, prom_version, vm_version)
        finally:
            for row in rows:
                row.system.close()
            sim.stop()


def systems(
    args: argparse.Namespace, work: Path, urls: dict[str, str], warnings: list[str], pv: str, vv: str
) -> list[Row]:
    """The ``--rows``: ours (live, windowed) and the agent write to a Prometheus; one vmagent per
    ``--vmagent-receivers`` kind."""
    interval = args.interval
    rows = []
    for mode in ("live", "windowed"):
        if mode not in args.rows:
            continue
        overrides, refused = relay_overrides(args, work, urls, live=mode == "live")
        warnings += [w.replace("WARNING: the relay", f"WARNING ({mode}): the relay") for w in refused]
        key = f"ours-{mode}"
        ours = Ours(
            key,
            f"edge-relay (ours, {mode})",
            work / key,
            interval,
            args.series,
            relay_overrides=overrides,
            ingest_overrides=INGEST_OVERRIDES,
        )
        rows.append(Row(ours, "prometheus", Prometheus(work / key / "receiver")))
    if "agent" in args.rows:
        rows.append(
            Row(
                Agent("agent", f"Prometheus agent {pv}", work / "agent", interval, args.series),
                "prometheus",
                Prometheus(work / "agent" / "receiver"),
            )
        )
    for kind in args.vmagent_receivers if "vmagent" in args.rows else ():
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
    ours = [r.system for r in rows if isinstance(r.system, Ours)]

    def alive() -> None:
        for o in ours:
            if not o.relay.alive():
                raise RuntimeError(f"edge-relay of {o.key} died:\n{o.relay.log_tail()}")
            if not o.ingest.alive():
                raise RuntimeError(f"cloud-ingest of {o.key} died:\n{o.ingest.log_tail()}")
        for row in rows:
            for svc in row.system.services:
                if not svc.is_running():
                    raise RuntimeError(f"{svc.name} of {row.system.key} died:\n{svc.log_tail()}")

    # Warm-up: at least --warmup seconds, and until every system has delivered something (ours may
    # hold a whole batch window first).
    windowed = any("budget_file" in o.relay_overrides for o in ours)
    batch_window = args.batch_window if windowed else 0.0
    give_up = started + args.warmup + batch_window + 6 * interval + 60
    while True:
        alive()
        waiting = [r.system for r in rows if r.system.tap.requests_ok == 0]
        if time.monotonic() >= started + args.warmup and not waiting:
            break
        if time.monotonic() > give_up:
            silent = [o for o in waiting if isinstance(o, Ours)]
            detail = "\n".join(o.relay.log_tail(30) for o in silent)
            hint = " (try --format-version 1)" if silent else ""
            names = ", ".join(s.key for s in waiting)
            raise RuntimeError(f"nothing reached the receiver of {names}{hint}\n{detail}")
        time.sleep(1)

    log(f"measuring for {args.minutes:g} min")
    for row in rows:
        row.start = reading(row)
    freshness = FreshnessSampler(rows, args.freshness_every).start()
    window_end = time.monotonic() + args.minutes * 60
    next_report = time.monotonic() + 60
    while time.monotonic() < window_end:
        alive()
        if time.monotonic() >= next_report:
            next_report += 60
            log("so far: " + ", ".join(f"{r.system.key} {r.system.proxy.bytes_total:,} B" for r in rows))
        time.sleep(min(1.0, max(0.0, window_end - time.monotonic())))
    freshness.stop()
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
        row.protocol = protocol(row)
        row.notes += notes(row)
    return report(args, rows, warnings, freshness, prom_version, vm_version, run_start, t0_ms, t1_ms)


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


def protocol(row: Row) -> str:
    if isinstance(row.system, Ours):
        overrides = row.system.relay_overrides
        fmt = overrides.get("batch__format_version")
        text = "MQTT, batch format " + (f"v{fmt}" if fmt is not None else "default")
        end = row.end.metrics if row.end is not None else {}
        if end.get("delta", 0) + end.get("key", 0) > 0:  # stream-coded publications in its life
            text = "MQTT, v3 stream frames"
        return text + (", windows" if "budget_file" in overrides else ", every cycle")
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
        if "stream_enabled" in b.metrics and "stream_enabled" in a.metrics:
            frames = {k: b.metrics[k] - a.metrics[k] for k in ("delta", "key", "batch", "need_state")}
            out.append(
                "publications in the window: {delta:,.0f} delta frames, {key:,.0f} key frames, {batch:,.0f} "
                "self-contained batches; {need_state:,.0f} need_state acks".format(**frames)
                + f"; edge_relay_stream_enabled {b.metrics['stream_enabled']:g} at the end"
            )
        out.append(f"remote-write requests of cloud-ingest in the window: {requests:,}")
        if stages := stage_latencies(a, b):
            out.append("latency by stage in the window, p50 / p99 s (bucket interpolation): " + stages)
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


def stage_latencies(a: Reading, b: Reading) -> str:
    parts = []
    for name, what in STAGE_HISTOGRAMS.items():
        start, end = a.histograms.get(name, {}), b.histograms.get(name, {})
        window = {le: n - start.get(le, 0.0) for le, n in end.items()}
        p50, p99 = bucket_quantile(0.5, window), bucket_quantile(0.99, window)
        if p50 is not None and p99 is not None:
            parts.append(f"{what} {p50:.2f} / {p99:.2f}")
    return "; ".join(parts)


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
    warnings: list[str],
    freshness: FreshnessSampler,
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
    )
    ours_rows = [r for r in rows if isinstance(r.system, Ours)]
    for r in ours_rows:
        assert isinstance(r.system, Ours)
        mode = r.system.key.removeprefix("ours-")
        head += f"- Our relay, {mode}: {describe_relay(r.system.relay_overrides, args)}; "
        head += f"{mqtt_timers(r.system.relay_overrides)}.\n"
    if warnings:
        head += "\n" + "\n".join(f"**{w}**" for w in warnings) + "\n"
    base = ours_rows[0] if ours_rows else None
    ours_bps = bytes_per_sample(base) if base else None
    ours_cpu = cpu_us(base, base.edge) if base else None
    ours_rss = rss_mib(base, base.edge) if base else None
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
                num(percentile(row.lags, 0.5), 1),
                num(percentile(row.lags, 0.99), 1),
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
            "freshness p50 s",
            "freshness p99 s",
            "bytes/sample vs ours",
            "CPU vs ours",
            "RSS vs ours",
        ],
        body,
    )
    cloud = table(
        ["our cloud side (not an edge cost)", "CPU us/sample", "peak RSS MiB"],
        [
            [
                f"{name} ({r.system.key.removeprefix('ours-')})",
                num(cpu_us(r, name), 1),
                num(rss_mib(r, name), 1),
            ]
            for r in ours_rows
            for name in ("cloud-ingest", "mosquitto")
            if name in r.final_stats
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
        f"- **freshness**: every {args.freshness_every:g} s of the window, now - the newest exporter "
        "sample's timestamp (its scrape's start) of each exporter job the receiver answers to an "
        f"instant query at now, `{freshness.queries['prometheus']}` (VictoriaMetrics: "
        "`tlast_over_time(...[5m])` instead of `timestamp()`; one metric per job, the one with the most "
        "series, since Prometheus 2.42's `timestamp()` refuses several metric names at once); p50 and "
        f"p99 over the window's readings of all {len(freshness.selectors)} jobs "
        f"(~{args.minutes * 60 / args.freshness_every * len(freshness.selectors):.0f} a row).\n"
        f"- **vs ours**: theirs / {base.system.title if base else 'ours (not run)'}.\n"
    )
    row_notes = "\n".join(f"- {r.system.title}: {'; '.join(r.notes)}" for r in rows if r.notes)
    versions = (
        f"Versions: `prometheus --version`: {prom_version}; `vmagent -version`: {vm_version}; "
        f"Python {platform.python_version()}.\n"
    )
    cloud = f"{cloud}\n\n" if ours_rows else ""
    return f"{head.rstrip()}\n\n{main}\n\n{cloud}{legend}\n{row_notes}\n\n{versions}"


# ------------------------------------------------------------------------------------------ budget scenario

# --budget-scenario: our stack alone, with a budget too small for its classes, so that the relay's
# controller has to degrade them (see bench/README.md, "Budget scenario").
BUDGET_CLASSES: list[dict[str, Any]] = [
    {"name": "critical", "preset": "dcgm-critical"},  # no `degrade`: never coarsened
    {
        "name": "kepler",
        "preset": "kepler",
        "resolution_seconds": 15,
        "degrade": {"max_resolution_seconds": 60},
    },
    {"name": "rest", "resolution_seconds": 0, "degrade": {"max_resolution_seconds": 300}},
]
CRITICAL_CLASS, CRITICAL_PRESET = "critical", "dcgm-critical"
# The first minute is left out of the worst ratio: the bucket starts full, so early on the allowed
# bytes are mostly burst and one batch is a large share of them.
WORST_AFTER_S = 60.0
RELAY_METRICS_EVERY_S = 5.0

Metrics = list[tuple[str, dict[str, str], float]]


class WireSampler:
    """Reads a ``LinkProxy``'s byte counters every second in a thread: (monotonic time, up, down)."""

    def __init__(self, proxy: LinkProxy, every: float = 1.0) -> None:
        self.proxy = proxy
        self.every = every
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wire-sampler", daemon=True)

    def start(self) -> WireSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()

    def sample(self) -> None:
        self.samples.append((time.monotonic(), self.proxy.bytes_up, self.proxy.bytes_down))

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample()
            next_at += self.every
            self._stop.wait(max(0.0, next_at - time.monotonic()))


@dataclass(frozen=True)
class WireCheck:
    """The proxy's counts over [t0, t_end] against the budget's ``burst + rate x elapsed``."""

    up: int
    down: int
    elapsed: float
    allowed: float
    worst_ratio: float  # the largest bytes / allowed at any sample at least WORST_AFTER_S in
    worst_at: float  # seconds after t0
    max_excess: float  # the largest (bytes in [a, b]) - rate x (b - a) over any pair of samples
    excess_span: tuple[float, float]  # that [a, b], seconds after t0

    @property
    def total(self) -> int:
        return self.up + self.down

    @property
    def ratio(self) -> float:
        return self.total / self.allowed


def wire_check(
    samples: list[tuple[float, int, int]], t0: float, t_end: float, rate: float, burst: float
) -> WireCheck:
    inside = [s for s in samples if t0 <= s[0] <= t_end]
    worst, worst_at = 0.0, 0.0
    low, low_at = 0.0, 0.0  # min over earlier samples of bytes - rate x elapsed (0 at t0: nothing sent)
    excess, span = 0.0, (0.0, 0.0)
    for t, up, down in inside:
        elapsed = t - t0
        total = up + down
        if elapsed >= WORST_AFTER_S and total / (burst + rate * elapsed) > worst:
            worst, worst_at = total / (burst + rate * elapsed), elapsed
        v = total - rate * elapsed
        if v - low > excess:
            excess, span = v - low, (low_at, elapsed)
        if v < low:
            low, low_at = v, elapsed
    _, up, down = inside[-1] if inside else (t0, 0, 0)
    elapsed = t_end - t0
    return WireCheck(up, down, elapsed, burst + rate * elapsed, worst, worst_at, excess, span)


def bytes_at(samples: list[tuple[float, int, int]], t: float) -> int:
    """Up + down of the last sample taken at or before ``t`` (0 before the first)."""
    total = 0
    for at, up, down in samples:
        if at > t:
            break
        total = up + down
    return total


@dataclass(frozen=True)
class SpoolBacklog:
    rows: int  # batches waiting to be published or acknowledged
    bytes: int
    samples: int
    staged_rows: int  # scrapes of the open batch window, not packed into a batch yet
    staged_bytes: int
    staged_samples: int
    oldest_ms: int | None


def spool_backlog(path: Path) -> SpoolBacklog | None:
    """What waits in the relay's spool, read from the SQLite file (read-only; the relay may run)."""
    try:
        conn = sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True, timeout=10)
        try:
            query = (
                "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0), "
                "min(first_ts_ms) FROM "
            )
            rows, size, samples, oldest = conn.execute(query + "batches").fetchone()
            s_rows, s_size, s_samples, s_oldest = conn.execute(query + "staging").fetchone()
        finally:
            conn.close()
    except sqlite3.Error as exc:
        log(f"cannot read the spool {path}: {exc}")
        return None
    firsts = [t for t in (oldest, s_oldest) if t is not None]
    return SpoolBacklog(rows, size, samples, s_rows, s_size, s_samples, min(firsts) if firsts else None)


def class_value(m: Metrics, name: str, cls: str, **labels: str) -> float:
    return metric_sum(m, name, **{"class": cls}, **labels)


@dataclass
class BudgetRun:
    t0: float  # monotonic time the relay was started
    t0_wall: float
    t_end: float  # end of the measured run
    t_drained: float  # the relay has exited (drained, or killed after --drain-seconds + 30 s)
    wire: list[tuple[float, int, int]]
    snapshots: list[tuple[float, Metrics]]  # the relay's /metrics every RELAY_METRICS_EVERY_S
    final: Metrics  # the relay's /metrics at the end of the run
    stats: dict[str, ProcStats]
    backlog_end: SpoolBacklog | None
    backlog_after: SpoolBacklog | None
    ledger: dict[str, int]
    critical: Score
    critical_series: int
    critical_scrapes: int
    steps: list[str]  # the controller's log lines, with the time since t0
    notes: list[str] = field(default_factory=list)


def budget_plan(
    args: argparse.Namespace, work: Path, urls: dict[str, str], overrides: dict[str, Any], budget: Path
) -> tuple[str, str, dict[str, Any] | None]:
    """``edge-relay budget plan`` for the relay's config: (command, its table, its JSON report).

    It scrapes every exporter once, so it runs before the relay starts (the critical check only counts
    what the simulator served after that)."""
    plan_dir = work / "plan"
    plan_dir.mkdir(parents=True, exist_ok=True)
    cfg = relay_config(plan_dir, urls=urls, mqtt_port=1883, interval=args.interval, node=NODE, **overrides)
    argv = [sys.executable, "-m", "edge_relay.cli", "budget", "plan", "--config", str(cfg)]
    argv += ["--budget", str(budget)]
    command = "edge-relay " + " ".join(argv[3:])
    proc = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return command, f"(failed, exit status {proc.returncode}: {proc.stderr.strip()[-500:]})", None
    rep: dict[str, Any] = json.loads(proc.stdout)
    from edge_relay.commands.budget_plan import (
        render_table,  # the command's own text output, without a 2nd scrape
    )

    return command, render_table(rep), rep


def critical_check(ours: Ours, receiver: Prometheus, since_ms: int) -> tuple[Score, int, int]:
    """Every sample the simulator served (since ``since_ms``) of the series the critical class's preset
    matches, against the receiver's raw samples: (score, series, scrapes)."""
    from edge_relay.budget import PRESETS

    pattern = "|".join(PRESETS[CRITICAL_PRESET].names)
    rx = re.compile(pattern)
    served = [r for r in read_served_log(ours.sim.served_log) if r.t_ms >= since_ms]
    expected = expected_samples(
        ours.sim.simulator,
        served,
        jobs={e: e for e in EXPORTERS},
        instances=ours.instances(),
        extra=EXTERNAL,
    )
    critical = {k: v for k, v in expected.items() if rx.fullmatch(dict(k)["__name__"])}
    now = time.time()
    lookback = f"{int(now - since_ms / 1000) + 120}s"
    actual = receiver.raw_samples(f'{{__name__=~"{pattern}"}}', lookback=lookback, at=now)
    result = score(
        critical,
        actual,
        skew_before_ms=ours.skew_before_ms,
        skew_after_ms=ours.skew_after_ms,
        until_ms=int(now * 1000),
        same_value=same_value,
    )
    scrapes = len({t for samples in critical.values() for t, _ in samples})
    return result, len(critical), scrapes


def controller_steps(ours: Ours, t0_wall: float) -> list[str]:
    """The controller's "budget: degrade/restore ..." log lines, stamped with the time since t0."""
    out = []
    with contextlib.suppress(OSError):
        for line in ours.relay.log_path.read_text(errors="replace").splitlines():
            if "edge_relay.budget.controller" not in line or "budget:" not in line:
                continue
            try:
                at = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                stamp = f"+{mmss(at - t0_wall)}"
            except ValueError:
                stamp = "?"
            out.append(f"{stamp} {line[line.index('budget:') :]}")
    return out


def code_version() -> str:
    """HEAD's commit and whether the product's code differs from it (what the relay ran)."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "edge_relay", "schemas", "relay_common"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return f"commit {head or '?'}" + (", with uncommitted changes in the product's code" if dirty else "")


def mmss(seconds: float) -> str:
    seconds = max(0, round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def run_budget(args: argparse.Namespace) -> str:
    rate = args.budget_bps
    version = code_version()  # before anything starts: the relay imports the code as it is now
    with workspace(args.workdir, args.keep, "budget-bench-") as work:
        (work / "simulator").mkdir(parents=True, exist_ok=True)
        sim = SimulatorProcess(
            work / "simulator",
            seed=SEED,
            interval=args.interval,
            churn_ticks=CHURN_TICKS,
            series=args.series,
            vendor=args.vendor,
        )
        sim.argv = die_with_parent(sim.argv)
        sim.start()
        ours: Ours | None = None
        try:
            log(f"simulator: {', '.join(f'{k} {v}' for k, v in sim.urls.items())}")
            budget = write_budget(
                work / "budget.yaml",
                bytes_per_second=rate,
                burst_bytes=args.budget_burst or None,
                batch_window_seconds=args.batch_window,
                classes=BUDGET_CLASSES,
            )
            from edge_relay.budget import load as load_budget

            uplink = load_budget(budget).uplink
            args.burst = uplink.burst_bytes  # the file's default if not given
            args.batch_cap = uplink.batch_cap(relay_schema_defaults("batch")["max_bytes"])
            overrides, warnings = relay_overrides(args, work, sim.urls, budget)
            if "budget_file" not in overrides:
                raise RuntimeError("the relay refuses the budget file: " + " ".join(warnings))
            command, plan_text, plan = budget_plan(args, work, sim.urls, overrides, budget)
            log(f"{command}\n{plan_text}")
            ours = Ours(
                "ours",
                "edge-relay (ours)",
                work / "ours",
                args.interval,
                args.series,
                relay_overrides=overrides,
                ingest_overrides=INGEST_OVERRIDES,
                drain_seconds=args.drain_seconds,
            )
            receiver = Prometheus(work / "ours" / "receiver")
            attach(ours, sim, receiver)
            result = budget_run(args, ours, receiver)
            result.notes.append(f"code: {version}")
            return budget_report(args, result, budget, command, plan_text, plan, overrides, warnings)
        finally:
            if ours is not None:
                ours.close()
            sim.stop()


def budget_run(args: argparse.Namespace, ours: Ours, receiver: Prometheus) -> BudgetRun:
    rate, burst = args.budget_bps, args.burst
    t0_wall = time.time()
    ours.start_edge()
    t0 = time.monotonic()
    log(f"relay started; running for {args.minutes:g} min at {rate} B/s, burst {burst} B")
    sampler = WireSampler(ours.proxy).start()
    url = ours.relay_metrics_url
    snapshots: list[tuple[float, Metrics]] = []

    def alive() -> None:
        if not ours.relay.alive():
            raise RuntimeError(f"edge-relay died:\n{ours.relay.log_tail()}")
        if not ours.ingest.alive():
            raise RuntimeError(f"cloud-ingest died:\n{ours.ingest.log_tail()}")
        for svc in ours.services:
            if not svc.is_running():
                raise RuntimeError(f"{svc.name} died:\n{svc.log_tail()}")

    try:
        end = t0 + args.minutes * 60
        next_metrics, next_report = t0 + RELAY_METRICS_EVERY_S, t0 + 60
        while (now := time.monotonic()) < end:
            alive()
            if now >= next_metrics:
                next_metrics += RELAY_METRICS_EVERY_S
                with contextlib.suppress(Exception):
                    snapshots.append((now, read_metrics(url)))
            if now >= next_report and snapshots:
                next_report += 60
                total = ours.proxy.bytes_total
                m = snapshots[-1][1]
                res = ", ".join(
                    f"{c['name']} {class_value(m, 'edge_relay_budget_resolution_seconds', c['name']):g} s"
                    for c in BUDGET_CLASSES
                )
                log(
                    f"+{mmss(now - t0)}: {total:,} B on the wire, {total / (burst + rate * (now - t0)):.2f} "
                    f"of the allowed; spool {metric_sum(m, 'edge_relay_spool_bytes'):,.0f} B; {res}"
                )
            time.sleep(max(0.0, min(1.0, end - time.monotonic(), next_metrics - time.monotonic())))
        t_end = time.monotonic()
        final = read_metrics(url)
        snapshots.append((t_end, final))
        stats = ours.stats()
        backlog_end = spool_backlog(ours.spool_path)
        log(f"stopping the relay: SIGTERM, --drain-seconds {args.drain_seconds:g}")
        notes: list[str] = []
        try:
            ours.stop_edge()
        except AssertionError as exc:  # Program.stop: not gone within drain + 30 s, killed
            notes.append(str(exc).splitlines()[0])
        t_drained = time.monotonic()
        log(f"relay gone after {t_drained - t_end:.0f} s")
    finally:
        sampler.stop()
    backlog_after = spool_backlog(ours.spool_path)
    ledger = ledger_totals(ours.relay_cfg)
    log("comparing the critical class with what the simulator served")
    critical, series, scrapes = critical_check(ours, receiver, int(t0_wall * 1000))
    return BudgetRun(
        t0=t0,
        t0_wall=t0_wall,
        t_end=t_end,
        t_drained=t_drained,
        wire=list(sampler.samples),
        snapshots=snapshots,
        final=final,
        stats=stats,
        backlog_end=backlog_end,
        backlog_after=backlog_after,
        ledger=ledger,
        critical=critical,
        critical_series=series,
        critical_scrapes=scrapes,
        steps=controller_steps(ours, t0_wall),
        notes=notes + ours.notes,
    )


def fmt_backlog(b: SpoolBacklog | None, at_wall: float) -> str:
    if b is None:
        return "n/a (spool unreadable)"
    text = f"{b.rows:,} batches, {b.bytes:,} B, {b.samples:,} samples"
    if b.staged_rows:
        text += (
            f"; open batch window: {b.staged_rows} scrapes, {b.staged_bytes:,} B staged, "
            f"{b.staged_samples:,} samples"
        )
    if b.oldest_ms is not None:
        text += f"; oldest sample {mmss(at_wall - b.oldest_ms / 1000)} old"
    return text


def budget_report(
    args: argparse.Namespace,
    r: BudgetRun,
    budget: Path,
    plan_command: str,
    plan_text: str,
    plan: dict[str, Any] | None,
    overrides: dict[str, Any],
    warnings: list[str],
) -> str:
    rate, burst = args.budget_bps, args.burst
    run = wire_check(r.wire, r.t0, r.t_end, rate, burst)
    whole = wire_check(r.wire, r.t0, r.t_drained, rate, burst)
    wall_end = r.t0_wall + (r.t_end - r.t0)
    full = plan["total"]["full_bytes_per_second"] if plan else None
    tail_start = max(r.t0, r.t_end - 300)
    tail_rate = (bytes_at(r.wire, r.t_end) - bytes_at(r.wire, tail_start)) / max(1e-9, r.t_end - tail_start)
    tail = f"{(r.t_end - tail_start) / 60:.0f} min"
    f = r.final
    relay_wire = metric_sum(f, "edge_relay_wire_bytes_total")
    relay_wire_at_end = bytes_at(r.wire, r.t_end)
    c = r.critical
    complete = c.missing == 0 and c.value_mismatches == 0 and c.extra == 0 and c.expected > 0
    crit_text = (
        f"**{'yes' if complete else 'NO'}**: {c.delivered:,} of {c.expected:,} served samples "
        f"(in {r.critical_series} label sets, {r.critical_scrapes} scrapes) at their scrape's timestamp, "
        f"{c.missing:,} missing, {c.value_mismatches:,} values differ, {c.extra:,} extra"
    )
    ledger = ", ".join(f"{k} {v:,}" for k, v in sorted(r.ledger.items())) or "empty"
    summary = [
        ["budget", f"{rate:,} B/s sustained, {burst:,} B burst, batch window {args.batch_window:g} s"],
        [
            "`budget plan` at full resolution",
            f"{full:,.1f} B/s = {full / rate:.2f}x the budget" if full else "n/a",
        ],
        [
            "run",
            f"{(r.t_end - r.t0) / 60:.1f} min from the relay's start (then a drain), "
            f"{args.series or 'natural'} series every {args.interval:g} s",
        ],
        ["bytes on the wire (up + down)", f"{run.total:,} ({run.up:,} + {run.down:,})"],
        ["allowed: burst + rate x elapsed", f"{run.allowed:,.0f}"],
        ["ratio", f"{run.ratio:.3f}"],
        [
            f"worst ratio at any second after the first {WORST_AFTER_S:g} s",
            f"{run.worst_ratio:.3f} at +{mmss(run.worst_at)}",
        ],
        [
            "largest (bytes - rate x length) over any interval",
            f"{run.max_excess:,.0f} B, +{mmss(run.excess_span[0])} to +{mmss(run.excess_span[1])} "
            f"({run.max_excess / burst:.2f} x burst)",
        ],
        [f"wire rate over the last {tail}", f"{tail_rate:,.1f} B/s ({tail_rate / rate:.2f} x rate)"],
        [
            "paced (batches waited for the budget)",
            f"{metric_sum(f, 'edge_relay_budget_paced_seconds_total'):,.0f} s",
        ],
        ["spool backlog at the end of the run", fmt_backlog(r.backlog_end, wall_end)],
        [
            "drain (SIGTERM to exit)",
            f"{r.t_drained - r.t_end:.0f} s, {whole.total - run.total:,} B "
            f"({(whole.total - run.total) / max(1e-9, r.t_drained - r.t_end):,.0f} B/s); "
            f"ratio incl. the drain {whole.ratio:.3f}, worst {whole.worst_ratio:.3f}",
        ],
        ["spool after the drain", fmt_backlog(r.backlog_after, r.t0_wall + (r.t_drained - r.t0))],
        ["critical class complete at full resolution in Prometheus", crit_text],
        ["loss ledger (samples, by reason)", ledger],
    ]
    classes = []
    for cls in BUDGET_CLASSES:
        name = cls["name"]
        configured = max(float(cls.get("resolution_seconds", 0)), args.interval)
        ceiling = cls.get("degrade", {}).get("max_resolution_seconds")
        classes.append(
            [
                name,
                f"{class_value(f, 'edge_relay_budget_degrade_level', name):g}",
                f"{class_value(f, 'edge_relay_budget_resolution_seconds', name):g}",
                f"{configured:g} / {ceiling:g}" if ceiling else f"{configured:g} / never",
                f"{class_value(f, 'edge_relay_budget_degrade_steps_total', name, direction='degrade'):g}",
                f"{class_value(f, 'edge_relay_budget_degrade_steps_total', name, direction='restore'):g}",
                f"{class_value(f, 'edge_relay_budget_samples_total', name, outcome='sent'):,.0f}",
                f"{class_value(f, 'edge_relay_budget_samples_total', name, outcome='merged'):,.0f}",
                f"{class_value(f, 'edge_relay_budget_samples_total', name, outcome='suppressed'):,.0f}",
            ]
        )
    timeline = []
    marks = [r.t0 + 60 * i for i in range(1, int((r.t_end - r.t0) // 60) + 1)]
    if not marks or r.t_end - marks[-1] > 5:
        marks.append(r.t_end)
    for i, t in enumerate(marks):
        start = r.t0 + 60 * i
        total, before = bytes_at(r.wire, t), bytes_at(r.wire, start)
        m = next((m for at, m in r.snapshots if at >= t - 0.5), r.final)
        timeline.append(
            [
                f"+{mmss(t - r.t0)}",
                f"{total:,}",
                f"{burst + rate * (t - r.t0):,.0f}",
                f"{total / (burst + rate * (t - r.t0)):.3f}",
                f"{(total - before) / (t - start):,.0f}",
                f"{metric_sum(m, 'edge_relay_spool_rows'):,.0f} / "
                f"{metric_sum(m, 'edge_relay_spool_bytes'):,.0f}",
                f"{metric_sum(m, 'edge_relay_spool_oldest_sample_age_seconds'):,.0f}",
                *(
                    f"{class_value(m, 'edge_relay_budget_resolution_seconds', cls['name']):g}"
                    for cls in BUDGET_CLASSES
                ),
            ]
        )
    observations = budget_observations(args, r, run, whole, full)
    fmt = overrides.get("batch__format_version")
    relay = [
        f"`batch.format_version: {fmt}`" if fmt is not None else "batch format: the relay's default",
        "MQTT timers at the product defaults ("
        + ", ".join(f"{k.removeprefix('mqtt__')} {v}" for k, v in overrides.items() if k.startswith("mqtt__"))
        + ")",
    ]
    head = (
        f"## Budget scenario: {args.series or 'natural'} series at {args.interval:g} s, {rate:,} B/s, "
        f"{args.minutes:g} min\n\n"
        f"Run {dt.datetime.fromtimestamp(r.t0_wall).isoformat(timespec='seconds')}. Our stack only: "
        "simulator -> edge-relay -> byte-counting proxy -> mosquitto -> cloud-ingest -> Prometheus; "
        "the proxy's counters (TCP payload of the relay's MQTT connection, both directions) are read "
        "every second from the relay's start, the relay's /metrics every "
        f"{RELAY_METRICS_EVERY_S:g} s. Relay: {relay[0]}; {relay[-1]}; `--drain-seconds "
        f"{args.drain_seconds:g}` on SIGTERM.\n\n"
        f"Budget file (`{budget.name}`):\n\n```yaml\n{budget.read_text()}```\n"
    )
    if warnings:
        head += "\n" + "\n".join(f"**{w}**" for w in warnings) + "\n"
    plan_block = f"`{plan_command}` (before the relay started):\n\n```\n{plan_text}\n```\n"
    steps = "\n".join(r.steps) or "(none)"
    relay_stats = r.stats.get("edge-relay")
    notes = list(r.notes)
    notes.append(
        f"the relay's own edge_relay_wire_bytes_total at the end of the run: {relay_wire:,.0f} B "
        f"(proxy: {relay_wire_at_end:,} B)"
    )
    if relay_stats is not None:
        notes.append(
            f"edge-relay CPU {relay_stats.cpu_seconds:.1f} s over the run, peak RSS "
            f"{relay_stats.peak_rss_bytes / 2**20:.1f} MiB"
        )
    notes.append(
        f"batches published: {metric_sum(f, 'edge_relay_batches_published_total', kind='first'):,.0f} "
        f"+ {metric_sum(f, 'edge_relay_batches_published_total', kind='retry'):,.0f} again; MQTT payload "
        f"{metric_sum(f, 'edge_relay_publish_payload_bytes_total'):,.0f} B"
    )
    return (
        f"{head}\n{plan_block}\n"
        + table(["measure", "value"], summary)
        + "\n\n"
        + table(
            [
                "class",
                "degrade level",
                "resolution s",
                "configured / max s",
                "degrade steps",
                "restore steps",
                "samples sent",
                "merged",
                "suppressed",
            ],
            classes,
        )
        + "\n\nAt the end of the run (the relay's /metrics: `edge_relay_budget_degrade_level`, "
        "`_resolution_seconds`, `_degrade_steps_total{direction}`, `_samples_total{outcome}`).\n\n"
        + table(
            [
                "time",
                "bytes on the wire",
                "allowed",
                "ratio",
                "B/s in the minute",
                "spool batches / bytes",
                "oldest unsent sample s",
                *(f"{cls['name']} res s" for cls in BUDGET_CLASSES),
            ],
            timeline,
        )
        + "\n\nPer minute since the relay started (spool and resolutions from the relay's /metrics; the "
        "spool counts packed batches, not the open batch window).\n\n"
        + f"Controller steps (relay log):\n\n```\n{steps}\n```\n\n"
        + "Observations:\n\n"
        + "\n".join(f"- {o}" for o in observations)
        + "\n\nNotes:\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + f"\n\nPython {platform.python_version()}.\n"
    )


def budget_observations(
    args: argparse.Namespace, r: BudgetRun, run: WireCheck, whole: WireCheck, plan_full: float | None
) -> list[str]:
    """What a reader should not miss, derived from the numbers (no judgement beyond them)."""
    rate, burst = args.budget_bps, args.burst
    out = []
    if run.worst_ratio > 1 or whole.worst_ratio > 1:
        out.append(
            "the wire went over `burst + rate x elapsed`: worst "
            f"{max(run.worst_ratio, whole.worst_ratio):.3f}"
        )
    else:
        out.append(
            f"the wire stayed within `burst + rate x elapsed` at every second after the first minute "
            f"(worst {run.worst_ratio:.3f}; {whole.worst_ratio:.3f} including the drain)"
        )
    if whole.max_excess > burst:
        # The controller's bound: burst + one batch (a batch is capped as the note below says, plus its
        # MQTT framing).
        bound = burst + args.batch_cap + 512
        out.append(
            f"over some interval (drain included) the wire carried {whole.max_excess:,.0f} B more than "
            f"rate x length: above the {burst:,} B burst, "
            + ("within" if whole.max_excess <= bound else "**beyond**")
            + f" burst + one batch (~{bound:,} B), the controller's documented bound"
        )
    restores = sum(
        class_value(r.final, "edge_relay_budget_degrade_steps_total", c["name"], direction="restore")
        for c in BUDGET_CLASSES
    )
    if restores:
        out.append(f"the controller restored {restores:g} time(s): it went back and forth (see the steps)")
    at_max = all(
        class_value(r.final, "edge_relay_budget_resolution_seconds", c["name"])
        >= c.get("degrade", {}).get("max_resolution_seconds", 0)
        for c in BUDGET_CLASSES
        if "degrade" in c
    )
    if at_max:
        out.append("every degradable class ended at its max_resolution_seconds")
    if class_value(r.final, "edge_relay_budget_degrade_level", CRITICAL_CLASS):
        out.append("the critical class was degraded")
    spool = [
        (at, metric_sum(m, "edge_relay_spool_bytes") + 0.0) for at, m in r.snapshots if at >= r.t_end - 180
    ]
    if len(spool) >= 2:
        growth = spool[-1][1] - spool[0][1]
        span = spool[-1][0] - spool[0][0]
        out.append(
            f"spool backlog over the last {span / 60:.0f} min: {spool[0][1]:,.0f} -> {spool[-1][1]:,.0f} B "
            f"({growth / span * 60:+,.0f} B/min)" + ("; still growing at the end" if growth > 0 else "")
        )
    demands = [int(d) for d in re.findall(r"\(demand (\d+) B/s", "\n".join(r.steps))]
    if demands and plan_full:
        out.append(
            f"demand the controller measured at its first step: {demands[0]:,} B/s, "
            f"{demands[0] / plan_full:.1f}x the plan's full-resolution estimate ({plan_full:,.0f} B/s); "
            f"at its last: {demands[-1]:,} B/s ({demands[-1] / rate:.1f}x the budget)"
        )
    published = metric_sum(r.final, "edge_relay_batches_published_total")
    payload = metric_sum(r.final, "edge_relay_publish_payload_bytes_total")
    if published:
        out.append(
            f"{published:,.0f} batches published in the run, {payload / published:,.0f} B of payload each: "
            f"the relay caps a batch at {args.batch_cap:,} B (burst - 512, at least 4 KiB: the pacer "
            "sends a batch only when the bucket holds all of it), so a batch window that encodes to more is "
            "split by series"
        )
    return out


# ------------------------------------------------------------------------------------------ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--series", type=int, default=2000, help="simulated series (default 2000)")
    ap.add_argument("--minutes", type=float, default=10.0, help="measured window, min (default 10)")
    ap.add_argument("--interval", type=float, default=5.0, help="scrape interval, s (default 5)")
    ap.add_argument(
        "--vendor",
        choices=("nvidia", "amd", "intel", "jetson"),
        default="nvidia",
        help="simulated GPU node (default nvidia; `edge-relay simulate --vendor`)",
    )
    ap.add_argument(
        "--warmup",
        type=float,
        default=30.0,
        help="seconds before the window, at least (default 30; also until every system delivered)",
    )
    ap.add_argument(
        "--format-version",
        type=int,
        choices=(1, 2),
        default=2,
        help="relay batch.format_version of the windowed row and the budget scenario (default 2; the live "
        "row runs the relay's default)",
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
        "--rows",
        nargs="+",
        choices=ROWS,
        default=list(ROWS),
        help="systems to run: ours without a budget file (live), ours with the lossless budget "
        "(windowed), the Prometheus agent, vmagent (one row per --vmagent-receivers); default all",
    )
    ap.add_argument(
        "--freshness-every",
        type=float,
        default=2.0,
        help="seconds between freshness queries to each receiver (default 2)",
    )
    ap.add_argument(
        "--vmagent-receivers",
        nargs="+",
        choices=sorted(RECEIVERS),
        default=["prometheus", "victoriametrics"],
        help="one vmagent row per receiver kind (default both)",
    )
    ap.add_argument(
        "--budget-scenario",
        action="store_true",
        help="instead: our stack alone under a budget too small for its classes (--minutes from the "
        "relay's start; writes <timestamp>-budget.md)",
    )
    ap.add_argument(
        "--budget-bps",
        type=int,
        default=280,
        help="budget scenario: sustained bytes/s (default 280: `budget plan` estimates about "
        "465 B/s at full resolution for 2000 series)",
    )
    ap.add_argument(
        "--budget-burst",
        type=int,
        default=0,
        help="budget scenario: burst_bytes (default 0: the budget file's default, two batch windows at "
        "the rate; session 2's runs used 20 x the rate, which splits every window)",
    )
    ap.add_argument(
        "--drain-seconds",
        type=float,
        default=3600.0,
        help="budget scenario: the relay's --drain-seconds when it is stopped at the end; the drain is "
        "paced by the budget too (default 3600)",
    )
    ap.add_argument("--workdir", help="working directory (default: a new temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory")
    args = ap.parse_args()

    started = time.monotonic()
    report = run_budget(args) if args.budget_scenario else run(args)
    write_results("budget" if args.budget_scenario else "bandwidth", report, started)
    return 0


if __name__ == "__main__":
    sys.exit(main())
