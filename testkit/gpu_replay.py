"""The real H200 trace (``simulator/data/h200-nvml-training-trace.csv``, NVML every 0.5 s while a training
job started, ran and cooled down) served as dcgm-exporter 4.x pages with its default fields, several GPUs
at different offsets, with incidents injected on top of the real values; and a replay of those pages
through the relay's own detector. The anomaly bench (``--real``) and the tests
(``tests/edge/test_anomaly_real.py``) use it.
"""

from __future__ import annotations

import bisect
import csv
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from simulator.base import data_path

T0_MS = 1_800_000_000_000

TRACE = data_path("h200-nvml-training-trace.csv")
REAL_KINDS = ("thermal", "slowdown", "xid", "memleak")
REAL_GPUS = 4
# dcgm-exporter 4.x's default fields (etc/default-counters.csv) the trace measured, with the help texts
# it serves; the fields the trace has no column for are served as their idle values (0).
REAL_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Frame buffer memory free (in MB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Frame buffer memory used (in MB)."),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter",
     "Number of remapped rows for uncorrectable errors"),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Number of remapped rows for correctable errors"),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "gauge", "The rate of data transmitted over the PCIe bus - including both "
     "protocol headers and data payloads - in bytes per second."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "gauge", "The rate of data received over the PCIe bus - including both "
     "protocol headers and data payloads - in bytes per second."),
)  # fmt: skip
# Served only with --health-fields (not among the defaults): the clock event reasons.
HEALTH_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons."),
)


class RealTrace:
    """The measured trace as an endless loop: each column's value at any time (sample-and-hold, as
    dcgm-exporter serves the latest sample), the energy counter monotonic across loops."""

    def __init__(self, path: Path = TRACE) -> None:
        with path.open(newline="") as f:
            rows = list(csv.DictReader(f))
        t0 = float(rows[0]["t"])
        self.t = [float(r["t"]) - t0 for r in rows]
        step = self.t[-1] - self.t[-2]
        self.period = self.t[-1] + step
        self.rows = [
            {k: float(v) for k, v in r.items() if k not in ("t", "phase", "fan") and v} for r in rows
        ]
        last, first = self.rows[-1], self.rows[0]
        self.energy_loop = last["energy_mj"] - first["energy_mj"] + last["power_w"] * step * 1000

    def at(self, seconds: float) -> dict[str, float]:
        loops, offset = divmod(seconds, self.period)
        row = dict(self.rows[max(0, bisect.bisect_right(self.t, offset) - 1)])
        row["energy_mj"] += loops * self.energy_loop
        return row


@dataclass(frozen=True)
class RealIncident:
    """An incident added to the trace's values on one GPU from ``start`` for ``seconds``."""

    kind: str  # thermal | slowdown | xid | memleak
    gpu: int
    start: float
    seconds: float

    def apply(self, t: float, row: dict[str, float]) -> None:
        dt = t - self.start
        if not 0 <= dt < self.seconds:
            return
        if self.kind == "thermal":
            # Cooling lost: first order toward 105 °C (0.8 °C/s at first from 45 °C), power unchanged.
            rise = (105.0 - row["gpu_temp"]) * (1 - math.exp(-dt / 75.0))
            row["gpu_temp"] = round(row["gpu_temp"] + rise)
            row["mem_temp"] = round(row["mem_temp"] + rise / 2)
        elif self.kind == "slowdown":
            # HW slowdown: the clocks cut to 40 %, the power above idle halved, reason 0x8 set.
            row["sm_clock"] = round(row["sm_clock"] * 0.4)
            row["power_w"] = 120.0 + max(0.0, row["power_w"] - 120.0) / 2
            row["throttle_reasons"] = float(int(row["throttle_reasons"]) | 0x8)
        elif self.kind == "xid":
            # A burst: XID 79 (fallen off the bus), 31, 43 (the gauge holds the last one).
            row["xid"] = (79.0, 31.0, 43.0)[min(2, int(dt // 10))]
        elif self.kind == "memleak":
            # A steady leak of 0.15 % of the memory a second (215 MiB/s on an H200) until it is full.
            total = row["fb_used_mib"] + row["fb_free_mib"]
            leak = min(0.0015 * total * dt, row["fb_free_mib"] - 64)
            row["fb_used_mib"] += leak
            row["fb_free_mib"] -= leak


def real_page(
    trace: RealTrace, t: float, gpus: int = REAL_GPUS, incident: RealIncident | None = None,
    health_fields: bool = False,
) -> bytes:  # fmt: skip
    """dcgm-exporter 4.x's page at ``t`` seconds: ``gpus`` H200s, GPU i at offset i/gpus of the trace."""
    rows = []
    for i in range(gpus):
        row = trace.at(t + i * trace.period / gpus)
        row.setdefault("xid", 0.0)
        if incident is not None and incident.gpu == i:
            incident.apply(t, row)
        rows.append(row)
    values = {
        "DCGM_FI_DEV_SM_CLOCK": lambda r: f"{r['sm_clock']:.0f}",
        "DCGM_FI_DEV_MEM_CLOCK": lambda r: f"{r['mem_clock']:.0f}",
        "DCGM_FI_DEV_MEMORY_TEMP": lambda r: f"{r['mem_temp']:.0f}",
        "DCGM_FI_DEV_GPU_TEMP": lambda r: f"{r['gpu_temp']:.0f}",
        "DCGM_FI_DEV_POWER_USAGE": lambda r: f"{r['power_w']:.6f}",
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": lambda r: f"{r['energy_mj']:.0f}",
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": lambda r: f"{r['pcie_replay']:.0f}",
        "DCGM_FI_DEV_GPU_UTIL": lambda r: f"{r['gpu_util']:.0f}",
        "DCGM_FI_DEV_MEM_COPY_UTIL": lambda r: f"{r['mem_copy_util']:.0f}",
        "DCGM_FI_DEV_XID_ERRORS": lambda r: f"{r['xid']:.0f}",
        "DCGM_FI_DEV_FB_FREE": lambda r: f"{r['fb_free_mib']:.0f}",
        "DCGM_FI_DEV_FB_USED": lambda r: f"{r['fb_used_mib']:.0f}",
        "DCGM_FI_PROF_PCIE_TX_BYTES": lambda r: f"{r['pcie_tx_kbs'] * 1024:.0f}",
        "DCGM_FI_PROF_PCIE_RX_BYTES": lambda r: f"{r['pcie_rx_kbs'] * 1024:.0f}",
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": lambda r: f"{r['throttle_reasons']:.0f}",
    }
    out = []
    for name, kind, help_text in REAL_FIELDS + (HEALTH_FIELDS if health_fields else ()):
        out.append(f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n")
        value = values.get(name, lambda r: "0")
        for i, row in enumerate(rows):
            labels = (
                f'gpu="{i}",UUID="GPU-5e3a8c1f-0b7d-4c2e-9a61-7f2d3e4b5c{i:02d}",'
                f'pci_bus_id="00000000:{0x18 + i:02X}:00.0",device="nvidia{i}",modelName="NVIDIA H200",'
                'Hostname="edge-h200-01",DCGM_FI_DRIVER_VERSION="580.159.04"'
            )
            out.append(f"{name}{{{labels}}} {value(row)}\n")
    return "".join(out).encode()


def replay_real(
    cfg: Any, interval_s: float, seconds: float, incident: RealIncident | None = None,
    gpus: int = REAL_GPUS, health_fields: bool = False, trace: RealTrace | None = None,
    on_cycle: Callable[[Any, int], None] | None = None,
) -> tuple[list[Any], Any]:  # fmt: skip
    """The trace's pages scraped every ``interval_s`` for ``seconds``, as the relay scrapes (parse +
    ``TargetShaper``), through the relay's ``Detector``: its events, and the detector (``on_cycle``:
    called with it and the cycle's time after each cycle)."""
    from edge_relay.anomaly.detector import Detector
    from edge_relay.collect.parse import parse as parse_exposition
    from edge_relay.collect.shape import TargetShaper

    trace = trace or RealTrace()
    shaper = TargetShaper("dcgm", {"job": "dcgm", "instance": "dcgm"}, {})
    det = Detector(cfg, interval_s)
    events = []
    for tick in range(int(seconds / interval_s)):
        t = tick * interval_s
        ts = T0_MS + round(t * 1000)
        page = real_page(trace, t, gpus, incident, health_fields)
        events += det.observe([shaper.shape(ts, parse_exposition(page), 0.01)], ts)
        if on_cycle is not None:
            on_cycle(det, ts)
    return events, det
