"""NVIDIA Jetson: jetson_stats_node_exporter (0.1.3, jtop), one integrated GPU per module.

Its own families (its Python process_* / python_* are generic client-library ones): ``*_Hz`` hold kHz,
``gpu_utilization_percentage_Hz`` is the GPU's *frequency* (labels swapped: ``nvidia_gpu="freq"``,
``statistic="gpu"``), memory in KiB ("kB"), power in mW, offline thermal zones read -256. It serves no GPU
load, no error counters and no model.
"""

from __future__ import annotations

from typing import Final

from vendors.record import (
    Exporter,
    Gauge,
    GpuSignals,
    ModelLimits,
    Preset,
    RuleDefaults,
    RuleSection,
    label,
    rule,
)

SAMPLE: Final = "jetson-stats-exporter-sample.prom"

# The modules' own limits (``source``; mW, as the exporter serves power). The exporter names no module, so
# the detector reads ``default_model``'s: the simulator's module (edge-orin-01, 15 W mode), without a power
# rule: its ordinary draw is 14.1-15.4 W, a capped one the same (the bench: 5.25 false events per GPU-hour
# at 0.95 x 15 W, 2.38 at 1.03); set anomaly.thresholds.power_limit to use one. Orin NX has no found
# source and is left out.
ORIN_NANO_8GB: Final = ModelLimits(
    power_limit=None,
    memory_bytes=8 << 30,
    source="Jetson Orin Nano series data sheet: 8 GB LPDDR5 (power modes 7-15 W, 25 W with MAXN SUPER)",
)
AGX_ORIN_64GB: Final = ModelLimits(
    power_limit=60000.0,
    memory_bytes=64 << 30,
    source="Jetson AGX Orin series module data sheet: JAO 64GB maximum module power up to 60 W",
)
AGX_ORIN_32GB: Final = ModelLimits(
    power_limit=40000.0,
    memory_bytes=32 << 30,
    source="Jetson AGX Orin series module data sheet: JAO 32GB maximum module power up to 40 W",
)
# The recording rules' power limit (the exporter serves none): Orin Nano 8GB in MAXN SUPER (AGX Orin: 60 W).
NOMINAL_POWER_LIMIT_W: Final = 25

_SIGNAL_FAMILIES: Final = frozenset(
    {"temperature_C", "integrated_power_mW", "ram_kB", "gpuram_kB", "gpu_utilization_percentage_Hz"}
)

RECORD: Final = Exporter(
    name="jetson",
    vendor="jetson",
    presets={
        "jetson": Preset(
            "every jetson_stats_node_exporter series: cpu_Hz, gpu_utilization_percentage_Hz, emc_Hz (kHz, "
            "despite the names), ram_kB, gpuram_kB, swap_kB, temperature_C, integrated_power, "
            "integrated_power_mW, disk_GB, uptime_s",
            (
                "cpu_Hz|gpu_utilization_percentage_Hz|emc_Hz|ram_kB|gpuram_kB|swap_kB|temperature_C"
                "|integrated_power|integrated_power_mW|disk_GB|uptime_s",
            ),
            # A clock typed gauge: sent as its last value, never averaged.
            frozenset({"uptime_s"}),
            summary="jetson_stats_node_exporter: cpu_Hz, gpu_utilization_percentage_Hz, ram_kB, "
            "temperature_C, integrated_power, ...",
        ),
        "jetson-critical": Preset(
            "the Jetson series alerts need at full resolution: temperatures, GPU frequency (the exporter has "
            "no GPU load), GPU and system memory, module power (Jetson reports no error counters)",
            ("temperature_C|gpu_utilization_percentage_Hz|gpuram_kB|ram_kB|integrated_power_mW",),
            summary="temperatures, GPU frequency, GPU and system memory, module power",
        ),
    },
    gpu=GpuSignals(
        owns=_SIGNAL_FAMILIES.__contains__,
        models={
            "Orin Nano 8GB": ORIN_NANO_8GB,
            "AGX Orin 64GB": AGX_ORIN_64GB,
            "AGX Orin 32GB": AGX_ORIN_32GB,
        },
        default_model="Orin Nano 8GB",
        rules=RuleDefaults(power_fraction=0.95, memory_fraction=0.95, gpu_temp_c=90.0, memory_temp_c=None),
        readings=(
            Gauge("temperature_C", "temp", when=(label("statistic", "tj"),)),
            Gauge("integrated_power_mW", "power", when=(label("statistic", "power"),)),
            Gauge("gpuram_kB", "fb", when=(label("statistic", "", "used", "gpu"),)),  # jetson_stats: "gpu"
            Gauge("ram_kB", "fb_total", when=(label("statistic", "total"),)),
            # The frequency; its min_freq / max_freq siblings are constants.
            Gauge(
                "gpu_utilization_percentage_Hz", "clock", when=(label("nvidia_gpu", "freq", missing="freq"),)
            ),
        ),
    ),
    rules=(
        RuleSection(
            "NVIDIA Jetson: jetson_stats_node_exporter (jtop)",
            notes="*_Hz hold kHz, gpu_utilization_percentage_Hz is the GPU *frequency* (labels swapped: "
            'nvidia_gpu="freq", statistic="gpu"), memory in KiB ("kB"), power in mW, offline sensors read '
            "-256. No GPU load and no error counters: no gpu:utilization_ratio, no gpu:errors:rate5m. Memory "
            "used is the GPU's share of the unified RAM, memory total the module's RAM, power the whole "
            f"module's (VDD_IN). The exporter serves no power limit: {NOMINAL_POWER_LIMIT_W} W (Orin Nano "
            "8GB, MAXN SUPER; AGX Orin: 60 W).",
            rules=tuple(
                rule(record, expr, comment, gpu="0")
                for record, expr, comment in (
                    (
                        "gpu:temperature_celsius",
                        'max without (statistic) (temperature_C{statistic="gpu"} > -256)',
                        "",
                    ),
                    ("gpu:memory_used_bytes", "max without (statistic, nvidia_gpu) (gpuram_kB) * 1024", ""),
                    (
                        "gpu:memory_total_bytes",
                        'max without (statistic) (ram_kB{statistic="total"}) * 1024',
                        "",
                    ),
                    (
                        "gpu:power_watts",
                        'max without (statistic) (integrated_power_mW{statistic="power"}) / 1000',
                        "",
                    ),
                    (
                        "gpu:power_limit_watts",
                        'max without (statistic) (integrated_power_mW{statistic="power"}) * 0 + '
                        f"{NOMINAL_POWER_LIMIT_W}",
                        "",
                    ),
                    (
                        "gpu:clock_hertz",
                        "max without (statistic, nvidia_gpu) "
                        '(gpu_utilization_percentage_Hz{nvidia_gpu="freq"}) * 1000',
                        "kHz, in the family named utilisation.",
                    ),
                )
            ),
        ),
    ),
    samples=(SAMPLE,),
)
