"""Which anomaly detector should the edge relay run? Labelled simulated incidents, detectors compared.

Issue 14: a detection raises the affected GPU to full resolution, so the detector must catch real
incidents early, rarely cry wolf on an ordinary day, and cost next to nothing on the edge. This bench
runs the simulator (``simulator.incidents``) with one incident per run (each kind on a random GPU at a
random time, 2-6 min long) plus incident-free runs, scrapes dcgm-exporter (with the health fields:
throttle reasons, ECC) and Kepler every 5 s, and feeds each GPU's signals to every detector:

- ``rules:counters``: any XID, any throttle reason but idle / application clocks / sync boost, any
  remapped row or ECC error;
- ``rules:all``: those plus thresholds (temperature, memory temperature, power at the limit, FB full)
  and slopes (temperature, FB used rising fast);
- ``robust-z``: median / MAD over a sliding 10 min window, per signal; ``ewma``: an EWMA mean and
  variance per signal (half-life ~3.5 min); both score max |z| over the signals;
- ``hst``: river's ``anomaly.HalfSpaceTrees`` (online isolation forest) on the signals scaled to [0, 1]
  by the GPU's physical ranges; ``iforest``: scikit-learn's ``IsolationForest`` refitted every 10 min on
  the last hour, as the seed sketches.

The simulator's ordinary day is smooth, so the bench adds what a real one has (seeded, the same for
every detector): sensor noise and benign load steps (a job starts or stops: utilisation +-30 %, power
and temperature follow, a model is loaded or dropped). Thresholds of the statistical detectors are
calibrated on separate incident-free runs: the lowest at which they raise at most ``--target-fp``
(0.25) false events per GPU-hour there; an alarm is a score over it on two scrapes in a row, an event
its onset (alarms within a minute of one another are one event). Edge cost is measured in
subprocesses (RSS) and from the packages' installed files.

    .venv/bin/python bench/anomaly_bench.py              # 16 runs per kind, 16 free, 8 calibration
    .venv/bin/python bench/anomaly_bench.py --quick      # 2 / 3 / 2 runs, ~1 min

``--vendor amd|intel|jetson`` (or ``--vendor nvidia --detectors product``) runs the relay's own detector
instead (``edge_relay.anomaly.detector.Detector`` with the vendor's preset and the relay's defaults: the rules
or-ed with the EWMA score at ``score_threshold``) on that vendor's simulated exporter, scraped as the
relay does (parse + ``TargetShaper``), with the same ordinary day applied to the raw samples in the
exporter's units (``VendorDay``); XID bursts are not applicable on Intel and Jetson (no XID, no ECC
count: ``NOT_APPLICABLE``).
It reports the union (``product``) and its two halves (``product:rules``, ``product:ewma``), which
rules made each detection and each false event, and, with calibration runs, the EWMA threshold that
would give ``--target-fp`` on that vendor. ``--threshold KEY=VALUE`` / ``--score-threshold`` change
the detector's configuration (as the budget file's ``anomaly.thresholds`` would) to test a value:

    .venv/bin/python bench/anomaly_bench.py --vendor jetson --threshold power_fraction=1.03

``--real`` runs the relay's detector on real telemetry instead: the measured H200 trace
(``simulator/data/h200-nvml-training-trace.csv``, looped) served as dcgm-exporter 4.x pages with its default
fields (``real_page``), 4 GPUs at quarter offsets, 1 s and 5 s scrapes, parsed and shaped as the relay
does (``replay_real``): false events per GPU-hour with the defaults, and the recall and time to detect
of incidents injected on top of the real values (``RealIncident``: thermal runaway, hardware slowdown,
XID burst, memory leak).

    .venv/bin/python bench/anomaly_bench.py --real
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.metadata
import json
import math
import random
import re
import shlex
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

from simulator import Simulator
from simulator.incidents import KINDS, Incident
from testkit.benchkit import RESULTS
from testkit.gpu_replay import REAL_GPUS, REAL_KINDS, TRACE, RealIncident, RealTrace, replay_real

INTERVAL = 5.0
SIGNALS = ("util", "power", "temp", "mem_temp", "fb", "clock", "w_per_util")
# A100 80GB PCIe (the simulated NVIDIA node): ranges for scaling and the rules' thresholds.
LIMIT_W, FB_TOTAL_MIB, CLOCK_MAX = 300.0, 81920.0, 1410.0
RANGES = {"util": 100.0, "power": LIMIT_W, "temp": 100.0, "mem_temp": 100.0, "fb": FB_TOTAL_MIB,
          "clock": CLOCK_MAX, "w_per_util": 20.0}  # fmt: skip
# z-score floors: a flat signal's MAD is ~0, a change smaller than this is never an anomaly.
FLOORS = {"util": 3.0, "power": 5.0, "temp": 1.0, "mem_temp": 1.0, "fb": 256.0, "clock": 20.0,
          "w_per_util": 0.2}  # fmt: skip
THROTTLE_MASK = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW / HW thermal, power brake (not the SW cap 0x4)
WARMUP = 120  # ticks (the first 10 min): baselines form, no alarms
GRACE = 6  # scrapes after an incident's end where a first alarm still counts as a detection
REFRACTORY = 12  # alarms within a minute are one event
_LINE = re.compile(r'^(DCGM_FI_DEV_\w+)\{gpu="(\d+)".*\} (\S+)$', re.M)
_KEPLER = re.compile(r'^kepler_node_gpu_watts\{gpu="(\d+)".*\} (\S+)$', re.M)

Sample = dict[str, float]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- data: the simulator, plus an ordinary day's noise ------------------------------------------


def scrape(sim: Simulator, tick: int) -> dict[int, Sample]:
    gpus: dict[int, Sample] = {}
    for name, gpu, value in _LINE.findall(sim.render("dcgm", tick).decode()):
        gpus.setdefault(int(gpu), {})[name[12:]] = float(value)
    for gpu, value in _KEPLER.findall(sim.render("kepler", tick).decode()):
        gpus[int(gpu)]["KEPLER_WATTS"] = float(value)
    return gpus


class OrdinaryDay:
    """Sensor noise and benign load steps for one GPU (seeded, independent of the incidents)."""

    def __init__(self, rng: random.Random, ticks: int) -> None:
        self.rng = rng
        self.steps: list[tuple[int, int, float, float]] = []  # start, end, util delta, fb delta
        t = 0
        while True:
            t += int(rng.expovariate(1 / 180))  # one every ~15 min
            if t >= ticks:
                break
            fb = rng.choice((0.0, rng.uniform(2048, 12288) * rng.choice((-1, 1))))
            self.steps.append((t, t + rng.randint(24, 240), rng.uniform(-30, 30), fb))
        self.temp_offset = 0.0

    def apply(self, tick: int, raw: Sample) -> Sample:
        rng, du, dfb = self.rng, 0.0, 0.0
        for start, end, u, fb in self.steps:
            if start <= tick < end:
                du, dfb = du + u, dfb + fb
        util = min(100.0, max(0.0, raw["GPU_UTIL"] + du + rng.gauss(0, 2)))
        dpower = (util - raw["GPU_UTIL"]) / 100 * 0.8 * (LIMIT_W - 70)
        noise = rng.gauss(0, 0.015)
        power = min(LIMIT_W * 1.03, max(20.0, (raw["POWER_USAGE"] + dpower) * (1 + noise)))
        target = dpower * 0.06  # ~6 °C per 100 W, reached with a 60 s time constant
        self.temp_offset += (target - self.temp_offset) * (1 - math.exp(-INTERVAL / 60))
        kw = raw.get("KEPLER_WATTS", raw["POWER_USAGE"])
        return {
            "util": util,
            "power": power,
            "temp": min(100.0, raw["GPU_TEMP"] + self.temp_offset + rng.gauss(0, 0.4)),
            "mem_temp": min(100.0, raw["MEMORY_TEMP"] + self.temp_offset + rng.gauss(0, 0.4)),
            "fb": min(FB_TOTAL_MIB, max(0.0, raw["FB_USED"] + dfb + rng.gauss(0, 16))),
            "clock": min(CLOCK_MAX, max(210.0, raw["SM_CLOCK"] + rng.gauss(0, 8))),
            "w_per_util": (kw + dpower) * (1 + noise) / max(util, 5.0),
            # counters and codes: exact
            "xid": raw["XID_ERRORS"],
            "throttle": raw["CLOCK_THROTTLE_REASONS"],
            "rows": raw["UNCORRECTABLE_REMAPPED_ROWS"] + raw["CORRECTABLE_REMAPPED_ROWS"],
            "ecc": raw["ECC_SBE_VOL_TOTAL"] + raw["ECC_DBE_VOL_TOTAL"],
        }


def run_data(
    seed: int, incident: Incident | None, ticks: int, benign: bool = True
) -> dict[int, list[Sample]]:
    sim = Simulator(
        seed, exporters=("dcgm", "kepler"), incidents=[incident] if incident else [], dcgm_health_fields=True
    )
    days = {g: OrdinaryDay(random.Random(f"day:{seed}:{g}"), ticks if benign else 0) for g in (0, 1)}
    out: dict[int, list[Sample]] = {0: [], 1: []}
    for tick in range(ticks):
        for gpu, raw in scrape(sim, tick).items():
            out[gpu].append(days[gpu].apply(tick, raw))
    return out


# --- detectors ----------------------------------------------------------------------------------


class Rules:
    """The rules a GPU preset ships with; score 1 when one fires (no calibration: physical limits)."""

    def __init__(self, thresholds: bool) -> None:
        self.thresholds = thresholds
        self.prev: Sample | None = None
        self.hist: deque[Sample] = deque(maxlen=13)
        self.hot = self.capped = 0

    def score(self, x: Sample) -> float:
        p, fired = self.prev, False
        if p is not None:
            fired = (x["xid"] != 0 and x["xid"] != p["xid"]) or x["rows"] > p["rows"] or x["ecc"] > p["ecc"]
        fired = fired or bool(int(x["throttle"]) & THROTTLE_MASK)
        self.prev = x
        self.hist.append(x)
        if not self.thresholds:
            return float(fired)
        self.hot = self.hot + 1 if x["temp"] >= 85 or x["mem_temp"] >= 92 else 0
        self.capped = self.capped + 1 if x["power"] >= 0.97 * LIMIT_W else 0
        fired = fired or self.hot >= 2 or self.capped >= 3 or x["fb"] >= 0.95 * FB_TOTAL_MIB
        h = self.hist
        if len(h) >= 4 and h[-1]["temp"] - h[-4]["temp"] >= 4.5:  # >= 0.3 °C/s over 15 s
            fired = True
        if len(h) == h.maxlen:
            # FB used climbing steadily for a minute: >= 5 % of the total, 10 of 12 steps up by more than
            # allocator noise, no step more than 40 % of the rise (a model loading is one or two jumps).
            steps = [b["fb"] - a["fb"] for a, b in zip(list(h)[:-1], list(h)[1:], strict=True)]
            rise = h[-1]["fb"] - h[0]["fb"]
            ups = sum(d > 0.001 * FB_TOTAL_MIB for d in steps)
            fired = fired or (rise >= 0.05 * FB_TOTAL_MIB and ups >= 10 and max(steps) <= 0.4 * rise)
        return float(fired)


class RobustZ:
    def __init__(self, window: int = 120) -> None:
        self.hist = {s: deque[float](maxlen=window) for s in SIGNALS}

    def score(self, x: Sample) -> float:
        z = 0.0
        for s, h in self.hist.items():
            if len(h) >= 24:
                srt = sorted(h)
                med = srt[len(srt) // 2]
                mad = sorted(abs(v - med) for v in srt)[len(srt) // 2]
                z = max(z, abs(x[s] - med) / (1.4826 * mad + FLOORS[s]))
            h.append(x[s])
        return z


class Ewma:
    def __init__(self, alpha: float = 0.016) -> None:  # half-life ~43 scrapes (3.5 min)
        self.alpha, self.n = alpha, 0
        self.mean: dict[str, float] = {}
        self.var: dict[str, float] = {}

    def score(self, x: Sample) -> float:
        z, a = 0.0, self.alpha
        for s in SIGNALS:
            v = x[s]
            if self.n == 0:
                self.mean[s], self.var[s] = v, 0.0
                continue
            d = v - self.mean[s]
            if self.n >= 24:
                z = max(z, abs(d) / math.sqrt(self.var[s] + FLOORS[s] ** 2))
            self.mean[s] += a * d
            self.var[s] = (1 - a) * (self.var[s] + a * d * d)
        self.n += 1
        return z


class Hst:
    """river's HalfSpaceTrees on the signals scaled by the GPU's physical ranges (it wants [0, 1])."""

    def __init__(self, seed: int = 1) -> None:
        from river import anomaly

        # river's defaults (10 trees of height 8); the paper's 25 x 15 takes ~0.5 GB and ~25 ms a scrape.
        self.model = anomaly.HalfSpaceTrees(n_trees=10, height=8, window_size=250, seed=seed)

    def score(self, x: Sample) -> float:
        f = {s: min(1.0, max(0.0, x[s] / RANGES[s])) for s in SIGNALS}
        score = float(self.model.score_one(f))
        self.model.learn_one(f)
        return score


class IForest:
    """scikit-learn's IsolationForest, refitted every ``every`` scrapes on the last ``window``."""

    def __init__(self, seed: int = 1, every: int = 120, window: int = 720) -> None:
        from sklearn.ensemble import IsolationForest

        self.make = lambda: IsolationForest(n_estimators=100, max_samples="auto", random_state=seed)
        self.every, self.hist = every, deque[list[float]](maxlen=window)
        self.model: Any = None
        self.seen = 0

    def scores(self, xs: Sequence[Sample]) -> list[float]:
        """The online scores of a stream, each scrape scored by the model fitted before it; computed a
        refit period at a time (the same numbers as one call per scrape, much faster here)."""
        out: list[float] = []
        for i in range(0, len(xs), self.every):
            block = [[x[s] for s in SIGNALS] for x in xs[i : i + self.every]]
            out += [0.0] * len(block) if self.model is None else list(-self.model.score_samples(block))
            self.hist.extend(block)
            self.model = self.make().fit(list(self.hist))
        return out


DETECTORS: dict[str, Callable[[], Any]] = {
    "rules:counters": lambda: Rules(thresholds=False),
    "rules:all": lambda: Rules(thresholds=True),
    "robust-z": RobustZ,
    "ewma": Ewma,
    "hst": Hst,
    "iforest": IForest,
}
CALIBRATED = ("robust-z", "ewma", "hst", "iforest")


def stream_scores(name: str, xs: Sequence[Sample]) -> tuple[list[float], float]:
    """Scores of one GPU's stream and the CPU seconds they took."""
    det = DETECTORS[name]()
    t0 = time.process_time()
    scores = det.scores(xs) if isinstance(det, IForest) else [det.score(x) for x in xs]
    return scores, time.process_time() - t0


# --- scoring ------------------------------------------------------------------------------------


def alarms(scores: Sequence[float], threshold: float, debounce: int, WARMUP: int) -> list[bool]:
    """Per scrape: over the threshold on ``debounce`` scrapes in a row (after the warm-up)."""
    out, run = [], 0
    for t, v in enumerate(scores):
        run = run + 1 if v > threshold and t >= WARMUP else 0
        out.append(run >= debounce)
    return out


def events(alarm: Sequence[bool]) -> list[int]:
    """Ticks where an event starts: an alarm not within ``REFRACTORY`` of the previous one."""
    out, last = [], -(10**9)
    for t, a in enumerate(alarm):
        if a:
            if t - last > REFRACTORY:
                out.append(t)
            last = t
    return out


def onsets(scores: Sequence[float], threshold: float, debounce: int, WARMUP: int) -> list[int]:
    return events(alarms(scores, threshold, debounce, WARMUP))


def calibrate(streams: Sequence[Sequence[float]], WARMUP: int, allowed: float) -> float:
    """The lowest threshold at which the incident-free ``streams`` raise at most ``allowed`` events."""
    values = sorted(v for s in streams for v in s[WARMUP:])
    candidates = sorted({values[min(len(values) - 1, int(q / 1000 * len(values)))] for q in range(900, 1000)})
    candidates.append(values[-1] * 1.01 + 1e-9)
    for threshold in candidates:
        if sum(len(onsets(s, threshold, 2, WARMUP)) for s in streams) <= allowed:
            return threshold
    return candidates[-1]


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    srt = sorted(values)
    return srt[min(len(srt) - 1, max(0, math.ceil(q * len(srt)) - 1))]


def labelled_runs(
    args: argparse.Namespace, *, skip: Collection[str] = (), gpus: int = 2
) -> list[tuple[str, int, Incident | None]]:
    """(label, seed, incident) of every run: calibration and incident-free runs, then ``runs_per_kind``
    incidents of each kind at random times and GPUs. The draws are the same whatever ``skip`` and
    ``gpus`` say, so every vendor gets the same incident times and seeds (a kind in ``skip`` has no
    signal on the vendor: not run; a GPU past ``gpus`` becomes the last one)."""
    rng = random.Random(args.seed)
    runs: list[tuple[str, int, Incident | None]] = []
    for i in range(args.calibration_runs):
        runs.append(("calibration", 10_000 + i, None))
    for i in range(args.free_runs):
        runs.append(("free", 20_000 + i, None))
    for kind in KINDS:
        for _ in range(args.runs_per_kind):
            n = rng.randint(24, 72)
            start = rng.randint(WARMUP + 60, args.ticks - n - GRACE - 1)
            seed, gpu = rng.randrange(1, 10**6), rng.randint(0, 1)
            if kind not in skip:
                runs.append((kind, seed, Incident(kind, min(gpu, gpus - 1), start, n)))
    return runs


def evaluate(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    runs = labelled_runs(args)
    names = [n for n in DETECTORS if n in args.detectors]
    scores: dict[str, list[tuple[str, Incident | None, int, list[float]]]] = {n: [] for n in names}
    cpu = dict.fromkeys(names, 0.0)
    evals = 0
    for i, (label, seed, inc) in enumerate(runs):
        t0 = time.monotonic()
        data = run_data(seed, inc, args.ticks, benign=not args.no_benign)
        for gpu, xs in data.items():
            evals += len(xs)
            for name in names:
                s, c = stream_scores(name, xs)
                scores[name].append((label, inc, gpu, s))
                cpu[name] += c
        where = "" if inc is None else f" gpu {inc.gpu} at {inc.start_tick}"
        log(f"run {i + 1}/{len(runs)} ({label}{where}) {time.monotonic() - t0:.1f} s")
    thresholds: dict[str, float] = {}
    cal_hours = args.calibration_runs * 2 * args.ticks * INTERVAL / 3600
    for name in names:
        thresholds[name] = 0.5
        if name in CALIBRATED:
            thresholds[name] = calibrate([s for label, _, _, s in scores[name] if label == "calibration"],
                                         WARMUP, args.target_fp * cal_hours)  # fmt: skip
    rows: list[list[str]] = []
    summary: dict[str, Any] = {}
    free_hours = args.free_runs * 2 * args.ticks * INTERVAL / 3600
    streams: dict[str, list[tuple[str, Incident | None, int, list[bool]]]] = {}
    for name in names:
        debounce = 1 if name.startswith("rules") else 2
        streams[name] = [
            (lb, inc, g, alarms(s, thresholds[name], debounce, WARMUP)) for lb, inc, g, s in scores[name]
        ]
    # What a sidecar would run: the rules, or-ed with one score.
    for score in ("ewma", "hst"):
        if "rules:all" in streams and score in streams:
            both = zip(streams["rules:all"], streams[score], strict=True)
            streams[f"rules:all + {score}"] = [
                (lb, inc, g, [x or y for x, y in zip(a, b, strict=True)]) for (lb, inc, g, a), (*_, b) in both
            ]
            thresholds[f"rules:all + {score}"] = thresholds[score]
            cpu[f"rules:all + {score}"] = cpu["rules:all"] + cpu[score]
    for name, per_stream in streams.items():
        fp_free = 0
        per_kind: dict[str, dict[str, Any]] = {
            k: {"tp": 0, "fp": 0, "hit": 0, "n": 0, "delays": [], "fp_where": []} for k in KINDS
        }
        for label, inc, gpu, alarm in per_stream:
            starts = events(alarm)
            if label == "free":
                fp_free += len(starts)
            elif inc is not None:
                k = per_kind[label]
                lo, hi = inc.start_tick, inc.end_tick + GRACE
                hits = [t for t in starts if gpu == inc.gpu and lo <= t < hi]
                k["tp"] += len(hits)
                k["fp"] += len(starts) - len(hits)
                k["fp_where"] += [
                    "other gpu" if gpu != inc.gpu else "before" if t < lo else "after"
                    for t in starts
                    if t not in hits
                ]
                if gpu == inc.gpu:
                    k["n"] += 1
                    if hits:
                        k["hit"] += 1
                        k["delays"].append((hits[0] - lo) * INTERVAL)
        for kind, k in per_kind.items():
            n_events = k["tp"] + k["fp"]
            prec = k["tp"] / n_events if n_events else math.nan
            rows.append([name, kind, f"{prec:.2f}", f"{k['hit']}/{k['n']}",
                         f"{pct(k['delays'], 0.5):.0f}", f"{pct(k['delays'], 0.95):.0f}"])  # fmt: skip
        summary[name] = {
            "threshold": thresholds[name],
            "fp_per_gpu_hour": fp_free / free_hours if free_hours else math.nan,
            "us_per_eval": 1e6 * cpu[name] / evals,
            "kinds": per_kind,
        }
    text = table(["detector", "incident", "precision", "recall", "delay p50 s", "delay p95 s"], rows)

    def where(n: str) -> str:
        places = [w for k in summary[n]["kinds"].values() for w in k["fp_where"]]
        return " / ".join(str(places.count(w)) for w in ("other gpu", "before", "after"))

    text += "\n" + table(
        ["detector", "threshold", "false events / GPU-hour (incident-free)",
         "false events in incident runs: other GPU / before / after", "CPU µs / eval (bench)"],
        [[n, f"{summary[n]['threshold']:.3g}", f"{summary[n]['fp_per_gpu_hour']:.2f}", where(n),
          f"{summary[n]['us_per_eval']:.0f}"] for n in summary],
    )  # fmt: skip
    text += (
        f"\n{args.runs_per_kind} runs per incident kind, {args.free_runs} incident-free runs "
        f"({free_hours:.0f} GPU-hours), {args.calibration_runs} calibration runs (thresholds for "
        f"{args.target_fp} false events / GPU-hour); {args.ticks} scrapes of "
        f"{INTERVAL:.0f} s per run, 2 GPUs. Precision: events on the incident GPU within its window (+"
        f"{GRACE * INTERVAL:.0f} s) over all events of those runs.\n"
    )
    return text, summary


# --- any vendor: the product's detector (edge_relay.anomaly.detector) on that vendor's exporter -------------

# The exporters scraped per vendor (Kepler only where it has GPU series: it reads GPUs through NVML).
VENDOR_EXPORTERS = {"nvidia": ("dcgm", "kepler"), "amd": ("amd",), "intel": ("intel",), "jetson": ("jetson",)}
VENDOR_PRESET = {"nvidia": "dcgm", "amd": "amd", "intel": "intel", "jetson": "jetson"}
# Incident kinds without their fault's signal on a vendor's exporter (simulator.incidents): XID is
# NVIDIA's; the XID burst moves AMD's ECC counts too (measured there), Intel's and Jetson's exporters show
# only the application dying (utilisation, power, memory to idle: what a job ending looks like).
NOT_APPLICABLE = {"nvidia": (), "amd": (), "intel": ("xid",), "jetson": ("xid",)}
PRODUCT_DETECTORS = ("product", "product:rules", "product:ewma")
T0_MS = 1_800_000_000_000
# (preset, metric, label, value) giving a GPU's total memory in the exporter's unit (dcgm: the sum).
_TOTALS = {
    "amd": ("gpu_total_vram", None, None),
    "intel": ("hw_memory_size_bytes", None, None),
    "jetson": ("ram_kB", "statistic", "total"),
}


class VendorDay:
    """``OrdinaryDay`` for any exporter, on its raw samples: the same sensor noise and benign load
    steps, in the exporter's units and scaled by its chip's limits (``simulator.incidents.CHIPS``):
    utilisation +-2 % and steps of +-30 % (one every ~15 min, 2-20 min long); power follows utilisation
    (80 % of limit - idle per 100 %), +-1.5 %; temperatures +18 °C per limit's worth of extra power (the
    A100's 6 °C per 100 W) with a 60 s time constant, +-0.4 °C; half the steps load or drop 2.5-15 % of
    the memory (the A100's 2-12 GB; a load that would take it over 90 % is not taken), +-0.02 %; clock
    +-0.57 %. The series moved are those the
    simulator's incidents move (``simulator.incidents``' roles: all of a GPU's power series move alike)."""

    def __init__(self, rng: random.Random, ticks: int, chip: Any) -> None:
        self.rng, self.chip = rng, chip
        self.steps: list[tuple[int, int, float, float]] = []  # start, end, util delta, memory share
        t = 0
        while True:
            t += int(rng.expovariate(1 / 180))
            if t >= ticks:
                break
            fb = rng.choice((0.0, rng.uniform(0.025, 0.15) * rng.choice((-1, 1))))
            self.steps.append((t, t + rng.randint(24, 240), rng.uniform(-30, 30), fb))
        self.temp_offset = 0.0
        self.now = (0.0, 0.0, 0.0, 0.0, 0.0)

    def begin(self, tick: int, raw_util: float | None, used_share: float | None = None) -> None:
        """This tick's deltas (``raw_util`` in %; None: the exporter has no utilisation, e.g. Jetson).
        A memory step that would take the memory used (``used_share`` of the total) over 90 % is not
        taken: a model does not load into memory another job holds (vLLM reserves 90 % by default)."""
        rng, du, dfb = self.rng, 0.0, 0.0
        for start, end, u, fb in self.steps:
            if start <= tick < end:
                du, dfb = du + u, dfb + fb
        if dfb > 0 and used_share is not None and used_share + dfb > 0.9:
            dfb = 0.0
        noise = rng.gauss(0, 2)
        dutil = du + noise if raw_util is None else min(100.0, max(0.0, raw_util + du + noise)) - raw_util
        c = self.chip
        dpower = dutil / 100 * 0.8 * (c.power_limit - c.power_idle)  # W
        self.temp_offset += (18.0 * dpower / c.power_limit - self.temp_offset) * (
            1 - math.exp(-INTERVAL / 60)
        )
        self.now = (dutil, dpower, rng.gauss(0, 0.015), self.temp_offset, dfb)

    def apply(self, role: int, v: float, total: float | None) -> float:
        from simulator import incidents as si

        rng, c = self.rng, self.chip
        dutil, dpower, pnoise, toff, dfb = self.now
        if role == si.UTIL:
            return min(c.util_full, max(0.0, v + dutil * c.util_full / 100))
        if role in (si.POWER, si.K_WATTS):
            ps = c.power_scale
            return min(
                c.power_limit * 1.03 * ps, max(0.3 * c.power_idle * ps, (v + dpower * ps) * (1 + pnoise))
            )
        if role in (si.TEMP, si.MEM_TEMP):
            return min(100.0, v + toff + rng.gauss(0, 0.4))
        if role in (si.FB_USED, si.FB_FREE) and total:
            d = dfb * total + rng.gauss(0, 0.0002 * total)
            return min(total, max(0.0, v + d if role == si.FB_USED else v - d))
        if role == si.CLOCK:
            return v * (1 + rng.gauss(0, 0.0057))
        return v


# What the product's detector saw per scrape, captured around ``_Gpu.evaluate`` (bench only).
_CAPTURED: dict[str, tuple[list[tuple[str, str]], float]] = {}


def _capture_evaluate() -> None:
    from edge_relay.anomaly import detector as anomaly

    if getattr(anomaly._Gpu.evaluate, "bench_capture", False):
        return
    original = anomaly._Gpu.evaluate

    def evaluate(self: Any, ts: int, x: dict[str, float], fired: list[tuple[str, str]], cfg: Any) -> None:
        original(self, ts, x, fired, cfg)
        _CAPTURED[self.key] = (list(fired), self.score)

    evaluate.bench_capture = True  # type: ignore[attr-defined]
    anomaly._Gpu.evaluate = evaluate  # type: ignore[method-assign]


def product_config(vendor: str, overrides: dict[str, float | None], score_threshold: float | None) -> Any:
    """The relay's default ``anomaly:`` config for ``vendor``'s preset, with the bench's overrides of
    that vendor's thresholds (``--threshold``) and score threshold."""
    import dataclasses

    from edge_relay.anomaly.detector import AnomalyConfig
    from edge_relay.anomaly.signals import DEFAULT_THRESHOLDS

    preset = VENDOR_PRESET[vendor]
    th = dict(DEFAULT_THRESHOLDS)
    th[preset] = dataclasses.replace(th[preset], **overrides)
    cfg = AnomalyConfig(presets=(preset,), thresholds=th)
    if score_threshold is not None:
        cfg = dataclasses.replace(cfg, score_threshold=score_threshold)
    # One event per firing scrape (the bench merges them into events itself, as for the other detectors).
    return dataclasses.replace(cfg, pre_seconds=0.0, post_seconds=0.001, max_windows=10**6)


def product_run(
    vendor: str, seed: int, incident: Incident | None, ticks: int, benign: bool, cfg: Any
) -> tuple[dict[int, list[list[tuple[str, str]]]], dict[int, list[float]]]:
    """One run of ``vendor``'s node scraped as the relay does (parse + ``TargetShaper``), the ordinary
    day applied to the raw samples, fed to the product's ``Detector``: per simulator GPU and scrape, the
    rules that fired ((kind, rule), the EWMA score's as ("score", ...)) and the EWMA score."""
    from edge_relay.anomaly.detector import Detector
    from edge_relay.anomaly.signals import gpu_key, vendor_of
    from edge_relay.collect.parse import parse as parse_exposition
    from edge_relay.collect.shape import TargetShaper
    from simulator import incidents as si

    _capture_evaluate()
    exporters = VENDOR_EXPORTERS[vendor]
    sim = Simulator(
        seed, exporters=exporters, incidents=[incident] if incident else [], dcgm_health_fields=True,
        kepler_gpu=vendor == "nvidia",
    )  # fmt: skip
    shapers = {e: TargetShaper(e, {"job": e, "instance": e}, {}) for e in exporters}
    det = Detector(cfg, INTERVAL)
    order: dict[str, list[str]] = {}
    info: dict[Any, tuple[int | None, int | None]] = {}  # labels -> (simulator GPU, role)
    key_gpu: dict[str, int] = {}  # the product's GPU key -> the simulator's GPU
    totals: dict[int, float] = {}
    days: dict[int, VendorDay] = {}
    fired: dict[int, list[list[tuple[str, str]]]] = {}
    scores: dict[int, list[float]] = {}
    for tick in range(ticks):
        ts = T0_MS + round(tick * INTERVAL * 1000)
        scrapes = []
        for e in exporters:
            samples = parse_exposition(sim.render(e, tick))
            if tick == 0 and e in ("amd", "intel"):
                key = "gpu_id" if e == "amd" else "pci_bdf"
                order[e] = sorted({v for ls, _, _ in samples for k, v in ls if k == key})
            scrapes.append((e, shapers[e].shape(ts, samples, 0.01)))
        if tick == 0:
            sums: dict[int, float] = {}
            for e, sc in scrapes:
                for labels, v in zip(sc.labels, sc.values, strict=True):
                    d = dict(labels)
                    g = _sim_gpu(e, d, order)
                    name = d["__name__"]
                    if g is None:
                        continue
                    if e == "dcgm" and name in (
                        "DCGM_FI_DEV_FB_USED",
                        "DCGM_FI_DEV_FB_FREE",
                        "DCGM_FI_DEV_FB_RESERVED",
                    ):
                        sums[g] = sums.get(g, 0.0) + v
                    t = _TOTALS.get(e)
                    if t and name == t[0] and (t[1] is None or d.get(t[1]) == t[2]):
                        totals[g] = v
            totals.update(sums)
            gpus = sorted(set(totals) | {0})
            days = {g: VendorDay(random.Random(f"day:{seed}:{g}"), ticks if benign else 0, si.CHIPS[
                VENDOR_PRESET[vendor]]) for g in gpus}  # fmt: skip
        raw_util: dict[int, float] = {}
        raw_used: dict[int, float] = {}
        for e, sc in scrapes:
            roles = si._ROLE_OF[e]
            for i, labels in enumerate(sc.labels):
                got = info.get(labels)
                if got is None:
                    d = dict(labels)
                    g = _sim_gpu(e, d, order)
                    role = None if g is None else roles(d["__name__"], d)
                    got = info[labels] = (g, role)
                    owner = vendor_of(d["__name__"])
                    if g is not None and owner is not None:
                        k = gpu_key(owner, labels)
                        if k is not None:
                            key_gpu.setdefault(f"{owner}:{k}", g)
                g, role = got
                v = sc.values[i]
                if g is None or v != v:
                    continue
                if role == si.UTIL and g not in raw_util:
                    raw_util[g] = v * 100 / si.CHIPS[VENDOR_PRESET[vendor]].util_full
                elif role == si.FB_USED and g not in raw_used and totals.get(g):
                    raw_used[g] = v / totals[g]
        for g, day in days.items():
            day.begin(tick, raw_util.get(g), raw_used.get(g))
        for _, sc in scrapes:
            for i, labels in enumerate(sc.labels):
                g, role = info[labels]
                v = sc.values[i]
                if g is not None and role is not None and g in days and v == v:  # not a stale marker
                    sc.values[i] = days[g].apply(role, v, totals.get(g))
        _CAPTURED.clear()
        det.observe([sc for _, sc in scrapes], ts)
        for g in days:
            fired.setdefault(g, []).append([])
            scores.setdefault(g, []).append(0.0)
        for k, (f, score) in _CAPTURED.items():
            g = key_gpu.get(k)
            if g is not None and g in days:
                fired[g][-1] += f
                scores[g][-1] = max(scores[g][-1], score)
    return fired, scores


def _sim_gpu(exporter: str, d: dict[str, str], order: dict[str, list[str]]) -> int | None:
    """The simulator's GPU index of a series (its incidents' ``gpu``), as ``simulator.incidents``."""
    if exporter == "dcgm":
        return int(d["gpu"]) if "gpu" in d else None
    if exporter == "kepler":
        return int(d["gpu"]) if d["__name__"] == "kepler_node_gpu_watts" and "gpu" in d else None
    if exporter in ("amd", "intel"):
        v = d.get("gpu_id" if exporter == "amd" else "pci_bdf")
        return order[exporter].index(v) if v in order.get(exporter, ()) else None
    return 0  # jetson: one GPU


def evaluate_product(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The product's detector (``edge_relay.anomaly.detector``, the vendor's preset with the relay's defaults)
    over ``args.vendor``'s exporter: incident runs per kind (those with a signal there) and incident-free
    runs; per kind precision, recall, delays, false events; which rules fired."""
    vendor = args.vendor
    overrides = dict(args.threshold or {})
    cfg = product_config(vendor, overrides, args.score_threshold)
    n_gpus = 1 if vendor == "jetson" else 2
    runs = labelled_runs(args, skip=NOT_APPLICABLE[vendor], gpus=n_gpus)
    streams: list[tuple[str, Incident | None, int, list[list[tuple[str, str]]], list[float]]] = []
    t_all = time.monotonic()
    for i, (label, seed, inc) in enumerate(runs):
        t0 = time.monotonic()
        fired, scores = product_run(vendor, seed, inc, args.ticks, not args.no_benign, cfg)
        for g in sorted(fired):
            streams.append((label, inc, g, fired[g], scores[g]))
        where = "" if inc is None else f" gpu {inc.gpu} at {inc.start_tick}"
        log(f"run {i + 1}/{len(runs)} ({label}{where}) {time.monotonic() - t0:.1f} s")
    elapsed = time.monotonic() - t_all
    hours = args.ticks * INTERVAL / 3600
    thr = cfg.score_threshold
    calibrated = math.nan
    if args.calibration_runs:
        cal = [s for lb, _, _, _, s in streams if lb == "calibration"]
        calibrated = calibrate(cal, WARMUP, args.target_fp * args.calibration_runs * n_gpus * hours)

    def alarm_streams(
        threshold: float,
    ) -> dict[str, list[tuple[str, Incident | None, int, list[bool], list[str]]]]:
        out: dict[str, list[Any]] = {n: [] for n in PRODUCT_DETECTORS}
        for lb, inc, g, f, s in streams:
            if threshold == thr:  # the product's own debounced score rule
                ew = [t >= WARMUP and any(k == "score" for k, _ in x) for t, x in enumerate(f)]
            else:  # the same rule at another threshold, from the captured scores
                ew = alarms(s, threshold, SCORE_DEBOUNCE_PRODUCT, WARMUP)
            rules = [bool(x) and any(k != "score" for k, _ in x) and t >= WARMUP for t, x in enumerate(f)]
            why = [",".join(sorted({r for k, r in x if k != "score"})) for x in f]
            why_e = [
                w + ("," if w and e else "") + (f"ewma>{threshold:g}" if e else "")
                for w, e in zip(why, ew, strict=True)
            ]
            out["product:rules"].append((lb, inc, g, rules, why))
            out["product:ewma"].append((lb, inc, g, ew, [f"ewma>{threshold:g}" if e else "" for e in ew]))
            out["product"].append((lb, inc, g, [a or b for a, b in zip(rules, ew, strict=True)], why_e))
        return out

    text = ""
    summary: dict[str, Any] = {"vendor": vendor, "preset": VENDOR_PRESET[vendor], "score_threshold": thr,
                               "calibrated_score_threshold": calibrated, "thresholds": overrides,
                               "not_applicable": list(NOT_APPLICABLE[vendor]), "detectors": {}}  # fmt: skip
    thresholds = [thr] + ([calibrated] if args.calibration_runs and not math.isnan(calibrated) else [])
    for threshold in thresholds:
        per = alarm_streams(threshold)
        rows, rows2, why_rows = [], [], []
        for name, st in per.items():
            tag = name if threshold == thr else f"{name} (ewma at calibrated {threshold:.3g})"
            if threshold != thr and name == "product:rules":
                continue
            fp_free, free_hours = 0, 0.0
            free_rules: dict[str, int] = {}
            kinds = {k: {"tp": 0, "fp": 0, "hit": 0, "n": 0, "delays": [], "hours": 0.0, "first": {},
                         "fp_rules": {}, "masked": 0} for k in KINDS}  # fmt: skip
            for lb, inc, g, alarm, why in st:
                starts = events(alarm)
                if lb == "free":
                    fp_free += len(starts)
                    free_hours += hours
                    for t in starts:
                        free_rules[why[t]] = free_rules.get(why[t], 0) + 1
                elif inc is not None:
                    k = kinds[lb]
                    k["hours"] += hours
                    lo, hi = inc.start_tick, inc.end_tick + GRACE
                    hits = [t for t in starts if g == inc.gpu and lo <= t < hi]
                    k["tp"] += len(hits)
                    k["fp"] += len(starts) - len(hits)
                    for t in starts:
                        if t not in hits:
                            k["fp_rules"][why[t]] = k["fp_rules"].get(why[t], 0) + 1
                    if g == inc.gpu:
                        k["n"] += 1
                        if hits:
                            k["hit"] += 1
                            k["delays"].append((hits[0] - lo) * INTERVAL)
                            k["first"][why[hits[0]]] = k["first"].get(why[hits[0]], 0) + 1
                        elif any(alarm[max(0, lo - REFRACTORY) : lo]) and any(alarm[lo:hi]):
                            k["masked"] += 1  # an alarm already going on the GPU: no new onset
            for kind, k in kinds.items():
                if kind in NOT_APPLICABLE[vendor]:
                    rows.append([tag, kind, "n/a", "n/a (no signal)", "–", "–", "–"])
                    continue
                n_ev = k["tp"] + k["fp"]
                prec = f"{k['tp'] / n_ev:.2f}" if n_ev else "–"
                fph = f"{k['fp'] / k['hours']:.2f}" if k["hours"] else "–"
                p50, p95 = (f"{pct(k['delays'], q):.0f}" if k["delays"] else "–" for q in (0.5, 0.95))
                masked = f" ({k['masked']} masked)" if k["masked"] else ""
                rows.append([tag, kind, prec, f"{k['hit']}/{k['n']}{masked}", p50, p95, fph])
                if name == "product" and threshold == thr:
                    why_rows.append([kind, _counts(k["first"]) or "–", _counts(k["fp_rules"]) or "–"])
            rows2.append(
                [tag, f"{fp_free / free_hours:.2f}" if free_hours else "–", _counts(free_rules) or "–"]
            )
            summary["detectors"][tag] = {"fp_per_gpu_hour_free": fp_free / free_hours if free_hours else None,
                                         "false_event_rules_free": free_rules, "kinds": kinds}  # fmt: skip
        text += table(["detector", "incident", "precision", "recall", "delay p50 s", "delay p95 s",
                       "false events / GPU-hour (incident runs)"], rows)  # fmt: skip
        text += "\n" + table(["detector", "false events / GPU-hour (incident-free)", "their rules"], rows2)
        if why_rows:
            text += "\n" + table(
                ["incident", "rules at the detection (runs)", "rules of the false events"], why_rows
            )
        text += "\n"
    free_gpu_hours = args.free_runs * n_gpus * hours
    na = ", ".join(NOT_APPLICABLE[vendor]) or "none"
    changed = "" if not overrides else " but " + ", ".join(f"{k}={v}" for k, v in overrides.items())
    exps = ", ".join(VENDOR_EXPORTERS[vendor])
    text += (
        f"Vendor `{vendor}` (exporters {exps}; preset `{VENDOR_PRESET[vendor]}`, "
        f"the relay's defaults{changed}"
        f", EWMA score threshold {thr:g}); {args.runs_per_kind} runs per incident kind "
        f"(not applicable: {na}), "
        f"{args.free_runs} incident-free runs ({free_gpu_hours:.3g} GPU-hours)"
        + (f", {args.calibration_runs} calibration runs (EWMA threshold for {args.target_fp} false events / "
           f"GPU-hour: {calibrated:.3g})" if args.calibration_runs else "")
        + f"; {args.ticks} scrapes of {INTERVAL:.0f} s per run, {n_gpus} GPU(s)"
        + ("" if not args.no_benign else ", no benign load steps")
        + f". Precision: events on the incident GPU within its window (+{GRACE * INTERVAL:.0f} s) over all "
        f"events of those runs; alarms within a minute are one event; a *masked* miss: an alarm was already "
        f"going on the GPU when the incident began (no new onset; the relay's open window holds it). "
        f"Detector time {elapsed / 60:.1f} min.\n"
    )  # fmt: skip
    return text, summary


SCORE_DEBOUNCE_PRODUCT = 2  # edge_relay.anomaly.signals.SCORE_DEBOUNCE


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k or '?'} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


# --- edge cost ----------------------------------------------------------------------------------

_RSS_PROBE = """
import json, runpy, time, types
def status():
    d = {{}}
    for line in open('/proc/self/status'):
        k, _, v = line.partition(':')
        if k in ('VmRSS', 'VmHWM'):
            d[k] = int(v.split()[0])
    return d
ab = types.SimpleNamespace(**runpy.run_path({bench!r}, run_name="anomaly_bench"))  # a script, not a module
before = status()
det = ab.DETECTORS[{name!r}]()
xs = [{{s: 50.0 + (i % 17) for s in ab.SIGNALS}} | {{'xid': 0.0, 'throttle': 0.0, 'rows': 0.0, 'ecc': 0.0}}
      for i in range(840)]
if isinstance(det, ab.IForest):
    det.scores(xs[:720])
    row = [[xs[0][s] for s in ab.SIGNALS]]
    t0 = time.perf_counter(); n = 300
    for _ in range(n):
        det.model.score_samples(row)
    single = (time.perf_counter() - t0) / n
    t0 = time.perf_counter(); det.model = det.make().fit(list(det.hist)); refit = time.perf_counter() - t0
    us = 1e6 * (single + refit / det.every)
else:
    for x in xs[:720]:
        det.score(x)
    t0 = time.perf_counter()
    for x in xs[720:]:
        det.score(x)
    us = 1e6 * (time.perf_counter() - t0) / 120
after = status()
print(json.dumps({{'rss_kb': after['VmRSS'] - before['VmRSS'], 'hwm_kb': after['VmHWM'] - before['VmHWM'],
                  'us': us}}))
"""

DEPENDENCIES = {
    "hst": ["river", "numpy", "scipy", "narwhals"],
    "iforest": ["scikit-learn", "numpy", "scipy", "joblib", "threadpoolctl", "narwhals"],
}


def installed_mb(dists: Sequence[str]) -> float:
    """Size of the distributions' installed files (their RECORD: site-packages dirs, .libs, metadata)."""
    total = 0
    for dist in dists:
        for f in importlib.metadata.distribution(dist).files or []:
            path = Path(str(f.locate()))
            if path.is_file():
                total += path.stat().st_size
    return total / 1e6


def edge_cost(names: Sequence[str]) -> str:
    rows = []
    for name in names:
        probe = _RSS_PROBE.format(bench=str(Path(__file__).resolve()), name=name)
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            rows.append([name, "error", "", "", out.stderr.strip().splitlines()[-1]])
            continue
        r = json.loads(out.stdout)
        deps = DEPENDENCIES.get(name, [])
        size = f"{installed_mb(deps):.0f} ({', '.join(deps)})" if deps else "0 (stdlib only)"
        rows.append([name, f"{r['us']:.0f}", f"{r['rss_kb'] / 1024:.1f}", f"{r['hwm_kb'] / 1024:.1f}", size])
    headers = ["detector", "CPU µs / eval (steady)", "RSS added MiB", "peak RSS added MiB", "install MB"]
    return table(headers, rows)


# --- report -------------------------------------------------------------------------------------


# --- real telemetry: the H200 trace served as dcgm-exporter pages ------------------------------------


def evaluate_real(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """False events per GPU-hour with the relay's defaults on the real trace, and recall / time to
    detect of incidents injected on top of it, at 1 s and 5 s scrapes."""
    from edge_relay.anomaly.detector import AnomalyConfig

    trace = RealTrace()
    defaults = AnomalyConfig(presets=("dcgm",))
    # One event per firing scrape (a window per detection would hide the incident behind an earlier one).
    per_scrape = dataclasses.replace(defaults, pre_seconds=0.0, post_seconds=0.001, max_windows=10**6)
    summary: dict[str, Any] = {"false": {}, "recall": {}}
    text = (
        f"Real telemetry: `simulator/data/{TRACE.name}` (an H200 under a training job, NVML every 0.5 s, "
        f"{trace.period:.0f} s looped), served as dcgm-exporter 4.x pages with its default fields"
        f"{' and the clock event reasons' if args.health_fields else ''}, {REAL_GPUS} GPUs at offsets of "
        "a quarter of the trace, scraped and shaped as the relay does, through the relay's detector "
        "with the defaults (`anomaly: {}`).\n\n## False events on the real trace\n\n"
    )
    rows = []
    for interval in args.real_intervals:
        log(f"real trace, {interval:g} s scrapes: {args.real_hours:g} h x {REAL_GPUS} GPUs")
        windowed = [0]

        def count_windows(det: Any, ts: int, windowed: list[int] = windowed) -> None:
            windowed[0] += sum(1 for k in det.active_windows(ts) if k != "node")

        events, _ = replay_real(defaults, interval, args.real_hours * 3600, None, REAL_GPUS,
                                args.health_fields, trace, count_windows)  # fmt: skip
        firing, _ = replay_real(per_scrape, interval, args.real_hours * 3600, None, REAL_GPUS,
                                args.health_fields, trace)  # fmt: skip
        gpu_hours = args.real_hours * REAL_GPUS
        scrapes = gpu_hours * 3600 / interval
        rules: dict[str, int] = {}
        for ev in firing:
            rules[ev.rule] = rules.get(ev.rule, 0) + 1
        summary["false"][interval] = {"events": len(events), "gpu_hours": gpu_hours, "firing": len(firing),
                                      "windowed_share": windowed[0] / scrapes, "rules": rules}  # fmt: skip
        rows.append([f"{interval:g} s", f"{gpu_hours:g}", str(len(events)), f"{len(events) / gpu_hours:.2f}",
                     f"{100 * windowed[0] / scrapes:.0f} %", f"{100 * len(firing) / scrapes:.1f} %",
                     _counts(rules) or "-"])  # fmt: skip
    text += table(["scrape", "GPU-hours", "events", "per GPU-hour", "time windowed", "scrapes firing",
                   "rules fired"], rows)  # fmt: skip
    text += (
        "\n*Events*: what the relay raises (a window per event, extended while the rules keep firing, "
        "closed at `max_window_seconds`); *time windowed*: the share of GPU-scrapes sent at full "
        "resolution; *scrapes firing*: the share of scrapes where a rule or the score fired.\n"
    )
    text += (
        f"\n## Incidents injected on the real trace\n\n{args.real_runs} runs per kind and interval, each "
        f"{args.real_minutes:g} min, the incident ({args.real_incident_s:g} s) on GPU run % {REAL_GPUS} at a "
        "random time after 4 min; caught: the first detection on that GPU within the incident (+30 s); "
        "other: detections on the other GPUs or outside it.\n\n"
    )
    rows = []
    rng = random.Random(args.seed)
    for interval in args.real_intervals:
        for kind in REAL_KINDS:
            delays: list[float] = []
            other = 0
            rules = {}
            for run in range(args.real_runs):
                start = rng.uniform(240, args.real_minutes * 60 - args.real_incident_s - 30)
                inc = RealIncident(kind, run % REAL_GPUS, start, args.real_incident_s)
                events, _ = replay_real(per_scrape, interval, args.real_minutes * 60, inc, REAL_GPUS,
                                        args.health_fields, trace)  # fmt: skip
                hit = None
                gpu = f"dcgm:{inc.gpu}"
                for ev in events:
                    t = (ev.at_ms - T0_MS) / 1000
                    if ev.gpu == gpu and start <= t <= start + args.real_incident_s + 30:
                        if hit is None:
                            hit = t - start
                            rules[ev.rule] = rules.get(ev.rule, 0) + 1
                    else:
                        other += 1
                if hit is not None:
                    delays.append(hit)
            summary["recall"][f"{kind}@{interval:g}"] = {"caught": len(delays), "runs": args.real_runs,
                                                         "delays": delays, "other": other}  # fmt: skip
            rows.append([
                kind, f"{interval:g} s", f"{len(delays)}/{args.real_runs}",
                f"{pct(delays, 0.5):.1f}" if delays else "-", f"{max(delays):.1f}" if delays else "-",
                str(other), _counts(rules) or "-",
            ])  # fmt: skip
    text += table(
        ["incident", "scrape", "caught", "median s to detect", "max s", "other", "first rule"], rows
    )
    return text, summary


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs-per-kind", type=int, default=16)
    p.add_argument("--free-runs", type=int, default=16)
    p.add_argument("--calibration-runs", type=int, default=8)
    p.add_argument("--ticks", type=int, default=720, help="scrapes per run (default 720: 1 h at 5 s)")
    p.add_argument("--seed", type=int, default=14)
    p.add_argument(
        "--target-fp",
        type=float,
        default=0.25,
        help="false events per GPU-hour the statistical detectors' thresholds are calibrated to (0.25)",
    )
    p.add_argument(
        "--vendor",
        choices=list(VENDOR_EXPORTERS),
        default="nvidia",
        help="whose GPU exporter to scrape (default nvidia: dcgm-exporter and Kepler, every detector); "
        "amd / intel / jetson run the product's detector (`product`) on that vendor's exporter",
    )
    p.add_argument(
        "--detectors",
        nargs="+",
        default=None,
        choices=[*DETECTORS, "product"],
        help="default: all of the bench's detectors on nvidia, `product` on the other vendors; `product` is "
        "edge_relay.anomaly.detector's detector (the vendor preset's rules or-ed with the EWMA score, "
        "relay defaults)",
    )
    p.add_argument(
        "--threshold",
        action="append",
        type=_threshold_arg,
        metavar="KEY=VALUE",
        help="product: override one of the vendor preset's thresholds "
        "(edge_relay.anomaly.signals.Thresholds, e.g. power_limit=180, power_fraction=0.99; "
        "`none` turns a rule off); repeatable",
    )
    p.add_argument("--score-threshold", type=float, default=None, help="product: the EWMA score threshold")
    p.add_argument("--quick", action="store_true", help="2 runs per kind, 3 free, 2 calibration")
    p.add_argument("--no-benign", action="store_true", help="sensor noise only, no benign load steps")
    p.add_argument(
        "--real",
        action="store_true",
        help="replay the real H200 trace (simulator/data) as dcgm-exporter pages through the relay's "
        "detector: "
        "false events per GPU-hour with the defaults, recall of incidents injected on top of it",
    )
    p.add_argument(
        "--real-hours", type=float, default=2.0, help="--real: hours per GPU of the false-event run"
    )
    p.add_argument("--real-runs", type=int, default=8, help="--real: runs per incident kind and interval")
    p.add_argument("--real-minutes", type=float, default=12.0, help="--real: minutes per incident run")
    p.add_argument("--real-incident-s", type=float, default=180.0, help="--real: incident length (s)")
    p.add_argument(
        "--real-intervals", type=float, nargs="+", default=[1.0, 5.0], help="--real: scrape intervals"
    )
    p.add_argument(
        "--health-fields",
        action="store_true",
        help="--real: serve DCGM_FI_DEV_CLOCK_THROTTLE_REASONS too (not a dcgm-exporter default field)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.runs_per_kind, args.free_runs, args.calibration_runs = 2, 3, 2
    if args.detectors is None:
        args.detectors = list(DETECTORS) if args.vendor == "nvidia" else ["product"]
    product = "product" in args.detectors
    if product and len(args.detectors) > 1:
        p.error("--detectors product runs alone")
    if not product and args.vendor != "nvidia":
        p.error(
            f"--vendor {args.vendor}: only the product's detector (`--detectors product`) reads its exporter"
        )
    if not product and (args.threshold or args.score_threshold is not None):
        p.error("--threshold / --score-threshold configure the product's detector (`--detectors product`)")
    args.threshold = dict(args.threshold or [])
    started = time.monotonic()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    if args.real:
        report = "# The relay's anomaly detector on real GPU telemetry\n\n"
        text, summary = evaluate_real(args)
        report += text
        name = f"{stamp}-anomaly-real"
    elif product:
        report = f"# The relay's anomaly detector on simulated GPU incidents: {args.vendor} (issue 14)\n\n"
        text, summary = evaluate_product(args)
        report += text
        name = f"{stamp}-anomaly-{args.vendor}"
    else:
        report = "# Anomaly detectors on simulated GPU incidents (issue 14)\n\n"
        text, summary = evaluate(args)
        report += text + "\n## Edge cost\n\n" + edge_cost(args.detectors)
        name = f"{stamp}-anomaly"
    report += f"\nBench wall time {(time.monotonic() - started) / 60:.1f} min; `{shlex.join(sys.argv)}`.\n"
    (RESULTS / f"{name}.md").write_text(report)
    (RESULTS / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str))
    print(report)
    log(f"written to bench/results/{name}.md")
    return 0


def _threshold_arg(text: str) -> tuple[str, float | None]:
    from edge_relay.anomaly.signals import THRESHOLD_KEYS

    key, sep, value = text.partition("=")
    if not sep or key not in THRESHOLD_KEYS:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE with KEY one of {', '.join(THRESHOLD_KEYS)}")
    if value.lower() in ("none", "null"):
        return key, None
    try:
        return key, float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{key}: {value!r} is not a number") from None


if __name__ == "__main__":
    sys.exit(main())
