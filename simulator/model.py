"""``Simulator``: the exporter models and ``render``, the payload at a tick.

The NVIDIA node's four (Kepler, Kepler 0.7, dcgm-exporter, node_exporter) and the AMD, Intel and Jetson
nodes' GPU exporters (``gpus``). ``render(exporter, tick)`` is a pure function of (seed, series,
interval, churn period, enabled exporters, Kepler GPU series on or off, incidents, dcgm health fields,
exporter, tick); the caches behind it only memoize.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from typing import Any

from prometheus_client.utils import floatToGoString

from simulator import dcgm, gpus, kepler, node
from simulator.base import (
    ALL_EXPORTERS,
    CONTENT_TYPE_OPENMETRICS,
    CONTENT_TYPE_SNIFFED,
    CONTENT_TYPE_TEXT,
    COUNTER,
    EXPORTERS,
    FMT_GO,
    FMT_GO_TICKS,
    FMT_INT,
    FMT_PY,
    GAUGE,
    RUN,
    STATIC,
    TERM,
    UNHELD,
    USER_HZ,
    Exposition,
    Tpl,
    escape_label,
    format_go_float,
    format_om_float,
    read_data,
)
from simulator.incidents import Incident, Overlay, check_gpus, gpu_counts
from simulator.topology import (
    LoadShapes,
    Owners,
    Pids,
    Unit,
    holder_state,
    instances,
    rand_hex,
    rand_suffix,
    rand_uid,
    remember,
)


class Simulator:
    """Deterministic payloads of the exporters; ``render`` is pure (caches only memoize).

    ``kepler_gpu=False`` drops Kepler's GPU series, as on a node whose GPUs are not NVIDIA's.
    ``incidents`` (``simulator.incidents.Incident``) make GPUs misbehave at given ticks;
    ``dcgm_health_fields`` adds the dcgm-exporter fields a health-minded counters CSV enables
    (throttle reasons, volatile ECC counts). Both default off: the payloads are then unchanged.
    """

    def __init__(
        self,
        seed: int = 1,
        series: int | None = None,
        interval_s: float = 5.0,
        *,
        churn_ticks: int = 30,
        exporters: Iterable[str] = EXPORTERS,
        kepler_gpu: bool = True,
        incidents: Iterable[Incident] = (),
        dcgm_health_fields: bool = False,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if churn_ticks < 0:
            raise ValueError("churn_ticks must be >= 0")
        if series is not None and series <= 0:
            raise ValueError("series must be > 0")
        wanted = set(exporters)
        self.exporters: tuple[str, ...] = tuple(e for e in ALL_EXPORTERS if e in wanted)
        unknown = wanted - set(ALL_EXPORTERS)
        if unknown:
            raise ValueError(f"unknown exporter(s): {', '.join(sorted(unknown))}")
        self.seed = seed
        self.series = series
        self.interval_s = float(interval_s)
        self.churn_ticks = churn_ticks
        self.kepler_gpu = kepler_gpu
        self._load = LoadShapes(seed)
        topo: dict[str, Any] = json.loads(read_data("topology.json"))
        self.node_name: str = topo["node_name"]
        self._owners = Owners(topo, seed, churn_ticks)
        self._units = self._owners.units
        for i in range(2):
            self._owners.static(f"gpu{i}")
        # The order matters: the exporter models add owners as they meet them in their fixtures.
        self._expo: dict[str, Exposition] = {
            "kepler": kepler.build(self._owners, topo),
            "kepler-0.7": kepler.build_07(self._owners, topo),
            "dcgm": dcgm.build(self._owners, topo, health_fields=dcgm_health_fields),
            "node": node.build(self._owners, self.interval_s, seed),
        }
        uptime = float(topo["kepler_uptime_s"])  # the other nodes' exporters have run as long
        self._expo["amd"] = gpus.build_amd(self._owners, uptime)
        self._expo["intel"] = gpus.build_intel(self._owners, uptime)
        self._expo["jetson"] = gpus.build_jetson(self._owners, uptime)
        if not kepler_gpu:
            self._drop_kepler_gpu()
        self._plan_growth(topo)
        # Series per exporter at tick 0 (a replaced pod briefly adds its terminated twin).
        self.planned_series: dict[str, int] = {e: self._nominal(e) for e in ALL_EXPORTERS}
        self.incidents: tuple[Incident, ...] = tuple(incidents)
        # None without incidents: render's only extra cost is one test per owner and row.
        self._overlay: Overlay | None = None
        if self.incidents:
            check_gpus(self.incidents, gpu_counts(self.exporters, self._units))
            self._overlay = Overlay(
                self.incidents, self._units, self._expo, self._load, interval_s=self.interval_s, seed=seed
            )

    # public API ------------------------------------------------------------------------------

    @property
    def planned_total(self) -> int:
        return sum(self.planned_series[e] for e in self.exporters)

    @staticmethod
    def supports_openmetrics(exporter: str) -> bool:
        return exporter == "kepler"

    @staticmethod
    def content_type(exporter: str, openmetrics: bool = False) -> str:
        if openmetrics:
            return CONTENT_TYPE_OPENMETRICS
        return CONTENT_TYPE_SNIFFED if exporter == "dcgm" else CONTENT_TYPE_TEXT

    def render(self, exporter: str, tick: int, openmetrics: bool = False) -> bytes:
        """The payload ``exporter`` serves at ``tick`` (``openmetrics``: Kepler's OpenMetrics form)."""
        expo = self._expo.get(exporter)
        if expo is None:
            raise ValueError(f"unknown exporter {exporter!r} (one of {', '.join(ALL_EXPORTERS)})")
        if openmetrics and not self.supports_openmetrics(exporter):
            raise ValueError(f"{exporter} serves the text format only")
        if tick < 0:
            raise ValueError("tick must be >= 0")
        tick = int(tick)
        buckets: list[list[tuple[str, str]]] = [[] for _ in expo.families]
        interval = self.interval_s
        fmt_float = format_om_float if openmetrics else format_go_float
        overlay = self._overlay
        for unit in self._units.values():
            if exporter not in unit.tpls:
                continue
            moved = overlay.refs(exporter, unit.key, tick) if overlay is not None else None
            for gen, state, t_eval, t_ref in instances(unit, tick):
                if state == TERM and exporter != "kepler":
                    continue  # only Kepler v0.11 tracks terminated workloads
                variant, id_gen = state, gen
                if exporter == "dcgm" and unit.holder is not None:
                    id_gen, held = holder_state(unit.holder, tick)
                    variant = RUN if held else UNHELD
                rows = self._rows(unit, exporter, id_gen, variant, openmetrics)
                shapes = self._load.of(unit, gen)
                levels = [s.level(t_eval) for s in shapes]
                integrals = [s.integral(t_eval, t_ref) for s in shapes]
                fresh = gen > 0 and unit.kind != STATIC  # a new pod's counters start near zero
                dt = t_eval - t_ref
                for fam, key, prefix, tpl in rows:
                    kind = tpl.kind
                    if kind == COUNTER:
                        base = 0.5 * interval * tpl.c if fresh else tpl.a
                        v = base + interval * (tpl.b * dt + tpl.c * integrals[tpl.slot])
                    elif kind == GAUGE:
                        v = tpl.a + tpl.b * levels[tpl.slot]
                        if v < tpl.lo:
                            v = tpl.lo
                        elif v > tpl.hi:
                            v = tpl.hi
                    else:
                        v = tpl.a
                    if moved is not None:
                        ref = moved.get(id(tpl))
                        if ref is not None:
                            assert overlay is not None
                            v, prefix = overlay.apply(ref, t_eval, t_ref, v, prefix)
                    if tpl.fmt == FMT_GO or tpl.fmt == FMT_PY:
                        if tpl.quantum:
                            v = float(round(v / tpl.quantum) * tpl.quantum)
                        elif tpl.dec is not None:
                            v = float(round(v, tpl.dec))
                        if tpl.fmt == FMT_PY:
                            text = floatToGoString(v)
                        else:
                            text = str(round(v)) if tpl.om_int and openmetrics else fmt_float(v)
                    elif tpl.fmt == FMT_INT:
                        text = f"{round(v):d}"
                    elif tpl.fmt == FMT_GO_TICKS:
                        # The fixture's value at tick 0, whole ticks after it; rounded up, so the
                        # counter never goes below its start.
                        text = fmt_float(v if v == tpl.a else math.ceil(v * USER_HZ) / USER_HZ)
                    else:
                        text = f"{v:f}"
                    buckets[fam].append((key, prefix + text + "\n"))
        out: list[str] = []
        headers = expo.header_om if openmetrics else expo.header_text
        for fi in expo.order:
            bucket = buckets[fi]
            if not bucket:
                continue  # client_golang drops families without metrics
            out.append(headers[fi])
            if expo.sort_series[fi]:
                bucket.sort()
            out.extend(line for _, line in bucket)
        if openmetrics:
            out.append("# EOF\n")
        return "".join(out).encode()

    def _drop_kepler_gpu(self) -> None:
        """Kepler on a node without NVML: no GPU family at all (Kepler 0.11 reads GPUs through NVML)."""
        for exporter in ("kepler", "kepler-0.7"):
            families = self._expo[exporter].families
            for unit in self._units.values():
                tpls = unit.tpls.get(exporter)
                if tpls is not None:
                    unit.tpls[exporter] = [t for t in tpls if "_gpu" not in families[t.fam].name]

    # identities (memoized, deterministic) ---------------------------------------------------

    def _identity(self, u: Unit, gen: int) -> dict[tuple[str, str], str]:
        if gen == 0 or u.spec is None:
            return u.ident0
        ident = u.idents.get(gen)
        if ident is None:
            spec = u.spec
            rng = random.Random(f"{self.seed}:id:{u.key}:{gen}")
            ident = dict(u.ident0)
            ident[("pod_id", spec.uid)] = rand_uid(rng)
            if spec.controller == "statefulset":
                name = u.ident0.get(("pod_name", spec.name), spec.name)
            elif spec.controller == "cronjob":
                minutes = max(1, round(u.cycle * self.interval_s / 60))
                name = f"{spec.base}-{spec.schedule + gen * minutes}-{rand_suffix(rng)}"
            else:
                name = f"{spec.base}-{rand_suffix(rng)}"
            ident[("pod_name", spec.name)] = ident[("pod", spec.name)] = name
            for cid in spec.cids:
                ident[("container_id", cid)] = rand_hex(rng, 64)
            pids = Pids(rng)
            for pid in spec.pids:
                ident[("pid", pid)] = pids()
            remember(u.idents, gen, ident)
        return ident

    def _rows(
        self, u: Unit, exporter: str, gen: int, variant: int, om: bool
    ) -> list[tuple[int, str, str, Tpl]]:
        """(family, sort key, 'name{labels} ', template) of one owner instance, memoized."""
        key = (exporter, gen, variant, om)
        rows = u.rows.get(key)
        if rows is not None:
            return rows
        ident = self._identity(u.holder if u.holder is not None and exporter == "dcgm" else u, gen)
        rows = []
        for tpl in u.tpls[exporter]:
            if variant == TERM and not tpl.app:
                continue
            labels = tuple((k, ident.get((k, v), v)) for k, v in tpl.labels)
            if variant == TERM:
                labels = tuple((k, "terminated" if k == "state" else v) for k, v in labels)
            elif variant == UNHELD:
                labels = tuple((k, v) for k, v in labels if k not in ("container", "namespace", "pod"))
            shown = labels
            if om:
                shown = tuple((k, format_om_float(float(v)) if k == "quantile" else v) for k, v in labels)
            inner = ",".join(f'{k}="{escape_label(v)}"' for k, v in shown)
            prefix = f"{tpl.name}{{{inner}}} " if inner else f"{tpl.name} "
            rows.append((tpl.fam, "\x00".join(v for _, v in labels), prefix, tpl))
        if u.kind != STATIC:
            for old in [k for k in list(u.rows) if k[0] == exporter and k[1] < gen - 2]:
                u.rows.pop(old, None)  # generations long gone
        u.rows[key] = rows
        return rows

    # sizing ----------------------------------------------------------------------------------

    def _nominal(self, exporter: str) -> int:
        n = 0
        for u in self._units.values():
            for _gen, state, _t, _r in instances(u, 0):
                tpls = u.tpls.get(exporter, [])
                if state == TERM:
                    n += sum(t.app for t in tpls) if exporter == "kepler" else 0
                else:
                    n += len(tpls)
        return n

    def _plan_growth(self, topo: dict[str, Any]) -> None:
        """Add pods (up to the kubelet's max-pods), then processes or sidecars, to reach --series."""
        self.clones = self.workers = self.sidecars = 0
        if self.series is None:
            return
        enabled = self.exporters
        budget = self.series - sum(self._nominal(e) for e in enabled)
        template = self._units[topo["clone_template"]]
        clone_cost = sum(len(template.tpls.get(e, [])) for e in enabled)
        if budget <= 0 or clone_cost == 0:
            return  # only dcgm / node enabled: they keep their natural size
        max_clones = topo["max_pods"] - len(topo["pods"]) - 1
        clones = min(max_clones, budget // clone_cost)
        if clones == 0 and budget * 2 >= clone_cost:
            clones = 1
        budget -= clones * clone_cost
        extra = 0
        worker_cost = 5  # Kepler v0.11: cpu joules + watts per zone, cpu seconds
        sidecar_cost = len(template.tpls.get("kepler-0.7", []))  # the 0.7 line has no process series
        use_workers = "kepler" in enabled
        if clones and budget > 0:
            extra = round(budget / (worker_cost if use_workers else sidecar_cost))
        per_clone = (
            [extra // clones + (1 if i < extra % clones else 0) for i in range(clones)] if clones else []
        )
        for i in range(clones):
            n = per_clone[i]
            self._owners.add_clone(
                i, topo, template, workers=n if use_workers else 0, sidecars=0 if use_workers else n
            )
        self.clones = clones
        self.workers = extra if use_workers else 0
        self.sidecars = 0 if use_workers else extra
