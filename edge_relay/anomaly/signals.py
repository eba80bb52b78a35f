"""What a scrape says about a GPU: the vendors' tables, the signals taken from their series, and the
EWMA z-score over them (``edge_relay.anomaly.detector`` runs the rules and keeps the windows).

Series are grouped by the vendor's GPU label: dcgm-exporter ``gpu`` (Kepler's ``kepler_*gpu*{gpu}``
joins the same GPU), AMD ``gpu_id``, Intel ``hw_id`` (or ``device_id``), Jetson one GPU (``0``).
``take`` turns one sample into a signal (``x``) or a fired counter / code rule; ``Ewma`` is the score
both the GPU and the node detectors (``edge_relay.anomaly.node``) use, over their own signals and floors.
Standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from schemas.model import Labels

VENDORS: Final = ("dcgm", "amd", "intel", "jetson")
# Which budget class presets say which GPU exporter is scraped (the default `presets`).
PRESET_VENDOR: Final = {
    "dcgm": "dcgm",
    "dcgm-critical": "dcgm",
    "amd": "amd",
    "amd-critical": "amd",
    "intel": "intel",
    "intel-critical": "intel",
    "jetson": "jetson",
    "jetson-critical": "jetson",
    "kepler-gpu": "dcgm",  # Kepler reads GPUs through NVML: an NVIDIA node
}
# Throttle reasons that are faults: SW power cap 0x4, HW slowdown 0x8, SW / HW thermal 0x20 / 0x40,
# power brake 0x80 (idle, application clocks and sync boost are ordinary).
THROTTLE_MASK: Final = 0xEC
SIGNALS: Final = ("util", "power", "temp", "mem_temp", "fb", "clock", "w_per_util")
# z-score floors (the bench's): a flat signal's near-zero spread must not turn noise into alarms.
FLOORS: Final = {"util": 3.0, "power": 5.0, "temp": 1.0, "mem_temp": 1.0, "fb": 256.0, "clock": 20.0,
                 "w_per_util": 0.2}  # fmt: skip
EWMA_ALPHA: Final = 0.016  # half-life ~43 scrapes
EWMA_WARMUP: Final = 24  # scrapes before the score counts
SCORE_DEBOUNCE: Final = 2  # scrapes in a row over the threshold


@dataclass(frozen=True, slots=True)
class Thresholds:
    """One vendor's limits; ``None``: that rule is off (the exporter has no such field)."""

    gpu_temp_c: float
    memory_temp_c: float | None
    power_fraction: float  # of the limit (served, else ``power_limit``)
    power_limit: float | None  # the exporter's unit (W; Jetson mW); None: only a served limit
    memory_fraction: float  # of the total memory
    temp_slope_c: float  # rise within ``slope_seconds`` that fires
    slope_seconds: float


DEFAULT_THRESHOLDS: Final = {
    "dcgm": Thresholds(85.0, 92.0, 0.97, 300.0, 0.95, 4.5, 15.0),  # A100 PCIe: the bench's rules:all
    # MI300X; memory 0.96: an inference server's GPU holds 89-95% of its VRAM on an ordinary day
    # (bench/anomaly_bench.py --vendor amd: precision 0.44 -> 0.94 on power-cap runs, recall unchanged).
    "amd": Thresholds(95.0, 90.0, 0.97, 750.0, 0.96, 4.5, 15.0),
    "intel": Thresholds(90.0, None, 0.97, None, 0.95, 4.5, 15.0),  # Flex 170: limit configured
    # Orin Nano 8GB, 15 W mode. No power rule: its ordinary draw is 14.1-15.4 W, a capped one the same
    # (the bench: 5.25 false events per GPU-hour at 0.95 x 15 W, 2.38 at 1.03); set power_limit to use one.
    "jetson": Thresholds(90.0, None, 0.95, None, 0.95, 4.5, 15.0),
}
THRESHOLD_KEYS: Final = tuple(Thresholds.__dataclass_fields__)


class Ewma:
    """Per signal |x - mean| / sqrt(var + floor²) with EWMA mean and variance; the max over signals."""

    __slots__ = ("floors", "mean", "n", "signals", "var")

    def __init__(self, signals: tuple[str, ...] = SIGNALS, floors: Mapping[str, float] = FLOORS) -> None:
        self.signals = signals
        self.floors = floors
        self.n = 0
        self.mean: dict[str, float] = {}
        self.var: dict[str, float] = {}

    def score(self, x: Mapping[str, float]) -> float:
        z, a = 0.0, EWMA_ALPHA
        floors = self.floors
        for s in self.signals:
            v = x.get(s)
            if v is None or v != v:
                continue
            if s not in self.mean:
                self.mean[s], self.var[s] = v, 0.0
                continue
            d = v - self.mean[s]
            if self.n >= EWMA_WARMUP:
                z = max(z, abs(d) / math.sqrt(self.var[s] + floors[s] ** 2))
            self.mean[s] += a * d
            self.var[s] = (1 - a) * (self.var[s] + a * d * d)
        self.n += 1
        return z


# (vendor, metric name) -> signal. Counters / codes are handled by ``take``.
_DCGM: Final = {
    "DCGM_FI_DEV_GPU_TEMP": "temp",
    "DCGM_FI_DEV_MEMORY_TEMP": "mem_temp",
    "DCGM_FI_DEV_POWER_USAGE": "power",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT": "power_limit",
    "DCGM_FI_DEV_FB_USED": "fb",
    "DCGM_FI_DEV_FB_FREE": "fb_free",
    "DCGM_FI_DEV_FB_RESERVED": "fb_reserved",
    "DCGM_FI_DEV_GPU_UTIL": "util",
    "DCGM_FI_DEV_SM_CLOCK": "clock",
}
# Counters whose any increase is an event: metric -> (kind, rule).
_DCGM_COUNTERS: Final = {
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": ("remap", "remapped_rows"),
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": ("remap", "remapped_rows"),
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc", "ecc_sbe"),
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc", "ecc_dbe"),
    "DCGM_FI_DEV_RETIRED_SBE": ("ecc", "retired_sbe"),
    "DCGM_FI_DEV_RETIRED_DBE": ("ecc", "retired_dbe"),
    "DCGM_FI_DEV_POWER_VIOLATION": ("power", "power_violation"),
    "DCGM_FI_DEV_THERMAL_VIOLATION": ("thermal", "thermal_violation"),
}
_AMD: Final = {
    "gpu_junction_temperature": "temp",
    "gpu_memory_temperature": "mem_temp",
    "gpu_package_power": "power",
    "gpu_used_vram": "fb",
    "gpu_total_vram": "fb_total",
    "gpu_gfx_activity": "util",
}
_AMD_COUNTERS: Final = {
    "gpu_ecc_uncorrect_total": ("ecc", "ecc_uncorrect"),
    "gpu_ecc_correct_total": ("ecc", "ecc_correct"),
    "gpu_ecc_deferred_total": ("ecc", "ecc_deferred"),
}
_INTEL: Final = {
    "hw_power_watts": "power",
    "hw_memory_usage_bytes": "fb",
    "hw_memory_size_bytes": "fb_total",
}
_WORKLOAD_LABELS: Final = frozenset(
    ("pod", "namespace", "container", "exported_pod", "exported_namespace", "exported_container")
)
_GPU_LABELS: Final = {"dcgm": ("gpu",), "amd": ("gpu_id",), "intel": ("hw_id", "device_id")}


def gpu_key(vendor: str, labels: Labels) -> str | None:
    """The GPU a series of ``vendor`` is about (its label's value); None: no GPU's (e.g. Kepler 0.7)."""
    want = _GPU_LABELS.get(vendor)
    if want is None:
        return "0"  # Jetson: one integrated GPU
    have = dict(labels)
    for k in want:
        v = have.get(k)
        if v:
            return v
    return None


def vendor_of(name: str) -> str | None:
    """The GPU exporter a metric name comes from (Kepler's GPU series: dcgm's); None: not a GPU's."""
    if name.startswith("DCGM_FI_"):
        return "dcgm"
    if name.startswith("kepler_") and "_gpu_" in name:
        return "dcgm"  # Kepler's GPU series carry dcgm's (NVML's) index in `gpu`
    bare = name[4:] if name.startswith("amd_gpu_") else name
    if bare.startswith(("gpu_", "pcie_", "xgmi_")) and bare.islower() and not name.endswith("_Hz"):
        return "amd"
    if name.startswith("hw_") or name.startswith("xpum_"):
        return "intel"
    if name in (
        "temperature_C",
        "integrated_power_mW",
        "ram_kB",
        "gpuram_kB",
        "gpu_utilization_percentage_Hz",
    ):
        return "jetson"
    return None


KEPLER_POD: Final = re.compile(r"kepler_(pod|container|process)_gpu_\w+")


def take(
    g: Any, vendor: str, name: str, labels: Labels, value: float, x: dict[str, float],
    fired: list[tuple[str, str]],
) -> None:  # fmt: skip
    """One sample of GPU ``g`` (its ``prev_xid``, ``prev_status``, ``prev_counters``): a signal into
    ``x``, or a counter / code rule into ``fired`` (kind, rule)."""
    if vendor == "dcgm":
        if name == "kepler_node_gpu_watts":
            x["kepler_watts"] = value
            return
        sig = _DCGM.get(name)
        if sig is not None:
            x[sig] = value
            return
        if name == "DCGM_FI_DEV_XID_ERRORS":
            # Holds the last XID: any new non-zero value is an event.
            if value and value != g.prev_xid:
                fired.append(("xid", f"xid={value:g}"))
            g.prev_xid = value
            return
        if name in ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"):
            bits = int(value) & THROTTLE_MASK
            if bits:
                fired.append(("throttle", f"throttle=0x{bits:x}"))
            return
        if name == "DCGM_FI_DEV_ROW_REMAP_FAILURE":
            if value:
                fired.append(("remap", "row_remap_failure"))
            return
        counter = _DCGM_COUNTERS.get(name)
    elif vendor == "amd":
        bare = name[4:] if name.startswith("amd_") else name
        sig = _AMD.get(bare)
        if sig is not None:
            x[sig] = value
            return
        if bare.startswith("gpu_violation_") and bare.endswith("_residency_percentage"):
            x["violation"] = max(value, x.get("violation", 0.0))  # the worst of the reasons
            return
        counter = _AMD_COUNTERS.get(bare)
    elif vendor == "intel":
        have = dict(labels)
        if name == "hw_temperature_celsius" and have.get("hw_sensor_location") == "gpu":
            x["temp"] = value
            return
        if name == "hw_gpu_utilization_ratio":
            x["util"] = value * 100
            return
        sig = _INTEL.get(name)
        if sig is not None:
            x[sig] = value
            return
        if name == "hw_status":
            # Becoming 1: frequency throttled, temperature warning, reset needed. Not on first sight: a
            # state the GPU was already in when the relay started is no event of now.
            prev = g.prev_status.get(labels)
            g.prev_status[labels] = value
            state = have.get("hw_state")
            if (
                value == 1
                and prev is not None
                and prev != 1
                and state in ("throttled", "warning", "reset_needed")
            ):
                fired.append(("throttle", f"hw_status={have.get('hw_type', '')}:{have.get('hw_state')}"))
            return
        counter = ("ecc", "hw_errors") if name == "hw_errors_total" else None
    else:  # jetson
        stat = dict(labels).get("statistic", "")
        if name == "temperature_C" and stat == "tj":
            x["temp"] = value
        elif name == "integrated_power_mW" and stat == "power":
            x["power"] = value
        elif name == "gpuram_kB" and stat in ("", "used", "gpu"):  # jetson_stats: {statistic="gpu"}
            x["fb"] = value
        elif name == "ram_kB" and stat == "total":
            x["fb_total"] = value
        elif name == "gpu_utilization_percentage_Hz" and dict(labels).get("nvidia_gpu", "freq") == "freq":
            x["clock"] = value  # the frequency; its min_freq / max_freq siblings are constants
        return
    if counter is not None:
        # Per series without the workload's labels: dcgm's label set follows the pod on the GPU, and a
        # pod's label set coming back must not compare with the value it had minutes ago.
        key = (name, tuple(kv for kv in labels if kv[0] not in _WORKLOAD_LABELS))
        prev = g.prev_counters.get(key)
        g.prev_counters[key] = value
        if prev is not None and value > prev:  # a reset (going down) is never an event
            fired.append(counter)
