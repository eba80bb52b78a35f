"""Incident injection: a GPU misbehaving at a given tick, for tests, the demo and the anomaly bench.

``Incident(kind, gpu, start_tick, duration_ticks)`` makes GPU ``gpu`` of the simulated node misbehave
during ticks ``[start_tick, start_tick + duration_ticks)``:

- ``thermal``: cooling lost; the temperature climbs fast (first order toward ~105 °C, about 4 °C per
  5 s at first) until the slowdown threshold, where the clocks drop (throttle bits: SW/HW thermal
  slowdown), power follows the clocks down and the temperature holds at the threshold; it cools back in
  the window's last sixth.
- ``xid``: an XID burst: a contained ECC error (XID 94), the row remap it causes (XID 63), then the
  application's channel is killed (XID 43): utilisation, clocks, power and frame buffer fall to idle and
  the GPU cools until the pod is restarted (the window's end). Row-remap and ECC counters step up.
- ``powercap``: the workload pulls more than the board can give: power jumps to the limit (one tick of
  overshoot, then at or just under it), utilisation saturates, the SM clock drops ~20 %, throttle bit
  SW power cap is set, the GPU warms a little.
- ``memleak``: frame buffer used grows steadily to the total (free to zero) over 80 % of the window and
  stays full.

What stays true (tests/tooling/test_incidents.py): outside the window and on every other GPU the payloads are
byte for byte those of the simulator without incidents, except that the incident GPU's counters keep
what they gained in the window (energy, remapped rows, ECC: a counter never gives anything back); the
counters stay monotonic, ``rate(energy) == power`` still holds, and Kepler's GPU watts and joules (node
and the pod holding the GPU) follow dcgm's power. Values stay in range: temperatures 30-100 °C, power
at most the limit but for one tick of overshoot (+2 %), clocks between idle and maximum.

The same incident moves the other vendors' GPU exporters where they have the signal (AMD: temperatures,
power and energy, gfx clock, activity, VRAM, ECC counts, violation residency; Intel: temperatures,
power and energy, frequency, utilisation, memory; Jetson: GPU temperatures, module power, GPU
frequency, GPU memory). An exporter without a signal (XID on AMD / Intel / Jetson) just does not show it.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from simulator.base import Exposition, Tpl
from simulator.topology import LoadShapes, Unit

KINDS: Final = ("thermal", "xid", "powercap", "memleak")

# NVML clock throttle / clock event reason bits (nvml.h, DCGM_CLOCKS_EVENT_REASON_*).
SW_POWER_CAP: Final = 0x4
SW_THERMAL_SLOWDOWN: Final = 0x20
HW_THERMAL_SLOWDOWN: Final = 0x40

# The XIDs of a burst (NVIDIA's XID catalogue).
XID_MESSAGES: Final = {
    94: "Contained ECC error",
    63: "ECC page retirement or row remapping recording event",
    43: "GPU stopped processing",
}


@dataclass(frozen=True, slots=True)
class Incident:
    """GPU ``gpu`` misbehaves (``kind``, one of ``KINDS``) from ``start_tick`` for ``duration_ticks``."""

    kind: str
    gpu: int
    start_tick: int
    duration_ticks: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown incident kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.gpu < 0:
            raise ValueError("incident gpu must be >= 0")
        if self.start_tick < 0:
            raise ValueError("incident start tick must be >= 0")
        if self.duration_ticks < 4:  # ramp, hold and recovery need a few ticks each
            raise ValueError("incident duration must be >= 4 ticks")

    @property
    def end_tick(self) -> int:
        """The first tick after the incident."""
        return self.start_tick + self.duration_ticks

    def active(self, tick: int) -> bool:
        return self.start_tick <= tick < self.end_tick


def parse_incident(spec: str) -> Incident:
    """``KIND:gpu=N:at=TICK:for=TICKS`` (e.g. ``thermal:gpu=1:at=120:for=60``); ValueError says why not."""
    kind, *fields = spec.strip().split(":")
    if kind not in KINDS:
        raise ValueError(f"incident {spec!r}: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    values: dict[str, int] = {}
    for f in fields:
        key, sep, raw = f.partition("=")
        if not sep or key not in ("gpu", "at", "for"):
            raise ValueError(f"incident {spec!r}: {f!r} is not gpu=N, at=TICK or for=TICKS")
        if key in values:
            raise ValueError(f"incident {spec!r}: {key} given twice")
        try:
            values[key] = int(raw)
        except ValueError:
            raise ValueError(f"incident {spec!r}: {key}={raw!r} is not an integer") from None
    missing = [k for k in ("gpu", "at", "for") if k not in values]
    if missing:
        raise ValueError(f"incident {spec!r}: missing {', '.join(missing)} (KIND:gpu=N:at=TICK:for=TICKS)")
    try:
        return Incident(kind, values["gpu"], values["at"], values["for"])
    except ValueError as e:
        raise ValueError(f"incident {spec!r}: {e}") from None


# --- what each exporter shows of a GPU ------------------------------------------------------------

# Roles of a series in an incident.
TEMP, MEM_TEMP, POWER, ENERGY, CLOCK, UTIL, FB_USED, FB_FREE = range(8)
XID, THROTTLE, ROWS_UNC, ECC_SBE, ECC_DBE, VIOL_PPT, VIOL_THERMAL, K_WATTS, K_JOULES = range(8, 17)
_COUNTER_ROLES: Final = frozenset({ENERGY, ROWS_UNC, ECC_SBE, ECC_DBE, K_JOULES})


@dataclass(frozen=True, slots=True)
class Chip:
    """A GPU's limits, in the exporter's units (watts scaled by ``power_scale``)."""

    temp_slowdown: float  # °C where the clocks are cut
    mem_temp_max: float
    power_limit: float  # W
    power_idle: float  # W with a context but no work
    clock_idle: float  # in the exporter's clock unit
    util_full: float  # 100 (%) or 1 (ratio)
    power_scale: float = 1.0  # exporter unit per W (Jetson: mW)
    mem_total: float = 0.0  # what GPU memory used can grow to where the exporter does not say
    energy_scale: float = 1.0  # exporter unit per J (dcgm: mJ, AMD: µJ)


CHIPS: Final[dict[str, Chip]] = {
    # A100 80GB PCIe: slowdown 89 °C (held at 88 here), HBM max 95 °C, 300 W board limit.
    "dcgm": Chip(88.0, 95.0, 300.0, 70.0, 210.0, 100.0, energy_scale=1000.0),
    # MI300X OAM: 750 W; junction throttles near 100 °C (kept under 100 here), HBM 95 °C.
    "amd": Chip(98.0, 95.0, 750.0, 140.0, 500.0, 100.0, energy_scale=1e6),
    # Data Center GPU Flex 170: 150 W TBP, but the fixture's board draws 168 W: its limit is set higher.
    "intel": Chip(95.0, 95.0, 180.0, 40.0, 3e8, 1.0),
    # Orin Nano 8GB: 15 W module, throttles ~97 °C (tj).
    # (gpuram_kB is shared RAM: it can take most of the 7.8 GB.)
    "jetson": Chip(96.0, 96.0, 15.0, 6.0, 306000.0, 100.0, power_scale=1000.0, mem_total=7.0e6),
}


def _dcgm_role(family: str, labels: Mapping[str, str]) -> int | None:
    return {
        "DCGM_FI_DEV_GPU_TEMP": TEMP,
        "DCGM_FI_DEV_MEMORY_TEMP": MEM_TEMP,
        "DCGM_FI_DEV_POWER_USAGE": POWER,
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ENERGY,
        "DCGM_FI_DEV_SM_CLOCK": CLOCK,
        "DCGM_FI_DEV_GPU_UTIL": UTIL,
        "DCGM_FI_DEV_FB_USED": FB_USED,
        "DCGM_FI_DEV_FB_FREE": FB_FREE,
        "DCGM_FI_DEV_XID_ERRORS": XID,
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": THROTTLE,
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS": THROTTLE,
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ROWS_UNC,
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ECC_SBE,
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ECC_DBE,
    }.get(family)


def _amd_role(family: str, labels: Mapping[str, str]) -> int | None:
    if family == "gpu_clock":
        return CLOCK if labels.get("clock_type") == "system" else None
    return {
        "gpu_junction_temperature": TEMP,
        "gpu_edge_temperature": TEMP,
        "gpu_memory_temperature": MEM_TEMP,
        "gpu_package_power": POWER,
        "gpu_average_package_power": POWER,
        "gpu_power_usage": POWER,
        "gpu_energy_consumed": ENERGY,
        "gpu_gfx_activity": UTIL,
        "gpu_used_vram": FB_USED,
        "gpu_free_vram": FB_FREE,
        "gpu_ecc_correct_total": ECC_SBE,
        "gpu_ecc_uncorrect_total": ECC_DBE,
        "gpu_violation_ppt_residency_percentage": VIOL_PPT,
        "gpu_violation_socket_thermal_residency_percentage": VIOL_THERMAL,
    }.get(family)


def _intel_role(family: str, labels: Mapping[str, str]) -> int | None:
    if family == "hw_temperature_celsius":
        return MEM_TEMP if labels.get("hw_sensor_location") == "memory" else TEMP
    if family == "hw_frequency_hertz":
        return CLOCK if labels.get("aggregation") == "avg" else None
    if family == "hw_gpu_utilization_ratio":
        return UTIL if labels.get("hw_gpu_task") == "render-single" else None
    return {
        "hw_power_watts": POWER,
        "hw_energy_joules_total": ENERGY,
        "hw_memory_usage_bytes": FB_USED,
    }.get(family)


def _jetson_role(family: str, labels: Mapping[str, str]) -> int | None:
    stat = labels.get("statistic")
    if family == "temperature_C" and stat in ("gpu", "tj"):
        return TEMP
    if family == "integrated_power_mW" and stat in ("power", "avg_power"):
        return POWER
    if family == "gpu_utilization_percentage_Hz" and labels.get("nvidia_gpu") == "freq":
        return CLOCK
    if family == "gpuram_kB":
        return FB_USED
    return None


def _kepler_role(family: str, labels: Mapping[str, str]) -> int | None:
    if family in ("kepler_node_gpu_idle_watts", "kepler_node_gpu_idle_joules_total"):
        return None  # the idle floor Kepler detected does not move with an incident
    if "_gpu_" in family and family.endswith("_watts"):
        return K_WATTS
    if "_gpu_" in family and family.endswith("_joules_total"):
        return K_JOULES
    return None


_ROLE_OF: Final = {
    "dcgm": _dcgm_role,
    "amd": _amd_role,
    "intel": _intel_role,
    "jetson": _jetson_role,
    "kepler": _kepler_role,
}


@dataclass(frozen=True, slots=True)
class Ref:
    """One series an incident may move: its GPU, role and the exporter whose plan it follows."""

    gpu: int
    role: int
    plan_exporter: str  # Kepler follows dcgm's power


# --- the plan of one incident on one exporter ---------------------------------------------------


@dataclass(slots=True)
class Plan:
    """Per tick of the window (index k = tick - start): what the incident makes of the GPU's signals."""

    dtemp: list[float] = field(default_factory=list)  # added to the temperatures
    dmem_temp: list[float] = field(default_factory=list)
    dpower: list[float] = field(default_factory=list)  # W added to the power gauges
    clock: list[float | None] = field(default_factory=list)  # factor (> 0) or, negated, a set value
    util: list[float | None] = field(default_factory=list)  # set to this share of full, or unchanged
    dfb: list[float] = field(default_factory=list)  # added to FB used, taken from FB free
    xid: list[int] = field(default_factory=list)
    throttle: list[int] = field(default_factory=list)
    viol: list[float] = field(default_factory=list)  # violation residency %, or 0
    energy: list[float] = field(default_factory=list)  # J gained by the end of tick k (cumulative)
    rows: list[int] = field(default_factory=list)  # cumulative counts
    sbe: list[int] = field(default_factory=list)
    dbe: list[int] = field(default_factory=list)


class Overlay:
    """The incidents of one simulated node: which series they move, and by how much at a tick.

    It reads the node as the simulator built it (its owners, the exporters' expositions and the
    owners' load shapes) and never the simulator itself: the simulator asks it, per owner and tick,
    what to change.
    """

    def __init__(
        self,
        incidents: Sequence[Incident],
        units: Mapping[str, Unit],
        expositions: Mapping[str, Exposition],
        shapes: LoadShapes,
        *,
        interval_s: float,
        seed: int,
    ) -> None:
        self.incidents = tuple(incidents)
        self.units = units
        self.shapes = shapes
        self.interval_s = interval_s
        self.seed = seed
        self._refs: dict[tuple[str, str], dict[int, Ref]] = {}
        self._first: dict[tuple[str, str], int] = {}  # first start tick touching that owner
        self._base: dict[tuple[str, int, int], Tpl] = {}  # (exporter, gpu, role) -> its first series
        self._units: dict[tuple[str, int, int], str] = {}
        self._plans: dict[tuple[int, str], Plan] = {}
        gpus = {i.gpu for i in self.incidents}
        for unit in units.values():
            for exporter, tpls in unit.tpls.items():
                role_of = _ROLE_OF.get(exporter)
                if role_of is None:
                    continue
                families = expositions[exporter].families
                refs: dict[int, Ref] = {}
                for tpl in tpls:
                    labels = dict(tpl.labels)
                    gpu = _gpu_of(exporter, unit.key, unit.gpu, tpl, labels)
                    if gpu is None or gpu not in gpus:
                        continue
                    role = role_of(families[tpl.fam].name, labels)
                    if role is None:
                        continue
                    plan_exporter = "dcgm" if exporter == "kepler" else exporter
                    refs[id(tpl)] = Ref(gpu, role, plan_exporter)
                    if exporter != "kepler":
                        self._base.setdefault((exporter, gpu, role), tpl)
                        self._units.setdefault((exporter, gpu, role), unit.key)
                if refs:
                    self._refs[(exporter, unit.key)] = refs
                    touched = {r.gpu for r in refs.values()}
                    self._first[(exporter, unit.key)] = min(
                        i.start_tick for i in self.incidents if i.gpu in touched
                    )

    # render's hook -------------------------------------------------------------------------

    def refs(self, exporter: str, unit_key: str, tick: int) -> dict[int, Ref] | None:
        """The moved series of one owner at ``tick`` (None: nothing to do, the common case)."""
        first = self._first.get((exporter, unit_key))
        if first is None or tick < first:
            return None
        return self._refs[(exporter, unit_key)]

    def apply(self, ref: Ref, tick: int, t_ref: int, v: float, prefix: str) -> tuple[float, str]:
        """The value (and the 'name{labels} ' prefix) of one moved series at ``tick``."""
        for idx, inc in enumerate(self.incidents):
            if inc.gpu != ref.gpu or tick < inc.start_tick:
                continue
            if ref.role in _COUNTER_ROLES:
                plan = self._plan(idx, ref.plan_exporter)
                v += self._counter_gain(inc, plan, ref, tick, t_ref)
            elif inc.active(tick):
                plan = self._plan(idx, ref.plan_exporter)
                v, prefix = self._gauge(plan, ref, tick - inc.start_tick, v, prefix)
        return v, prefix

    def _counter_gain(self, inc: Incident, plan: Plan, ref: Ref, tick: int, t_ref: int) -> float:
        role = ref.role
        if role in (ENERGY, K_JOULES):
            scale = CHIPS[ref.plan_exporter].energy_scale if role == ENERGY else 1.0
            # A pod generation started during or after the window only gains from then on.
            prior = _at(plan.energy, inc, t_ref) if t_ref > 0 else 0.0
            return scale * (_at(plan.energy, inc, tick) - prior)
        series = plan.rows if role == ROWS_UNC else plan.sbe if role == ECC_SBE else plan.dbe
        return float(_at(series, inc, tick))

    def _gauge(self, plan: Plan, ref: Ref, k: int, v: float, prefix: str) -> tuple[float, str]:
        role = ref.role
        chip = CHIPS[ref.plan_exporter]
        # Several sensors share a plan computed from the first one: none goes past its chip's limit.
        if role == TEMP:
            return min(v + plan.dtemp[k], max(v, chip.temp_slowdown + 1.0)), prefix
        if role == MEM_TEMP:
            return min(v + plan.dmem_temp[k], max(v, chip.mem_temp_max)), prefix
        if role in (POWER, K_WATTS):
            return max(0.0, v + plan.dpower[k] * chip.power_scale), prefix
        if role == CLOCK:
            c = plan.clock[k]
            if c is None:
                return v, prefix
            return (v * c if c > 0 else -c), prefix
        if role == UTIL:
            u = plan.util[k]
            return (v if u is None else u * chip.util_full), prefix
        if role == FB_USED:
            return v + plan.dfb[k], prefix
        if role == FB_FREE:
            return max(0.0, v - plan.dfb[k]), prefix
        if role == XID:
            code = plan.xid[k]
            if code:
                # dcgm-exporter labels the XID series with the error's code and text.
                prefix = prefix.replace(
                    'err_code="0",err_msg="No Error"', f'err_code="{code}",err_msg="{XID_MESSAGES[code]}"'
                )
            return float(code) if code else v, prefix
        if role == THROTTLE:
            return float(int(v) | plan.throttle[k]), prefix
        if role in (VIOL_PPT, VIOL_THERMAL):
            hit = plan.throttle[k] & (SW_POWER_CAP if role == VIOL_PPT else SW_THERMAL_SLOWDOWN)
            return (max(v, plan.viol[k]) if hit else v), prefix
        return v, prefix

    # plans ---------------------------------------------------------------------------------

    def base(self, exporter: str, gpu: int, role: int, tick: int) -> float | None:
        """The no-incident value of the first series of that role (before rounding), or None."""
        tpl = self._base.get((exporter, gpu, role))
        if tpl is None:
            return None
        unit = self.units[self._units[(exporter, gpu, role)]]
        level = self.shapes.of(unit, 0)[tpl.slot].level(tick)
        return min(tpl.hi, max(tpl.lo, tpl.a + tpl.b * level))

    def _plan(self, idx: int, exporter: str) -> Plan:
        plan = self._plans.get((idx, exporter))
        if plan is None:
            plan = self._plans[(idx, exporter)] = make_plan(self, self.incidents[idx], idx, exporter)
        return plan


def _at(series: list[float] | list[int], inc: Incident, tick: int) -> float:
    """A cumulative plan series at ``tick``: 0 before the window, its last value after it."""
    if tick < inc.start_tick:
        return 0.0
    return float(series[min(tick, inc.end_tick - 1) - inc.start_tick])


def _gpu_of(
    exporter: str, unit_key: str, unit_gpu: int | None, tpl: Tpl, labels: Mapping[str, str]
) -> int | None:
    if exporter == "dcgm":
        return int(labels["gpu"]) if "gpu" in labels else None
    if exporter == "kepler":
        if unit_key.startswith("gpu") and "gpu" in labels:
            return int(labels["gpu"])
        return unit_gpu if unit_gpu is not None and tpl.slot == 1 else None  # the pod holding the GPU
    if exporter == "amd":
        return tpl.slot if "gpu_id" in labels else None
    if exporter == "intel":
        return tpl.slot if "pci_bdf" in labels else None
    if exporter == "jetson":
        return 0
    return None


def make_plan(ov: Overlay, inc: Incident, idx: int, exporter: str) -> Plan:
    """The incident's course on one exporter's GPU, from that GPU's own no-incident values."""
    chip = CHIPS[exporter]
    n, dt = inc.duration_ticks, ov.interval_s
    rng = random.Random(f"{ov.seed}:incident:{idx}:{inc.kind}:{inc.gpu}:{inc.start_tick}:{n}")
    noise = [rng.uniform(-1.0, 1.0) for _ in range(n)]
    ticks = range(inc.start_tick, inc.end_tick)
    zeros = [0.0] * n

    def base(role: int, default: float) -> list[float]:
        values = [ov.base(exporter, inc.gpu, role, t) for t in ticks]
        return [default if v is None else v for v in values]

    ps = chip.power_scale
    p0 = [p / ps for p in base(POWER, chip.power_idle * ps)]  # W
    t0 = base(TEMP, 50.0)
    used0 = base(FB_USED, 0.0)
    # Recovery: the window's last sixth blends back to normal (cooled, restarted, fixed).
    rec = max(2, n // 6)
    weight = [1.0 if k < n - rec else (n - k) / (rec + 1) for k in range(n)]
    plan = Plan(
        dtemp=list(zeros), dmem_temp=list(zeros), dpower=list(zeros), clock=[None] * n, util=[None] * n,
        dfb=list(zeros), xid=[0] * n, throttle=[0] * n, viol=list(zeros),
    )  # fmt: skip
    power = list(p0)
    if inc.kind == "thermal":
        target, tau = 105.0, 60.0
        throttled_at: int | None = None
        for k in range(n):
            s = (k + 1) * dt
            rise = (target - t0[k]) * (1.0 - math.exp(-s / tau))
            temp = t0[k] + rise
            cap = chip.temp_slowdown + 0.6 * noise[k]
            if temp >= cap and throttled_at is None:
                throttled_at = k
            w = weight[k]
            if throttled_at is not None:
                temp = min(temp, cap)
                depth = min(1.0, (k - throttled_at + 1) / 2)  # clocks are cut over two scrapes
                factor = 1.0 - depth * (0.38 + 0.03 * noise[k])
                plan.clock[k] = 1.0 - w * (1.0 - factor)
                busy = chip.power_idle + (p0[k] - chip.power_idle) * factor**1.5
                power[k] = p0[k] + w * (busy - p0[k])
                if w == 1.0:
                    plan.throttle[k] = SW_THERMAL_SLOWDOWN | (HW_THERMAL_SLOWDOWN if noise[k] > 0.5 else 0)
                    plan.viol[k] = min(100.0, 40.0 + 10.0 * depth + 5.0 * noise[k])
            else:
                leak = 1.0 + 0.004 * rise  # leakage grows with temperature
                power[k] = max(p0[k], min(chip.power_limit, p0[k] * (1.0 + w * (leak - 1.0))))
            plan.dtemp[k] = w * max(0.0, temp - t0[k])
            plan.dmem_temp[k] = min(plan.dtemp[k] * 1.05, max(0.0, chip.mem_temp_max - 1.0 - t0[k]))
    elif inc.kind == "powercap":
        limit = chip.power_limit
        for k in range(n):
            w = weight[k]
            if k == 0:
                pw = p0[k] + 0.7 * (limit - p0[k])
            elif k == 1:
                pw = limit * 1.02  # one tick of overshoot before the controller catches it
            else:
                pw = limit - 2.0 * abs(noise[k]) * limit / 150.0
            power[k] = p0[k] + w * (max(pw, p0[k]) - p0[k])
            if k >= 1:
                plan.clock[k] = 1.0 - w * (0.2 + 0.03 * noise[k])
                plan.util[k] = None if w < 1.0 else 0.97 + 0.03 * abs(noise[k])
                if w == 1.0:
                    plan.throttle[k] = SW_POWER_CAP
                    plan.viol[k] = min(100.0, 60.0 + 10.0 * noise[k])
            plan.dtemp[k] = w * 6.0 * (1.0 - math.exp(-(k + 1) * dt / 120.0))
            plan.dmem_temp[k] = plan.dtemp[k] * 0.8
    elif inc.kind == "xid":
        dies = max(2, int(0.4 * n))
        for k in range(n):
            plan.xid[k] = 94 if k == 0 else 63 if k < dies else 43
            if k >= dies:
                s = (k - dies + 1) * dt
                plan.clock[k] = -chip.clock_idle
                plan.util[k] = 0.0
                power[k] = min(p0[k], chip.power_idle + 1.5 * noise[k])
                plan.dfb[k] = -(used0[k] * 0.98)  # the driver's own allocations stay
                plan.dtemp[k] = -(t0[k] - 38.0) * (1.0 - math.exp(-s / 120.0)) if t0[k] > 38.0 else 0.0
                plan.dmem_temp[k] = plan.dtemp[k]
        plan.rows = [0 if k == 0 else 1 for k in range(n)]
        plan.dbe = [1] * n
        plan.sbe = [min(k + 1, 3) for k in range(n)]
    else:  # memleak
        total = _fb_capacity(ov, exporter, inc.gpu)
        grow = max(1, int(0.8 * n))
        for k in range(n):
            frac = min(1.0, (k + 1) / grow) * weight[k]
            plan.dfb[k] = max(0.0, (total - used0[k]) * frac)
    plan.dpower = [power[k] - p0[k] for k in range(n)]
    # Energy: the power at a scrape is what the interval before it drew (rate(energy) == power).
    acc, plan.energy = 0.0, []
    for k in range(n):
        acc += dt * plan.dpower[k]
        plan.energy.append(acc)
    plan.rows = plan.rows or [0] * n
    plan.sbe = plan.sbe or [0] * n
    plan.dbe = plan.dbe or [0] * n
    return plan


def _fb_capacity(ov: Overlay, exporter: str, gpu: int) -> float:
    """What FB used can grow to: total - reserved (dcgm), total VRAM (AMD), the memory size (Intel),
    most of the shared RAM (Jetson)."""
    used = ov._base.get((exporter, gpu, FB_USED))
    if used is None:
        return 0.0
    free = ov._base.get((exporter, gpu, FB_FREE))
    if free is not None:  # free + used is the same at any load: dcgm's total - reserved, AMD's total
        return free.a + used.a
    return used.hi if math.isfinite(used.hi) else CHIPS[exporter].mem_total


def gpu_counts(exporters: Iterable[str], units: Mapping[str, Unit]) -> dict[str, int]:
    """GPUs per enabled GPU exporter of the node's owners (Kepler's own GPU series follow dcgm's)."""
    counts: dict[str, int] = {}
    for exporter in exporters:
        if exporter not in CHIPS:
            continue
        found: set[int] = set()
        for unit in units.values():
            for tpl in unit.tpls.get(exporter, []):
                gpu = _gpu_of(exporter, unit.key, unit.gpu, tpl, dict(tpl.labels))
                if gpu is not None:
                    found.add(gpu)
        counts[exporter] = len(found)
    return counts


def check_gpus(incidents: Iterable[Incident], gpu_counts: Mapping[str, int]) -> None:
    """ValueError unless every incident's GPU exists on one of the enabled GPU exporters and no two
    incidents overlap on one GPU."""
    incidents = list(incidents)
    if not incidents:
        return
    if not gpu_counts:
        raise ValueError("incidents need a GPU exporter (dcgm, amd, intel or jetson) enabled")
    most = max(gpu_counts.values())
    for inc in incidents:
        if inc.gpu >= most:
            have = ", ".join(f"{e}: {c}" for e, c in gpu_counts.items())
            raise ValueError(f"incident on gpu {inc.gpu}: the simulated node has GPUs 0-{most - 1} ({have})")
    by_gpu = sorted(incidents, key=lambda i: (i.gpu, i.start_tick))
    for a, b in itertools.pairwise(by_gpu):
        if a.gpu == b.gpu and b.start_tick < a.end_tick:
            raise ValueError(f"incidents {a.kind} and {b.kind} overlap on gpu {a.gpu}")
