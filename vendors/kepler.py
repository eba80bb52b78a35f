"""Kepler (0.7.12 and 0.10+/0.11): power and energy per node, container, pod, process and VM.

Not a GPU exporter of its own: its GPU series (``kepler_node_gpu_*`` and the workloads' ``*_gpu_*``,
0.11 with experimental.gpu.enabled) are read through NVML, so they describe an NVIDIA node and join
dcgm-exporter's GPUs (``vendors.dcgm``). The node's anomaly detector reads its node energy counters
(``NODE_ENERGY_*``); the GPU detector joins its per-workload GPU series (``WORKLOAD_GPU_SERIES``) to the
GPU dcgm names the workload's pod on.
"""

from __future__ import annotations

import re
from typing import Final

from vendors.record import Exporter, Preset

SAMPLE: Final = "kepler-current-sample.prom"  # 0.11
SAMPLE_07: Final = "kepler-0.7-sample.prom"

# A workload's GPU series: no GPU label of their own, found through the pod dcgm names on a GPU.
WORKLOAD_GPU_SERIES: Final = re.compile(r"kepler_(pod|container|process)_gpu_\w+")
# How those series name their workload (kinds in the order the join meets them: a pod's uid finds its
# containers, a container's id its processes).
WORKLOAD_KINDS: Final = ("pod", "container", "process")
POD_NAME, POD_NAMESPACE, POD_ID, CONTAINER_ID = "pod_name", "pod_namespace", "pod_id", "container_id"

# The node's energy by component. 0.7: one counter per component (both modes summed: dynamic + idle);
# 0.10+: kepler_node_cpu_joules_total with a `zone` label (RAPL's zones, psys the platform).
NODE_ENERGY_07: Final = {
    "kepler_node_platform_joules_total": "platform",
    "kepler_node_package_joules_total": "package",
    "kepler_node_dram_joules_total": "dram",
}
NODE_ENERGY_010: Final = "kepler_node_cpu_joules_total"
NODE_ENERGY_ZONE_LABEL: Final = "zone"
NODE_ENERGY_ZONES: Final = {"psys": "platform", "platform": "platform", "package": "package", "dram": "dram"}


def is_gpu_series(name: str) -> bool:
    """A Kepler series about GPUs (the node's or a workload's), of either line."""
    return name.startswith("kepler_") and "_gpu_" in name


RECORD: Final = Exporter(
    name="kepler",
    presets={
        "kepler": Preset(
            "every Kepler series: 0.7's kepler_{container,node,...}_*_joules_total and 0.10+'s "
            "kepler_{node,container,pod,process,vm}_*_{watts,joules_total}, the GPU ones included "
            "(kepler_node_gpu_*, kepler_{container,pod,process}_gpu_*: 0.11 with experimental.gpu.enabled), "
            "plus their info series",
            ("kepler_.+",),
            # Kepler 0.7 declares its info series a counter.
            frozenset({"kepler_node_info"}),
            summary="every kepler_* series, Kepler 0.7 and 0.10+, GPU series included",
        ),
        "kepler-gpu": Preset(
            "Kepler's GPU power and energy only: kepler_node_gpu_* (info included) and "
            "kepler_{container,pod,process,vm}_gpu_* (0.11 with experimental.gpu.enabled; 0.7's GPU "
            "counters)",
            ("kepler_(node|container|pod|process|vm)_gpu_.+",),
            summary="Kepler's GPU series only: kepler_node_gpu_*, kepler_{container,pod,process,vm}_gpu_*",
            gpus="dcgm",  # Kepler reads GPUs through NVML: an NVIDIA node
        ),
    },
    samples=(SAMPLE, SAMPLE_07),
)
