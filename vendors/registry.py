"""Every exporter's record, in order, and the views of them all that the relay reads.

The order is visible: it is the order of the budget schema's preset enum and of the default
``anomaly.presets`` (the GPU exporters'). The records are checked on import (unique names, a preset's
``gpus`` naming a GPU exporter, a summary for every preset, a vendor for every record with rules), so a
broken record fails at once, not in a scrape.
"""

from __future__ import annotations

from typing import Final

from vendors import amd, dcgm, intel, jetson, kepler, node, scrape
from vendors.record import Exporter, GpuSignals, Preset

RECORDS: Final[tuple[Exporter, ...]] = (
    kepler.RECORD,
    dcgm.RECORD,
    amd.RECORD,
    intel.RECORD,
    jetson.RECORD,
    node.RECORD,
    scrape.RECORD,
)
BY_NAME: Final = {r.name: r for r in RECORDS}


def _presets() -> dict[str, Preset]:
    presets: dict[str, Preset] = {}
    for record in RECORDS:
        for name, preset in record.presets.items():
            if name in presets:
                raise ValueError(f"vendors.{record.name}: preset {name!r} is another record's already")
            presets[name] = preset
    return presets


# The budget's presets by name, and the names every class treats as counters without a counter suffix.
PRESETS: Final = _presets()
PRESET_COUNTERS: Final = frozenset[str]().union(*(p.counters for p in PRESETS.values()))

# The GPU exporters (the anomaly detector's vendors), by name, in order.
GPUS: Final[dict[str, GpuSignals]] = {r.name: r.gpu for r in RECORDS if r.gpu is not None}
# Which GPU exporter a budget class's preset says the node runs (the default ``anomaly.presets``).
PRESET_GPUS: Final = {
    name: preset.gpus or record.name
    for record in RECORDS
    for name, preset in record.presets.items()
    if preset.gpus or record.gpu is not None
}
# hwmon chip names of GPUs (node-exporter's ``node_hwmon_chip_names``): the GPU detector watches those.
HWMON_GPU_CHIPS: Final = frozenset[str]().union(*(r.hwmon_chips for r in RECORDS))


def _check() -> None:
    if len(BY_NAME) != len(RECORDS):
        raise ValueError("vendors: two records share a name")
    for preset, gpus in PRESET_GPUS.items():
        if gpus not in GPUS:
            raise ValueError(f"vendors: preset {preset!r} implies {gpus!r}, which is no GPU exporter")
    for name, preset in PRESETS.items():
        if not preset.summary:
            raise ValueError(f"vendors: preset {name!r} has no summary (the schema describes it by it)")
    for record in RECORDS:
        if record.rules and not record.vendor:
            raise ValueError(f"vendors.{record.name}: recording rules need a vendor (their `vendor` label)")


_check()


def gpu_exporter_of(name: str) -> str | None:
    """The GPU exporter a metric name is one of (Kepler's GPU series: dcgm's); None: no GPU's."""
    for key, gpu in GPUS.items():
        if gpu.owns(name):
            return key
    return None
