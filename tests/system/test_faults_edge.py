"""Edge-side fault tests of issue 3, on real mosquitto + real Prometheus (out-of-order window on).

The relay (``edge-relay run``) and the ingester (``cloud-ingest run``) run as subprocesses exactly as in
``test_e2e.py``, scraping the simulator every second. Faults:

1. the relay is SIGKILLed at random instants, 20+ times, and restarted on the same spool;
2. the spool fills up during a broker outage (``spool.max_bytes``, and a real size-capped tmpfs);
3. a corrupt spool row (CRC mismatch) and a corrupt spool file (garbage, truncated mid-page).

Every test ends with a SIGTERM (``--drain-seconds``), an empty spool, and a sample-by-sample comparison
of Prometheus with what the simulator served. The oracle works *per scrape*: each served request is
matched to the scrape the relay stamped it with (the timestamps its samples, ``up`` among them, carry in
Prometheus). A matched scrape must be in Prometheus whole, with exact values at exactly that timestamp;
an unmatched one must be wholly absent and explained by the fault (killed before it was spooled,
evicted because the spool was full, quarantined, or in a spool file that was destroyed). Where the relay
thins out its backlog on purpose (spool caps), present samples must be unchanged and the missing ones
must add up to the loss ledger (``edge_relay_samples_dropped_total``). Nothing else may be in Prometheus.
"""

from __future__ import annotations

import os
import random
import shutil
import sqlite3
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml

from schemas import codec
from schemas.model import Batch, is_stale
from testkit.oracle import Served, compare, expected_samples, read_served_log, same_value
from testkit.readings import metric_sum as metric
from testkit.readings import read_metrics
from testkit.services import Mosquitto, Prometheus, RawSamples, wait_until
from testkit.stack import EXPORTERS, Program, SimulatorProcess, ingest_config, program, relay_config

NODE = "edge-gpu-01"
CLUSTER = "test"
SYNTHETIC = ("up", "scrape_duration_seconds", "scrape_samples_scraped")
# The relay stamps a scrape when it starts the request; the simulator logs the request when it answers.
# The scrape timeout is 0.8 s, so a served request belongs to a scrape stamped at most this much earlier.
MAX_SKEW_MS = 1000
# A cycle commits its batch to the spool right after its slowest scrape (timeout 0.8 s) plus parse and
# encode: a served request can only be lost to a kill that came within about a second.
KILL_WINDOW_MS = 1200
DRAIN_SECONDS = 30
ACK_TIMEOUT_SECONDS = 3


# ------------------------------------------------------------------------------------------ the stack


def _listen_url(config: Path) -> str:
    listen = yaml.safe_load(config.read_text())["metrics"]["listen"]
    return f"http://{listen}/metrics"


def spool_query(path: Path, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(path, isolation_level=None)) as db:
        return db.execute(sql, args).fetchall()


def spool_rows(path: Path) -> int:
    return int(spool_query(path, "SELECT count(*) FROM batches")[0][0])


def spool_last_seq(path: Path) -> int:
    return int(spool_query(path, "SELECT value FROM meta WHERE key = 'last_seq'")[0][0])


@dataclass
class Edge:
    """Simulator, cloud-ingest and edge-relay around the test's mosquitto and Prometheus."""

    tmp: Path
    mosquitto: Mosquitto
    prometheus: Prometheus
    sim: SimulatorProcess
    relay: Program
    ingest: Program
    spool_path: Path
    relay_metrics_url: str
    ingest_metrics_url: str
    started: float = field(default_factory=time.monotonic)

    @classmethod
    def create(
        cls,
        tmp: Path,
        mosquitto: Mosquitto,
        prometheus: Prometheus,
        *,
        churn_ticks: int = 10,
        spool_path: Path | None = None,
        **relay_overrides: Any,
    ) -> Edge:
        sim = SimulatorProcess(tmp, seed=11, interval=1.0, churn_ticks=churn_ticks).start()
        spool_path = spool_path or tmp / "spool.db"
        relay_cfg = relay_config(
            tmp,
            urls=sim.urls,
            mqtt_port=mosquitto.port,
            interval=1.0,
            spool__path=str(spool_path),
            mqtt__ack_timeout_seconds=ACK_TIMEOUT_SECONDS,
            **relay_overrides,
        )
        ingest_cfg = ingest_config(
            tmp,
            mqtt_port=mosquitto.port,
            remote_write_url=prometheus.remote_write_url,
            mqtt__reconnect_min_seconds=0.2,
            mqtt__reconnect_max_seconds=2,
        )
        relay = program("edge-relay", "edge_relay.cli", relay_cfg, tmp, "--drain-seconds", str(DRAIN_SECONDS))
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, tmp)
        return cls(
            tmp,
            mosquitto,
            prometheus,
            sim,
            relay,
            ingest,
            spool_path,
            _listen_url(relay_cfg),
            _listen_url(ingest_cfg),
        )

    def relay_metrics(self) -> list[tuple[str, dict[str, str], float]]:
        return read_metrics(self.relay_metrics_url)

    def ingest_metrics(self) -> list[tuple[str, dict[str, str], float]]:
        return read_metrics(self.ingest_metrics_url)

    def relay_metrics_when_up(self, timeout: float = 15) -> list[tuple[str, dict[str, str], float]]:
        def get() -> list[tuple[str, dict[str, str], float]] | None:
            assert self.relay.alive(), self.relay.log_tail()
            try:
                return self.relay_metrics()
            except requests.RequestException:
                return None

        return wait_until(get, timeout=timeout, interval=0.1, message="the relay's /metrics")

    def stop_relay_drained(self) -> None:
        """SIGTERM with --drain-seconds; every batch spooled must have been acknowledged by then."""
        assert self.relay.alive(), self.relay.log_tail()
        assert self.relay.stop(timeout=DRAIN_SECONDS + 30) == 0, self.relay.log_tail()
        assert spool_rows(self.spool_path) == 0, f"spool not drained:\n{self.relay.log_tail()}"

    def newest_scrape_ms(self, job: str = "node") -> int:
        data = self.prometheus.raw_samples(f'up{{job="{job}"}}', lookback="10m")
        return max((t for samples in data.values() for t, _ in samples), default=0)

    def wait_for_new_samples(self, after_ms: int, timeout: float = 30) -> None:
        """Until Prometheus holds a scrape stamped after ``after_ms`` for every exporter."""

        def arrived() -> bool:
            assert self.relay.alive(), self.relay.log_tail()
            return all(self.newest_scrape_ms(job) > after_ms for job in EXPORTERS)

        wait_until(arrived, timeout=timeout, interval=0.25, message=f"samples scraped after {after_ms}")

    def close(self) -> None:
        self.relay.kill()
        if self.ingest.alive():
            self.ingest.stop()
        self.sim.stop()

    def actual(self) -> RawSamples:
        return self.prometheus.raw_samples('{job=~".+"}', lookback="10m")

    def served(self) -> list[Served]:
        return read_served_log(self.sim.served_log)

    def instances(self) -> dict[str, str]:
        return {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in self.sim.urls.items()}


@contextmanager
def edge_stack(tmp: Path, mosquitto: Mosquitto, prometheus: Prometheus, **kwargs: Any) -> Iterator[Edge]:
    edge = Edge.create(tmp, mosquitto, prometheus, **kwargs)
    try:
        yield edge
    finally:
        edge.close()
        print(f"\n[{tmp.name}] stack ran {time.monotonic() - edge.started:.1f}s")


# ----------------------------------------------------------------------------------------- the oracle


@dataclass
class Verdict:
    """What Prometheus holds, explained scrape by scrape and sample by sample."""

    expected: RawSamples  # real samples of every scrape found in Prometheus, at the scrape's timestamp
    matched: list[tuple[Served, int]]  # served request -> timestamp of its scrape in Prometheus
    absent: list[tuple[Served, int]]  # served request -> scrape the test knows was lost on purpose
    unmatched: list[Served]  # served requests whose scrape left no trace at all in Prometheus
    failed_scrapes: int  # scrapes with up == 0 (legitimate under load: no samples, nothing lost)
    present: int  # samples in Prometheus (real + synthetic) that belong to a served scrape, unchanged
    missing: int  # samples of served scrapes (real + synthetic) that are not in Prometheus
    problems: list[str]


def _expected(edge: Edge, records: list[Served]) -> RawSamples:
    return dict(
        expected_samples(
            edge.sim.simulator,
            records,
            jobs={e: e for e in EXPORTERS},
            instances=edge.instances(),
            extra={"cluster": CLUSTER, "node": NODE},
        )
    )


def _partial_problems(expected: RawSamples, real: RawSamples) -> tuple[int, list[str]]:
    """Every sample in ``real`` must be expected, unchanged; returns (how many are, problems)."""
    problems: list[str] = []
    present = 0
    for key, samples in real.items():
        want = dict(expected.get(key, []))
        for t, v in samples:
            if t not in want:
                problems.append(f"{dict(key)}: sample at {t} belongs to no served scrape (value {v!r})")
            elif not same_value(want[t], v):
                problems.append(f"{dict(key)} at {t}: expected value {want[t]!r}, got {v!r}")
            else:
                present += 1
    return present, problems


def judge(
    edge: Edge, actual: RawSamples, *, absent: Iterable[tuple[str, int]] = (), whole_scrapes: bool = True
) -> Verdict:
    """Match served requests to the scrapes in Prometheus and account for every sample.

    A scrape's timestamp is known from any of its samples in Prometheus (its ``up`` in particular);
    ``absent`` adds (job, timestamp) of scrapes the test knows were lost on purpose. With
    ``whole_scrapes`` every scrape found must be complete (synthetic series included); without it
    (the relay re-downsampled its backlog on purpose) present samples must merely be unchanged.
    """
    served = edge.served()
    problems: list[str] = []
    real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
    synthetic: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    stamps: dict[str, set[int]] = defaultdict(set)
    for key, samples in actual.items():
        labels = dict(key)
        stamps[labels["job"]].update(t for t, _ in samples)
        if labels["__name__"] in SYNTHETIC:
            for t, v in samples:
                synthetic[(labels["__name__"], labels["job"])][t] = v

    absent_set = set(absent)
    matched: list[tuple[Served, int]] = []
    lost_on_purpose: list[tuple[Served, int]] = []
    unmatched: list[Served] = []
    failed: set[tuple[str, int]] = set()
    for job in EXPORTERS:
        ups = synthetic[("up", job)]
        records = sorted((r for r in served if r.exporter == job), key=lambda r: r.t_ms)
        i = 0
        for t in sorted(stamps[job] | {t for j, t in absent_set if j == job}):
            while i < len(records) and records[i].t_ms < t:
                unmatched.append(records[i])
                i += 1
            rec = records[i] if i < len(records) and records[i].t_ms - t <= MAX_SKEW_MS else None
            if rec is not None:
                i += 1
            if (job, t) in absent_set:
                if rec is None:
                    problems.append(f"{job}: lost scrape at {t} matches no served request")
                else:
                    lost_on_purpose.append((rec, t))
                if t in stamps[job]:
                    problems.append(f"{job}: scrape at {t} should be absent but has samples in Prometheus")
            elif ups.get(t) == 0.0:
                failed.add((job, t))  # a failed scrape (timeout under load): `up 0`, no samples
            elif rec is None:
                problems.append(f"{job}: scrape at {t} is in Prometheus but the simulator served none")
            else:
                matched.append((rec, t))
        unmatched.extend(records[i:])

    # Samples of every scrape found, stamped with the scrape's timestamp (exactly).
    stamp = {(r.exporter, r.t_ms): t for r, t in matched}
    expected: RawSamples = {}
    for key, samples in _expected(edge, [r for r, _ in matched]).items():
        job = dict(key)["job"]
        expected[key] = sorted((stamp[(job, ts)], v) for ts, v in samples)
    n_expected = sum(len(v) for v in expected.values()) + len(SYNTHETIC) * len(matched)
    n_unmatched = sum(len(v) for v in _expected(edge, unmatched).values()) + len(SYNTHETIC) * len(unmatched)

    present = 0
    for job in EXPORTERS:
        scrapes = {t for r, t in matched if r.exporter == job}
        for name in SYNTHETIC:
            got = {t: v for t, v in synthetic[(name, job)].items() if (job, t) not in failed}
            if whole_scrapes and set(got) != scrapes:
                problems.append(f"{job}: {name} at {len(got)} timestamps, scrapes found: {len(scrapes)}")
            if not set(got) <= scrapes:
                problems.append(f"{job}: {name} at timestamps of no served scrape")
            if name == "up" and any(v != 1.0 for v in got.values()):
                problems.append(f"{job}: up != 1 for a scrape with samples")
            present += len(set(got) & scrapes)
    if whole_scrapes:
        problems += compare(expected, real, max_skew_ms=0)
        present += sum(len(v) for v in real.values()) if not problems else 0
    else:
        n, more = _partial_problems(expected, real)
        present += n
        problems += more
    return Verdict(
        expected,
        matched,
        lost_on_purpose,
        sorted(unmatched, key=lambda r: r.t_ms),
        len(failed),
        present,
        n_expected + n_unmatched - present,
        problems,
    )


def check_clean(verdict: Verdict) -> None:
    assert not verdict.problems, "\n".join(verdict.problems[:30])
    total = sum(len(v) for v in verdict.expected.values())
    assert total > 5000, f"only {total} samples compared: the test would prove little"


# ------------------------------------------------------------------------------- 1. SIGKILL at random


KILLS = 24  # at a uniformly random delay after the process starts
ANCHORED_KILLS = 12  # shortly after the simulator served one of the relay's scrapes
KILL_SEED = 20240603


def _served_bytes(edge: Edge) -> int:
    try:
        return edge.sim.served_log.stat().st_size
    except FileNotFoundError:
        return 0


@pytest.mark.timeout(180)
def test_relay_killed_at_random_instants_resumes_from_spool(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    """SIGKILL 36 times; every scrape that reached the spool must arrive, whole and unchanged.

    A uniform delay of 0.05-1.5 s after the start lands in start-up, in a scrape cycle, or between
    cycles while batches are published and acked. A cycle (4 scrapes, parse, encode, one fsynced spool
    commit) lasts only tens of milliseconds, so a third of the kills are anchored to it instead: a
    random 0-120 ms after the simulator answered the relay's first request of a cycle, i.e. during
    the other scrapes, the parse, the spool write, the publication or the first acks.
    """
    t0 = time.monotonic()
    rng = random.Random(KILL_SEED)
    plan = ["uniform"] * KILLS + ["anchored"] * ANCHORED_KILLS
    rng.shuffle(plan)
    kills_ms: list[int] = []
    delays: list[float] = []
    with edge_stack(tmp_path, mosquitto, prometheus) as edge:
        edge.ingest.start()
        for kind in plan:
            served_before = _served_bytes(edge)
            edge.relay.start()
            if kind == "uniform":
                delay = rng.uniform(0.05, 1.5)
                time.sleep(delay)
            else:
                started = time.monotonic()
                wait_until(lambda b=served_before: _served_bytes(edge) > b, timeout=10, interval=0.002)
                time.sleep(rng.uniform(0.0, 0.12))
                delay = time.monotonic() - started
            delays.append(delay)
            assert edge.relay.alive(), f"the relay died by itself:\n{edge.relay.log_tail()}"
            kills_ms.append(int(time.time() * 1000))
            edge.relay.kill()
        # The last life: long enough to ship the backlog, then a clean stop that drains.
        edge.relay.start()
        time.sleep(5)
        final = edge.relay_metrics_when_up()
        edge.stop_relay_drained()
        log = edge.relay.log_path.read_text(errors="replace")
        actual = edge.actual()
        verdict = judge(edge, actual)

    # Nothing was given up on purpose: the loss ledger (kept in the spool, so across lives) is empty.
    assert metric(final, "edge_relay_samples_dropped_total") == 0

    check_clean(verdict)
    # A served request without any trace in Prometheus is a scrape whose cycle died before its batch
    # was committed to the spool; that can only be one served shortly before a kill.
    unexplained = [
        r for r in verdict.unmatched if not any(k - KILL_WINDOW_MS <= r.t_ms <= k + 100 for k in kills_ms)
    ]
    assert not unexplained, f"{len(unexplained)} scrapes lost though no kill followed them: {unexplained[:8]}"
    per_kill: dict[int, list[Served]] = defaultdict(list)
    for r in verdict.unmatched:
        per_kill[min(k for k in kills_ms if k + 100 >= r.t_ms)].append(r)
    # A kill takes at most the one cycle in progress: 4 scrapes, one per exporter.
    for k, lost in per_kill.items():
        assert len(lost) <= len(EXPORTERS) and len({r.exporter for r in lost}) == len(lost), (k, lost)
    connects = log.count("connected to MQTT")
    print(
        f"\nSIGKILL test: {len(plan)} kills ({KILLS} uniform, {ANCHORED_KILLS} anchored; seed {KILL_SEED}, "
        f"delays {min(delays):.2f}-{max(delays):.2f}s), "
        f"{connects} relay lives reached the broker; {len(verdict.matched)} scrapes in Prometheus, "
        f"{len(verdict.unmatched)} served scrapes lost to {len(per_kill)} kills (never spooled), "
        f"{verdict.failed_scrapes} failed scrapes; {sum(len(v) for v in verdict.expected.values())} samples "
        f"compared; {time.monotonic() - t0:.1f}s"
    )
    assert connects >= 5, "too few relay lives got as far as publishing: the kills proved little"


# ---------------------------------------------------------------------------------- 2. spool disk full


def _mid_interval(edge: Edge) -> None:
    """Sleep until about half way between two scrape cycles: no batch is on its way to the cloud then."""
    last = read_served_log(edge.sim.served_log)[-1].t_ms
    phase_ms = (int(time.time() * 1000) - last) % 1000
    time.sleep(((500 - phase_ms) % 1000) / 1000)


@dataclass
class Outage:
    dropped: dict[str, float]  # the relay's edge_relay_samples_dropped_total by reason, before the stop
    errors_full: float
    stale_markers: float
    outage_ms: int
    recovered_ms: int


def _fill_spool_during_outage(edge: Edge) -> Outage:
    """Normal shipping; broker down until the spool has been full twice; broker back; backlog drained."""
    edge.ingest.start()
    edge.relay.start()
    start_ms = int(time.time() * 1000)
    edge.relay_metrics_when_up()

    def shipped_normally() -> bool:
        m = edge.relay_metrics()
        files = {p.name: p.stat().st_size for p in edge.spool_path.parent.glob("spool.db*")}
        assert metric(m, "edge_relay_spool_errors_total", reason="full") == 0, (
            f"the spool is full before any outage, with {metric(m, 'edge_relay_spool_rows'):.0f} row(s) "
            f"in it; files: {files}\n{edge.relay.log_tail(8)}"
        )
        return all(edge.newest_scrape_ms(job) > start_ms + 3000 for job in EXPORTERS)

    wait_until(shipped_normally, timeout=30, interval=0.25, message="a few cycles shipped normally")
    normal = edge.relay_metrics()
    assert metric(normal, "edge_relay_samples_dropped_total") == 0, "drops before the outage"

    _mid_interval(edge)  # so that no batch was written by the ingester but not acked when the broker goes
    edge.mosquitto.stop()
    outage_ms = int(time.time() * 1000)

    def full_events(n: int) -> Any:
        def check() -> list[tuple[str, dict[str, str], float]] | None:
            assert edge.relay.alive(), edge.relay.log_tail()
            m = edge.relay_metrics()  # /metrics keeps answering
            return m if metric(m, "edge_relay_spool_errors_total", reason="full") >= n else None

        return check

    wait_until(full_events(1), timeout=30, interval=0.2, message="the spool to fill up")

    def dropped() -> list[tuple[str, dict[str, str], float]] | None:
        # Read after the room is made: the failed write is counted before the eviction's ledger entry.
        m = edge.relay_metrics()
        return m if metric(m, "edge_relay_samples_dropped_total", reason="spool_full") > 0 else None

    first = wait_until(dropped, timeout=10, interval=0.2, message="the samples given up in the ledger")
    # The relay reports it: the failed write, and the samples given up in the loss ledger.
    assert metric(first, "edge_relay_samples_dropped_total", reason="spool_full") > 0, edge.relay.log_tail()
    # Keep it full for several cycles: it fills again (room is made by evicting), the relay keeps going.
    wait_until(full_events(2), timeout=30, interval=0.2, message="the spool to fill up again")
    time.sleep(1.5)
    assert requests.get(edge.relay_metrics_url.replace("/metrics", "/healthz"), timeout=5).ok
    edge.mosquitto.restart()  # same port; without persistence the sessions are gone

    # Recovered: both ends back on the broker, the backlog shipped, no failed spool write for 3 cycles.
    seen = {"errors": -1.0, "since": 0.0}

    def recovered() -> bool:
        assert edge.relay.alive(), edge.relay.log_tail()
        m = edge.relay_metrics()
        errors = metric(m, "edge_relay_spool_errors_total", reason="full")
        if errors != seen["errors"]:
            seen.update(errors=errors, since=time.monotonic())
            return False
        return (
            time.monotonic() - seen["since"] >= 3
            and metric(m, "edge_relay_mqtt_connected") == 1
            and metric(edge.ingest_metrics(), "cloud_ingest_mqtt_connected") == 1
            and metric(m, "edge_relay_spool_rows") <= 2
        )

    wait_until(recovered, timeout=30, interval=0.25, message="the relay to recover once the broker is back")
    # New cycles are spooled again and arrive in Prometheus.
    recovered_ms = int(time.time() * 1000)
    edge.wait_for_new_samples(recovered_ms + 1000, timeout=30)
    after = edge.relay_metrics()
    outage = Outage(
        dropped={lab["reason"]: v for n, lab, v in after if n == "edge_relay_samples_dropped_total" and v},
        errors_full=metric(after, "edge_relay_spool_errors_total", reason="full"),
        stale_markers=metric(after, "edge_relay_stale_markers_total"),
        outage_ms=outage_ms,
        recovered_ms=recovered_ms,
    )
    edge.stop_relay_drained()
    return outage


def _check_spool_full_accounting(edge: Edge, outage: Outage) -> None:
    # Whole scrapes are not required: over spool.cap_bytes the relay re-downsamples on purpose.
    verdict = judge(edge, edge.actual(), whole_scrapes=False)
    check_clean(verdict)  # nothing changed, nothing extra
    assert outage.stale_markers == 0, "no churn in this run: stale markers would make the count inexact"
    dropped = sum(outage.dropped.values())
    print(
        f"\nspool full: {verdict.missing} samples missing from Prometheus ({len(verdict.unmatched)} whole "
        f"scrapes), dropped by reason {outage.dropped}, {outage.errors_full:.0f} failed spool writes; "
        f"{verdict.present} samples present"
    )
    assert outage.dropped.get("spool_full", 0) > 0 and outage.errors_full > 0
    # Every missing sample is accounted for by the loss ledger, and nothing else is missing.
    assert verdict.missing == dropped, (
        f"{verdict.missing} samples missing, {dropped} dropped: {outage.dropped}"
    )
    outside = [r for r in verdict.unmatched if not outage.outage_ms - 1000 <= r.t_ms <= outage.recovered_ms]
    assert not outside, f"scrapes lost outside the outage: {outside[:8]}"


SPOOL_CAP = 160 * 1024  # room for about four 24 KB batches besides the schema and the WAL share


@pytest.mark.timeout(150)
def test_spool_cap_full_during_outage_keeps_running_and_recovers(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    t0 = time.monotonic()
    with edge_stack(tmp_path, mosquitto, prometheus, churn_ticks=0, spool__max_bytes=SPOOL_CAP) as edge:
        outage = _fill_spool_during_outage(edge)
        _check_spool_full_accounting(edge, outage)
    print(f"spool cap test: {time.monotonic() - t0:.1f}s")


TMPFS_BYTES = 384 * 1024


@contextmanager
def small_tmpfs(path: Path, size: int) -> Iterator[None]:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a size-capped tmpfs needs root (mount -t tmpfs); the max_bytes variant covers the cap")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k,mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


@pytest.mark.timeout(150)
def test_spool_on_full_filesystem_keeps_running_and_recovers(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    t0 = time.monotonic()
    fs = tmp_path / "fs"
    with (
        small_tmpfs(fs, TMPFS_BYTES),
        edge_stack(tmp_path, mosquitto, prometheus, churn_ticks=0, spool_path=fs / "spool.db") as edge,
    ):
        outage = _fill_spool_during_outage(edge)
        _check_spool_full_accounting(edge, outage)
    print(f"tmpfs test: {time.monotonic() - t0:.1f}s")


# ------------------------------------------------------------------------------- 3. corrupt spool data


def _blocks_by_job(batch: Batch) -> set[tuple[str, int]]:
    """(job, scrape timestamp) of every scrape in the batch. From the samples, not the blocks: a v2
    batch decodes to one block per distinct timestamp, so two targets scraped in the same millisecond
    share a block."""
    out = set()
    for block in batch.scrapes:
        for i, idx in enumerate(block.series):
            out.add((dict(batch.labelsets[idx])["job"], block.sample_timestamp(i)))
    return out


def _batch_samples(batch: Batch) -> RawSamples:
    out: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = defaultdict(list)
    for block in batch.scrapes:
        for i, (idx, value) in enumerate(zip(block.series, block.values, strict=True)):
            labels = batch.labelsets[idx]
            if dict(labels)["__name__"] in SYNTHETIC or is_stale(value):
                continue
            out[frozenset(labels)].append((block.sample_timestamp(i), value))
    return dict(out)


@pytest.mark.timeout(120)
def test_corrupt_spool_row_is_quarantined_and_the_rest_delivered(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus
) -> None:
    t0 = time.monotonic()
    with edge_stack(tmp_path, mosquitto, prometheus) as edge:
        # Broker down: the rows stay in the spool.
        mosquitto.stop()
        edge.relay.start()
        edge.relay_metrics_when_up()
        wait_until(lambda: spool_rows(edge.spool_path) >= 5, timeout=20, message="5 spooled batches")
        assert edge.relay.stop() == 0, edge.relay.log_tail()
        seqs = [s for (s,) in spool_query(edge.spool_path, "SELECT seq FROM batches ORDER BY seq")]
        victim = seqs[len(seqs) // 2]
        ((payload,),) = spool_query(edge.spool_path, "SELECT payload FROM batches WHERE seq = ?", victim)
        original = codec.decode_batch(payload)
        broken = bytearray(payload)
        for pos in (len(broken) // 3, len(broken) // 2, len(broken) - 7):
            broken[pos] ^= 0x5A
        # Same length, other bytes: only the CRC can tell.
        spool_query(edge.spool_path, "UPDATE batches SET payload = ? WHERE seq = ?", bytes(broken), victim)

        mosquitto.restart()
        edge.ingest.start()
        edge.relay.start()
        restart_ms = int(time.time() * 1000)
        edge.relay_metrics_when_up()

        def quarantined() -> bool:
            assert edge.relay.alive(), f"relay died on a corrupt row:\n{edge.relay.log_tail()}"
            return metric(edge.relay_metrics(), "edge_relay_spool_quarantined_rows") >= 1

        wait_until(quarantined, timeout=30, interval=0.2, message="edge_relay_spool_quarantined_rows >= 1")
        edge.wait_for_new_samples(restart_ms, timeout=30)
        time.sleep(2)
        ledger = edge.relay_metrics()
        edge.stop_relay_drained()
        log = edge.relay.log_path.read_text(errors="replace")
        quarantine = spool_query(edge.spool_path, "SELECT seq, reason FROM quarantine")
        verdict = judge(edge, edge.actual(), absent=_blocks_by_job(original))

    assert [q[0] for q in quarantine] == [victim], quarantine
    assert "checksum mismatch" in quarantine[0][1]
    assert f"quarantined batch seq={victim}" in log
    # The loss ledger has the quarantined row's samples, and nothing else.
    assert metric(ledger, "edge_relay_samples_dropped_total", reason="corrupt_row") == original.sample_count
    assert metric(ledger, "edge_relay_samples_dropped_total") == original.sample_count
    assert log.count("edge relay test/edge-gpu-01") == 2, "the relay restarted by itself"
    check_clean(verdict)
    assert not verdict.unmatched, f"scrapes lost besides the quarantined row: {verdict.unmatched[:8]}"
    assert len(verdict.absent) == len(_blocks_by_job(original))
    # The oracle agrees with the quarantined payload: those are exactly the samples missing.
    lost = _expected(edge, [r for r, _ in verdict.absent])
    stamp = {(r.exporter, r.t_ms): t for r, t in verdict.absent}
    lost = {k: [(stamp[(dict(k)["job"], ts)], v) for ts, v in s] for k, s in lost.items()}
    assert not compare(lost, _batch_samples(original), max_skew_ms=0)
    print(
        f"\ncorrupt row: seq {victim} of {seqs} quarantined ({original.sample_count} samples, "
        f"{len(original.scrapes)} scrapes); {len(verdict.matched)} scrapes delivered; "
        f"{time.monotonic() - t0:.1f}s"
    )


def _corrupt_garbage(path: Path) -> None:
    size = path.stat().st_size
    path.write_bytes(random.Random(5).randbytes(max(size, 8192)))


def _corrupt_truncate(path: Path) -> None:
    size = path.stat().st_size
    assert size >= 8 * 4096, f"spool of {size} bytes: too small to truncate mid-page meaningfully"
    with path.open("r+b") as f:
        f.truncate((size // 4096 // 2) * 4096 + 1234)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_spool_file_is_moved_aside_and_shipping_continues(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, damage: str
) -> None:
    t0 = time.monotonic()
    with edge_stack(tmp_path, mosquitto, prometheus) as edge:
        edge.ingest.start()
        edge.relay.start()
        start_ms = int(time.time() * 1000)
        edge.relay_metrics_when_up()
        edge.wait_for_new_samples(start_ms + 2000, timeout=30)  # a few batches spooled and shipped
        if damage == "truncated":
            # Broker down for a while, so the file holds a backlog worth truncating.
            mosquitto.stop()
            wait_until(lambda: spool_rows(edge.spool_path) >= 6, timeout=20, message="a backlog")
        assert edge.relay.stop() == 0, edge.relay.log_tail()
        seq_before = spool_last_seq(edge.spool_path)
        rows_before = spool_rows(edge.spool_path)
        for side in ("-wal", "-shm"):
            assert not Path(f"{edge.spool_path}{side}").exists(), "clean close should checkpoint the WAL"
        corrupted_ms = int(time.time() * 1000)
        (_corrupt_garbage if damage == "garbage" else _corrupt_truncate)(edge.spool_path)
        if damage == "truncated":
            mosquitto.restart()

        edge.relay.start()
        restart_ms = int(time.time() * 1000)
        moved = wait_until(
            lambda: sorted(edge.spool_path.parent.glob("spool.db.corrupt-*")),
            timeout=15,
            message="moved aside",
        )
        edge.relay_metrics_when_up()
        edge.wait_for_new_samples(restart_ms, timeout=30)
        time.sleep(2)
        ingest = edge.ingest_metrics()
        ledger = edge.relay_metrics()
        assert edge.relay.alive(), edge.relay.log_tail()
        edge.stop_relay_drained()
        seq_after = spool_last_seq(edge.spool_path)
        log = edge.relay.log_path.read_text(errors="replace")
        verdict = judge(edge, edge.actual())

    errors = [line for line in log.splitlines() if " ERROR " in line and "corrupt" in line]
    assert any(str(edge.spool_path) in line and str(moved[0]) in line for line in errors), errors
    assert log.count("edge relay test/edge-gpu-01") == 2, "the relay restarted by itself"
    # The event is in the loss ledger (how many samples the destroyed part held is unknowable).
    assert any(
        n == "edge_relay_samples_dropped_total" and lab.get("reason") == "spool_file_corrupt"
        for n, lab, _ in ledger
    ), "the corrupt spool file is not in the loss ledger"
    # Seqs keep increasing past everything handed out before, and the cloud took the new batches.
    assert seq_after > seq_before
    assert seq_after > corrupted_ms * 1000, "seqs do not continue from the time-derived floor"
    last_seq = metric(ingest, "cloud_ingest_node_last_seq", node=NODE)
    assert last_seq > seq_before, f"the ingester's last seq {last_seq} is not above {seq_before}"
    assert metric(ingest, "cloud_ingest_batches_refused_total") == 0
    assert metric(ingest, "cloud_ingest_dead_letters_total") == 0
    assert metric(ingest, "cloud_ingest_acks_published_total", result="rejected") == 0
    check_clean(verdict)
    # Lost: at most the batches the destroyed file held (none for "garbage": it had drained).
    late = [r for r in verdict.unmatched if r.t_ms > corrupted_ms]
    assert not late, f"scrapes lost after the spool was recreated: {late[:8]}"
    if damage == "garbage":
        assert not verdict.unmatched, verdict.unmatched[:8]
    print(
        f"\ncorrupt file ({damage}): {rows_before} rows in the destroyed file, "
        f"{len(verdict.unmatched)} scrapes lost with it, moved to {moved[0].name}; seq {seq_before} -> "
        f"{seq_after}; {time.monotonic() - t0:.1f}s"
    )
