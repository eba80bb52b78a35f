"""Exporter models of three more GPU edge nodes: AMD (``amd``), Intel (``intel``), NVIDIA Jetson (``jetson``).

- ``amd``: ROCm device-metrics-exporter v1.5.1 on ``edge-gpu-02`` (2 x MI300X), port 5000;
- ``intel``: Intel XPU Manager 2.x ``xpumd`` v2.0.0 (OpenTelemetry ``hw_*`` names) on ``edge-gpu-03``
  (2 x Data Center GPU Flex 170), port 8080;
- ``jetson``: laminair/jetson_stats_node_exporter v0.1.3 (jtop) on ``edge-orin-01`` (Orin Nano 8GB).

Each is its fixture in ``data/`` brought to life, as ``dcgm`` is: tick 0 is the fixture byte for byte,
families, series order, labels and number spelling stay the exporter's, and the exporters' quirks stay
in: AMD types every accumulator (energy in µJ, ECC, violation residency) as a gauge; Jetson's ``*_Hz``
families hold kHz, ``gpu_utilization_percentage_Hz`` holds the GPU *frequency* with its two labels
swapped, offline thermal zones read -256 and never move, ``disk_GB{mountpoint="percent"}`` is divided
by 1e9. The series set is fixed (no pods come and go on these nodes' GPUs).

Values: a gauge follows its GPU's (or the module's) load shape within bounds; power drives energy, so
``rate(energy) == power`` (AMD: µJ per second = 1e6 x W); memory used drives free memory and the used
ratio; accumulators without a rate in the fixture grow at their fixture value over the exporter's
uptime. Jetson's numbers are Python's prometheus_client spelling (``115200.0``, ``1.728e+06``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Final

from simulator.base import (
    CONST,
    COUNTER,
    FMT_GO,
    FMT_PY,
    GAUGE,
    INF,
    Exposition,
    Family,
    RawFamily,
    Tpl,
    family_decimals,
    fixture,
)
from simulator.topology import Owners
from vendors import amd, intel, jetson

AMD_FIXTURE: Final = amd.SAMPLE
INTEL_FIXTURE: Final = intel.SAMPLE
JETSON_FIXTURE: Final = jetson.SAMPLE
# The AMD node's GPUs (MI300X OAM): their board limit bounds what they draw.
_AMD_POWER_LIMIT_W: Final = amd.MI300X.power_limit if amd.MI300X.power_limit is not None else INF

# Gauge families: (share of the value that follows the load, lower bound, upper bound).
Move = tuple[float, float, float]

_AMD_GAUGES: Final[dict[str, Move]] = {
    "gpu_package_power": (1.0, 0.0, _AMD_POWER_LIMIT_W),
    "gpu_average_package_power": (1.0, 0.0, _AMD_POWER_LIMIT_W),
    "gpu_power_usage": (1.0, 0.0, _AMD_POWER_LIMIT_W),
    "gpu_junction_temperature": (0.15, 20.0, 110.0),
    "gpu_edge_temperature": (0.15, 20.0, 100.0),
    "gpu_memory_temperature": (0.15, 20.0, 105.0),
    "gpu_gfx_activity": (0.8, 0.0, 100.0),
    "gpu_umc_activity": (0.8, 0.0, 100.0),
    "gpu_gfx_busy_instantaneous": (0.8, 0.0, 100.0),
    "gpu_process_cu_occupancy": (0.6, 0.0, 100.0),
    "gpu_used_vram": (0.3, 0.0, INF),
    "pcie_bandwidth": (1.0, 0.0, INF),
    "gpu_violation_ppt_residency_percentage": (1.0, 0.0, 100.0),
    "gpu_violation_socket_thermal_residency_percentage": (1.0, 0.0, 100.0),
    "gpu_violation_hbm_thermal_residency_percentage": (1.0, 0.0, 100.0),
}

_INTEL_GAUGES: Final[dict[str, Move]] = {
    "hw_power_watts": (1.0, 0.0, 400.0),
    "hw_temperature_celsius": (0.15, 20.0, 105.0),
    "hw_gpu_utilization_ratio": (0.8, 0.0, 1.0),
    "hw_gpu_bandwidth_utilization_ratio": (1.0, 0.0, 1.0),
    "hw_memory_bandwidth_utilization_ratio": (0.8, 0.0, 1.0),
    "hw_gpu_io_rate_bytes_per_second": (1.0, 0.0, INF),
    "hw_memory_io_rate_bytes_per_second": (1.0, 0.0, INF),
    "hw_memory_usage_bytes": (0.3, 0.0, INF),
}

# Jetson: the module's load drives GPU, power rails and thermals (slot 0), the CPUs drive their own
# series (slot 1), memory moves slowly (slot 2).
_J_GPU, _J_CPU, _J_SLOW = 0, 1, 2


def _exposition(raw: tuple[RawFamily, ...], *, go_sorted: bool) -> Exposition:
    """The families in the exporter's order; series always in the fixture's order, which is the
    exporter's own (client_golang's sort for AMD and Intel, insertion order for prometheus_client)."""
    expo = Exposition([Family(f.name, f.help, f.type) for f in raw], sorted_output=go_sorted)
    expo.sort_series = [False] * len(raw)
    return expo


def _gauge(tpl: Tpl, v0: float, move: Move) -> None:
    amp, lo, hi = move
    tpl.kind, tpl.a, tpl.b, tpl.lo, tpl.hi = GAUGE, v0 * (1 - amp), v0 * amp, lo, hi


def _derived(tpl: Tpl, src: Tpl, factor: float, total: float | None = None) -> None:
    """A gauge that moves with ``src``: ``factor * src`` (a ratio), or ``total - src`` (free memory)."""
    if total is None:
        tpl.kind, tpl.a, tpl.b, tpl.lo, tpl.hi = GAUGE, src.a * factor, src.b * factor, 0.0, 1.0
    else:
        tpl.kind, tpl.a, tpl.b, tpl.lo, tpl.hi = GAUGE, total - src.a, -src.b, 0.0, total


def _exact_at_tick0(tpl: Tpl, v0: float) -> None:
    """Nudge the offset so ``a + b * 1.0`` (the load is 1 at tick 0) is the fixture's value to the bit:
    full-precision values (``55.88235294117647``) must come out as the fixture spells them."""
    for _ in range(16):
        err = v0 - (tpl.a + tpl.b)
        if err == 0:
            return
        tpl.a = math.nextafter(tpl.a, math.inf if err > 0 else -math.inf)


def _accumulator(tpl: Tpl, v0: float, per_second: float) -> None:
    tpl.kind, tpl.a, tpl.b, tpl.c = COUNTER, v0, 0.0, per_second


def _build(
    owners: Owners,
    exporter: str,
    raw: tuple[RawFamily, ...],
    *,
    go_sorted: bool,
    owner: str,
    slots: list[str],
    slot_of: Callable[[dict[str, str]], int | None],
    model: Callable[[str, dict[str, str], float, Tpl, dict[tuple[str, str], Tpl]], None],
    fmt: int = FMT_GO,
) -> Exposition:
    """The exposition of ``raw``; every series goes to the static owner ``owner`` in fixture order.

    ``model(family, labels, v0, tpl, done)`` turns the CONST template into a moving one; ``done`` maps
    (family, key) -> template of the series built so far, keyed by ``_key`` (siblings look each
    other up: energy finds its power, free memory its used memory).
    """
    expo = _exposition(raw, go_sorted=go_sorted)
    unit = owners.static(owner, slots)
    done: dict[tuple[str, str], Tpl] = {}
    # Sources first (sizes, then power and used memory, then what derives from them).
    order = sorted(range(len(raw)), key=lambda i: _SOURCES.get(raw[i].name, 2))
    tpls: dict[tuple[int, int], Tpl] = {}
    for fi in order:
        fam = raw[fi]
        dec = family_decimals(fam)
        for si, (sname, labels, vs) in enumerate(fam.samples):
            v0 = float(vs)
            d = dict(labels)
            slot = slot_of(d)
            tpl = Tpl(fi, sname, labels, CONST, v0, dec=dec, slot=slot or 0, fmt=fmt)
            if slot is not None:
                model(fam.name, d, v0, tpl, done)
                if tpl.kind == GAUGE:
                    _exact_at_tick0(tpl, v0)
            done[(fam.name, _key(d))] = tpl
            tpls[(fi, si)] = tpl
    for key in sorted(tpls):
        unit.add(exporter, tpls[key])
    return expo


# Families other families are derived from, by build order.
_SOURCES: Final = {
    "gpu_total_vram": 0,
    "hw_memory_size_bytes": 0,
    "gpu_package_power": 1,
    "gpu_used_vram": 1,
    "hw_power_watts": 1,
    "hw_memory_usage_bytes": 1,
}


def _key(d: Mapping[str, str]) -> str:
    """What identifies a device (or a sensor of it) across families."""
    for k in ("gpu_id", "pci_bdf"):
        if k in d:
            return d[k]
    return d.get("statistic", "")


# --- AMD ----------------------------------------------------------------------------------------


def build_amd(owners: Owners, uptime: float) -> Exposition:
    """ROCm device-metrics-exporter: client_golang text, every family a gauge (accumulators too)."""
    raw = fixture(AMD_FIXTURE)
    gpus = sorted({dict(lab)["gpu_id"] for f in raw for _, lab, _ in f.samples if "gpu_id" in dict(lab)})

    def model(family: str, d: dict[str, str], v0: float, tpl: Tpl, done: dict[tuple[str, str], Tpl]) -> None:
        gpu = d["gpu_id"]
        if family == "gpu_energy_consumed":  # µJ, at the package power's rate
            power = done[("gpu_package_power", gpu)]
            tpl.kind, tpl.c = COUNTER, 1e6 * power.b
        elif family == "gpu_free_vram":
            _derived(tpl, done[("gpu_used_vram", gpu)], 1.0, done[("gpu_total_vram", gpu)].a)
        elif family == "gpu_clock":
            if d.get("clock_type") == "system":  # gfx clocks follow the load; memory, soc, ... do not
                _gauge(tpl, v0, (0.4, 0.0, 2100.0))
        elif family.startswith("gpu_violation_") and family.endswith(("_accumulated", "_counter")):
            _accumulator(tpl, v0, v0 / uptime)
        elif family in _AMD_GAUGES:
            _gauge(tpl, v0, _AMD_GAUGES[family])
        # Everything else (totals, ECC and PCIe error counts, health, link speed) stays put.

    return _build(
        owners,
        "amd",
        raw,
        go_sorted=True,
        owner="amd",
        slots=[f"gpu{g}" for g in gpus],
        slot_of=lambda d: gpus.index(d["gpu_id"]) if "gpu_id" in d else None,
        model=model,
    )


# --- Intel --------------------------------------------------------------------------------------


def build_intel(owners: Owners, uptime: float) -> Exposition:
    """xpumd's Prometheus exporter (OpenTelemetry prometheusexporter): client_golang text."""
    raw = fixture(INTEL_FIXTURE)
    bdfs = sorted({dict(lab)["pci_bdf"] for f in raw for _, lab, _ in f.samples if "pci_bdf" in dict(lab)})

    def model(family: str, d: dict[str, str], v0: float, tpl: Tpl, done: dict[tuple[str, str], Tpl]) -> None:
        bdf = d["pci_bdf"]
        if family == "hw_energy_joules_total":  # at the power gauge's rate
            tpl.kind, tpl.c = COUNTER, done[("hw_power_watts", bdf)].b
        elif family in ("hw_gpu_io_bytes_total", "hw_memory_io_bytes_total"):
            _accumulator(tpl, v0, v0 / uptime)
        elif family == "hw_memory_utilization_ratio":  # used / size
            size = done[("hw_memory_size_bytes", bdf)].a
            _derived(tpl, done[("hw_memory_usage_bytes", bdf)], 1.0 / size)
            tpl.dec = None
        elif family == "hw_memory_usage_bytes":
            _gauge(tpl, v0, _INTEL_GAUGES[family])
            tpl.hi, tpl.quantum = done[("hw_memory_size_bytes", bdf)].a, 4096
        elif family == "hw_frequency_hertz":
            if d.get("aggregation") == "avg":
                _gauge(tpl, v0, (0.3, 0.0, 2.05e9))
                tpl.dec = -6  # whole MHz, as Sysman reports it
        elif family in _INTEL_GAUGES:
            _gauge(tpl, v0, _INTEL_GAUGES[family])

    return _build(
        owners,
        "intel",
        raw,
        go_sorted=True,
        owner="intel",
        slots=[f"gpu{i}" for i in range(len(bdfs))],
        slot_of=lambda d: bdfs.index(d["pci_bdf"]) if "pci_bdf" in d else None,
        model=model,
    )


# --- Jetson -------------------------------------------------------------------------------------


def build_jetson(owners: Owners, uptime: float) -> Exposition:
    """jetson_stats_node_exporter: prometheus_client text, insertion order, Python float spelling."""
    raw = fixture(JETSON_FIXTURE)
    by_stat = {(f.name, dict(lab).get("statistic", "")): float(v) for f in raw for _, lab, v in f.samples}

    def slot_of(d: dict[str, str]) -> int:
        # The Python collectors' series (no statistic / core label) and the disk move slowly.
        return _J_SLOW if "generation" in d or ("statistic" not in d and "core" not in d) else _J_GPU

    def model(family: str, d: dict[str, str], v0: float, tpl: Tpl, done: dict[tuple[str, str], Tpl]) -> None:
        stat = d.get("statistic", "")
        if family in ("python_gc_objects_collected_total", "python_gc_collections_total"):
            _accumulator(tpl, v0, v0 / uptime)
            tpl.dec = 0  # counts
        elif family == "process_cpu_seconds_total":
            _accumulator(tpl, v0, v0 / uptime)
        elif family in ("process_virtual_memory_bytes", "process_resident_memory_bytes"):
            _gauge(tpl, v0, (0.05, 0.0, INF))
            tpl.quantum = 4096
        elif family == "cpu_Hz":
            tpl.slot = _J_CPU
            if stat == "freq":  # kHz, between the cores' min and max
                _gauge(tpl, v0, (0.3, by_stat[("cpu_Hz", "min_freq")], by_stat[("cpu_Hz", "max_freq")]))
                tpl.dec = 0
            elif stat == "val":  # load in %
                _gauge(tpl, v0, (0.6, 0.0, 100.0))
        elif family == "gpu_utilization_percentage_Hz":
            if d.get("nvidia_gpu") == "freq":  # the GPU's frequency in kHz, not its load
                _gauge(tpl, v0, (0.4, 306000.0, 1020000.0))
                tpl.dec = 0
        elif family == "ram_kB":
            tpl.slot = _J_SLOW
            if stat == "used":
                _gauge(tpl, v0, (0.3, 0.0, by_stat[("ram_kB", "total")]))
                tpl.dec = 0
            elif stat == "free":  # what used memory leaves: free0 + used0 - used(t)
                used = done[("ram_kB", "used")]
                tpl.kind, tpl.a, tpl.b = GAUGE, v0 + used.b, -used.b
                tpl.lo, tpl.hi, tpl.dec = 0.0, by_stat[("ram_kB", "total")], 0
        elif family == "gpuram_kB":
            _gauge(tpl, v0, (0.3, 0.0, INF))
            tpl.dec = 0
        elif family == "emc_Hz":
            if stat == "total":  # holds the current EMC clock (kHz); "used" the max, "cached" the min
                _gauge(tpl, v0, (0.3, by_stat[("emc_Hz", "cached")], by_stat[("emc_Hz", "used")]))
                tpl.dec = 0
        elif family == "temperature_C":
            if v0 > -256.0:  # an offline zone reads -256 and stays there
                _gauge(tpl, v0, (0.1, 20.0, 105.0))
        elif family in ("integrated_power", "integrated_power_mW"):
            if stat in ("power", "avg_power", "current"):
                _gauge(tpl, v0, (1.0 if stat != "avg_power" else 0.8, 0.0, INF))
                tpl.dec = 0
        elif family == "uptime_s":
            tpl.kind, tpl.a, tpl.b, tpl.c = COUNTER, v0, 1.0, 0.0  # a clock: one second per second

    return _build(
        owners,
        "jetson",
        raw,
        go_sorted=False,
        owner="jetson",
        slots=["gpu:jetson", "cpu:jetson", "slow:jetson"],
        slot_of=slot_of,
        model=model,
        fmt=FMT_PY,
    )
