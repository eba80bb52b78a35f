"""Kepler models: v0.11.x (``kepler``, text or OpenMetrics) and the old v0.7.12 line (``kepler-0.7``).

The fixtures' series as templates: gauges follow their owner's load, counters grow at their sibling
watts gauge's rate (so ``rate(joules) == watts``) or, without one, at the fixture's value over Kepler's
uptime; ``*_info`` and Go runtime settings stay constant. Process CPU time moves in whole clock ticks,
as Kepler reads it from procfs.
"""

from __future__ import annotations

from typing import Any

from simulator.base import (
    CONST,
    COUNTER,
    FMT_GO_TICKS,
    GAUGE,
    STATIC,
    Exposition,
    Family,
    Tpl,
    family_decimals,
    fixture,
    is_constant,
)
from simulator.topology import Owners, relabel
from vendors import kepler as record


def build(owners: Owners, topo: dict[str, Any]) -> Exposition:
    """Kepler v0.11's exposition; its series go to their owners."""
    raw = fixture(record.SAMPLE)
    uptime = float(topo["kepler_uptime_s"])
    expo = Exposition([Family(f.name, f.help, f.type) for f in raw], sorted_output=True)
    watts = {
        (f.name, labels): float(v) for f in raw if f.name.endswith("_watts") for _, labels, v in f.samples
    }
    job_key = topo["job"]["key"]
    for fi, fam in enumerate(raw):
        dec = family_decimals(fam)
        for sname, labels, vs in fam.samples:
            v0 = float(vs)
            d = dict(labels)
            owner, app = _kepler_owner(owners, fam.name, d)
            unit = owners.static(owner)
            slot = 1 if unit.gpu is not None and unit.kind != STATIC and "_gpu_" in fam.name else 0
            if owner == job_key:  # stored as running; the terminated report relabels it
                labels = tuple((k, "running" if k == "state" else v) for k, v in labels)
            tpl = Tpl(fi, sname, labels, GAUGE, 0.0, v0, lo=0.0, dec=dec, slot=slot, app=app)
            if is_constant(fam.name):
                tpl.kind, tpl.a, tpl.b = CONST, v0, 0.0
            elif fam.name == "go_memstats_last_gc_time_seconds":
                tpl.kind, tpl.a, tpl.b, tpl.c = COUNTER, v0, 1.0, 0.0  # wall clock of the last GC
            elif fam.type == "counter" or (fam.type == "summary" and sname != fam.name):
                sibling = watts.get((fam.name.replace("_joules_total", "_watts"), labels))
                rate = sibling if sibling is not None else v0 / uptime
                tpl.kind, tpl.a, tpl.b, tpl.c = COUNTER, v0, 0.0, rate
                if sname.endswith("_count") and fam.type == "summary":
                    tpl.om_int, tpl.dec = True, 0  # an observation count is an integer
            elif fam.name == "kepler_node_cpu_usage_ratio":
                tpl.hi = 1.0
            if fam.name == "kepler_process_cpu_seconds_total":
                # Kepler reads it as (utime + stime) / USER_HZ (internal/resource/procfs_reader.go):
                # whole 10 ms ticks. Some of the fixture's values have 17 digits, which that code
                # cannot print; they stay at tick 0 only, as the fixture's byte-for-byte contract.
                tpl.fmt = FMT_GO_TICKS
            unit.add("kepler", tpl)
    return expo


def _kepler_owner(owners: Owners, family: str, d: dict[str, str]) -> tuple[str, bool]:
    """Owner key of a Kepler v0.11 series, and whether it is app-level (reported when terminated)."""
    if "pid" in d:
        pid = d["pid"]
        return owners.pid_owner.get(pid, f"proc:{pid}"), pid in owners.app_pids
    if "container_id" in d:
        cid = d["container_id"]
        return owners.cid_owner[cid], cid in owners.app_cids
    if "pod_id" in d:
        return owners.uid_owner[d["pod_id"]], True
    if family.startswith("kepler_node_gpu"):
        return f"gpu{d['gpu']}", False
    if family.startswith("kepler_node_cpu") and family != "kepler_node_cpu_info":
        return "power:node", False
    return "runtime", False


def build_07(owners: Owners, topo: dict[str, Any]) -> Exposition:
    """Kepler v0.7.12's exposition (the old line); its series go to their owners."""
    raw = fixture(record.SAMPLE_07)
    uptime = float(topo["kepler_uptime_s"])
    expo = Exposition([Family(f.name, f.help, f.type) for f in raw], sorted_output=True)
    gpu_families = ("kepler_container_gpu_compute_util_total", "kepler_container_gpu_mem_util_total")
    for fi, fam in enumerate(raw):
        dec = family_decimals(fam)
        for sname, labels, vs in fam.samples:
            v0 = float(vs)
            d = dict(labels)
            if "container_id" in d:
                owner = owners.cid_owner.get(d["container_id"], f"k07:{d['container_id']}")
            elif fam.name == "kepler_node_gpu_joules_total":
                owner = f"gpu{d['package']}"
            elif fam.name.startswith("kepler_node_") and fam.name != "kepler_node_info":
                owner = "power:node"
            else:
                owner = "runtime"
            unit = owners.static(owner)
            gpu_bound = fam.name in gpu_families or (
                fam.name == "kepler_container_gpu_joules_total" and d.get("mode") == "dynamic"
            )
            slot = 1 if unit.gpu is not None and unit.kind != STATIC and gpu_bound else 0
            if is_constant(fam.name):
                tpl = Tpl(fi, sname, labels, CONST, v0, dec=dec)
            else:  # the old line exposes counters only; no watts gauges to take rates from
                tpl = Tpl(fi, sname, labels, COUNTER, v0, 0.0, v0 / uptime, dec=dec, slot=slot)
            unit.add("kepler-0.7", tpl)
    # The fixture has no 0.7 series for the finished job; give it the template pod's, relabelled.
    job = topo["job"]
    src = owners.units[job["kepler07_template"]]
    src_pod = next(p for p in topo["pods"] if p["key"] == src.key)
    changes = {
        "container_id": job["containers"][0]["id"],
        "container_name": job["containers"][0]["name"],
        "container_namespace": job["namespace"],
        "pod_name": job["name"],
    }
    job_unit = owners.units[job["key"]]
    app_cid = src_pod["containers"][0]["id"]
    for tpl in src.tpls.get("kepler-0.7", []):
        if dict(tpl.labels).get("container_id") == app_cid:
            job_unit.add("kepler-0.7", relabel(tpl, changes, 6.0))
    return expo
