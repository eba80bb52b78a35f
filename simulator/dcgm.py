"""dcgm-exporter model (``dcgm``): NVIDIA GPU fields, unsorted, ``%d`` / ``%f`` numbers, text only.

Each field follows its GPU's load shape within realistic bounds; the energy counter grows at the power
gauge's rate, free frame buffer is what is neither used nor reserved. A GPU's series carry the
container / namespace / pod of the pod holding it, and drop them at the tick its pod is replaced.
"""

from __future__ import annotations

from typing import Any, Final

from simulator.base import CONST, COUNTER, FMT_FLOAT, FMT_INT, GAUGE, INF, Exposition, Family, Tpl, fixture
from simulator.topology import Owners
from vendors import dcgm as record

# The fixture's GPUs: their board power limit and frame buffer (MiB) bound what they draw and hold.
_GPU: Final = record.A100_80GB_PCIE
_POWER_LIMIT_W: Final = _GPU.power_limit if _GPU.power_limit is not None else INF
_FB_MIB: Final = _GPU.memory_bytes / 2**20 if _GPU.memory_bytes is not None else INF

# DCGM field -> (how strongly it follows the GPU's load, lower bound, upper bound); None: constant.
_DCGM_FIELDS: Final[dict[str, tuple[float, float, float] | None]] = {
    "DCGM_FI_DEV_SM_CLOCK": (0.4, 210.0, 1410.0),
    "DCGM_FI_DEV_MEM_CLOCK": None,
    "DCGM_FI_DEV_MEMORY_TEMP": (0.15, 25.0, 95.0),
    "DCGM_FI_DEV_GPU_TEMP": (0.15, 25.0, 90.0),
    "DCGM_FI_DEV_POWER_USAGE": (1.0, 0.0, _POWER_LIMIT_W),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": None,
    "DCGM_FI_DEV_GPU_UTIL": (0.8, 0.0, 100.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": (0.8, 0.0, 100.0),
    "DCGM_FI_DEV_ENC_UTIL": (1.0, 0.0, 100.0),
    "DCGM_FI_DEV_DEC_UTIL": (0.6, 0.0, 100.0),
    "DCGM_FI_DEV_XID_ERRORS": None,
    "DCGM_FI_DEV_FB_USED": (0.3, 0.0, _FB_MIB),
    "DCGM_FI_DEV_FB_RESERVED": None,
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": None,
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": None,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": None,
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": None,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": None,
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (0.8, 0.0, 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (1.0, 0.0, 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": (0.8, 0.0, 1.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": (1.0, 0.0, INF),
    "DCGM_FI_PROF_PCIE_RX_BYTES": (1.0, 0.0, INF),
}


# Fields a counters CSV minded for GPU health adds after the default ones (commented out in
# dcgm-exporter's default-counters.csv): name, type, help. Steady at 0; incidents move them.
HEALTH_FIELDS: Final = (
    ("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", "gauge", "Current clock throttle reasons."),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "counter", "Total number of single-bit volatile ECC errors."),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "counter", "Total number of double-bit volatile ECC errors."),
)


def build(owners: Owners, topo: dict[str, Any], *, health_fields: bool = False) -> Exposition:
    """dcgm-exporter's exposition: the fixture's GPU fields, following each GPU's load
    (``health_fields``: plus ``HEALTH_FIELDS``, after them)."""
    raw = fixture(record.SAMPLE)
    families = [Family(f.name, f.help, f.type) for f in raw]
    if health_fields:
        families += [Family(name, help_, typ) for name, typ, help_ in HEALTH_FIELDS]
    expo = Exposition(families, sorted_output=False)
    values: dict[tuple[str, str], float] = {
        (f.name, dict(labels)["gpu"]): float(v) for f in raw for _, labels, v in f.samples
    }
    holders = {p["gpu"]: owners.units[p["key"]] for p in topo["pods"] if p.get("gpu") is not None}
    for fi, fam in enumerate(raw):
        for sname, labels, vs in fam.samples:
            v0 = float(vs)
            gpu = dict(labels)["gpu"]
            unit = owners.static(f"gpu{gpu}")
            unit.holder = holders.get(int(gpu))
            fmt = FMT_FLOAT if "." in vs else FMT_INT
            tpl = Tpl(fi, sname, labels, CONST, v0, fmt=fmt)
            model = _DCGM_FIELDS.get(fam.name, (0.3, 0.0, INF))
            if fam.name == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":  # mJ, at the power gauge's rate
                power = values[("DCGM_FI_DEV_POWER_USAGE", gpu)]
                tpl.kind, tpl.c = COUNTER, 1000.0 * power
            elif fam.name == "DCGM_FI_DEV_FB_FREE":  # whatever is neither used nor reserved
                amp, lo, hi = _DCGM_FIELDS["DCGM_FI_DEV_FB_USED"]
                used = values[("DCGM_FI_DEV_FB_USED", gpu)]
                total = v0 + used + values[("DCGM_FI_DEV_FB_RESERVED", gpu)]
                tpl.kind, tpl.a, tpl.b = GAUGE, v0 + used * amp, -used * amp
                tpl.lo, tpl.hi = 0.0, total
            elif model is not None:
                amp, lo, hi = model
                tpl.kind, tpl.a, tpl.b, tpl.lo, tpl.hi = GAUGE, v0 * (1 - amp), v0 * amp, lo, hi
            unit.add("dcgm", tpl)
    if health_fields:
        clocks = next(f for f in raw if f.name == "DCGM_FI_DEV_SM_CLOCK")
        for i, (name, _, _) in enumerate(HEALTH_FIELDS):
            for _, labels, _ in clocks.samples:
                gpu = dict(labels)["gpu"]
                owners.static(f"gpu{gpu}").add(
                    "dcgm", Tpl(len(raw) + i, name, labels, CONST, 0.0, fmt=FMT_INT)
                )
    return expo
