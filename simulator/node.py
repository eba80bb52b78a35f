"""node_exporter model (``node``): CPU, memory, filesystems, network, disks, hwmon, its Go runtime.

Written from ``data/node-exporter.json`` (the inventory, HELP texts, rates and shares) plus the rules
here, which keep the kernel's arithmetic: per CPU the modes add up to wall time, MemAvailable and the
active / inactive split follow from the other meminfo fields, free and available space from used.
The Go collector's families are Kepler's (same client_golang), with a smaller process's values.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

from simulator.base import (
    CONST,
    COUNTER,
    GAUGE,
    INF,
    Exposition,
    Family,
    RawFamily,
    Tpl,
    fixture,
    is_constant,
    read_data,
)
from simulator.topology import Owners
from vendors import kepler


def build(owners: Owners, interval_s: float, seed: int) -> Exposition:
    """node_exporter's exposition; its series belong to one static owner, ``host:node_exporter``."""
    spec: dict[str, Any] = json.loads(read_data("node-exporter.json"))
    nb = _NodeBuilder(spec, interval_s, seed)
    nb.build(fixture(kepler.SAMPLE))
    expo = nb.exposition()
    unit = owners.static("host:node_exporter", nb.slots)
    unit.tpls["node"] = nb.templates(expo)
    return expo


class _NodeBuilder:
    """node_exporter's series for edge-gpu-01, from data/node-exporter.json plus the model here."""

    def __init__(self, spec: dict[str, Any], interval_s: float, seed: int) -> None:
        self.spec = spec
        self.interval_s = interval_s
        self.rng = random.Random(f"{seed}:node")
        self.slots: list[str] = []
        self.help: dict[str, tuple[str, str]] = {k: (v[0], v[1]) for k, v in spec["help"].items()}
        self.series: list[tuple[str, dict[str, str], Tpl]] = []
        self.uptime = float(spec["uptime_s"])
        self.epoch = float(spec["epoch_at_tick0"])

    def slot(self, key: str) -> int:
        if key not in self.slots:
            self.slots.append(key)
        return self.slots.index(key)

    def _add(self, name: str, labels: Mapping[str, str], tpl: Tpl) -> None:
        self.series.append((name, dict(labels), tpl))

    def const(self, name: str, labels: Mapping[str, str], v: float) -> None:
        self._add(name, labels, Tpl(0, name, (), CONST, float(v), dec=None))

    def gauge(
        self,
        name: str,
        labels: Mapping[str, str],
        c0: float,
        c1: float,
        slot: str,
        *,
        lo: float = 0.0,
        hi: float = INF,
        dec: int | None = None,
        quantum: int = 0,
    ) -> None:
        """``c0 + c1*S(t)`` of the named shape."""
        tpl = Tpl(0, name, (), GAUGE, c0, c1, lo=lo, hi=hi, dec=dec, quantum=quantum, slot=self.slot(slot))
        self._add(name, labels, tpl)

    def around(
        self, name: str, labels: Mapping[str, str], mean: float, amp: float, slot: str, **kw: Any
    ) -> None:
        """A gauge at ``mean`` that follows the shape with relative strength ``amp``."""
        self.gauge(name, labels, mean * (1 - amp), mean * amp, slot, **kw)

    def counter(
        self,
        name: str,
        labels: Mapping[str, str],
        rate: float,
        slot: str,
        *,
        v0: float | None = None,
        lin: float = 0.0,
        dec: int | None = 0,
    ) -> None:
        """A counter growing at ``rate``/s times the load (plus ``lin``/s), ``rate*uptime`` at tick 0."""
        start = rate * self.uptime if v0 is None else v0
        tpl = Tpl(0, name, (), COUNTER, start, lin, rate, dec=dec, slot=self.slot(slot))
        self._add(name, labels, tpl)

    def build(self, kepler_raw: Iterable[RawFamily]) -> None:
        spec, rng = self.spec, self.rng
        up = self.uptime
        self._cpu(spec)
        self._memory(spec)
        for i, fs in enumerate(spec["filesystems"]):
            lab = {"device": fs["device"], "fstype": fs["fstype"], "mountpoint": fs["mountpoint"]}
            size = float(fs["size"])
            used = fs["used"] * size
            # Used space drifts slowly (images, logs, recordings); free and avail follow.
            slot = f"slow-fs{i}"
            self.const("node_filesystem_size_bytes", lab, size)
            self.gauge("node_filesystem_free_bytes", lab, size, -used, slot, quantum=4096)
            reserved = fs["reserved"] * size
            self.gauge("node_filesystem_avail_bytes", lab, size - reserved, -used, slot, quantum=4096)
            files = float(fs["files"])
            self.const("node_filesystem_files", lab, files)
            self.gauge("node_filesystem_files_free", lab, files, -files * fs["files_used"], slot, dec=0)
            self.const("node_filesystem_readonly", lab, 0)
            self.const("node_filesystem_device_error", lab, 0)
        for nic in spec["interfaces"]:
            lab = {"device": nic["device"]}
            rx, tx, pkt = nic["rx_bps"], nic["tx_bps"], nic["pkt"]
            self.counter("node_network_receive_bytes_total", lab, rx, "node-net")
            self.counter("node_network_transmit_bytes_total", lab, tx, "node-net")
            self.counter("node_network_receive_packets_total", lab, rx / pkt, "node-net")
            self.counter("node_network_transmit_packets_total", lab, tx / pkt, "node-net")
            self.counter("node_network_receive_errs_total", lab, 0.0004 if rx > 1e7 else 0.0, "node-net")
            self.counter("node_network_transmit_errs_total", lab, 0.0, "node-net")
            self.const("node_network_up", lab, nic["up"])
            self.const("node_network_mtu_bytes", lab, nic["mtu"])
            info = {
                "address": nic["address"],
                "adminstate": "up",
                "broadcast": nic["broadcast"],
                "device": nic["device"],
                "duplex": nic["duplex"],
                "ifalias": "",
                "operstate": nic["operstate"],
            }
            self.const("node_network_info", info, 1)
        for disk in spec["disks"]:
            lab = {"device": disk["device"]}
            reads, writes = disk["read_bps"] / 65536, disk["write_bps"] / 131072
            self.counter("node_disk_reads_completed_total", lab, reads, "node-disk")
            self.counter("node_disk_read_bytes_total", lab, reads * 65536, "node-disk")
            self.counter("node_disk_read_time_seconds_total", lab, reads * 0.00011, "node-disk", dec=3)
            self.counter("node_disk_writes_completed_total", lab, writes, "node-disk")
            self.counter("node_disk_written_bytes_total", lab, writes * 131072, "node-disk")
            self.counter("node_disk_write_time_seconds_total", lab, writes * 0.00004, "node-disk", dec=3)
            self.counter("node_disk_io_time_seconds_total", lab, disk["io"], "node-disk", dec=3)
            self.counter(
                "node_disk_io_time_weighted_seconds_total", lab, disk["io"] * 1.4, "node-disk", dec=3
            )
            self.around("node_disk_io_now", lab, 1.0, 1.0, "node-disk", dec=0)
            info = {
                k: disk[k] for k in ("device", "major", "minor", "model", "path", "revision", "rotational")
            }
            info.update(serial=disk["serial"], wwn=disk["wwn"])
            self.const("node_disk_info", info, 1)
        hw = spec["hwmon"]
        self.const("node_hwmon_chip_names", {"chip": "platform_coretemp_0", "chip_name": "coretemp"}, 1)
        package = {"chip": "platform_coretemp_0", "sensor": "temp1"}
        self.around("node_hwmon_temp_celsius", package, hw["package_celsius"], 0.15, "node-load", dec=0)
        for core in range(hw["coretemp_cores"]):
            mean = hw["core_celsius"] + rng.uniform(-4, 4)
            lab = {"chip": "platform_coretemp_0", "sensor": f"temp{core + 2}"}
            self.around("node_hwmon_temp_celsius", lab, mean, 0.15, "node-load", dec=0)
        for n, celsius in enumerate(hw["nvme_celsius"]):
            self.const("node_hwmon_chip_names", {"chip": f"nvme_nvme{n}", "chip_name": "nvme"}, 1)
            lab = {"chip": f"nvme_nvme{n}", "sensor": "temp1"}
            self.around("node_hwmon_temp_celsius", lab, celsius, 0.05, "node-disk", dec=2)
        cpus = spec["cpus"]
        busy = 0.44 * cpus
        for name, mean, amp in (
            ("node_load1", busy, 0.8),
            ("node_load5", busy * 0.98, 0.5),
            ("node_load15", busy * 0.96, 0.3),
        ):
            self.around(name, {}, mean, amp, "node-load", dec=2)
        self.around("node_procs_running", {}, busy, 0.8, "node-load", dec=0, lo=1.0)
        self.around("node_procs_blocked", {}, 0.6, 1.0, "node-disk", dec=0)
        self.counter("node_context_switches_total", {}, 186000.0, "node-load")
        self.counter("node_intr_total", {}, 121000.0, "node-load")
        self.counter("node_forks_total", {}, 46.0, "node-load")
        self.const("node_entropy_available_bits", {}, 256)  # constant since Linux 5.18's CSPRNG rework
        self.around("node_filefd_allocated", {}, 28416.0, 0.05, "node-load", dec=0)
        self.const("node_filefd_maximum", {}, 9223372036854775807)
        self.const("node_boot_time_seconds", {}, round(self.epoch - up))
        self.counter("node_time_seconds", {}, 0.0, "flat", v0=self.epoch, lin=1.0, dec=None)
        self.const("node_textfile_scrape_error", {}, 0)
        self.around("node_nf_conntrack_entries", {}, 4130.0, 0.3, "node-net", dec=0)
        self.const("node_nf_conntrack_entries_limit", {}, 262144)
        pressure = {
            "cpu_waiting": 0.41,
            "io_waiting": 0.021,
            "io_stalled": 0.016,
            "memory_waiting": 0.0003,
            "memory_stalled": 0.0001,
        }
        for what, rate in pressure.items():
            self.counter(f"node_pressure_{what}_seconds_total", {}, rate, "node-load", dec=6)
        for field_, rate in (
            ("pgfault", 95000.0),
            ("pgmajfault", 0.8),
            ("pgpgin", 21000.0),
            ("pgpgout", 36000.0),
        ):
            self.counter(f"node_vmstat_{field_}", {}, rate, "node-disk")
        tcp = {
            "ActiveOpens": 41.0,
            "PassiveOpens": 55.0,
            "InSegs": 38000.0,
            "OutSegs": 36500.0,
            "RetransSegs": 12.0,
        }
        for field_, rate in tcp.items():
            self.counter(f"node_netstat_Tcp_{field_}", {}, rate, "node-net")
        self.around("node_netstat_Tcp_CurrEstab", {}, 420.0, 0.2, "node-net", dec=0)
        for collector in spec["collectors"]:
            lab = {"collector": collector}
            mean = math.exp(rng.uniform(math.log(4e-5), math.log(0.02)))
            self.around("node_scrape_collector_duration_seconds", lab, mean, 0.6, "node-runtime")
            self.const("node_scrape_collector_success", lab, 1)
        self.const("node_os_info", spec["os"], 1)
        osv = {"id": spec["os"]["id"], "id_like": spec["os"]["id_like"], "name": spec["os"]["name"]}
        self.const("node_os_version", osv, float(spec["os"]["version_id"]))
        self.const("node_uname_info", spec["uname"], 1)
        self.const("node_exporter_build_info", spec["build_info"], 1)
        self._process()
        self._go_runtime(kepler_raw)

    def _cpu(self, spec: dict[str, Any]) -> None:
        up = self.uptime
        for cpu in range(spec["cpus"]):
            slot = f"node-cpu{cpu}"
            load = self.rng.uniform(0.6, 1.4)
            busy_rate = busy_total = 0.0
            for mode, share in spec["cpu_modes"].items():
                rate = share * load * self.rng.uniform(0.8, 1.2)
                self.counter("node_cpu_seconds_total", {"cpu": str(cpu), "mode": mode}, rate, slot, dec=2)
                busy_rate += rate
                busy_total += rate * up
            # Idle is what the other modes leave: per CPU the modes add up to wall time exactly.
            lab = {"cpu": str(cpu), "mode": "idle"}
            self.counter("node_cpu_seconds_total", lab, -busy_rate, slot, v0=up - busy_total, lin=1.0, dec=2)

    def _memory(self, spec: dict[str, Any]) -> None:
        total = float(spec["mem_total_kb"]) * 1024
        # Affine functions of the "node-mem" shape S: (c0, c1) means c0 + c1*S.
        parts: dict[str, tuple[float, float]] = {}
        for name, value in spec["memory"].items():
            if not name.startswith("_"):
                share, amp = value
                parts[name] = (share * total * (1 - amp), share * total * amp)

        def comb(*terms: tuple[float, str | tuple[float, float]]) -> tuple[float, float]:
            c0 = c1 = 0.0
            for k, part in terms:
                p = parts[part] if isinstance(part, str) else part
                c0 += k * p[0]
                c1 += k * p[1]
            return c0, c1

        one = (total, 0.0)
        kernel = ("AnonPages", "Cached", "Buffers", "SReclaimable", "SUnreclaim", "KernelStack", "PageTables")
        parts["MemFree"] = comb((1, one), *((-1, k) for k in kernel), (-0.008, one))
        parts["MemAvailable"] = comb(
            (1, "MemFree"), (1, "Cached"), (1, "Buffers"), (1, "SReclaimable"), (-1, "Shmem"), (-0.02, one)
        )
        parts["Active_anon"] = comb((0.96, "AnonPages"), (0.5, "Shmem"))
        parts["Inactive_anon"] = comb((0.04, "AnonPages"), (0.5, "Shmem"))
        parts["Active_file"] = comb((0.55, "Cached"), (0.5, "Buffers"))
        parts["Inactive_file"] = comb((0.45, "Cached"), (0.5, "Buffers"))
        parts["Active"] = comb((1, "Active_anon"), (1, "Active_file"))
        parts["Inactive"] = comb((1, "Inactive_anon"), (1, "Inactive_file"))
        parts["Committed_AS"] = comb((1.7, "AnonPages"))
        for name, (c0, c1) in parts.items():
            self.gauge(f"node_memory_{name}_bytes", {}, c0, c1, "node-mem", quantum=1024)
        fixed = {
            "MemTotal": total,
            "CommitLimit": total / 2 // 1024 * 1024,  # no swap: half of RAM at overcommit_ratio 50
            "SwapTotal": 0,
            "SwapFree": 0,
            "SwapCached": 0,
            "Hugepagesize": 2097152,
            "VmallocTotal": 35184372087808,
        }
        for name, value in fixed.items():
            self.const(f"node_memory_{name}_bytes", {}, value)
        self.const("node_memory_HugePages_Total", {}, 0)
        self.const("node_memory_HugePages_Free", {}, 0)

    def _process(self) -> None:
        up, lab = self.uptime, {}
        self.counter("process_cpu_seconds_total", lab, 0.021, "node-runtime", dec=2)
        self.const("process_max_fds", lab, 1048576)
        self.around("process_open_fds", lab, 11.0, 0.2, "node-runtime", dec=0)
        self.around("process_resident_memory_bytes", lab, 27.3e6, 0.1, "node-runtime", quantum=4096)
        self.around("process_virtual_memory_bytes", lab, 1.318e9, 0.02, "node-runtime", quantum=4096)
        self.const("process_virtual_memory_max_bytes", lab, 18446744073709551615)
        self.const("process_start_time_seconds", lab, round(self.epoch - up + 41.37, 2))
        self.counter("process_network_receive_bytes_total", lab, 900.0, "node-runtime")
        self.counter("process_network_transmit_bytes_total", lab, 26000.0, "node-runtime")
        self.const("promhttp_metric_handler_requests_in_flight", lab, 1)
        # One scrape per tick: exactly +1 per tick whatever the interval.
        scrapes = {"code": "200"}
        per_tick = 1.0 / self.interval_s
        self.counter(
            "promhttp_metric_handler_requests_total", scrapes, 0.0, "flat", v0=round(up / 15), lin=per_tick
        )
        for code in ("500", "503"):
            self.const("promhttp_metric_handler_requests_total", {"code": code}, 0)
        for cause in ("encoding", "gathering"):
            self.const("promhttp_metric_handler_errors_total", {"cause": cause}, 0)

    def _go_runtime(self, kepler_raw: Iterable[RawFamily]) -> None:
        """Same client_golang Go collector as Kepler's (same HELP text), a smaller process's values."""
        go = self.spec["build_info"]["goversion"]
        for fam in kepler_raw:
            if not fam.name.startswith("go_"):
                continue
            self.help[fam.name] = (fam.type, fam.help)
            for sname, labels, vs in fam.samples:
                lab = dict(labels)
                v = float(vs)
                if fam.name == "go_info":
                    self.const(sname, {"version": go}, 1)
                elif is_constant(fam.name):
                    self.const(sname, lab, v)
                elif fam.name == "go_memstats_last_gc_time_seconds":
                    self.counter(sname, lab, 0.0, "flat", v0=self.epoch - 7.3, lin=1.0, dec=None)
                elif fam.type == "counter" or sname != fam.name:
                    scaled = v * 0.11
                    dec = 0 if float(vs).is_integer() else None
                    self.counter(sname, lab, scaled / self.uptime, "node-runtime", v0=scaled, dec=dec)
                else:
                    mean = {"go_goroutines": 9.0, "go_threads": 15.0}.get(fam.name, v * 0.18)
                    self.around(sname, lab, mean, 0.3, "node-runtime", dec=0 if float(vs).is_integer() else 9)

    def exposition(self) -> Exposition:
        families = []
        for name in sorted({_summary_family(name) for name, _, _ in self.series}):
            if name.startswith("node_memory_"):
                self.help.setdefault(name, ("gauge", f"Memory information field {name[12:]}."))
            typ, text = self.help[name]
            families.append(Family(name, text, typ))
        return Exposition(families, sorted_output=True)

    def templates(self, expo: Exposition) -> list[Tpl]:
        index = expo.index()
        out = []
        for name, labels, tpl in self.series:
            tpl.fam = index[_summary_family(name)]
            tpl.labels = tuple(sorted(labels.items()))  # client_golang sorts label pairs by name
            tpl.om_int = name == "go_gc_duration_seconds_count"
            out.append(tpl)
        return out


def _summary_family(name: str) -> str:
    return "go_gc_duration_seconds" if name.startswith("go_gc_duration_seconds") else name
