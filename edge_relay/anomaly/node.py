"""Per-node anomaly detection: the node's own signals from node-exporter and Kepler, their rules and
the same EWMA score as the GPUs' (``edge_relay.anomaly.detector`` opens and keeps the windows).

Signals (``docs/anomaly-detection.md``, "Per node"), each taken only where the node serves it:

- ``temp``: the hottest of ``node_hwmon_temp_celsius`` / ``node_thermal_zone_temp`` sensors, without
  the GPUs' own (hwmon chips the GPU records name, ``vendors.registry.HWMON_GPU_CHIPS``: ``amdgpu``,
  ``nouveau``, ``i915``, ``xe``, ...; thermal zones typed ``*gpu*``: the GPU detector watches those with
  the vendor's limits);
- ``mem_avail``: ``node_memory_MemAvailable_bytes / node_memory_MemTotal_bytes``;
- ``mem_stall``: the rate of ``node_pressure_memory_stalled_seconds_total`` (PSI "full": the share of
  the time no task could run for lack of memory), when the pressure collector is on;
- ``power``: the node's power from Kepler's energy counters, over ``RATE_SECONDS`` (Kepler refreshes its
  counters every few seconds: a rate between two 5 s scrapes aliases by up to ±40 %): the platform
  (``kepler_node_platform_joules_total``, Kepler 0.7; ``kepler_node_cpu_joules_total{zone="psys"}``,
  0.10+) when metered (it includes the GPUs'), else package + DRAM (0.7
  ``kepler_node_{package,dram}_joules_total``, both modes; 0.10+ ``kepler_node_cpu_joules_total
  {zone="package"|"dram"}``); one Kepler line, 0.10+ when a node serves both. Counter resets and
  series changes restart the rate.

The series' names are node-exporter's and Kepler's (``vendors.node``, ``vendors.kepler``).

Rules (``NodeThresholds``, the budget file's ``anomaly.node.thresholds``): temperature at or over
``temp_c`` on 2 scrapes, or up ``temp_slope_c`` within ``slope_seconds`` while within 15 °C of
``temp_c`` (a climb toward the limit; a load step at a cool temperature is ordinary); available memory
at or under ``memory_available_fraction`` on 2 scrapes; memory stalls at or over
``memory_stall_share`` on 2 scrapes; power at or over ``power_watts`` on 3 (off by default: no
exporter serves a node's limit), or up by ``power_jump_fraction`` and ``power_jump_watts`` against
``slope_seconds`` before on 2. The node's series (``is_node_series``: ``node_*`` and Kepler's
``kepler_node_*`` but its GPU series) are what its window holds. The EWMA score (``Ewma``, the GPUs'
alpha, warm-up and 2-scrape debounce) runs over the four signals with floors 2 °C, 2 % of the memory,
2 % stalled and 10 W; its threshold is ``anomaly.score_threshold`` unless ``anomaly.node`` sets one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from edge_relay.anomaly.signals import SCORE_DEBOUNCE, Ewma
from schemas.model import Labels
from vendors import kepler, registry
from vendors import node as node_exporter

NODE_KEY: Final = "node"  # the node's detector in events, metrics (gpu="node") and windows
NODE_SIGNALS: Final = ("temp", "mem_avail", "mem_stall", "power")
NODE_FLOORS: Final = {"temp": 2.0, "mem_avail": 0.02, "mem_stall": 0.02, "power": 10.0}
RATE_SECONDS: Final = 15.0  # the span of the power rate
WARM_MARGIN_C: Final = 15.0  # the slope rule counts from temp_c - this
# The metrics ``NodeState.take`` reads; the node's other series are only held by its window.
SIGNAL_METRICS: Final = frozenset(
    {
        node_exporter.HWMON_TEMP,
        node_exporter.THERMAL_ZONE_TEMP,
        node_exporter.HWMON_CHIP_NAMES,
        node_exporter.MEM_AVAILABLE,
        node_exporter.MEM_TOTAL,
        node_exporter.MEM_STALLED,
        kepler.NODE_ENERGY_010,
        *kepler.NODE_ENERGY_07,
    }
)


@dataclass(frozen=True, slots=True)
class NodeThresholds:
    """The node's limits; ``None``: that rule is off."""

    temp_c: float = 90.0  # x86 packages throttle at ~95-100 °C (Tjmax), Jetson zones at ~97 °C
    temp_slope_c: float = 6.0
    slope_seconds: float = 30.0
    memory_available_fraction: float = 0.05  # the OOM killer is near
    memory_stall_share: float | None = 0.1  # PSI memory full: 10 % of the time stalled
    power_watts: float | None = None  # the node's budget (PSU, site); no exporter serves it
    power_jump_fraction: float | None = 0.5
    power_jump_watts: float = 50.0


NODE_THRESHOLD_KEYS: Final = tuple(NodeThresholds.__dataclass_fields__)


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """The budget file's ``anomaly.node`` section."""

    enabled: bool = True
    score_threshold: float | None = None  # None: anomaly.score_threshold
    thresholds: NodeThresholds = field(default_factory=NodeThresholds)


def parse_node_config(raw: Mapping[str, Any] | None, error: Callable[[str, str], Exception]) -> NodeConfig:
    """``anomaly.node`` (already schema-checked); ``error(key, message)`` builds the ConfigError."""
    if raw is None:
        return NodeConfig()
    base = NodeThresholds()
    values: dict[str, Any] = {k: getattr(base, k) for k in NODE_THRESHOLD_KEYS}
    for k, v in (raw.get("thresholds") or {}).items():
        values[k] = None if v is None else float(v)
    for k in ("temp_c", "temp_slope_c", "slope_seconds", "memory_available_fraction", "power_jump_watts"):
        if values[k] is None:
            raise error(f"anomaly.node.thresholds.{k}", "cannot be null")
    if not 0 < values["memory_available_fraction"] < 1:
        raise error(
            "anomaly.node.thresholds.memory_available_fraction",
            f"expected a fraction in (0, 1), got {values['memory_available_fraction']:g}",
        )
    score = raw.get("score_threshold")
    return NodeConfig(
        enabled=bool(raw.get("enabled", True)),
        score_threshold=None if score is None else float(score),
        thresholds=NodeThresholds(**values),
    )


def is_node_series(name: str) -> bool:
    """A node-level series: node-exporter's, and Kepler's node series but its GPU ones (those are the
    GPU's: ``kepler_node_gpu_*``)."""
    if name.startswith("node_"):
        return True
    return name.startswith("kepler_node_") and "_gpu_" not in name


class NodeState:
    """The node's detector state and its series (``key``, ``score``, ``series``, ``window_end_ms`` and
    ``quiet_until_ms`` as a GPU's, for ``Detector``'s windows)."""

    def __init__(self, cfg: NodeConfig) -> None:
        self.key = NODE_KEY
        self.vendor = NODE_KEY
        self.cfg = cfg
        self.series: set[Labels] = set()
        self.window_end_ms = 0
        self.window_start_ms = 0
        self.quiet_until_ms = 0
        self.score = 0.0
        self.ewma = Ewma(NODE_SIGNALS, NODE_FLOORS)
        self.hot = self.low_mem = self.stalled = self.over_power = self.jumped = self.over_score = 0
        self.temps: dict[Labels, float] = {}  # this scrape's sensors
        self.gpu_chips: set[str] = set()
        self.mem: dict[str, float] = {}
        self.counters: dict[Labels, tuple[int, float]] = {}  # PSI counters: the previous sample
        self.energy: dict[str, dict[str, float]] = {}  # this scrape's joules per Kepler line, component
        self.energy_series: set[Labels] = set()
        self.energy_ts: dict[str, int] = {}
        self.x: dict[str, float] = {}
        self.ts = 0
        self._energy_hist: deque[tuple[int, dict[str, float], frozenset[Labels]]] = deque(maxlen=64)
        self._temp_hist: deque[tuple[int, float]] = deque(maxlen=64)
        self._power_hist: deque[tuple[int, float]] = deque(maxlen=64)

    def take(self, name: str, labels: Labels, value: float, ts: int) -> None:
        """One sample of a node series (not NaN)."""
        if not self.ts:
            self.ts = ts
        if name == node_exporter.HWMON_TEMP or name == node_exporter.THERMAL_ZONE_TEMP:
            self.temps[labels] = value
        elif name == node_exporter.HWMON_CHIP_NAMES:
            d = dict(labels)
            if d.get("chip_name") in registry.HWMON_GPU_CHIPS:
                self.gpu_chips.add(d.get("chip", ""))
        elif name == node_exporter.MEM_AVAILABLE:
            self.mem["avail"] = value
        elif name == node_exporter.MEM_TOTAL:
            self.mem["total"] = value
        elif name == node_exporter.MEM_STALLED:
            prev = self.counters.get(labels)
            self.counters[labels] = (ts, value)
            if prev is not None and ts > prev[0] and value >= prev[1]:
                self.x["mem_stall"] = (value - prev[1]) / ((ts - prev[0]) / 1000)
        else:
            comp, version = kepler.NODE_ENERGY_07.get(name), "0.7"
            if comp is None and name == kepler.NODE_ENERGY_010:
                zone = dict(labels).get(kepler.NODE_ENERGY_ZONE_LABEL, "")
                comp, version = kepler.NODE_ENERGY_ZONES.get(zone.lower()), "0.10"
            if comp is not None:
                energy = self.energy.setdefault(version, {})
                energy[comp] = energy.get(comp, 0.0) + value
                self.energy_series.add(labels)
                self.energy_ts[version] = max(self.energy_ts.get(version, 0), ts)

    def _signals(self) -> dict[str, float]:
        x = self.x
        temps = []
        for ls, v in self.temps.items():
            d = dict(ls)
            if d.get("chip", "") not in self.gpu_chips and "gpu" not in d.get("type", "").lower():
                temps.append(v)
        if temps:
            x["temp"] = max(temps)
        total = self.mem.get("total")
        if total and "avail" in self.mem:
            x["mem_avail"] = self.mem["avail"] / total
        if self.energy:
            self._power(x)
        return x

    def _power(self, x: dict[str, float]) -> None:
        # One Kepler line: 0.10+ when the node serves both (a node mid-upgrade), never their sum.
        version = "0.10" if "0.10" in self.energy else "0.7"
        ts, now, series = self.energy_ts[version], self.energy[version], frozenset(self.energy_series)
        h = self._energy_hist
        if h and (h[-1][2] != series or any(now[c] < v for c, v in h[-1][1].items() if c in now)):
            h.clear()  # a counter reset or other series: the rate starts again
        h.append((ts, now, series))
        since = ts - RATE_SECONDS * 1000
        old = next(((t, e) for t, e, _ in h if t >= since - 1), None)
        if old is None or old[0] >= ts or h[0][0] > since + 1:
            return  # not yet RATE_SECONDS of history
        dt = (ts - old[0]) / 1000
        rate = {c: (now[c] - old[1].get(c, now[c])) / dt for c in now}
        # The platform when it is metered (Kepler 0.7 serves 0 without an ACPI power meter).
        platform = rate.get("platform", 0.0)
        x["power"] = platform if platform > 0 else rate.get("package", 0.0) + rate.get("dram", 0.0)

    def evaluate(self, score: str, score_threshold: float) -> list[tuple[str, str]]:
        """This scrape's node rules and score: what fired (kind, rule); resets the scrape's signals."""
        th, ts = self.cfg.thresholds, self.ts
        x = self._signals()
        fired: list[tuple[str, str]] = []
        temp = x.get("temp")
        self.hot = self.hot + 1 if (temp is not None and temp >= th.temp_c) else 0
        if self.hot >= 2:
            fired.append(("thermal", f"node_temp>={th.temp_c:g}"))
        if temp is not None:
            h = self._temp_hist
            h.append((ts, temp))
            since = ts - th.slope_seconds * 1000
            old = next((t for s, t in h if s >= since - 1), None)
            warm = temp >= th.temp_c - WARM_MARGIN_C
            if warm and old is not None and h[0][0] <= since + 1 and temp - old >= th.temp_slope_c:
                fired.append(("thermal", "node_temp_slope"))
        avail = x.get("mem_avail")
        low = avail is not None and avail <= th.memory_available_fraction
        self.low_mem = self.low_mem + 1 if low else 0
        if self.low_mem >= 2:
            fired.append(("memory", f"node_mem_available<={th.memory_available_fraction:g}"))
        stall = x.get("mem_stall")
        share = th.memory_stall_share
        self.stalled = self.stalled + 1 if (stall is not None and share is not None and stall >= share) else 0
        if self.stalled >= 2:
            fired.append(("memory", f"node_mem_stall>={share:g}"))
        power = x.get("power")
        if power is not None:
            self._power_rules(ts, power, th, fired)
        if score == "ewma":
            self.score = self.ewma.score(x)
            self.over_score = self.over_score + 1 if self.score > score_threshold else 0
            if self.over_score >= SCORE_DEBOUNCE:
                fired.append(("score", f"node_ewma>{score_threshold:g}"))
        self.temps.clear()
        self.mem.clear()
        self.energy.clear()
        self.energy_series.clear()
        self.x = {}
        self.energy_ts.clear()
        self.ts = 0
        return fired

    def _power_rules(self, ts: int, power: float, th: NodeThresholds, fired: list[tuple[str, str]]) -> None:
        limit = th.power_watts
        self.over_power = self.over_power + 1 if (limit is not None and power >= limit) else 0
        if self.over_power >= 3:
            fired.append(("power", f"node_power>={limit:g}W"))
        h = self._power_hist
        since = ts - th.slope_seconds * 1000
        old = next((p for s, p in h if s >= since - 1), None)
        f = th.power_jump_fraction
        jump = (
            f is not None
            and old is not None
            and h[0][0] <= since + 1
            and power >= (1 + f) * old
            and power - old >= th.power_jump_watts
        )
        h.append((ts, power))
        self.jumped = self.jumped + 1 if jump else 0
        if self.jumped >= 2:
            fired.append(("power", "node_power_jump"))


def node_score_threshold(cfg: NodeConfig, default: float) -> float:
    return default if cfg.score_threshold is None else cfg.score_threshold
