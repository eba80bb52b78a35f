"""Prometheus node_exporter: the host's CPU, memory, disks, network, sensors (node_*).

Not a GPU exporter; the node's anomaly detector (``edge_relay.anomaly.node``) reads the series below:
the hottest hwmon / thermal-zone sensor (``node_hwmon_chip_names`` tells a GPU's hwmon chip, by the GPU
records' ``hwmon_chips``; a thermal zone's ``type`` containing "gpu" is a GPU's), available memory of the
total, and memory stalls (PSI "full", with the pressure collector on).
"""

from __future__ import annotations

from typing import Final

from vendors.record import Exporter, Preset

HWMON_TEMP: Final = "node_hwmon_temp_celsius"  # labels chip, sensor
THERMAL_ZONE_TEMP: Final = "node_thermal_zone_temp"  # labels zone, type
HWMON_CHIP_NAMES: Final = "node_hwmon_chip_names"  # labels chip, chip_name
MEM_AVAILABLE: Final = "node_memory_MemAvailable_bytes"
MEM_TOTAL: Final = "node_memory_MemTotal_bytes"
MEM_STALLED: Final = "node_pressure_memory_stalled_seconds_total"

RECORD: Final = Exporter(
    name="node",
    presets={
        "node": Preset("every node_exporter series (node_*)", ("node_.+",), summary="node_exporter's node_*"),
    },
)
