"""The owners of series: pods (and their replacements), the job, clones, static owners; their lifecycle.

Every series hangs off an owner (``Unit``). A pod generation has an identity (UID, name, container IDs,
PIDs): generation 0 is the fixture's, later ones are drawn from the seed. ``instances`` says which
generations of an owner are reported at a tick and in which state; ``LoadShapes`` gives each owner
generation its load shapes, drawn from the seed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from simulator.base import FLAT, JOB, POD, RUN, STATIC, TERM, Shape, Tpl

_K8S_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery rand.String


@dataclass(slots=True)
class IdSpec:
    """How a pod's identity looks in the templates and how replacement pods are named."""

    controller: str  # deployment / statefulset / daemonset / cronjob
    base: str  # name stem of replacement pods
    uid: str  # values as they appear in the templates' labels
    name: str
    cids: list[str]
    pids: list[str]
    schedule: int = 0  # cronjob: scheduled minute of generation 0


@dataclass(slots=True)
class Unit:
    key: str
    kind: int
    tpls: dict[str, list[Tpl]] = field(default_factory=dict)
    slot_keys: list[str] = field(default_factory=list)  # static units: shape keys of their slots
    gpu: int | None = None
    cycle: int = 0  # ticks per generation; 0: never replaced
    offset: int = 0
    run: int = 0  # cronjob: ticks a job runs
    ident0: dict[tuple[str, str], str] = field(default_factory=dict)  # label rewrites of generation 0
    spec: IdSpec | None = None
    holder: Unit | None = None  # dcgm: the pod holding this GPU (adds container/namespace/pod)
    rows: dict[tuple[Any, ...], list[tuple[int, str, str, Tpl]]] = field(default_factory=dict)
    idents: dict[int, dict[tuple[str, str], str]] = field(default_factory=dict)
    shapes: dict[int, list[Shape]] = field(default_factory=dict)

    def add(self, exporter: str, tpl: Tpl) -> None:
        self.tpls.setdefault(exporter, []).append(tpl)


def rand_hex(rng: random.Random, n: int) -> str:
    return f"{rng.getrandbits(4 * n):0{n}x}"


def rand_uid(rng: random.Random) -> str:
    h = rand_hex(rng, 32)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def rand_suffix(rng: random.Random, n: int = 5) -> str:
    return "".join(rng.choice(_K8S_ALPHABET) for _ in range(n))


class Pids:
    """PIDs of one pod generation: increasing from a random start, as processes forked in turn get
    them, so they never repeat within the pod (they stay above the fixture's and below pid_max)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next = rng.randrange(60000, 3000000)

    def __call__(self) -> str:
        pid = self.next
        self.next += self.rng.randint(1, 40)
        return str(60000 + (pid - 60000) % (4194304 - 60000))


def relabel(tpl: Tpl, changes: Mapping[str, str], factor: float = 1.0) -> Tpl:
    t = tpl.scaled(factor)
    t.labels = tuple((k, changes.get(k, v)) for k, v in tpl.labels)
    return t


def remember(d: dict[int, Any], gen: int, value: Any) -> None:
    """Memoize per generation, forgetting generations that are long gone."""
    # list(d) is one C call (atomic under the GIL): renders of several exporters may share a unit.
    for old in [g for g in list(d) if g < gen - 2]:
        d.pop(old, None)
    d[gen] = value


class LoadShapes:
    """The owners' load shapes, drawn from the seed: one per shape key, memoized.

    ``of(unit, gen)`` is what drives an owner generation's series (templates index it by ``slot``).
    Rendering reads it, and the incident overlay reads it for a GPU's no-incident values.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._cache: dict[str, Shape] = {}

    def shape(self, key: str) -> Shape:
        shape = self._cache.get(key)
        if shape is None:
            rng = random.Random(f"{self.seed}:shape:{key}")
            if key.startswith("flat"):
                shape = FLAT
            else:
                # Node and GPU power and filesystems move gently; the rest up to +-60 % around the mean.
                fmax = 0.3
                if key.startswith(("gpu", "power:")):
                    fmax = 0.1
                elif key.startswith("slow"):
                    fmax = 0.03
                period = rng.uniform(24.0, 240.0)
                shape = Shape(
                    rng.uniform(0.3 * fmax, fmax), 2 * math.pi / period, rng.uniform(0, 2 * math.pi)
                )
            self._cache[key] = shape
        return shape

    def of(self, u: Unit, gen: int) -> list[Shape]:
        shapes = u.shapes.get(gen)
        if shapes is None:
            if u.kind == STATIC:
                shapes = [self.shape(k) for k in u.slot_keys]
            else:
                shapes = [self.shape(f"{u.key}#{gen}")]
                if u.gpu is not None:
                    shapes.append(self.shape(f"gpu{u.gpu}"))
            remember(u.shapes, gen, shapes)
        return shapes


# --- lifecycle ----------------------------------------------------------------------------------


def instances(u: Unit, t: int) -> list[tuple[int, int, int, int]]:
    """(generation, state, tick to evaluate at, tick the generation's counters start from)."""
    if u.kind == STATIC:
        return [(0, RUN, t, 0)]
    if u.cycle == 0:
        # No churn: everything stays as in the fixture (the finished job included).
        return [(0, TERM, 0, 0)] if u.kind == JOB else [(0, RUN, t, 0)]
    g, p = divmod(t + u.offset, u.cycle)
    ref = g * u.cycle - u.offset if g else 0
    if u.kind == POD:
        out = [(g, RUN, t, ref)]
        if p == 0 and g > 0:
            prev_ref = (g - 1) * u.cycle - u.offset if g > 1 else 0
            out.append((g - 1, TERM, t - 1, prev_ref))
        return out
    if p < u.run:
        return [(g, RUN, t, ref)]
    if p == u.run:  # terminated: reported once with the values of its last running tick
        return [(g, TERM, t - 1 if g else 0, ref)]
    return []


def holder_state(holder: Unit, t: int) -> tuple[int, bool]:
    """Generation of the pod holding a GPU, and whether it holds it (not at the swap tick)."""
    if holder.cycle == 0:
        return 0, True
    g, p = divmod(t + holder.offset, holder.cycle)
    return g, not (p == 0 and g > 0)


# --- the owner registry -------------------------------------------------------------------------


class Owners:
    """The owners of a node's series by key, in the order they were added (the order series are written
    in where an exporter does not sort them).

    Pods and the job come from topology.json; the exporter models add static owners (GPUs, the node's
    power, host processes, runtimes) while they read their fixtures; ``--series`` adds clones. The maps
    say which pod a fixture's PID, container ID or pod UID belongs to (``app_*``: the application
    containers' and processes', reported once more when their pod has terminated).
    """

    def __init__(self, topo: dict[str, Any], seed: int, churn_ticks: int) -> None:
        self.seed = seed
        self.churn_ticks = churn_ticks
        self.units: dict[str, Unit] = {}
        self.pid_owner: dict[str, str] = {}
        self.cid_owner: dict[str, str] = {}
        self.uid_owner: dict[str, str] = {}
        self.app_pids: set[str] = set()
        self.app_cids: set[str] = set()
        self._pod_units(topo)

    def static(self, key: str, slot_keys: list[str] | None = None) -> Unit:
        """The owner ``key``, a static one made on first use (``slot_keys``: its shapes' keys)."""
        u = self.units.get(key)
        if u is None:
            u = self.units[key] = Unit(key, STATIC, slot_keys=slot_keys or [key])
        elif slot_keys is not None and u.slot_keys != slot_keys:
            raise ValueError(f"simulator data: owner key {key!r} used twice")
        return u

    def cycle(self, factor: int, rng: random.Random) -> tuple[int, int]:
        """(ticks per generation, offset) of a pod replaced every ``factor`` churn periods; (0, 0): never."""
        if self.churn_ticks == 0 or factor == 0:
            return 0, 0
        cycle = max(2, self.churn_ticks * factor)
        return cycle, rng.randrange(cycle)

    def _pod_units(self, topo: dict[str, Any]) -> None:
        """The pods and the job of topology.json, with their replacement cycles."""
        for pod in [*topo["pods"], topo["job"]]:
            is_job = pod is topo["job"]
            key = pod["key"]
            rng = random.Random(f"{self.seed}:lifecycle:{key}")
            cycle, offset = self.cycle(pod["churn"], rng)
            cids = [c["id"] for c in pod["containers"]]
            pids = [p for c in pod["containers"] for p in c["pids"]]
            self.app_pids.update(pids)
            self.app_cids.update(cids)
            if not is_job:
                cids.append(pod["sandbox"])
                pids += [pod["pause_pid"], pod["shim_pid"]]
            spec = IdSpec(
                pod["controller"], pod["base"], pod["uid"], pod["name"], cids, pids, pod.get("schedule", 0)
            )
            unit = Unit(key, JOB if is_job else POD, gpu=pod.get("gpu"), cycle=cycle, spec=spec)
            if is_job and cycle:
                # The fixture shows the job just terminated: tick 0 is the tick after its last run.
                unit.cycle = max(3, cycle)
                unit.run = max(1, unit.cycle // 3)
                unit.offset = unit.run
            else:
                unit.offset = offset
            self.units[key] = unit
            self.uid_owner[pod["uid"]] = key
            for cid in cids:
                self.cid_owner[cid] = key
            for pid in pids:
                self.pid_owner[pid] = key

    def add_clone(self, i: int, topo: dict[str, Any], src: Unit, *, workers: int, sidecars: int) -> None:
        """A pod cloned from the template pod (one container, one process) under a new identity."""
        rng = random.Random(f"{self.seed}:clone:{i}")
        workloads = topo["clone_workloads"]
        wl = workloads[i % len(workloads)]
        stem = wl["base"] if i < len(workloads) else f"{wl['base']}-{i // len(workloads) + 1}"
        base = f"{stem}-{rng.choice('56789')}{rand_suffix(rng, rng.choice((8, 9)))}"
        src_pod = next(p for p in topo["pods"] if p["key"] == src.key)
        assert src.spec is not None
        app = src_pod["containers"][0]
        app_pid = app["pids"][0]
        proc = next(t for t in src.tpls["kepler"] if dict(t.labels).get("pid") == app_pid)
        pl = dict(proc.labels)
        factor = math.exp(rng.uniform(math.log(0.3), math.log(6.0)))
        key = f"clone{i}"
        spec = IdSpec(
            "deployment", base, src.spec.uid, src.spec.name, list(src.spec.cids), list(src.spec.pids)
        )
        unit = Unit(key, POD, spec=spec)
        if self.churn_ticks and rng.random() < 0.5:
            unit.cycle, unit.offset = self.cycle(rng.choice((1, 2, 3)), rng)
        name = f"{base}-{rand_suffix(rng)}"
        ns = src_pod["namespace"]
        unit.ident0 = {
            ("pod_id", spec.uid): rand_uid(rng),
            ("pod_name", spec.name): name,
            ("pod", spec.name): name,
            ("pod_namespace", ns): wl["namespace"],
            ("container_namespace", ns): wl["namespace"],
            ("container_name", app["name"]): wl["container"],
            ("comm", pl["comm"]): wl["comm"],
            ("exe", pl["exe"]): wl["exe"],
        }
        for cid in spec.cids:
            unit.ident0[("container_id", cid)] = rand_hex(rng, 64)
        pids = Pids(rng)
        for pid in spec.pids:
            unit.ident0[("pid", pid)] = pids()
        for exporter, tpls in src.tpls.items():
            unit.tpls[exporter] = [t.scaled(factor) for t in tpls]
        proc_tpls = [t for t in src.tpls["kepler"] if dict(t.labels).get("pid") == app_pid]
        for k in range(workers):  # more worker processes in the app container
            placeholder = f"w{k}"
            wf = factor * rng.uniform(0.05, 0.8)
            for t in proc_tpls:
                w = relabel(t, {"pid": placeholder}, wf)
                w.app = False  # terminated reports keep to the main process (maxTerminated)
                unit.add("kepler", w)
            spec.pids.append(placeholder)
            unit.ident0[("pid", placeholder)] = pids()
        sidecar_specs = topo["sidecars"]
        for k in range(sidecars):  # more containers in the pod (when only the old Kepler line grows)
            sc = sidecar_specs[k % len(sidecar_specs)]
            cname = (
                sc["container"] if k < len(sidecar_specs) else f"{sc['container']}-{k // len(sidecar_specs)}"
            )
            cid, pid = f"s{k}", f"sp{k}"
            changes = {
                "container_id": cid,
                "container_name": cname,
                "pid": pid,
                "comm": sc["comm"],
                "exe": sc["exe"],
            }
            sf = factor * rng.uniform(0.05, 0.5)
            for exporter, tpls in src.tpls.items():
                for t in tpls:
                    lab = dict(t.labels)
                    # The app container's own series and (Kepler v0.11) its process's series.
                    if lab.get("container_id") == app["id"] or lab.get("pid") == app_pid:
                        s = relabel(t, changes, sf)
                        s.app = False
                        unit.add(exporter, s)
            spec.cids.append(cid)
            spec.pids.append(pid)
            unit.ident0[("container_id", cid)] = rand_hex(rng, 64)
            unit.ident0[("pid", pid)] = pids()
        self.units[key] = unit
