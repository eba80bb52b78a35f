"""Anomaly detection on the raw scrapes, and the full-resolution windows a detection opens.

Runs per GPU, and per node, on every cycle's scrapes after ``TargetShaper`` and before
``BudgetRuntime.shape`` (the same scrapes the flight recorder keeps). Measured choice
(``docs/anomaly-detection.md``): the preset's **rules** (any increase of XID / ECC / remapped-row /
throttle-reason counters; temperature, power or memory over a threshold or rising faster than a slope)
or-ed with an **EWMA z-score** over the GPU's signals. Standard library only: the sidecar core must not
need river or scikit-learn. Which series a GPU exporter serves and how they read, its GPU label and
its GPU models' limits are its record's (``vendors``): ``edge_relay.anomaly.signals`` compiles the records'
readings and keeps the score; the node's own detector (node-exporter and Kepler's node power:
temperature, available memory, memory stalls, power; the same score) is ``edge_relay.anomaly.node``,
keyed ``node`` (``NODE_KEY``) where a GPU's key is ``vendor:label`` (the GPU exporter's record name).

On a detection the caller (``Relay``) gets an ``Event``; this module keeps the GPU's (or the node's)
window open until ``post_seconds`` after its last detection and exposes ``override``: the label sets of
the windowed GPUs' series (the node's: its ``node_*`` / ``kepler_node_*`` series, not the GPUs'), which
``BudgetShaper`` passes at full resolution (its cost per sample is unchanged for every other series:
one test of an empty set). The past part (``pre_seconds`` before the event) comes from the flight
recorder (``match`` gives the GPU's or the node's series): ``PastParts`` spools it through the sink at
``reserved_share`` of the allowed rate. Per scraped sample the detector costs ~0.2 us (a cached label
set -> GPU lookup; the simulator's 1,400 series in ~0.2 ms a cycle).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from edge_relay.anomaly.node import (
    NODE_KEY,
    SIGNAL_METRICS,
    NodeConfig,
    NodeState,
    is_node_series,
    node_score_threshold,
    parse_node_config,
)
from edge_relay.anomaly.signals import (
    DEFAULT_THRESHOLDS,
    READERS,
    SCORE_DEBOUNCE,
    THRESHOLD_KEYS,
    Ewma,
    Thresholds,
    gpu_key,
    vendor_of,
)
from relay_common.config import ConfigError
from schemas.model import Labels, metric_name
from vendors import kepler, registry
from vendors.record import ModelLimits

log = logging.getLogger("edge_relay.anomaly")

MAX_GPUS: Final = 64  # per node: label churn must not grow the state without bound
GPU_VENDORS: Final = tuple(registry.GPUS)  # the GPU exporters, in the registry's order


@dataclass(frozen=True, slots=True)
class AnomalyConfig:
    """The budget file's ``anomaly`` section."""

    enabled: bool = True
    presets: tuple[str, ...] = GPU_VENDORS
    score: str = "ewma"  # ewma | none
    score_threshold: float = 8.4  # the bench's busy-day calibration (0.25 false events / GPU-hour)
    pre_seconds: float = 120.0
    post_seconds: float = 300.0
    reserved_share: float = 0.2
    max_windows: int = 4
    # A window a steady condition keeps extending (a GPU that simply holds most of its memory) closes
    # after this long and stays closed while the condition lasts: it must not hold a max_windows slot,
    # and the raw samples it costs, for ever.
    max_window_seconds: float = 1800.0
    thresholds: Mapping[str, Thresholds] = field(default_factory=lambda: dict(DEFAULT_THRESHOLDS))
    node: NodeConfig = field(default_factory=NodeConfig)  # the node's own detector (anomaly.node)


def _error(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: invalid budget:\n  key `{key}`: {message}")


def parse_config(
    raw: Mapping[str, Any] | None, class_presets: Iterable[str], source: str
) -> AnomalyConfig | None:
    """``anomaly`` (already schema-checked) as ``AnomalyConfig``; None without the section (the relay
    then runs no detection at all, exactly as before it existed)."""
    if raw is None:
        return None
    implied = registry.PRESET_GPUS
    vendors = sorted({implied[p] for p in class_presets if p in implied}, key=GPU_VENDORS.index)
    presets = tuple(raw.get("presets") or vendors or GPU_VENDORS)
    pre, post = float(raw.get("pre_seconds", 120)), float(raw.get("post_seconds", 300))
    if pre + post <= 0:
        raise _error(source, "anomaly.post_seconds", "expected pre_seconds + post_seconds > 0 (a window)")
    share = float(raw.get("reserved_share", 0.2))
    if not 0 < share < 1:
        raise _error(source, "anomaly.reserved_share", f"expected a share in (0, 1), got {share:g}")
    overrides = raw.get("thresholds", {})
    thresholds: dict[str, Thresholds] = {}
    for vendor, base in DEFAULT_THRESHOLDS.items():
        values = {k: getattr(base, k) for k in THRESHOLD_KEYS}
        for k, v in overrides.items():
            values[k] = None if v is None else float(v)
        for k in ("power_fraction", "memory_fraction"):
            if not 0 < values[k] <= 1.5:  # type: ignore[operator]
                raise _error(
                    source, f"anomaly.thresholds.{k}", f"expected a fraction in (0, 1.5], got {values[k]}"
                )
        if values["slope_seconds"] is None or values["slope_seconds"] <= 0:
            raise _error(source, "anomaly.thresholds.slope_seconds", "expected a positive number of seconds")
        if values["gpu_temp_c"] is None or values["temp_slope_c"] is None:
            raise _error(source, "anomaly.thresholds", "gpu_temp_c and temp_slope_c cannot be null")
        thresholds[vendor] = Thresholds(**values)  # type: ignore[arg-type]
    return AnomalyConfig(
        enabled=bool(raw.get("enabled", True)),
        presets=presets,
        score=str(raw.get("score", "ewma")),
        score_threshold=float(raw.get("score_threshold", 8.4)),
        pre_seconds=pre,
        post_seconds=post,
        reserved_share=share,
        max_windows=int(raw.get("max_windows", 4)),
        max_window_seconds=float(raw.get("max_window_seconds", 1800)),
        thresholds=thresholds,
        node=parse_node_config(raw.get("node"), lambda key, message: _error(source, key, message)),
    )


def gpu_label(key: str) -> str:
    """A detector's key as the metrics' ``gpu`` label: the GPU's (``dcgm:1`` -> ``1``), ``node``."""
    return key.partition(":")[2] or key


@dataclass(slots=True)
class Event:
    """One detection: on which GPU (or the node), why, and the window it opens."""

    gpu: str  # vendor:key, e.g. dcgm:1; the node's detector: "node" (NODE_KEY)
    kind: str  # thermal | power | memory | xid | ecc | remap | throttle | score
    rule: str  # e.g. gpu_temp>=85, temp_slope, xid=94, throttle=0x20, ewma>8.4, node_temp_slope
    at_ms: int
    score: float
    window_end_ms: int
    opened: bool = True  # False: max_windows were open, no window for this one
    missing: str = ""  # what the recorder could not supply for the past part (set by the relay)

    @property
    def scope(self) -> str:
        """``node`` for the node's detector, ``gpu`` for a GPU's."""
        return "node" if self.gpu == NODE_KEY else "gpu"

    def describe(self) -> str:
        return f"gpu={self.gpu} kind={self.kind} rule={self.rule} at_ms={self.at_ms}"


# How a GPU works, for the rules and the score (docs/anomaly-detection.md, "Rules that know a GPU"):
BUSY_UTIL: Final = 60.0  # % utilisation at or over: under load
IDLE_UTIL: Final = 20.0  # % at or under: idle (in between: the state it was in)
LOAD_STEP_UTIL: Final = 25.0  # % points between two scrapes: the load changed
LOAD_STEP_POWER: Final = 0.3  # of the larger of two scrapes' power: the load changed
# After a load change the temperature settles for a minute or two: the score neither counts nor learns
# until then, and each load state (idle, busy) keeps its own baseline, so a job starting or stopping
# (utilisation, power, clocks and temperature all moving together) is never an anomaly.
SETTLE_SECONDS: Final = 120.0
# A temperature rise is explained (a job starting, not a fault) when the power (or the utilisation) over
# the last EXPLAIN_SECONDS is above what it was around the start of the rise: a GPU's die follows its
# power within seconds (the real H200: +16 °C in 3 s as a burst starts), so a rise the power does not
# show is heat that no longer leaves (cooling lost, a stuck fan, a blocked inlet).
EXPLAIN_SECONDS: Final = 5.0
EXPLAIN_POWER_RISE: Final = 1.15
EXPLAIN_UTIL_RISE: Final = 15.0
# The slope counts within this of the temperature limit: a burst heating a cool die by 10-16 °C (the real
# H200 at 36 -> 52 °C, its power sample lagging its temperature's at 5 s scrapes) is no fault yet.
SLOPE_MARGIN_C: Final = 25.0
# On 2 scrapes in a row: a burst sampled at its peak (its power sample lagging) is one scrape; heat that
# no longer leaves keeps rising.
SLOPE_SCRAPES: Final = 2
# Hardware slowdown without its throttle-reason field (not among dcgm-exporter's defaults): under load
# the clock at or under this share of the highest clock seen under load (HW slowdown cuts it by 2x or
# more; the SW power cap moved the real H200 between 1155 and 1965 MHz), on 2 scrapes.
SLOWDOWN_CLOCK_SHARE: Final = 0.5
# An unknown model's power limit is learned from what it draws under load: the highest power seen at or
# over BUSY_UTIL, times LEARN_MARGIN, once LEARN_SECONDS of data and LEARN_BUSY_SCRAPES busy scrapes.
LEARN_SECONDS: Final = 600.0
LEARN_BUSY_SCRAPES: Final = 12
LEARN_MARGIN: Final = 1.1
CLIMB_SECONDS: Final = 60.0  # the span of the memory climb (at least 13 scrapes)
MODEL_SCAN_CYCLES: Final = 3  # cycles the GPU's series are searched for the model label
HISTORY: Final = 96  # scrapes of (ts, temp, fb, power, util): the memory climb's minute at 1 s scrapes


class _Gpu:
    """One GPU's detector state and its series."""

    def __init__(self, key: str, vendor: str, th: Thresholds) -> None:
        self.key = key
        self.vendor = vendor
        self.th = th
        self.reader = READERS[vendor]
        record = registry.GPUS[vendor]
        self.pods = record.pods  # None: no workload series join this GPU
        self.model_label = record.model_label
        # The model's own limits: the record's default model where the exporter names none (Jetson), else
        # found from the model label in the first cycles; None: not (yet) known.
        self.limits: ModelLimits | None = record.default_limits if record.model_label is None else None
        self.model_scans = 0 if record.model_label is not None else MODEL_SCAN_CYCLES
        self.unknown_model: str | None = None  # the name served for a model the registry does not list
        self.prev_counters: dict[tuple[str, Labels], float] = {}
        self.prev_xid = 0.0
        self.prev_status: dict[Labels, float] = {}
        self.hist: deque[tuple[int, float, float, float, float]] = deque(maxlen=HISTORY)
        self.hot = self.capped = self.over_score = self.violating = 0
        self.ewmas: dict[str, Ewma] = {}  # per load state
        self.load_state = "any"  # idle | busy; "any" without a utilisation signal
        self.settled_ms = 0  # the score counts from then on
        self.last_util: float | None = None
        self.last_power: float | None = None
        self.first_ms: int | None = None
        self.learned_max = 0.0
        self.busy_scrapes = 0
        self.busy_clock = 0.0  # the highest clock seen under load
        self.slow = 0  # scrapes in a row with the clock cut under load
        self.sloping = 0  # scrapes in a row with an unexplained rise near the limit
        self.score = 0.0
        self.series: set[Labels] = set()
        self.window_end_ms = 0  # full resolution until then (0: no window)
        self.window_start_ms = 0  # the scrape that opened it
        # An event refused for max_windows, or a window closed at max_window_seconds: no new one while
        # it keeps firing.
        self.quiet_until_ms = 0

    @property
    def model_pending(self) -> bool:
        return self.model_scans < MODEL_SCAN_CYCLES

    def see_labels(self, labels: Labels) -> None:
        """Looks for the model label on one of the GPU's series (only while ``model_pending``)."""
        for k, v in labels:
            if k == self.model_label and v:
                found = registry.GPUS[self.vendor].model(v)
                self.limits = None if found is None else found[1]
                self.unknown_model = v if found is None else None
                self.model_scans = MODEL_SCAN_CYCLES
                return

    def power_limit(self, ts: int, served: float | None) -> float | None:
        """Configured, else served, else the model's data sheet, else (an unknown model) learned."""
        if self.th.power_limit:
            return self.th.power_limit
        if served:
            return served
        if self.limits is not None or self.model_label is None:
            return None if self.limits is None else self.limits.power_limit
        if (
            self.first_ms is not None
            and ts - self.first_ms >= LEARN_SECONDS * 1000
            and self.busy_scrapes >= LEARN_BUSY_SCRAPES
        ):
            return self.learned_max * LEARN_MARGIN
        return None

    def _temp_limits(self) -> tuple[float, float | None]:
        """The model's published temperatures where known and the thresholds are the vendor's defaults."""
        th, limits = self.th, self.limits
        base = DEFAULT_THRESHOLDS[self.vendor]
        gpu, mem = th.gpu_temp_c, th.memory_temp_c
        if limits is not None and limits.gpu_temp_c is not None and gpu == base.gpu_temp_c:
            gpu = limits.gpu_temp_c
        if limits is not None and limits.memory_temp_c is not None and mem == base.memory_temp_c:
            mem = limits.memory_temp_c
        return gpu, mem

    def _load_rose(self, ts: int, since: float) -> bool:
        """Whether the power (or the load) of the last seconds is above its level around ``since``."""
        span = EXPLAIN_SECONDS * 1000
        now_p: list[float] = []
        then_p: list[float] = []
        now_u: list[float] = []
        then_u: list[float] = []
        for s, _, _, p, u in self.hist:
            if s > ts - span:
                now_p.append(p)
                now_u.append(u)
            elif abs(s - since) <= span:
                then_p.append(p)
                then_u.append(u)
        now_p, then_p = [p for p in now_p if p == p], [p for p in then_p if p == p]
        if now_p and then_p and max(now_p) >= EXPLAIN_POWER_RISE * min(then_p):
            return True
        now_u, then_u = [u for u in now_u if u == u], [u for u in then_u if u == u]
        return bool(now_u and then_u and max(now_u) >= min(then_u) + EXPLAIN_UTIL_RISE)

    def _settle(self, ts: int, util: float | None, power: float | None) -> None:
        """Tracks the load state; a change of it (or a load step) restarts the score's settling time."""
        state = self.load_state
        if util is not None:
            if util >= BUSY_UTIL:
                state = "busy"
            elif util <= IDLE_UTIL or state == "any":
                state = "idle"
        step = (
            util is not None and self.last_util is not None and abs(util - self.last_util) >= LOAD_STEP_UTIL
        ) or (
            power is not None
            and self.last_power is not None
            and abs(power - self.last_power) >= LOAD_STEP_POWER * max(power, self.last_power)
        )
        if state != self.load_state or step:
            self.settled_ms = ts + round(SETTLE_SECONDS * 1000)
        self.load_state = state
        self.last_util, self.last_power = util, power

    def evaluate(
        self, ts: int, x: dict[str, float], fired: list[tuple[str, str]], cfg: AnomalyConfig
    ) -> None:
        th = self.th
        self.model_scans += 1
        if self.model_scans == MODEL_SCAN_CYCLES and self.limits is None and self.unknown_model is None:
            self.unknown_model = f"(no {self.model_label})"  # the exporter names no model: reported too
        if self.first_ms is None:
            self.first_ms = ts
        temp, mem_temp, power, fb = x.get("temp"), x.get("mem_temp"), x.get("power"), x.get("fb")
        util = x.get("util")
        gpu_temp_c, memory_temp_c = self._temp_limits()
        self.hot = self.hot + 1 if (temp is not None and temp >= gpu_temp_c) else 0
        if self.hot >= 2:
            fired.append(("thermal", f"gpu_temp>={gpu_temp_c:g}"))
        if mem_temp is not None and memory_temp_c is not None and mem_temp >= memory_temp_c:
            fired.append(("thermal", f"memory_temp>={memory_temp_c:g}"))
        limit = self.power_limit(ts, x.get("power_limit"))
        if power is not None and util is not None and util >= BUSY_UTIL:
            self.learned_max = max(self.learned_max, power)  # after the limit: a new high is compared first
            self.busy_scrapes += 1
        self.capped = (
            self.capped + 1 if (power is not None and limit and power >= th.power_fraction * limit) else 0
        )
        if self.capped >= 3:
            fired.append(("power", f"power>={th.power_fraction:g}xlimit"))
        clock = x.get("clock")
        busy = util is not None and util >= BUSY_UTIL
        slowed = (
            busy
            and clock is not None
            and self.busy_clock > 0
            and clock <= SLOWDOWN_CLOCK_SHARE * self.busy_clock
        )
        if busy:  # bursty work: the scrapes in between (idle, clocks up) neither count nor reset
            self.slow = self.slow + 1 if slowed else 0
        if slowed and self.slow >= 2:
            fired.append(("throttle", "clock_slowdown"))
        if busy and clock is not None:
            self.busy_clock = max(self.busy_clock, clock)
        # AMD: the share of time the GPU was held back (PPT, socket / HBM / VR thermal), for 3 scrapes.
        violation = x.get("violation")
        self.violating = self.violating + 1 if (violation is not None and violation >= 10) else 0
        if self.violating >= 3:
            fired.append(("throttle", "violation_residency>=10%"))
        total = x.get("fb_total")
        if total is None and fb is not None and "fb_free" in x:
            total = fb + x["fb_free"] + x.get("fb_reserved", 0.0)
        if fb is not None and total and fb >= th.memory_fraction * total:
            fired.append(("memory", f"memory>={th.memory_fraction:g}xtotal"))
        if temp is not None or fb is not None:
            nan = math.nan
            self.hist.append((ts, nan if temp is None else temp, nan if fb is None else fb,
                              nan if power is None else power, nan if util is None else util))  # fmt: skip
        h = self.hist
        if temp is not None and len(h) >= 2 and temp >= gpu_temp_c - SLOPE_MARGIN_C:
            # A rise over the last slope_seconds (+4.5 °C in 15 s) near the limit that no power or load rise
            # explains: a cooling fault heats a GPU whose work did not change; a job starting heats it
            # with its power.
            since = ts - th.slope_seconds * 1000
            old = None
            for s, t, *_ in reversed(h):  # newest first: the oldest reading within the span
                if s < since - 1:
                    break
                if t == t:
                    old = t
            rising = (
                old is not None
                and h[0][0] <= since + 1
                and temp - old >= th.temp_slope_c
                and not self._load_rose(ts, since)
            )
            self.sloping = self.sloping + 1 if rising else 0
            if self.sloping >= SLOPE_SCRAPES:
                fired.append(("thermal", "temp_slope"))
        else:
            self.sloping = 0
        start = ts - CLIMB_SECONDS * 1000
        if total and len(h) >= 13 and h[-1][2] - next(f for s, _, f, *_ in h if s >= start) >= 0.05 * total:
            # Memory used climbing steadily for a minute: >= 5 % of the total, 10 of 12 steps up, no step
            # over 40 % of the rise (a model loading is one or two jumps, a leak is steady).
            span = [f for s, _, f, *_ in h if s >= start]
            # 12 steps over the minute, whatever the scrape interval (at 1 s: every fifth scrape).
            last = [span[round(i * (len(span) - 1) / 12)] for i in range(13)] if len(span) >= 13 else []
            if last and all(f == f for f in last):
                steps = [b - a for a, b in itertools.pairwise(last)]
                rise = last[-1] - last[0]
                ups = sum(d > 0.001 * total for d in steps)
                if rise >= 0.05 * total and ups >= 10 and max(steps) <= 0.4 * rise:
                    fired.append(("memory", "memory_climb"))
        self._settle(ts, util, power)
        if cfg.score == "ewma":
            if ts >= self.settled_ms:
                ewma = self.ewmas.get(self.load_state)
                if ewma is None:
                    ewma = self.ewmas[self.load_state] = Ewma()
                self.score = ewma.score(x)
            else:
                self.score = 0.0  # settling after a load change: neither counted nor learned
            self.over_score = self.over_score + 1 if self.score > cfg.score_threshold else 0
            if self.over_score >= SCORE_DEBOUNCE:
                fired.append(("score", f"ewma>{cfg.score_threshold:g}"))


_POD: Final = "~pod"  # the label-set cache's mark for those
_NODE_HELD: Final = "~node"  # a node series no node signal reads: only its window holds it


def _pod_series(windowed: Sequence[_Gpu], workloads: Sequence[Labels]) -> None:
    """Adds to each windowed GPU that names its pod (``_Gpu.pods``: dcgm's ``pod`` / ``namespace``)
    Kepler's GPU series of that pod (its ``pod_name`` / ``pod_namespace``): the pod's ``pod_id`` finds its
    containers, their ``container_id`` its processes. Only while a window is open."""
    by_pod: dict[tuple[str, str], _Gpu] = {}
    for g in windowed:
        join = g.pods
        if join is None:
            continue
        for ls in g.series:
            d = dict(ls)
            if d.get(join.pod) and d["__name__"].startswith(join.series_prefix):
                by_pod[(d[join.pod], d.get(join.namespace, ""))] = g
    if not by_pod:
        return
    by_pod_id: dict[str, _Gpu] = {}
    by_container: dict[str, _Gpu] = {}
    rows = [(dict(ls), ls) for ls in workloads]
    for kind in kepler.WORKLOAD_KINDS:
        for d, ls in rows:
            if not d["__name__"].startswith(f"kepler_{kind}_"):
                continue
            g = by_pod.get((d.get(kepler.POD_NAME, ""), d.get(kepler.POD_NAMESPACE, "")))
            if kind == "pod" and g is not None and d.get(kepler.POD_ID):
                by_pod_id[d[kepler.POD_ID]] = g
            if g is None and kind != "process":
                g = by_pod_id.get(d.get(kepler.POD_ID, ""))
            if kind == "container" and g is not None and d.get(kepler.CONTAINER_ID):
                by_container[d[kepler.CONTAINER_ID]] = g
            if g is None and kind == "process":
                g = by_container.get(d.get(kepler.CONTAINER_ID, ""))
            if g is not None:
                g.series.add(ls)


def _joins_workloads(vendors: frozenset[str]) -> bool:
    """Whether a GPU exporter among ``vendors`` names the pod on its GPUs (workload series join it)."""
    return any(registry.GPUS[v].pods is not None for v in vendors if v in registry.GPUS)


class Detector:
    """Per-GPU (and per-node) rules and score over each cycle's raw scrapes; the open windows and their
    override."""

    def __init__(self, cfg: AnomalyConfig, interval_s: float) -> None:
        self.cfg = cfg
        self.interval_ms = max(1, round(interval_s * 1000))
        self._gpus: dict[str, _Gpu] = {}
        self._vendors = frozenset(cfg.presets)
        self._joins_workloads = _joins_workloads(self._vendors)
        self.events_total = 0
        self.last_event: Event | None = None
        self.override: frozenset[Labels] = frozenset()  # series at full resolution now
        self._keys: dict[Labels, str | None] = {}  # label set -> its GPU ("vendor:key"), None: no GPU's
        self._node: NodeState | None = NodeState(cfg.node) if cfg.node.enabled else None

    def _gpu_of(self, labels: Labels) -> str | None:
        name = metric_name(labels)
        if self._node is not None and is_node_series(name):
            return NODE_KEY if name in SIGNAL_METRICS else _NODE_HELD
        if self._joins_workloads and kepler.WORKLOAD_GPU_SERIES.fullmatch(name):
            return _POD  # a workload's GPU series: the GPU is found through the pod on it (_pod_series)
        vendor = vendor_of(name)
        if vendor is None or vendor not in self._vendors:
            return None
        key = gpu_key(vendor, labels)
        return None if key is None else f"{vendor}:{key}"

    def set_config(self, cfg: AnomalyConfig) -> None:
        self.cfg = cfg
        self._vendors = frozenset(cfg.presets)
        self._joins_workloads = _joins_workloads(self._vendors)
        self._keys.clear()
        for g in self._gpus.values():
            g.th = cfg.thresholds[g.vendor]
        if not cfg.node.enabled:
            self._node = None
        elif self._node is None:
            self._node = NodeState(cfg.node)
        else:
            self._node.cfg = cfg.node  # its baseline and open window stay

    @property
    def gpus(self) -> Mapping[str, _Gpu]:
        return self._gpus

    @property
    def node(self) -> NodeState | None:
        """The node's detector (None: ``anomaly.node.enabled`` is false)."""
        return self._node

    def _units(self) -> list[_Gpu | NodeState]:
        # A copy: the uplink's thread reads this for the status message while the loop may add a GPU.
        units: list[_Gpu | NodeState] = list(self._gpus.values())
        if self._node is not None:
            units.append(self._node)
        return units

    def active_windows(self, now_ms: int) -> list[str]:
        """The keys of the open windows: GPUs' (``vendor:key``) and the node's (``node``)."""
        return [g.key for g in self._units() if g.window_end_ms > now_ms]

    def match(self, gpu: str) -> Callable[[Labels], bool]:
        """A recorder ``Match`` for the series of ``gpu`` (vendor:key): its own, and the workload series
        its window holds now (Kepler's pod, container and process GPU series of the pod on it). For
        ``node``: the node-level series (``is_node_series``), never a GPU's."""
        if gpu == NODE_KEY:
            node_held = frozenset(self._node.series) if self._node is not None else frozenset()
            return lambda labels: labels in node_held or is_node_series(metric_name(labels))
        vendor, _, key = gpu.partition(":")
        g = self._gpus.get(gpu)
        held = frozenset(g.series) if g is not None else frozenset()

        def match(labels: Labels) -> bool:
            return labels in held or (
                vendor_of(metric_name(labels)) == vendor and gpu_key(vendor, labels) == key
            )

        return match

    def observe(self, scrapes: Sequence[Any], now_ms: int) -> list[Event]:
        """One cycle's raw scrapes (``ShapedScrape``s); returns the new events (at most one per GPU)."""
        per_gpu: dict[str, tuple[int, dict[str, float]]] = {}
        fired: dict[str, list[tuple[str, str]]] = {}
        seen: dict[str, set[Labels]] = {}  # this cycle's series per GPU: what a window holds now
        pods: list[Labels] = []  # Kepler's pod / container / process GPU series
        node, node_seen = self._node, set()
        node_ts: int | None = None
        keys = self._keys
        if len(keys) > 200_000:  # series churn must not grow the cache without bound
            keys.clear()
        for scrape in scrapes:
            if not len(scrape):
                continue
            base = scrape.timestamp_ms
            stamps = scrape.timestamps
            for i, labels in enumerate(scrape.labels):
                gid = keys.get(labels, "")
                if gid == "":
                    gid = keys[labels] = self._gpu_of(labels)
                if gid is None:
                    continue
                if gid == _POD:
                    pods.append(labels)
                    continue
                if gid == _NODE_HELD:
                    node_seen.add(labels)
                    continue
                if gid == NODE_KEY:
                    if node is not None:
                        node_seen.add(labels)
                        value = scrape.values[i]
                        if value == value:
                            ts = base if stamps is None else stamps[i]
                            node_ts = ts if node_ts is None else node_ts
                            node.take(metric_name(labels), labels, value, ts)
                    continue
                g = self._gpus.get(gid)
                vendor = gid.partition(":")[0]
                if g is None:
                    if len(self._gpus) >= MAX_GPUS:
                        continue
                    g = self._gpus[gid] = _Gpu(gid, vendor, self.cfg.thresholds[vendor])
                if g.model_pending:
                    g.see_labels(labels)
                bucket = seen.get(gid)
                if bucket is None:
                    bucket = seen[gid] = set()
                bucket.add(labels)
                value = scrape.values[i]
                if value != value:  # NaN / stale marker: no signal
                    continue
                ts = base if stamps is None else stamps[i]
                _, x = per_gpu.setdefault(gid, (ts, {}))
                g.reader.take(g, metric_name(labels), labels, value, x, fired.setdefault(gid, []))
        for gid, g in self._gpus.items():
            g.series = seen.get(gid, set())
        events: list[Event] = []
        for gid, (ts, x) in per_gpu.items():
            g = self._gpus[gid]
            out = fired.setdefault(gid, [])
            if (vendor_watts := x.pop("kepler_watts", None)) and "util" in x:
                x["w_per_util"] = vendor_watts / max(x["util"], 5.0)
            g.evaluate(ts, x, out, self.cfg)
            if out and self.cfg.enabled:
                ev = self._open(g, out, now_ms, ts)
                if ev is not None:
                    events.append(ev)
        if node is not None:
            node.series = node_seen
            if node_ts is not None:
                cfg = self.cfg
                out = node.evaluate(cfg.score, node_score_threshold(cfg.node, cfg.score_threshold))
                if out and cfg.enabled:
                    ev = self._open(node, out, now_ms, node_ts)
                    if ev is not None:
                        events.append(ev)
        # By this cycle's scrape time, not the clock: a scrape taken at window_end is still in the window.
        cycle_ms = min((x.timestamp_ms for x in scrapes if len(x)), default=now_ms)
        windowed = [g for g in self._gpus.values() if g.window_end_ms >= cycle_ms and g.pods is not None]
        if windowed and pods:
            _pod_series(windowed, pods)
        self.override = frozenset(s for g in self._units() if g.window_end_ms >= cycle_ms for s in g.series)
        return events

    def _open(self, g: _Gpu | NodeState, fired: list[tuple[str, str]], now_ms: int, ts: int) -> Event | None:
        """A detection on ``g``: opens its window (an event), or extends the open one (no new event: one
        incident fires its rules every scrape; the window's end moves, the count does not)."""
        cfg = self.cfg
        # From the scrape that showed it (its samples' timestamp), so the window is exact in the data.
        end = ts + round(cfg.post_seconds * 1000)
        if g.window_end_ms > now_ms:
            if end - g.window_start_ms <= cfg.max_window_seconds * 1000:
                g.window_end_ms = end
            else:
                # At its longest: it closes at its end as it stands, and no new one opens while this
                # keeps firing (every detection moves the quiet period on).
                if g.quiet_until_ms < g.window_end_ms:
                    log.warning(
                        "anomaly window on %s open for %.0fs and still firing: it closes at its end, no "
                        "new window while it lasts (anomaly.max_window_seconds)",
                        g.key,
                        (ts - g.window_start_ms) / 1000,
                    )
                g.quiet_until_ms = end
            return None
        if g.quiet_until_ms > now_ms:
            g.quiet_until_ms = end  # refused earlier and still firing: the same event, not a new one
            return None
        kind, rule = fired[0]
        if len(self.active_windows(now_ms)) >= cfg.max_windows:
            # Recorded (metrics, status), not widened: max_windows bounds what the uplink must carry.
            log.warning("anomaly on %s (%s %s): %d windows already open, not widened", g.key, kind, rule,
                        cfg.max_windows)  # fmt: skip
            ev = Event(g.key, kind, rule, ts, g.score, 0, opened=False)
            g.quiet_until_ms = end
        else:
            g.window_end_ms = end
            g.window_start_ms = ts
            ev = Event(g.key, kind, rule, ts, g.score, end)
        self.events_total += 1
        self.last_event = ev
        return ev


def status_fields(det: Detector, now_ms: int) -> dict[str, Any]:
    """The detector's part of the status message: flat scalars within the status codec's limits."""
    active = det.active_windows(now_ms)
    out: dict[str, Any] = {"anomaly_events": det.events_total, "anomaly_windows": len(active)}
    if active:
        out["anomaly_open"] = ",".join(active)[:256]  # which: e.g. "dcgm:1,node"
    unknown = sorted({g.unknown_model for g in det.gpus.values() if g.unknown_model})
    if unknown:
        # Models the registry lists no limits for: their power limit is learned from what they draw.
        out["anomaly_unknown_models"] = ",".join(unknown)[:256]
    ev = det.last_event
    if ev is not None:
        out["anomaly_last_ms"] = ev.at_ms
        out["anomaly_last"] = ev.describe()[:256]
        if ev.missing:
            out["anomaly_last_missing"] = ev.missing[:256]
    return out
