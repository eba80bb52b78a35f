"""AMD ROCm device-metrics-exporter (1.5): lower-case gpu_* / pcie_* / xgmi_* series, per GPU ``gpu_id``.

With the Helm chart's MetricsFieldPrefix the names start ``amd_`` (``amd_gpu_*``, ...). Every family is
typed gauge, accumulators too: energy (µJ), ECC counts, violation residency; VRAM in "MB" that are MiB
(MI300X: 196592 = 192 GiB), activity in %, clocks in MHz. MI300X has no edge temperature, MI2xx no
junction one, and MI2xx reports gpu_average_package_power instead of gpu_package_power. ``card_model``
is a board part number, not a product name.
"""

from __future__ import annotations

from typing import Final

from vendors.record import (
    Counter,
    Exporter,
    Gauge,
    GpuSignals,
    ModelLimits,
    Preset,
    RuleDefaults,
    RuleSection,
    label_gpu,
    rule,
)

SAMPLE: Final = "amd-device-metrics-exporter-sample.prom"

# The GPU models' own limits, from AMD's data sheets (``source``). ``card_model`` is a board part number:
# ``served_as`` lists the ones known (the sample's MI300X boards). MI210 and others without a found source
# are left out: they get a learned limit.
MI300X: Final = ModelLimits(
    power_limit=750.0,
    memory_bytes=192 << 30,
    served_as=("102-G30211-0C", "AMD Instinct MI300X"),
    source="AMD Instinct MI300X data sheet: 750 W peak board power (OAM), 192 GB HBM3",
)


def _counters() -> frozenset[str]:
    """The monotonic families without a counter suffix (typed gauge), with and without the Helm chart's
    ``amd_`` prefix. ``*_count`` ones already are counters."""
    blocks = ("sdma", "gfx", "mmhub", "athub", "bif", "hdp", "xgmi_wafl", "df", "smn", "sem")
    blocks += ("mp0", "mp1", "fuse", "umc", "mca", "vcn", "jpeg", "ih", "mpio")
    names = {"gpu_energy_consumed", "gpu_violation_current_accumulated_counter"}
    names |= {f"gpu_ecc_{kind}_{block}" for kind in ("correct", "uncorrect", "deferred") for block in blocks}
    names |= {
        f"gpu_violation_{what}_accumulated"
        for what in (
            "processor_hot_residency",
            "ppt_residency",
            "socket_thermal_residency",
            "vr_thermal_residency",
            "hbm_thermal_residency",
        )
    }
    return frozenset(names | {f"amd_{n}" for n in names})


def _owns(name: str) -> bool:
    # Lower case only, and never a *_Hz name: Jetson's gpu_utilization_percentage_Hz is not AMD's.
    bare = name[4:] if name.startswith("amd_gpu_") else name
    return bare.startswith(("gpu_", "pcie_", "xgmi_")) and bare.islower() and not name.endswith("_Hz")


_POWER: Final = "(gpu_package_power or gpu_average_package_power or gpu_power_usage)"

RECORD: Final = Exporter(
    name="amd",
    vendor="amd",
    presets={
        # Lower case only: Jetson's gpu_utilization_percentage_Hz is not AMD's.
        "amd": Preset(
            "every ROCm device-metrics-exporter series: gpu_*, pcie_*, xgmi_* (and amd_gpu_*, ... with the "
            "Helm chart's MetricsFieldPrefix amd_)",
            ("(amd_)?(gpu|pcie|xgmi)_[a-z0-9_]+",),
            _counters(),
            summary="ROCm device-metrics-exporter: gpu_*, pcie_*, xgmi_*, optionally prefixed amd_",
        ),
        "amd-critical": Preset(
            "the AMD GPU series alerts need at full resolution: temperature, utilisation, VRAM, power, "
            "ECC error totals",
            (
                "(amd_)?gpu_(junction|edge|memory|hbm)_temperature|(amd_)?gpu_(gfx|umc)_activity"
                "|(amd_)?gpu_(used|free|total)_vram|(amd_)?gpu_(package_power|average_package_power|power_usage)"
                "|(amd_)?gpu_ecc_(correct|uncorrect)_total",
            ),
            summary="its temperatures, gfx/umc activity, VRAM, power, ECC totals",
        ),
    },
    gpu=GpuSignals(
        owns=_owns,
        gpu_labels=("gpu_id",),
        strip_prefix="amd_",
        model_label="card_model",
        models={"MI300X": MI300X},
        # Memory 0.96: an inference server's GPU holds 89-95% of its VRAM on an ordinary day
        # (bench/anomaly_bench.py --vendor amd: precision 0.44 -> 0.94 on power-cap runs, recall unchanged).
        rules=RuleDefaults(power_fraction=0.97, memory_fraction=0.96, gpu_temp_c=95.0, memory_temp_c=90.0),
        readings=(
            Gauge("gpu_junction_temperature", "temp"),
            Gauge("gpu_memory_temperature", "mem_temp"),
            Gauge("gpu_package_power", "power"),
            Gauge("gpu_used_vram", "fb"),
            Gauge("gpu_total_vram", "fb_total"),
            Gauge("gpu_gfx_activity", "util"),
            # The share of time the GPU was held back (PPT, socket / HBM / VR thermal): the worst reason.
            Gauge("gpu_violation_*_residency_percentage", "violation", worst=True),
            Counter("gpu_ecc_uncorrect_total", "ecc", "ecc_uncorrect"),
            Counter("gpu_ecc_correct_total", "ecc", "ecc_correct"),
            Counter("gpu_ecc_deferred_total", "ecc", "ecc_deferred"),
        ),
    ),
    rules=(
        RuleSection(
            "AMD: ROCm device-metrics-exporter",
            notes='VRAM in "MB" that are MiB (MI300X: 196592 = 192 GiB), activity in %, clocks in MHz, ECC '
            "counts typed gauge (rate() does not care); MI300X has no edge temperature, MI2xx no junction "
            "one, and MI2xx reports gpu_average_package_power instead of gpu_package_power. The exporter "
            f"serves no power limit: {MI300X.power_limit:g} W (MI300X OAM).",
            rules=(
                rule(
                    "gpu:temperature_celsius",
                    label_gpu("gpu_edge_temperature or gpu_junction_temperature", "gpu_id"),
                    "The edge temperature where there is one (MI2xx), as other vendors report; MI300X has "
                    "only the junction (hotspot) one, which runs hotter.",
                ),
                rule("gpu:utilization_ratio", label_gpu("gpu_gfx_activity / 100", "gpu_id")),
                rule("gpu:memory_used_bytes", label_gpu("gpu_used_vram * 1048576", "gpu_id")),
                rule("gpu:memory_total_bytes", label_gpu("gpu_total_vram * 1048576", "gpu_id")),
                rule("gpu:power_watts", label_gpu(_POWER, "gpu_id")),
                rule("gpu:power_limit_watts", label_gpu(f"{_POWER} * 0 + {MI300X.power_limit:g}", "gpu_id")),
                rule(
                    "gpu:clock_hertz",
                    label_gpu(
                        'max without (clock_index, clock_type) (gpu_clock{clock_type="system"}) * 1e6',
                        "gpu_id",
                    ),
                ),
                rule(
                    "gpu:errors:rate5m",
                    label_gpu("rate(gpu_ecc_uncorrect_total[5m])", "gpu_id"),
                    error_type="uncorrectable",
                ),
                rule(
                    "gpu:errors:rate5m",
                    label_gpu("rate(gpu_ecc_correct_total[5m])", "gpu_id"),
                    error_type="correctable",
                ),
            ),
        ),
    ),
    samples=(SAMPLE,),
    hwmon_chips=frozenset({"amdgpu", "radeon"}),
)
