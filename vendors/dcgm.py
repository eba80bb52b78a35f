"""NVIDIA dcgm-exporter: DCGM's fields as DCGM_FI_* series, one per GPU (label ``gpu``, DCGM's index).

Its counters keep DCGM's field names: upper case, mostly without a ``_total`` suffix. Frame buffer in
MiB, utilisation in %, clocks in MHz; the series carry the pod holding the GPU (``pod``, ``namespace``,
``container``), and the GPU's model in ``modelName``. Kepler's GPU series are read through NVML on the
same GPUs (``vendors.kepler``), so the detector counts them as this exporter's.
"""

from __future__ import annotations

from typing import Final

from vendors import kepler
from vendors.record import (
    Bits,
    Code,
    Counter,
    Exporter,
    Flag,
    Gauge,
    GpuSignals,
    ModelLimits,
    PodJoin,
    Preset,
    RuleDefaults,
    RuleSection,
    rule,
)

SAMPLE: Final = "dcgm-exporter-sample.prom"

GIB: Final = 1 << 30


def _nvidia(power_w: float, memory_gib: int | None, served: str, source: str, *also: str) -> ModelLimits:
    return ModelLimits(
        power_limit=power_w,
        memory_bytes=None if memory_gib is None else memory_gib * GIB,
        served_as=(served, *also),
        source=source,
    )


# The GPU models' own limits, from NVIDIA's data sheets and product briefs (``source``; the pages where
# the figure was read are listed in docs/anomaly-detection.md, "GPU models"). ``served_as``: the model
# names NVML gives (dcgm-exporter's ``modelName``). Models whose figures no source was found for (RTX
# A5000 / A6000, GeForce) are left out: they get a learned limit, never a neighbour's.
MODELS: Final = {
    "H200 SXM": _nvidia(
        700, 141, "NVIDIA H200", "NVIDIA H200 Tensor Core GPU data sheet: H200 SXM up to 700 W, 141 GB HBM3e"
    ),
    "H200 NVL": _nvidia(
        600,
        141,
        "NVIDIA H200 NVL",
        "NVIDIA H200 Tensor Core GPU data sheet: H200 NVL up to 600 W, 141 GB HBM3e",
    ),
    "H100 SXM": _nvidia(
        700,
        80,
        "NVIDIA H100 80GB HBM3",
        "NVIDIA H100 Tensor Core GPU data sheet: H100 SXM up to 700 W, 80 GB",
        "NVIDIA H100 SXM5 80GB",
    ),
    "H100 PCIe": _nvidia(
        350,
        80,
        "NVIDIA H100 PCIe",
        "NVIDIA H100 PCIe GPU product brief PB-11133-001_v02: maximum TDP 350 W, 80 GB",
    ),
    "A100 SXM4 80GB": _nvidia(
        400,
        80,
        "NVIDIA A100-SXM4-80GB",
        "NVIDIA A100 Tensor Core GPU data sheet: A100 80GB SXM max TDP 400 W",
    ),
    "A100 SXM4 40GB": _nvidia(
        400,
        40,
        "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100 Tensor Core GPU data sheet: A100 40GB SXM max TDP 400 W",
    ),
    "A100 80GB PCIe": _nvidia(
        300,
        80,
        "NVIDIA A100 80GB PCIe",
        "NVIDIA A100 80GB PCIe GPU product brief PB-10577-001_v03: 300 W, 80 GB HBM2e",
    ),
    "A100 PCIe 40GB": _nvidia(
        250,
        40,
        "NVIDIA A100-PCIE-40GB",
        "NVIDIA A100 40GB PCIe product brief PB-10137-001_v03 / A100 data sheet: 250 W, 40 GB HBM2",
    ),
    "A30": _nvidia(165, 24, "NVIDIA A30", "NVIDIA A30 Tensor Core GPU data sheet: max TDP 165 W, 24 GB"),
    "A2": _nvidia(
        60,
        16,
        "NVIDIA A2",
        "NVIDIA A2 Tensor Core GPU data sheet: max TDP 60 W, 16 GB GDDR6",
    ),
    "L40S": _nvidia(
        350, 48, "NVIDIA L40S", "NVIDIA L40S data sheet: max power consumption 350 W, 48 GB GDDR6"
    ),
    "L4": _nvidia(72, 24, "NVIDIA L4", "NVIDIA L4 Tensor Core GPU data sheet: max TDP 72 W, 24 GB GDDR6"),
    "T4": _nvidia(
        70, 16, "Tesla T4", "NVIDIA T4 product brief: 70 W maximum power limit, 16 GB GDDR6", "NVIDIA T4"
    ),
    "RTX A2000": _nvidia(
        70,
        None,
        "NVIDIA RTX A2000",
        "NVIDIA RTX A2000 data sheet: max power consumption 70 W",
        "NVIDIA RTX A2000 12GB",
    ),
    "RTX A4000": _nvidia(
        140, None, "NVIDIA RTX A4000", "NVIDIA RTX A4000 data sheet: max power consumption 140 W"
    ),
}
A100_80GB_PCIE: Final = MODELS["A100 80GB PCIe"]  # the simulator's GPU (its fixture's modelName)

# Clock throttle / clock event reasons that are faults (NVML's nvmlClocksThrottleReasons, DCGM's
# DCGM_CLOCKS_THROTTLE_REASON_*): HW slowdown 0x8, SW thermal 0x20, HW thermal 0x40, HW power brake 0x80.
# Ordinary: idle 0x1, application clocks 0x2, sync boost 0x10, and the SW power cap 0x4, which a GPU at
# full load holds most of the time (the real H200 trace: most of every epoch).
THROTTLE_MASK: Final = 0xE8

# The recording rules' power limit where the exporter serves no DCGM_FI_DEV_POWER_MGMT_LIMIT: 280 W alerts.
NOMINAL_POWER_LIMIT_W: Final = 295


def _owns(name: str) -> bool:
    # Kepler's GPU series carry dcgm's (NVML's) index in `gpu`.
    return name.startswith("DCGM_FI_") or kepler.is_gpu_series(name)


RECORD: Final = Exporter(
    name="dcgm",
    vendor="nvidia",
    presets={
        "dcgm": Preset(
            "every dcgm-exporter series (DCGM_FI_*)",
            ("DCGM_FI_.+",),
            frozenset(
                {
                    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
                    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
                    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
                    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
                    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
                    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
                    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
                    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
                    "DCGM_FI_DEV_RETIRED_SBE",
                    "DCGM_FI_DEV_RETIRED_DBE",
                    "DCGM_FI_DEV_RETIRED_PENDING",
                    "DCGM_FI_DEV_POWER_VIOLATION",
                    "DCGM_FI_DEV_THERMAL_VIOLATION",
                    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
                    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
                    "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
                    "DCGM_FI_DEV_RELIABILITY_VIOLATION",
                    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
                    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
                    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
                    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
                }
            ),
            summary="every DCGM_FI_* series",
        ),
        "dcgm-critical": Preset(
            "the GPU series alerts need at full resolution: temperature, utilisation, memory used/free, "
            "power usage and limit, XID errors",
            # POWER_MGMT_LIMIT: the recording rules divide the power usage by it.
            (
                "DCGM_FI_DEV_(GPU_TEMP|MEMORY_TEMP|GPU_UTIL|MEM_COPY_UTIL|FB_USED|FB_FREE|POWER_USAGE"
                "|POWER_MGMT_LIMIT|XID_ERRORS)",
            ),
            summary="GPU temperature, utilisation, memory used/free, power usage and limit, XID errors",
        ),
    },
    gpu=GpuSignals(
        owns=_owns,
        gpu_labels=("gpu",),
        model_label="modelName",
        models=MODELS,
        rules=RuleDefaults(power_fraction=0.97, memory_fraction=0.95, gpu_temp_c=85.0, memory_temp_c=92.0),
        pods=PodJoin(series_prefix="DCGM_"),
        readings=(
            Gauge("kepler_node_gpu_watts", "kepler_watts"),
            Gauge("DCGM_FI_DEV_GPU_TEMP", "temp"),
            Gauge("DCGM_FI_DEV_MEMORY_TEMP", "mem_temp"),
            Gauge("DCGM_FI_DEV_POWER_USAGE", "power"),
            Gauge("DCGM_FI_DEV_POWER_MGMT_LIMIT", "power_limit"),
            Gauge("DCGM_FI_DEV_FB_USED", "fb"),
            Gauge("DCGM_FI_DEV_FB_FREE", "fb_free"),
            Gauge("DCGM_FI_DEV_FB_RESERVED", "fb_reserved"),
            Gauge("DCGM_FI_DEV_GPU_UTIL", "util"),
            Gauge("DCGM_FI_DEV_SM_CLOCK", "clock"),
            Code("DCGM_FI_DEV_XID_ERRORS", "xid", "xid"),
            Bits("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "throttle", "throttle", THROTTLE_MASK),
            Bits("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "throttle", "throttle", THROTTLE_MASK),
            Flag("DCGM_FI_DEV_ROW_REMAP_FAILURE", "remap", "row_remap_failure"),
            Counter("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "remap", "remapped_rows"),
            Counter("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "remap", "remapped_rows"),
            Counter("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "ecc", "ecc_sbe"),
            Counter("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "ecc", "ecc_dbe"),
            Counter("DCGM_FI_DEV_RETIRED_SBE", "ecc", "retired_sbe"),
            Counter("DCGM_FI_DEV_RETIRED_DBE", "ecc", "retired_dbe"),
            Counter("DCGM_FI_DEV_POWER_VIOLATION", "power", "power_violation"),
            Counter("DCGM_FI_DEV_THERMAL_VIOLATION", "thermal", "thermal_violation"),
        ),
    ),
    rules=(
        RuleSection(
            "NVIDIA: dcgm-exporter",
            notes="Frame buffer in MiB, utilisation in %, clocks in MHz. Without "
            f"DCGM_FI_DEV_POWER_MGMT_LIMIT the limit is {NOMINAL_POWER_LIMIT_W} W (so 280 W alerts; "
            "A100/H100 PCIe boards are limited to 300-350 W).",
            rules=(
                rule("gpu:temperature_celsius", "DCGM_FI_DEV_GPU_TEMP"),
                rule("gpu:utilization_ratio", "DCGM_FI_DEV_GPU_UTIL / 100"),
                rule("gpu:memory_used_bytes", "DCGM_FI_DEV_FB_USED * 1048576"),
                rule("gpu:memory_total_bytes", "(DCGM_FI_DEV_FB_USED + DCGM_FI_DEV_FB_FREE) * 1048576"),
                rule("gpu:power_watts", "DCGM_FI_DEV_POWER_USAGE"),
                rule(
                    "gpu:power_limit_watts",
                    "DCGM_FI_DEV_POWER_MGMT_LIMIT or "
                    f"(DCGM_FI_DEV_POWER_USAGE * 0 + {NOMINAL_POWER_LIMIT_W})",
                ),
                rule("gpu:clock_hertz", "DCGM_FI_DEV_SM_CLOCK * 1e6"),
                rule(
                    "gpu:errors:rate5m",
                    "rate(DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS[5m])",
                    "Rows remapped after memory errors (real counters), and new XID errors (a gauge "
                    "holding the last XID: each change is a new error).",
                    error_type="uncorrectable",
                ),
                rule(
                    "gpu:errors:rate5m",
                    "rate(DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS[5m])",
                    error_type="correctable",
                ),
                rule("gpu:errors:rate5m", "changes(DCGM_FI_DEV_XID_ERRORS[5m]) / 300", error_type="xid"),
            ),
        ),
    ),
    samples=(SAMPLE,),
    hwmon_chips=frozenset({"nouveau"}),  # the open driver's
)
