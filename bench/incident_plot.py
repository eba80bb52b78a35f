"""Incident pictures (issue 14): what the cloud sees of the incident GPU's temperature without the
anomaly feature and with it, against the truth.  Not a test: it writes one PNG per scenario to
``docs/img/incident-<kind>.png`` and a markdown table to ``bench/results/<timestamp>-incident-plot.md``.

    .venv/bin/pip install -e .[plots]                   # matplotlib (never needed by the sidecar)
    .venv/bin/python bench/incident_plot.py             # 4 scenarios, 2.5 min each (~10 min)
    .venv/bin/python bench/incident_plot.py --kinds thermal --keep    # one scenario, keep the logs
    .venv/bin/python bench/incident_plot.py --replot DIR  # redraw from a kept --workdir DIR, no run

``--sequential`` runs the two stacks of a scenario one after the other (twice as long, half the load).

Per scenario (thermal runaway, XID burst, power capping, memory leak; the incident on GPU 1, the
simulated node's second and last GPU: the issue's "GPU 3") the real stack runs twice, at the same
time, each with a simulator of its own on the same simulated timeline (same seed and incident, by
tick):

    simulator -> edge-relay -> mosquitto -> cloud-ingest -> Prometheus      (x 2: without / with)

Both relays scrape every 1 s under the same budget (6000 B/s, GPU detail and the rest degraded to
``--resolution`` s, 60 by default, aggregation ``last``; ``up`` at full resolution); "with" adds the
budget file's ``anomaly`` section (``pre_seconds`` = ``post_seconds`` = 30, ``reserved_share`` 0.2).
60 s rather than the test's 300 s so that the degraded run shows a few points in a 2.5 min run.
Each run: the incident starts at tick 40 and lasts 60 ticks; the relay is stopped (and drains) at tick
145, then GPU 1's dcgm series are read back from Prometheus as raw samples.

The truth is what the simulator served: the oracle (``testkit.oracle.expected_samples``) re-renders
every dcgm payload the relay fetched on the in-process twin.  Every stored sample is matched to the
served request of its scrape (the first one served at or after its timestamp, within 1 s; one relay per
simulator, so unambiguous) and compared bit for bit; the x axis is the simulator's tick (seconds since
the incident's start), common to both runs.  "Window": the ticks from ``pre_seconds`` before the
event's scrape to ``post_seconds`` after it (what the feature guarantees; it extends while the rules
keep firing, the shaded band shows the full-resolution span actually stored).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from simulator.incidents import KINDS, Incident
from testkit.benchkit import ROOT, log, table, workspace, write_results
from testkit.oracle import Served, expected_samples, read_served_log, same_value
from testkit.readings import metric_sum, read_metrics
from testkit.services import Mosquitto, Prometheus, RawSamples, ServiceFactory
from testkit.stack import (
    EXPORTERS,
    Program,
    SimulatorProcess,
    incident_budget,
    ingest_config,
    program,
    relay_config,
    write_yaml,
)

NODE = "edge-gpu-01"
GPU = 1  # the simulated A100 node has GPUs 0 and 1
SEED = 11
INTERVAL_S = 1.0
AT, FOR = 40, 60  # incident ticks
END_TICK = AT + FOR + 45  # the relay stops here
PRE_S = POST_S = 30
RATE, BURST_S = 6000, 20
TEMP = "DCGM_FI_DEV_GPU_TEMP"
# The metric each incident drives, when it is not the temperature (a second panel).
SECOND: dict[str, tuple[str, str]] = {
    "xid": ("DCGM_FI_DEV_XID_ERRORS", "last XID"),
    "powercap": ("DCGM_FI_DEV_POWER_USAGE", "power (W)"),
    "memleak": ("DCGM_FI_DEV_FB_USED", "frame buffer used (MiB)"),
}
TITLES = {
    "thermal": "thermal runaway",
    "xid": "XID burst (94, 63, then 43: channel killed)",
    "powercap": "power capping",
    "memleak": "memory leak",
}
EVENT = re.compile(r"anomaly: gpu=dcgm:(\d+) kind=(\w+) rule=(\S+) at_ms=(\d+)")
IMG = ROOT / "docs" / "img"

Series = dict[int, float]  # tick -> value


@dataclass
class Run:
    """One stack: simulator, relay, ingester, mosquitto, Prometheus."""

    name: str
    work: Path
    services: ServiceFactory
    sim: SimulatorProcess
    relay: Program
    ingest: Program
    prom: Prometheus
    metrics_url: str
    t0: float  # monotonic time the simulator started (its tick 0)
    wire_bytes: float = 0.0
    log_text: str = ""


def start_run(name: str, work: Path, kind: str, resolution: int, anomaly: bool) -> Run:
    work.mkdir(parents=True, exist_ok=True)
    services = ServiceFactory(work)
    mosquitto = services(Mosquitto)
    prom = services(Prometheus)
    sim = SimulatorProcess(
        work, seed=SEED, interval=INTERVAL_S, churn_ticks=0, incidents=[Incident(kind, GPU, AT, FOR)],
        dcgm_health_fields=True,
    )  # fmt: skip
    window = {"pre_seconds": PRE_S, "post_seconds": POST_S, "reserved_share": 0.2}
    doc = incident_budget(
        rate=RATE,
        burst_seconds=BURST_S,
        gpu_resolution_seconds=resolution,
        anomaly=window if anomaly else None,
    )
    budget = write_yaml(work / "budget.yaml", doc)
    ingest_cfg = ingest_config(work, mqtt_port=mosquitto.port, remote_write_url=prom.remote_write_url)
    sim.start()
    t0 = time.monotonic()
    relay_cfg = relay_config(
        work, urls=sim.urls, mqtt_port=mosquitto.port, interval=INTERVAL_S, budget_file=str(budget),
        recorder={"max_bytes": 50_000_000, "block_seconds": 5},
    )  # fmt: skip
    metrics_url = f"http://{yaml.safe_load(relay_cfg.read_text())['metrics']['listen']}/metrics"
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, work).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, work, "--drain-seconds", "60").start()
    return Run(name, work, services, sim, relay, ingest, prom, metrics_url, t0)


def stop_run(run: Run) -> None:
    """The relay drains and stops; then the ingester and the simulator (Prometheus stays for reading)."""
    try:
        try:
            run.wire_bytes = metric_sum(read_metrics(run.metrics_url), "edge_relay_wire_bytes_total")
        except Exception as exc:  # a dead relay: said below
            log(f"{run.name}: no metrics ({exc})")
        alive = run.relay.alive()
        code = run.relay.stop(timeout=120) if alive else None
        if not alive or code != 0:
            raise RuntimeError(f"{run.name}: the relay died or failed ({code}):\n{run.relay.log_tail()}")
    finally:
        run.relay.kill()
        run.ingest.stop()
        run.sim.stop()
        run.log_text = run.relay.log_path.read_text(errors="replace")


@dataclass
class Outcome:
    """What one run's Prometheus holds of GPU 1, by simulator tick, against the truth."""

    truth: dict[str, Series]  # metric -> tick -> served value (several series of a name: merged)
    stored: dict[str, Series]
    stored_ticks: dict[frozenset[tuple[str, str]], set[int]]
    truth_ticks: dict[frozenset[tuple[str, str]], set[int]]
    mismatches: int = 0  # stored samples not equal to what was served for their scrape
    unmatched: int = 0  # stored samples no served request belongs to
    events: list[tuple[str, str, int]] = field(default_factory=list)  # GPU 1's: (kind, rule, scrape's tick)
    foreign: list[str] = field(default_factory=list)  # events on another GPU (none expected)

    @property
    def event(self) -> tuple[str, str, int] | None:
        return self.events[0] if self.events else None


def read_back(run: Run) -> Outcome:
    served = [r for r in read_served_log(run.sim.served_log) if r.exporter == "dcgm"]
    served.sort(key=lambda r: r.t_ms)
    instances = {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in run.sim.urls.items()}
    expected = expected_samples(
        run.sim.simulator, served, jobs={e: e for e in EXPORTERS}, instances=instances,
        extra={"cluster": "test", "node": NODE},
    )  # fmt: skip
    tick_at = {r.t_ms: r.tick for r in served}
    stamps = [r.t_ms for r in served]
    actual: RawSamples = run.prom.raw_samples(f'{{job="dcgm",gpu="{GPU}"}}', lookback="30m")

    def served_for(t: int) -> Served | None:
        i = bisect.bisect_left(stamps, t)  # the relay stamps a sample with its scrape's start
        return served[i] if i < len(served) and served[i].t_ms - t < 1000 else None

    out = Outcome({}, {}, {}, {})
    for key, samples in expected.items():
        labels = dict(key)
        if labels.get("gpu") != str(GPU) or not labels["__name__"].startswith("DCGM_FI_"):
            continue
        out.truth_ticks[key] = {tick_at[t] for t, _ in samples}
        merged = out.truth.setdefault(labels["__name__"], {})
        for t, v in samples:
            merged[tick_at[t]] = v
    for key, samples in actual.items():
        name = dict(key)["__name__"]
        want = {t: v for t, v in expected.get(key, [])}
        ticks = out.stored_ticks.setdefault(key, set())
        for t, v in samples:
            rec = served_for(t)
            if rec is None or rec.t_ms not in want:
                out.unmatched += 1
                continue
            if not same_value(v, want[rec.t_ms]):
                out.mismatches += 1
            ticks.add(rec.tick)
            out.stored.setdefault(name, {})[rec.tick] = v
    for m in EVENT.finditer(run.log_text):
        gpu, kind, rule, at_ms = m.groups()
        rec = served_for(int(at_ms))
        if gpu != str(GPU) or rec is None:
            out.foreign.append(m.group(0))
        else:
            out.events.append((kind, rule, rec.tick))
    return out


def in_window(ticks: set[int], lo: int, hi: int) -> int:
    return sum(1 for k in ticks if lo <= k <= hi)


def full_res_span(ticks: list[int], around: int) -> tuple[int, int]:
    """The run of stored ticks (gaps of at most 2 s) that contains ``around``."""
    ticks = sorted(ticks)
    i = bisect.bisect_left(ticks, around)
    i = min(i, len(ticks) - 1)
    lo = hi = i
    while lo > 0 and ticks[lo] - ticks[lo - 1] <= 2:
        lo -= 1
    while hi < len(ticks) - 1 and ticks[hi + 1] - ticks[hi] <= 2:
        hi += 1
    return ticks[lo], ticks[hi]


def plot(kind: str, without: Outcome, with_: Outcome, resolution: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [(TEMP, "GPU temperature (°C)")]
    if kind in SECOND:
        metrics.append(SECOND[kind])
    fig, axes = plt.subplots(
        len(metrics), 1, figsize=(9, 4.6 if len(metrics) == 1 else 6.2), dpi=100, sharex=True, squeeze=False
    )
    ev_tick = with_.event[2] if with_.event else None
    span = full_res_span(list(with_.stored.get(TEMP, {})), ev_tick) if ev_tick is not None else None
    for ax, (metric, ylabel) in zip(axes[:, 0], metrics, strict=True):
        truth = sorted(with_.truth.get(metric, {}).items())
        ax.plot(
            [k - AT for k, _ in truth], [v for _, v in truth], color="0.25", lw=0.8, label="truth (served)"
        )
        coarse = sorted(without.stored.get(metric, {}).items())
        ax.step(
            [k - AT for k, _ in coarse], [v for _, v in coarse], where="post", color="tab:orange", lw=1.6,
            marker="o", ms=7, label=f"cloud, without anomaly detection ({resolution} s, last)",
        )  # fmt: skip
        fine = sorted(with_.stored.get(metric, {}).items())
        ax.plot(
            [k - AT for k, _ in fine], [v for _, v in fine], ls="none", marker=".", ms=3.5, color="tab:blue",
            label="cloud, with anomaly detection",
        )  # fmt: skip
        ax.axvspan(0, FOR, ymin=0.975, ymax=1, color="tab:red", alpha=0.6, lw=0)
        if span is not None:
            ax.axvspan(span[0] - AT, span[1] - AT, color="tab:blue", alpha=0.10, lw=0)
        for i, (_, _, tick) in enumerate(with_.events):
            ax.axvline(tick - AT, color="tab:red", lw=1, ls="--" if i == 0 else ":")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, lw=0.5)
        ax.margins(x=0.01)
    top = axes[0, 0]
    label = f"event ({with_.event[1]})" if with_.event else "no event"
    handles, labels = top.get_legend_handles_labels()
    from matplotlib.patches import Patch

    handles += [
        plt.Line2D([], [], color="tab:red", lw=1, ls="--"),
        Patch(color="tab:red", alpha=0.6),
        Patch(color="tab:blue", alpha=0.25),
    ]
    labels += [
        label,
        f"incident ({FOR} s)",
        f"full resolution ({PRE_S} s before, {POST_S} s after the last detection)",
    ]
    if len(with_.events) > 1:
        handles.append(plt.Line2D([], [], color="tab:red", lw=1, ls=":"))
        labels.append("later event: " + ", ".join(f"{r}" for _, r, _ in with_.events[1:]))
    axes[-1, 0].set_xlabel("seconds since the incident started (1 s scrapes)")
    top.set_title(f"GPU {GPU}, {TITLES[kind]}: what Prometheus holds", fontsize=10)
    legend_h = 0.42  # inches under the axes
    fig.legend(handles, labels, fontsize=7.5, loc="lower center", ncol=3, frameon=False)
    fig.tight_layout(rect=(0, legend_h / fig.get_figheight(), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, pil_kwargs={"optimize": True})
    plt.close(fig)


def dump(o: Outcome, path: Path) -> None:
    """What ``plot`` needs, for ``--replot``."""
    path.write_text(json.dumps({"truth": o.truth, "stored": o.stored, "events": o.events}))


def undump(path: Path) -> Outcome:
    doc = json.loads(path.read_text())
    series = {
        key: {m: {int(k): v for k, v in s.items()} for m, s in doc[key].items()}
        for key in ("truth", "stored")
    }
    return Outcome(series["truth"], series["stored"], {}, {}, events=[tuple(e) for e in doc["events"]])


def scenario(kind: str, work: Path, args: argparse.Namespace) -> list[str]:
    log(f"{kind}: starting both stacks")
    runs: list[Run] = []
    try:
        for name, anomaly in (("without", False), ("with", True)):
            runs.append(start_run(name, work / name, kind, args.resolution, anomaly))
            if args.sequential:
                wait_and_stop(runs[-1])
        if not args.sequential:
            for run in runs:
                wait_and_stop(run)
        without, with_ = (read_back(r) for r in runs)
        for run, o in zip(runs, (without, with_), strict=True):
            dump(o, work / f"outcome-{run.name}.json")
    finally:
        for run in runs:
            run.relay.kill()
            run.ingest.stop()
            run.sim.stop()
            run.services.stop_all()
    path = args.out / f"incident-{kind}.png"
    plot(kind, without, with_, args.resolution, path)
    log(f"{kind}: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    if with_.event is None:
        return [kind, "none", "-", "-", "-", "-", "-"]
    ev_tick = with_.event[2]
    lo, hi = ev_tick - PRE_S, ev_tick + POST_S

    def counts(o: Outcome, metric: str | None) -> tuple[int, int]:
        keys = [k for k in o.truth_ticks if metric is None or dict(k)["__name__"] == metric]
        truth = sum(in_window(o.truth_ticks[k], lo, hi) for k in keys)
        stored = sum(in_window(o.stored_ticks.get(k, set()), lo, hi) for k in keys)
        return truth, stored

    t_truth, t_without = counts(without, TEMP)
    t_truth_w, t_with = counts(with_, TEMP)
    a_truth, a_without = counts(without, None)
    a_truth_w, a_with = counts(with_, None)
    exact = [o.mismatches == 0 and o.unmatched == 0 for o in (without, with_)]
    notes = [
        f"{o.mismatches} values differ, {o.unmatched} unmatched" for o in (without, with_) if o.mismatches
    ]
    if with_.foreign or without.events:
        notes.append(f"unexpected events: {with_.foreign + without.foreign} / without: {without.events}")
    span = full_res_span(list(with_.stored.get(TEMP, {})), ev_tick)
    return [
        kind,
        "; then ".join(f"{k} `{r}`, {t - AT:+d} s" for k, r, t in with_.events),
        f"{t_truth_w} / {t_without} / {t_with}"
        + ("" if t_truth == t_truth_w else f" (truth without: {t_truth})"),
        f"{a_truth_w} / {a_without} / {a_with}"
        + ("" if a_truth == a_truth_w else f" (truth without: {a_truth})"),
        f"{span[0] - AT:+d} .. {span[1] - AT:+d} s",
        " / ".join("yes" if e else "no" for e in exact) + (f" ({'; '.join(notes)})" if notes else ""),
        f"{runs[0].wire_bytes / 1024:.0f} / {runs[1].wire_bytes / 1024:.0f} KiB",
    ]


def wait_and_stop(run: Run) -> None:
    remaining = run.t0 + END_TICK * INTERVAL_S - time.monotonic()
    if remaining > 0:
        log(f"{run.name}: {remaining:.0f} s to tick {END_TICK}")
        time.sleep(remaining)
    stop_run(run)


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--resolution", type=int, default=60, help="degraded GPU resolution, s (default 60)")
    parser.add_argument("--sequential", action="store_true", help="one stack at a time (slower, less CPU)")
    parser.add_argument("--out", type=Path, default=IMG, help="where the PNGs go (default docs/img)")
    parser.add_argument("--workdir", help="keep everything here")
    parser.add_argument("--keep", action="store_true", help="keep the working directory")
    parser.add_argument("--replot", type=Path, metavar="WORKDIR", help="only redraw from a kept --workdir")
    args = parser.parse_args()
    args.out = args.out.resolve()
    if args.replot:
        for kind in args.kinds:
            d = args.replot / kind
            path = args.out / f"incident-{kind}.png"
            plot(
                kind,
                undump(d / "outcome-without.json"),
                undump(d / "outcome-with.json"),
                args.resolution,
                path,
            )
            log(f"{path} ({path.stat().st_size / 1024:.0f} KiB)")
        return
    started = time.monotonic()
    rows = []
    with workspace(args.workdir, args.keep, "incident-plot-") as work:
        for kind in args.kinds:
            rows.append(scenario(kind, work / kind, args))
    headers = [
        "incident",
        "event (rule, s after onset)",
        "temperature samples in window: truth / without / with",
        "all dcgm samples in window: truth / without / with",
        "full resolution stored",
        "bit-exact: without / with",
        "relay wire bytes: without / with",
    ]
    report = (
        f"## Incident pictures: GPU {GPU} without / with anomaly detection\n\n"
        + table(headers, rows)
        + f"\n\nIncident on GPU {GPU} at tick {AT} for {FOR} ticks, 1 s scrapes, relay stopped at tick "
        f"{END_TICK}; budget {RATE} B/s, GPU detail and the rest at {args.resolution} s (`last`); with: "
        f"`anomaly: {{pre_seconds: {PRE_S}, post_seconds: {POST_S}, reserved_share: 0.2}}`. Window: "
        f"{PRE_S} s before to {POST_S} s after the event's scrape, by simulator tick. Bit-exact: every "
        f"stored GPU {GPU} dcgm sample equals what the simulator served for its scrape. Pictures: "
        + ", ".join(f"`{shown(args.out / f'incident-{k}.png')}`" for k in args.kinds)
        + ".\n"
    )
    write_results("incident-plot", report, started)


if __name__ == "__main__":
    main()
