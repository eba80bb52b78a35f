"""Intel XPU Manager: 2.x ``xpumd`` (OpenTelemetry hardware names, hw_*) and the 1.x exporter (xpum_*).

xpumd serves base units, one series per engine / sensor / RAS category, each with the OpenTelemetry
scope's labels, per GPU ``hw_id`` (and ``pci_bdf``); the model is ``hw_gpu_info``'s ``hw_model``. The
1.x exporter's ratios are 0..1 and it has a ``vendor`` label of its own. The two never run side by side,
but their recording rules carry ``exporter`` (xpumd | xpum) so that they cannot collide.
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
    State,
    label,
    label_gpu,
    rule,
)

SAMPLE: Final = "intel-xpumd-sample.prom"

# The GPU models' own limits (``source``). Flex 170 carries no power limit on purpose: its TBP is 150 W,
# but boards run configured above it (the fixture's draws 168 W); set anomaly.thresholds.power_limit to
# use one. Flex 140 and others without a found source are left out: they get a learned limit.
FLEX_170: Final = ModelLimits(
    power_limit=None,
    served_as=("Intel(R) Data Center GPU Flex 170",),
    source="no power limit: boards run above the 150 W TBP (the simulator's fixture draws 168 W)",
)
MAX_1550: Final = ModelLimits(
    power_limit=600.0,
    memory_bytes=128 << 30,
    served_as=("Intel(R) Data Center GPU Max 1550",),
    source="Intel Data Center GPU Max 1550 product page: 600 W TBP, 128 GB HBM2e",
)
MAX_1100: Final = ModelLimits(
    power_limit=300.0,
    memory_bytes=48 << 30,
    served_as=("Intel(R) Data Center GPU Max 1100",),
    source="Intel Data Center GPU Max 1100 product page: 300 W TBP, 48 GB HBM2e",
)
# The recording rules' power limit (the exporters serve no usable one): Flex 170's TBP.
NOMINAL_POWER_LIMIT_W: Final = 150

_OTEL: Final = "otel_scope_name, otel_scope_version, otel_scope_schema_url"


def _owns(name: str) -> bool:
    return name.startswith(("hw_", "xpum_"))


_XPUMD_POWER: Final = (
    f'sum without (hw_name, hw_sensor_location, {_OTEL}) (hw_power_watts{{hw_sensor_location="package"}})'
)
_XPUM_POWER: Final = 'sum without (src) (xpum_power_watts{pci_bdf!="", sub_dev=""})'

RECORD: Final = Exporter(
    name="intel",
    vendor="intel",
    presets={
        # XPU Manager 2.x xpumd (OpenTelemetry hardware names) and the 1.x exporter's xpum_*.
        "intel": Preset(
            "every Intel XPU Manager series: 2.x xpumd's hw_{power,energy,temperature,gpu,memory,frequency,"
            "errors}_* and hw_status, 1.x's xpum_*",
            (
                "hw_status|hw_(energy|errors|frequency|gpu|memory|power|temperature)_[a-z0-9_]+",
                "xpum_[a-z0-9_]+",
            ),
            summary="XPU Manager: 2.x xpumd hw_*, 1.x xpum_*",
        ),
        "intel-critical": Preset(
            "the Intel GPU series alerts need at full resolution: temperature, utilisation, memory used and "
            "size, power, RAS errors (2.x hw_* and 1.x xpum_*)",
            (
                "hw_(temperature_celsius|gpu_utilization_ratio|memory_usage_bytes|memory_size_bytes|power_watts"
                "|errors_total)",
                "xpum_(temperature_celsius|engine_ratio|memory_used_bytes|memory_ratio|power_watts"
                "|(cache|non_compute|programming|driver)_errors_total|resets_total)",
            ),
            summary="temperature, utilisation, memory, power, RAS errors",
        ),
    },
    gpu=GpuSignals(
        owns=_owns,
        gpu_labels=("hw_id", "device_id"),
        model_label="hw_model",
        models={
            "Data Center GPU Flex 170": FLEX_170,
            "Data Center GPU Max 1550": MAX_1550,
            "Data Center GPU Max 1100": MAX_1100,
        },
        rules=RuleDefaults(power_fraction=0.97, memory_fraction=0.95, gpu_temp_c=90.0, memory_temp_c=None),
        readings=(
            Gauge("hw_temperature_celsius", "temp", when=(label("hw_sensor_location", "gpu"),)),
            Gauge("hw_gpu_utilization_ratio", "util", scale=100.0),
            Gauge("hw_power_watts", "power"),
            Gauge("hw_memory_usage_bytes", "fb"),
            Gauge("hw_memory_size_bytes", "fb_total"),
            # Becoming 1: frequency throttled, temperature warning, reset needed.
            State(
                "hw_status",
                "throttle",
                state_label="hw_state",
                states=frozenset({"throttled", "warning", "reset_needed"}),
                what_label="hw_type",
            ),
            Counter("hw_errors_total", "ecc", "hw_errors"),
        ),
    ),
    rules=(
        RuleSection(
            "Intel: XPU Manager 2.x xpumd (OpenTelemetry names)",
            notes="Already base units, one series per engine / sensor / RAS category. These rules and the "
            "1.x exporter's carry `exporter` (xpumd | xpum): the two never run side by side, but their rules "
            "must not collide. Neither serves a usable power limit: "
            f"{NOMINAL_POWER_LIMIT_W} W (Data Center GPU Flex 170).",
            rules=tuple(
                rule(record, label_gpu(expr, "pci_bdf"), comment, exporter="xpumd")
                for record, expr, comment in (
                    (
                        "gpu:temperature_celsius",
                        f"max without (hw_name, hw_sensor_location, statistic, {_OTEL}) "
                        '(hw_temperature_celsius{hw_sensor_location="gpu"})',
                        "",
                    ),
                    (
                        "gpu:utilization_ratio",
                        f"max without (hw_name, hw_gpu_task, {_OTEL}) (hw_gpu_utilization_ratio)",
                        "The busiest engine (compute, render, media, copy), as xpu-smi reports GPU "
                        "utilisation.",
                    ),
                    (
                        "gpu:memory_used_bytes",
                        f"sum without (hw_name, hw_memory_location, hw_memory_type, {_OTEL}) "
                        '(hw_memory_usage_bytes{hw_memory_location="device"})',
                        "",
                    ),
                    (
                        "gpu:memory_total_bytes",
                        f"sum without (hw_name, hw_memory_location, hw_memory_type, {_OTEL}) "
                        '(hw_memory_size_bytes{hw_memory_location="device"})',
                        "",
                    ),
                    ("gpu:power_watts", _XPUMD_POWER, ""),
                    (
                        "gpu:power_limit_watts",
                        f"{_XPUMD_POWER} * 0 + {NOMINAL_POWER_LIMIT_W}",
                        "xpumd's hw_power_limit_watts is left out: it scales milliwatts by 1e3 instead of "
                        "1e-3.",
                    ),
                    (
                        "gpu:clock_hertz",
                        f"max without (hw_name, aggregation, hw_frequency_domain, {_OTEL}) "
                        '(hw_frequency_hertz{aggregation="avg", hw_frequency_domain="gpu"})',
                        "",
                    ),
                    (
                        "gpu:errors:rate5m",
                        f"sum without (hw_name, hw_type, error_category, {_OTEL}) "
                        '(rate(hw_errors_total{hw_type="gpu"}[5m]))',
                        "error_type is xpumd's own (correctable | uncorrectable); the RAS categories add up.",
                    ),
                )
            ),
        ),
        RuleSection(
            "Intel: XPU Manager 1.x exporter",
            notes="xpum_* with a `vendor` label of its own (overwritten here), ratios 0..1.",
            rules=tuple(
                rule(record, label_gpu(expr, "pci_bdf"), comment, exporter="xpum")
                for record, expr, comment in (
                    (
                        "gpu:temperature_celsius",
                        'max without (sub_dev, location, src) (xpum_temperature_celsius{location="gpu"})',
                        "",
                    ),
                    (
                        "gpu:utilization_ratio",
                        'max without (sub_dev, src) (xpum_engine_ratio{pci_bdf!=""})',
                        "",
                    ),
                    (
                        "gpu:memory_used_bytes",
                        'sum without (sub_dev, src) (xpum_memory_used_bytes{pci_bdf!=""})',
                        "",
                    ),
                    (
                        "gpu:memory_total_bytes",
                        "sum without (sub_dev, src) "
                        '(xpum_memory_used_bytes{pci_bdf!=""} / (xpum_memory_ratio > 0))',
                        "The 1.x exporter has no memory size; xpum_memory_ratio is used / size (0..1).",
                    ),
                    (
                        "gpu:power_watts",
                        _XPUM_POWER,
                        "Per GPU: the card-level series carry `card` and no pci_bdf.",
                    ),
                    ("gpu:power_limit_watts", f"{_XPUM_POWER} * 0 + {NOMINAL_POWER_LIMIT_W}", ""),
                    (
                        "gpu:clock_hertz",
                        "max without (sub_dev, src, location, type) "
                        '(xpum_frequency_mhz{location="gpu", type="actual"}) * 1e6',
                        "",
                    ),
                    (
                        "gpu:errors:rate5m",
                        "sum without (type, sub_dev, src) (label_replace(rate({__name__=~"
                        '"xpum_(cache|non_compute)_errors_total", pci_bdf!=""}[5m]), '
                        '"error_type", "$1", "type", "(.*)"))',
                        "",
                    ),
                )
            ),
        ),
    ),
    samples=(SAMPLE,),
    hwmon_chips=frozenset({"i915", "xe"}),
)
