"""Exporter simulator: realistic, deterministic Kepler / dcgm-exporter / node-exporter payloads over HTTP.

Four exporters of the fixture node ``edge-gpu-01``, each on its own port, path ``/metrics``:

- ``kepler``: Kepler v0.11.x (client_golang text format; OpenMetrics 1.0 when the Accept header asks),
- ``kepler-0.7``: the old Kepler line (v0.7.12), text only,
- ``dcgm``: NVIDIA dcgm-exporter (fixed label order, ``%d`` / ``%f`` numbers), text only,
- ``node``: node_exporter, text only.

The Kepler and dcgm payloads are the fixtures in ``simdata/`` brought to life: HELP/TYPE text, metric
names, label names and order and number formatting are exactly the fixtures'; values move with time,
pods are replaced now and then (so series disappear and appear) and ``--series`` adds pods / processes.

``Simulator.render(exporter, tick)`` is a pure function of (seed, series, interval, churn period,
enabled exporters, exporter, tick): a test can recompute exactly what the server served at tick k.

Value model (why it looks the way it does):

- Every series hangs off an *owner* (a pod generation, a host process, a GPU, the node ...). An owner
  has a smooth load shape ``S(t) = 1 + f*(sin(w*t + p) - sin(p))`` (t in ticks, ``f < 0.5``), so
  ``S(0) = 1`` and the fixture value is exactly the value at tick 0.
- Gauges are ``a + b*S(t)`` (watts: ``b`` = fixture value), clamped to realistic bounds.
- Counters are ``v0 + interval*(lin*t + rate*integral(S))``; the integral has a closed form and its
  derivative ``rate*S`` is always positive, so counters never decrease (integer counters are rounded,
  which keeps them monotonic). A joules counter's rate is its sibling watts gauge, so
  ``rate(joules) == watts`` as in Kepler; all series of one owner share its shape, which keeps the
  fixtures' sums (pod = containers = processes, node = active + idle, DCGM power = Kepler GPU power).
- A replaced pod's new generation gets new UID / container IDs / PIDs / pod name and counters that
  start near zero; Kepler v0.11 reports the old generation once more with ``state="terminated"``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import logging
import math
import random
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from types import FrameType
from typing import IO, Any, Final
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

EXPORTERS: Final = ("kepler", "kepler-0.7", "dcgm", "node")
DEFAULT_PORTS: Final = {"kepler": 28282, "kepler-0.7": 9102, "dcgm": 9400, "node": 9100}

CONTENT_TYPE_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_OPENMETRICS: Final = "application/openmetrics-text; version=1.0.0; charset=utf-8"
CONTENT_TYPE_OPENMETRICS_001: Final = "application/openmetrics-text; version=0.0.1; charset=utf-8"
# dcgm-exporter writes its body without a Content-Type; Go's net/http then sniffs plain text.
CONTENT_TYPE_SNIFFED: Final = "text/plain; charset=utf-8"

_Pairs = tuple[tuple[str, str], ...]

# Series value kinds.
_CONST, _GAUGE, _COUNTER = 0, 1, 2
# Number formats: Go strconv 'g' (client_golang), dcgm-exporter's %d and %f.
_FMT_GO, _FMT_INT, _FMT_FLOAT = 0, 1, 2
# Instance states: running, reported once more as terminated (Kepler v0.11), GPU held by no pod (dcgm).
_RUN, _TERM, _UNHELD = 0, 1, 2
# Unit kinds.
_STATIC, _POD, _JOB = 0, 1, 2

_INF = math.inf
_K8S_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery rand.String


# --- number formatting -------------------------------------------------------------------------


def format_go_float(v: float) -> str:
    """``strconv.FormatFloat(v, 'g', -1, 64)``: how client_golang's text encoder writes a value.

    Shortest round-trip digits, like Python's repr, but Go switches to the exponent form from 1e6
    on (Python's repr only from 1e16): ``15390577.028`` is written ``1.5390577028e+07``.
    """
    if v != v:
        return "NaN"
    if v == _INF:
        return "+Inf"
    if v == -_INF:
        return "-Inf"
    if v == 0:
        return "-0" if math.copysign(1.0, v) < 0 else "0"
    s = repr(v)
    if "e" in s:  # Python and Go agree on this range and on the exponent spelling
        return s
    if -1e6 < v < 1e6:
        return s[:-2] if s.endswith(".0") else s
    sign = ""
    if s[0] == "-":
        sign, s = "-", s[1:]
    whole, _, frac = s.partition(".")
    digits = (whole + ("" if frac == "0" else frac)).rstrip("0")
    mantissa = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{mantissa}e+{len(whole) - 1:02d}"


def format_om_float(v: float) -> str:
    """client_golang's OpenMetrics float: like the text format, but always with a '.' or exponent."""
    s = format_go_float(v)
    if math.isfinite(v) and "e" not in s and "." not in s:
        s += ".0"
    return s


def _decimals(s: str) -> int:
    """Decimal places a fixture value was written with (``1.5390577028e+07`` -> 3)."""
    mantissa, _, exp = s.lower().partition("e")
    frac = mantissa.partition(".")[2]
    return max(0, len(frac) - (int(exp) if exp else 0))


def _escape_label(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        v = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _escape_help(v: str, openmetrics: bool) -> str:
    v = v.replace("\\", "\\\\").replace("\n", "\\n")
    return v.replace('"', '\\"') if openmetrics else v


# --- load shapes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Shape:
    """``S(t) = 1 + f*(sin(w*t + p) - sin(p))`` and its integral; ``S > 0`` because ``f < 0.5``."""

    f: float
    w: float
    p: float

    def level(self, t: float) -> float:
        return 1.0 + self.f * (math.sin(self.w * t + self.p) - math.sin(self.p))

    def integral(self, t: float, t0: float) -> float:
        f, w, p = self.f, self.w, self.p
        return (t - t0) * (1.0 - f * math.sin(p)) + f / w * (math.cos(w * t0 + p) - math.cos(w * t + p))


_FLAT = _Shape(0.0, 1.0, 0.0)


# --- templates ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tpl:
    """One series of one owner: labels as the exporter writes them plus the value model."""

    fam: int  # family index in the exporter's _Exposition
    name: str  # sample name (a summary's _sum / _count differ from the family name)
    labels: _Pairs
    kind: int
    a: float  # CONST: value; GAUGE: offset; COUNTER: value at tick 0
    b: float = 0.0  # GAUGE: load coefficient; COUNTER: growth per second independent of load
    c: float = 0.0  # COUNTER: growth per second at load 1
    lo: float = -_INF
    hi: float = _INF
    dec: int | None = None  # round to this many decimals (the fixture's precision)
    quantum: int = 0  # round to a multiple (meminfo kB, filesystem blocks)
    slot: int = 0  # index of the owner shape that drives this series
    fmt: int = _FMT_GO
    app: bool = True  # reported when the owner is terminated (Kepler v0.11)
    om_int: bool = False  # a summary's _count: OpenMetrics writes it as an integer

    def scaled(self, factor: float) -> _Tpl:
        if self.kind == _CONST:
            return dataclasses.replace(self)
        if self.kind == _GAUGE:
            return dataclasses.replace(self, a=self.a * factor, b=self.b * factor)
        return dataclasses.replace(self, a=self.a * factor, c=self.c * factor)


@dataclass(slots=True)
class _Family:
    name: str
    help: str
    type: str


@dataclass(slots=True)
class _Exposition:
    families: list[_Family]
    sorted_output: bool  # client_golang sorts families and series; dcgm-exporter does not
    order: list[int] = field(default_factory=list)
    header_text: list[str] = field(default_factory=list)
    header_om: list[str] = field(default_factory=list)
    sort_series: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        fams = self.families
        idx = range(len(fams))
        self.order = sorted(idx, key=lambda i: fams[i].name) if self.sorted_output else list(idx)
        self.header_text = [f"# HELP {f.name} {f.help}\n# TYPE {f.name} {f.type}\n" for f in fams]
        self.header_om = []
        for f in fams:
            # OpenMetrics names a counter family without _total; its samples keep it.
            name = f.name[:-6] if f.type == "counter" and f.name.endswith("_total") else f.name
            self.header_om.append(f"# HELP {name} {_escape_help(f.help, True)}\n# TYPE {name} {f.type}\n")
        # A summary is one metric written as several lines in a fixed order: never re-sort those.
        self.sort_series = [self.sorted_output and f.type not in ("summary", "histogram") for f in fams]

    def index(self) -> dict[str, int]:
        return {f.name: i for i, f in enumerate(self.families)}


@dataclass(slots=True)
class _RawFamily:
    name: str
    help: str
    type: str
    samples: list[tuple[str, _Pairs, str]]


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _parse_fixture(text: str) -> list[_RawFamily]:
    """The simdata fixtures: HELP, TYPE, then samples; HELP text kept byte for byte."""
    helps: dict[str, str] = {}
    out: list[_RawFamily] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, text_ = line[7:].partition(" ")
            helps[name] = text_
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            out.append(_RawFamily(name, helps.get(name, ""), typ, []))
        elif line and not line.startswith("#"):
            m = _SAMPLE_RE.match(line)
            if m is None or not out:
                raise ValueError(f"simdata: cannot parse {line!r}")
            pairs = tuple((k, v) for k, v in _LABEL_RE.findall(m.group(2) or ""))
            out[-1].samples.append((m.group(1), pairs, m.group(3)))
    return out


@cache
def _simdata(name: str) -> str:
    return resources.files("edge_relay").joinpath("simdata", name).read_text(encoding="utf-8")


@cache
def _fixture(name: str) -> tuple[_RawFamily, ...]:
    return tuple(_parse_fixture(_simdata(name)))


def _family_decimals(fam: _RawFamily) -> int | None:
    d = max((_decimals(v) for _, _, v in fam.samples), default=0)
    return None if d > 12 else d  # full float precision in the fixture: keep it


# --- units: the owners of series ----------------------------------------------------------------


@dataclass(slots=True)
class _IdSpec:
    """How a pod's identity looks in the templates and how replacement pods are named."""

    controller: str  # deployment / statefulset / daemonset / cronjob
    base: str  # name stem of replacement pods
    uid: str  # values as they appear in the templates' labels
    name: str
    cids: list[str]
    pids: list[str]
    schedule: int = 0  # cronjob: scheduled minute of generation 0


@dataclass(slots=True)
class _Unit:
    key: str
    kind: int
    tpls: dict[str, list[_Tpl]] = field(default_factory=dict)
    slot_keys: list[str] = field(default_factory=list)  # static units: shape keys of their slots
    gpu: int | None = None
    cycle: int = 0  # ticks per generation; 0: never replaced
    offset: int = 0
    run: int = 0  # cronjob: ticks a job runs
    ident0: dict[tuple[str, str], str] = field(default_factory=dict)  # label rewrites of generation 0
    spec: _IdSpec | None = None
    holder: _Unit | None = None  # dcgm: the pod holding this GPU (adds container/namespace/pod)
    rows: dict[tuple[Any, ...], list[tuple[int, str, str, _Tpl]]] = field(default_factory=dict)
    idents: dict[int, dict[tuple[str, str], str]] = field(default_factory=dict)
    shapes: dict[int, list[_Shape]] = field(default_factory=dict)

    def add(self, exporter: str, tpl: _Tpl) -> None:
        self.tpls.setdefault(exporter, []).append(tpl)


def _hex(rng: random.Random, n: int) -> str:
    return f"{rng.getrandbits(4 * n):0{n}x}"


def _uid(rng: random.Random) -> str:
    h = _hex(rng, 32)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _suffix(rng: random.Random, n: int = 5) -> str:
    return "".join(rng.choice(_K8S_ALPHABET) for _ in range(n))


class _Pids:
    """PIDs of one pod generation: increasing from a random start, as processes forked in turn get
    them, so they never repeat within the pod (they stay above the fixture's and below pid_max)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.next = rng.randrange(60000, 3000000)

    def __call__(self) -> str:
        pid = self.next
        self.next += self.rng.randint(1, 40)
        return str(60000 + (pid - 60000) % (4194304 - 60000))


def _relabel(tpl: _Tpl, changes: Mapping[str, str], factor: float = 1.0) -> _Tpl:
    t = tpl.scaled(factor)
    t.labels = tuple((k, changes.get(k, v)) for k, v in tpl.labels)
    return t


# --- the simulator ------------------------------------------------------------------------------


class Simulator:
    """Deterministic payloads of the four exporters; ``render`` is pure (caches only memoize)."""

    def __init__(
        self,
        seed: int = 1,
        series: int | None = None,
        interval_s: float = 5.0,
        *,
        churn_ticks: int = 30,
        exporters: Iterable[str] = EXPORTERS,
    ) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be > 0")
        if churn_ticks < 0:
            raise ValueError("churn_ticks must be >= 0")
        if series is not None and series <= 0:
            raise ValueError("series must be > 0")
        wanted = set(exporters)
        self.exporters: tuple[str, ...] = tuple(e for e in EXPORTERS if e in wanted)
        unknown = wanted - set(EXPORTERS)
        if unknown:
            raise ValueError(f"unknown exporter(s): {', '.join(sorted(unknown))}")
        self.seed = seed
        self.series = series
        self.interval_s = float(interval_s)
        self.churn_ticks = churn_ticks
        self._shape_cache: dict[str, _Shape] = {}
        topo: dict[str, Any] = json.loads(_simdata("topology.json"))
        self.node_name: str = topo["node_name"]
        self._units: dict[str, _Unit] = {}
        self._expo: dict[str, _Exposition] = {}
        self._pod_units(topo)
        for i in range(2):
            self._static(f"gpu{i}")
        self._build_kepler(topo)
        self._build_kepler07(topo)
        self._build_dcgm(topo)
        self._build_node()
        self._plan_growth(topo)
        # Series per exporter at tick 0 (a replaced pod briefly adds its terminated twin).
        self.planned_series: dict[str, int] = {e: self._nominal(e) for e in EXPORTERS}

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
            raise ValueError(f"unknown exporter {exporter!r} (one of {', '.join(EXPORTERS)})")
        if openmetrics and not self.supports_openmetrics(exporter):
            raise ValueError(f"{exporter} serves the text format only")
        if tick < 0:
            raise ValueError("tick must be >= 0")
        tick = int(tick)
        buckets: list[list[tuple[str, str]]] = [[] for _ in expo.families]
        interval = self.interval_s
        fmt_float = format_om_float if openmetrics else format_go_float
        for unit in self._units.values():
            if exporter not in unit.tpls:
                continue
            for gen, state, t_eval, t_ref in self._instances(unit, tick):
                if state == _TERM and exporter != "kepler":
                    continue  # only Kepler v0.11 tracks terminated workloads
                variant, id_gen = state, gen
                if exporter == "dcgm" and unit.holder is not None:
                    id_gen, held = self._holder_state(unit.holder, tick)
                    variant = _RUN if held else _UNHELD
                rows = self._rows(unit, exporter, id_gen, variant, openmetrics)
                shapes = self._shapes(unit, gen)
                levels = [s.level(t_eval) for s in shapes]
                integrals = [s.integral(t_eval, t_ref) for s in shapes]
                fresh = gen > 0 and unit.kind != _STATIC  # a new pod's counters start near zero
                dt = t_eval - t_ref
                for fam, key, prefix, tpl in rows:
                    kind = tpl.kind
                    if kind == _COUNTER:
                        base = 0.5 * interval * tpl.c if fresh else tpl.a
                        v = base + interval * (tpl.b * dt + tpl.c * integrals[tpl.slot])
                    elif kind == _GAUGE:
                        v = tpl.a + tpl.b * levels[tpl.slot]
                        if v < tpl.lo:
                            v = tpl.lo
                        elif v > tpl.hi:
                            v = tpl.hi
                    else:
                        v = tpl.a
                    if tpl.fmt == _FMT_GO:
                        if tpl.quantum:
                            v = float(round(v / tpl.quantum) * tpl.quantum)
                        elif tpl.dec is not None:
                            v = float(round(v, tpl.dec))
                        text = str(round(v)) if tpl.om_int and openmetrics else fmt_float(v)
                    elif tpl.fmt == _FMT_INT:
                        text = f"{round(v):d}"
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

    # lifecycle -------------------------------------------------------------------------------

    def _instances(self, u: _Unit, t: int) -> list[tuple[int, int, int, int]]:
        """(generation, state, tick to evaluate at, tick the generation's counters start from)."""
        if u.kind == _STATIC:
            return [(0, _RUN, t, 0)]
        if u.cycle == 0:
            # No churn: everything stays as in the fixture (the finished job included).
            return [(0, _TERM, 0, 0)] if u.kind == _JOB else [(0, _RUN, t, 0)]
        g, p = divmod(t + u.offset, u.cycle)
        ref = g * u.cycle - u.offset if g else 0
        if u.kind == _POD:
            out = [(g, _RUN, t, ref)]
            if p == 0 and g > 0:
                prev_ref = (g - 1) * u.cycle - u.offset if g > 1 else 0
                out.append((g - 1, _TERM, t - 1, prev_ref))
            return out
        if p < u.run:
            return [(g, _RUN, t, ref)]
        if p == u.run:  # terminated: reported once with the values of its last running tick
            return [(g, _TERM, t - 1 if g else 0, ref)]
        return []

    def _holder_state(self, holder: _Unit, t: int) -> tuple[int, bool]:
        """Generation of the pod holding a GPU, and whether it holds it (not at the swap tick)."""
        if holder.cycle == 0:
            return 0, True
        g, p = divmod(t + holder.offset, holder.cycle)
        return g, not (p == 0 and g > 0)

    # shapes and identities (memoized, deterministic) -----------------------------------------

    def _shape(self, key: str) -> _Shape:
        shape = self._shape_cache.get(key)
        if shape is None:
            rng = random.Random(f"{self.seed}:shape:{key}")
            if key.startswith("flat"):
                shape = _FLAT
            else:
                # Node and GPU power and filesystems move gently; the rest up to +-60 % around the mean.
                fmax = 0.3
                if key.startswith(("gpu", "power:")):
                    fmax = 0.1
                elif key.startswith("slow"):
                    fmax = 0.03
                period = rng.uniform(24.0, 240.0)
                shape = _Shape(
                    rng.uniform(0.3 * fmax, fmax), 2 * math.pi / period, rng.uniform(0, 2 * math.pi)
                )
            self._shape_cache[key] = shape
        return shape

    def _shapes(self, u: _Unit, gen: int) -> list[_Shape]:
        shapes = u.shapes.get(gen)
        if shapes is None:
            if u.kind == _STATIC:
                shapes = [self._shape(k) for k in u.slot_keys]
            else:
                shapes = [self._shape(f"{u.key}#{gen}")]
                if u.gpu is not None:
                    shapes.append(self._shape(f"gpu{u.gpu}"))
            _remember(u.shapes, gen, shapes)
        return shapes

    def _identity(self, u: _Unit, gen: int) -> dict[tuple[str, str], str]:
        if gen == 0 or u.spec is None:
            return u.ident0
        ident = u.idents.get(gen)
        if ident is None:
            spec = u.spec
            rng = random.Random(f"{self.seed}:id:{u.key}:{gen}")
            ident = dict(u.ident0)
            ident[("pod_id", spec.uid)] = _uid(rng)
            if spec.controller == "statefulset":
                name = u.ident0.get(("pod_name", spec.name), spec.name)
            elif spec.controller == "cronjob":
                minutes = max(1, round(u.cycle * self.interval_s / 60))
                name = f"{spec.base}-{spec.schedule + gen * minutes}-{_suffix(rng)}"
            else:
                name = f"{spec.base}-{_suffix(rng)}"
            ident[("pod_name", spec.name)] = ident[("pod", spec.name)] = name
            for cid in spec.cids:
                ident[("container_id", cid)] = _hex(rng, 64)
            pids = _Pids(rng)
            for pid in spec.pids:
                ident[("pid", pid)] = pids()
            _remember(u.idents, gen, ident)
        return ident

    def _rows(
        self, u: _Unit, exporter: str, gen: int, variant: int, om: bool
    ) -> list[tuple[int, str, str, _Tpl]]:
        """(family, sort key, 'name{labels} ', template) of one owner instance, memoized."""
        key = (exporter, gen, variant, om)
        rows = u.rows.get(key)
        if rows is not None:
            return rows
        ident = self._identity(u.holder if u.holder is not None and exporter == "dcgm" else u, gen)
        rows = []
        for tpl in u.tpls[exporter]:
            if variant == _TERM and not tpl.app:
                continue
            labels = tuple((k, ident.get((k, v), v)) for k, v in tpl.labels)
            if variant == _TERM:
                labels = tuple((k, "terminated" if k == "state" else v) for k, v in labels)
            elif variant == _UNHELD:
                labels = tuple((k, v) for k, v in labels if k not in ("container", "namespace", "pod"))
            shown = labels
            if om:
                shown = tuple((k, format_om_float(float(v)) if k == "quantile" else v) for k, v in labels)
            inner = ",".join(f'{k}="{_escape_label(v)}"' for k, v in shown)
            prefix = f"{tpl.name}{{{inner}}} " if inner else f"{tpl.name} "
            rows.append((tpl.fam, "\x00".join(v for _, v in labels), prefix, tpl))
        if u.kind != _STATIC:
            for old in [k for k in list(u.rows) if k[0] == exporter and k[1] < gen - 2]:
                u.rows.pop(old, None)  # generations long gone
        u.rows[key] = rows
        return rows

    # building the owners ---------------------------------------------------------------------

    def _static(self, key: str, slot_keys: list[str] | None = None) -> _Unit:
        u = self._units.get(key)
        if u is None:
            u = self._units[key] = _Unit(key, _STATIC, slot_keys=slot_keys or [key])
        elif slot_keys is not None and u.slot_keys != slot_keys:
            raise ValueError(f"simdata: owner key {key!r} used twice")
        return u

    def _cycle(self, factor: int, rng: random.Random) -> tuple[int, int]:
        if self.churn_ticks == 0 or factor == 0:
            return 0, 0
        cycle = max(2, self.churn_ticks * factor)
        return cycle, rng.randrange(cycle)

    def _pod_units(self, topo: dict[str, Any]) -> None:
        self._pid_owner: dict[str, str] = {}
        self._cid_owner: dict[str, str] = {}
        self._uid_owner: dict[str, str] = {}
        self._app_pids: set[str] = set()
        self._app_cids: set[str] = set()
        for pod in [*topo["pods"], topo["job"]]:
            is_job = pod is topo["job"]
            key = pod["key"]
            rng = random.Random(f"{self.seed}:lifecycle:{key}")
            cycle, offset = self._cycle(pod["churn"], rng)
            cids = [c["id"] for c in pod["containers"]]
            pids = [p for c in pod["containers"] for p in c["pids"]]
            self._app_pids.update(pids)
            self._app_cids.update(cids)
            if not is_job:
                cids.append(pod["sandbox"])
                pids += [pod["pause_pid"], pod["shim_pid"]]
            spec = _IdSpec(
                pod["controller"], pod["base"], pod["uid"], pod["name"], cids, pids, pod.get("schedule", 0)
            )
            unit = _Unit(key, _JOB if is_job else _POD, gpu=pod.get("gpu"), cycle=cycle, spec=spec)
            if is_job and cycle:
                # The fixture shows the job just terminated: tick 0 is the tick after its last run.
                unit.cycle = max(3, cycle)
                unit.run = max(1, unit.cycle // 3)
                unit.offset = unit.run
            else:
                unit.offset = offset
            self._units[key] = unit
            self._uid_owner[pod["uid"]] = key
            for cid in cids:
                self._cid_owner[cid] = key
            for pid in pids:
                self._pid_owner[pid] = key

    def _build_kepler(self, topo: dict[str, Any]) -> None:
        raw = _fixture("kepler-current-sample.prom")
        uptime = float(topo["kepler_uptime_s"])
        self._expo["kepler"] = _Exposition([_Family(f.name, f.help, f.type) for f in raw], sorted_output=True)
        watts = {
            (f.name, labels): float(v) for f in raw if f.name.endswith("_watts") for _, labels, v in f.samples
        }
        job_key = topo["job"]["key"]
        for fi, fam in enumerate(raw):
            dec = _family_decimals(fam)
            for sname, labels, vs in fam.samples:
                v0 = float(vs)
                d = dict(labels)
                owner, app = self._kepler_owner(fam.name, d)
                unit = self._static(owner)
                slot = 1 if unit.gpu is not None and unit.kind != _STATIC and "_gpu_" in fam.name else 0
                if owner == job_key:  # stored as running; the terminated report relabels it
                    labels = tuple((k, "running" if k == "state" else v) for k, v in labels)
                tpl = _Tpl(fi, sname, labels, _GAUGE, 0.0, v0, lo=0.0, dec=dec, slot=slot, app=app)
                if _is_constant(fam.name):
                    tpl.kind, tpl.a, tpl.b = _CONST, v0, 0.0
                elif fam.name == "go_memstats_last_gc_time_seconds":
                    tpl.kind, tpl.a, tpl.b, tpl.c = _COUNTER, v0, 1.0, 0.0  # wall clock of the last GC
                elif fam.type == "counter" or (fam.type == "summary" and sname != fam.name):
                    sibling = watts.get((fam.name.replace("_joules_total", "_watts"), labels))
                    rate = sibling if sibling is not None else v0 / uptime
                    tpl.kind, tpl.a, tpl.b, tpl.c = _COUNTER, v0, 0.0, rate
                    if sname.endswith("_count") and fam.type == "summary":
                        tpl.om_int, tpl.dec = True, 0  # an observation count is an integer
                elif fam.name == "kepler_node_cpu_usage_ratio":
                    tpl.hi = 1.0
                unit.add("kepler", tpl)

    def _kepler_owner(self, family: str, d: dict[str, str]) -> tuple[str, bool]:
        """Owner key of a Kepler v0.11 series, and whether it is app-level (reported when terminated)."""
        if "pid" in d:
            pid = d["pid"]
            return self._pid_owner.get(pid, f"proc:{pid}"), pid in self._app_pids
        if "container_id" in d:
            cid = d["container_id"]
            return self._cid_owner[cid], cid in self._app_cids
        if "pod_id" in d:
            return self._uid_owner[d["pod_id"]], True
        if family.startswith("kepler_node_gpu"):
            return f"gpu{d['gpu']}", False
        if family.startswith("kepler_node_cpu") and family != "kepler_node_cpu_info":
            return "power:node", False
        return "runtime", False

    def _build_kepler07(self, topo: dict[str, Any]) -> None:
        raw = _fixture("kepler-0.7-sample.prom")
        uptime = float(topo["kepler_uptime_s"])
        self._expo["kepler-0.7"] = _Exposition(
            [_Family(f.name, f.help, f.type) for f in raw], sorted_output=True
        )
        gpu_families = ("kepler_container_gpu_compute_util_total", "kepler_container_gpu_mem_util_total")
        for fi, fam in enumerate(raw):
            dec = _family_decimals(fam)
            for sname, labels, vs in fam.samples:
                v0 = float(vs)
                d = dict(labels)
                if "container_id" in d:
                    owner = self._cid_owner.get(d["container_id"], f"k07:{d['container_id']}")
                elif fam.name == "kepler_node_gpu_joules_total":
                    owner = f"gpu{d['package']}"
                elif fam.name.startswith("kepler_node_") and fam.name != "kepler_node_info":
                    owner = "power:node"
                else:
                    owner = "runtime"
                unit = self._static(owner)
                gpu_bound = fam.name in gpu_families or (
                    fam.name == "kepler_container_gpu_joules_total" and d.get("mode") == "dynamic"
                )
                slot = 1 if unit.gpu is not None and unit.kind != _STATIC and gpu_bound else 0
                if _is_constant(fam.name):
                    tpl = _Tpl(fi, sname, labels, _CONST, v0, dec=dec)
                else:  # the old line exposes counters only; no watts gauges to take rates from
                    tpl = _Tpl(fi, sname, labels, _COUNTER, v0, 0.0, v0 / uptime, dec=dec, slot=slot)
                unit.add("kepler-0.7", tpl)
        # The fixture has no 0.7 series for the finished job; give it the template pod's, relabelled.
        job = topo["job"]
        src = self._units[job["kepler07_template"]]
        src_pod = next(p for p in topo["pods"] if p["key"] == src.key)
        changes = {
            "container_id": job["containers"][0]["id"],
            "container_name": job["containers"][0]["name"],
            "container_namespace": job["namespace"],
            "pod_name": job["name"],
        }
        job_unit = self._units[job["key"]]
        app_cid = src_pod["containers"][0]["id"]
        for tpl in src.tpls.get("kepler-0.7", []):
            if dict(tpl.labels).get("container_id") == app_cid:
                job_unit.add("kepler-0.7", _relabel(tpl, changes, 6.0))

    def _build_dcgm(self, topo: dict[str, Any]) -> None:
        raw = _fixture("dcgm-exporter-sample.prom")
        self._expo["dcgm"] = _Exposition([_Family(f.name, f.help, f.type) for f in raw], sorted_output=False)
        values: dict[tuple[str, str], float] = {
            (f.name, dict(labels)["gpu"]): float(v) for f in raw for _, labels, v in f.samples
        }
        holders = {p["gpu"]: self._units[p["key"]] for p in topo["pods"] if p.get("gpu") is not None}
        for fi, fam in enumerate(raw):
            for sname, labels, vs in fam.samples:
                v0 = float(vs)
                gpu = dict(labels)["gpu"]
                unit = self._static(f"gpu{gpu}")
                unit.holder = holders.get(int(gpu))
                fmt = _FMT_FLOAT if "." in vs else _FMT_INT
                tpl = _Tpl(fi, sname, labels, _CONST, v0, fmt=fmt)
                model = _DCGM_FIELDS.get(fam.name, (0.3, 0.0, _INF))
                if fam.name == "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION":  # mJ, at the power gauge's rate
                    power = values[("DCGM_FI_DEV_POWER_USAGE", gpu)]
                    tpl.kind, tpl.c = _COUNTER, 1000.0 * power
                elif fam.name == "DCGM_FI_DEV_FB_FREE":  # whatever is neither used nor reserved
                    amp, lo, hi = _DCGM_FIELDS["DCGM_FI_DEV_FB_USED"]
                    used = values[("DCGM_FI_DEV_FB_USED", gpu)]
                    total = v0 + used + values[("DCGM_FI_DEV_FB_RESERVED", gpu)]
                    tpl.kind, tpl.a, tpl.b = _GAUGE, v0 + used * amp, -used * amp
                    tpl.lo, tpl.hi = 0.0, total
                elif model is not None:
                    amp, lo, hi = model
                    tpl.kind, tpl.a, tpl.b, tpl.lo, tpl.hi = _GAUGE, v0 * (1 - amp), v0 * amp, lo, hi
                unit.add("dcgm", tpl)

    def _build_node(self) -> None:
        spec: dict[str, Any] = json.loads(_simdata("node-exporter.json"))
        nb = _NodeBuilder(spec, self.interval_s, self.seed)
        nb.build(_fixture("kepler-current-sample.prom"))
        self._expo["node"] = nb.exposition()
        unit = self._static("host:node_exporter", nb.slots)
        unit.tpls["node"] = nb.templates(self._expo["node"])

    # sizing ----------------------------------------------------------------------------------

    def _nominal(self, exporter: str) -> int:
        n = 0
        for u in self._units.values():
            for _gen, state, _t, _r in self._instances(u, 0):
                tpls = u.tpls.get(exporter, [])
                if state == _TERM:
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
            self._add_clone(
                i, topo, template, workers=n if use_workers else 0, sidecars=0 if use_workers else n
            )
        self.clones = clones
        self.workers = extra if use_workers else 0
        self.sidecars = 0 if use_workers else extra

    def _add_clone(self, i: int, topo: dict[str, Any], src: _Unit, *, workers: int, sidecars: int) -> None:
        """A pod cloned from the template pod (one container, one process) under a new identity."""
        rng = random.Random(f"{self.seed}:clone:{i}")
        workloads = topo["clone_workloads"]
        wl = workloads[i % len(workloads)]
        stem = wl["base"] if i < len(workloads) else f"{wl['base']}-{i // len(workloads) + 1}"
        base = f"{stem}-{rng.choice('56789')}{_suffix(rng, rng.choice((8, 9)))}"
        src_pod = next(p for p in topo["pods"] if p["key"] == src.key)
        assert src.spec is not None
        app = src_pod["containers"][0]
        app_pid = app["pids"][0]
        proc = next(t for t in src.tpls["kepler"] if dict(t.labels).get("pid") == app_pid)
        pl = dict(proc.labels)
        factor = math.exp(rng.uniform(math.log(0.3), math.log(6.0)))
        key = f"clone{i}"
        spec = _IdSpec(
            "deployment", base, src.spec.uid, src.spec.name, list(src.spec.cids), list(src.spec.pids)
        )
        unit = _Unit(key, _POD, spec=spec)
        if self.churn_ticks and rng.random() < 0.5:
            unit.cycle, unit.offset = self._cycle(rng.choice((1, 2, 3)), rng)
        name = f"{base}-{_suffix(rng)}"
        ns = src_pod["namespace"]
        unit.ident0 = {
            ("pod_id", spec.uid): _uid(rng),
            ("pod_name", spec.name): name,
            ("pod", spec.name): name,
            ("pod_namespace", ns): wl["namespace"],
            ("container_namespace", ns): wl["namespace"],
            ("container_name", app["name"]): wl["container"],
            ("comm", pl["comm"]): wl["comm"],
            ("exe", pl["exe"]): wl["exe"],
        }
        for cid in spec.cids:
            unit.ident0[("container_id", cid)] = _hex(rng, 64)
        pids = _Pids(rng)
        for pid in spec.pids:
            unit.ident0[("pid", pid)] = pids()
        for exporter, tpls in src.tpls.items():
            unit.tpls[exporter] = [t.scaled(factor) for t in tpls]
        proc_tpls = [t for t in src.tpls["kepler"] if dict(t.labels).get("pid") == app_pid]
        for k in range(workers):  # more worker processes in the app container
            placeholder = f"w{k}"
            wf = factor * rng.uniform(0.05, 0.8)
            for t in proc_tpls:
                w = _relabel(t, {"pid": placeholder}, wf)
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
                        s = _relabel(t, changes, sf)
                        s.app = False
                        unit.add(exporter, s)
            spec.cids.append(cid)
            spec.pids.append(pid)
            unit.ident0[("container_id", cid)] = _hex(rng, 64)
            unit.ident0[("pid", pid)] = pids()
        self._units[key] = unit


def _remember(d: dict[int, Any], gen: int, value: Any) -> None:
    """Memoize per generation, forgetting generations that are long gone."""
    # list(d) is one C call (atomic under the GIL): renders of several exporters may share a unit.
    for old in [g for g in list(d) if g < gen - 2]:
        d.pop(old, None)
    d[gen] = value


def _is_constant(family: str) -> bool:
    return family.endswith("_info") or family in (
        "go_gc_gogc_percent",
        "go_gc_gomemlimit_bytes",
        "go_sched_gomaxprocs_threads",
    )


# DCGM field -> (how strongly it follows the GPU's load, lower bound, upper bound); None: constant.
_DCGM_FIELDS: Final[dict[str, tuple[float, float, float] | None]] = {
    "DCGM_FI_DEV_SM_CLOCK": (0.4, 210.0, 1410.0),
    "DCGM_FI_DEV_MEM_CLOCK": None,
    "DCGM_FI_DEV_MEMORY_TEMP": (0.15, 25.0, 95.0),
    "DCGM_FI_DEV_GPU_TEMP": (0.15, 25.0, 90.0),
    "DCGM_FI_DEV_POWER_USAGE": (1.0, 0.0, 300.0),
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": None,
    "DCGM_FI_DEV_GPU_UTIL": (0.8, 0.0, 100.0),
    "DCGM_FI_DEV_MEM_COPY_UTIL": (0.8, 0.0, 100.0),
    "DCGM_FI_DEV_ENC_UTIL": (1.0, 0.0, 100.0),
    "DCGM_FI_DEV_DEC_UTIL": (0.6, 0.0, 100.0),
    "DCGM_FI_DEV_XID_ERRORS": None,
    "DCGM_FI_DEV_FB_USED": (0.3, 0.0, 81920.0),
    "DCGM_FI_DEV_FB_RESERVED": None,
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": None,
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": None,
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": None,
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": None,
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": None,
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": (0.8, 0.0, 1.0),
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": (1.0, 0.0, 1.0),
    "DCGM_FI_PROF_DRAM_ACTIVE": (0.8, 0.0, 1.0),
    "DCGM_FI_PROF_PCIE_TX_BYTES": (1.0, 0.0, _INF),
    "DCGM_FI_PROF_PCIE_RX_BYTES": (1.0, 0.0, _INF),
}


# --- node_exporter ------------------------------------------------------------------------------


class _NodeBuilder:
    """node_exporter's series for edge-gpu-01, from simdata/node-exporter.json plus the model here."""

    def __init__(self, spec: dict[str, Any], interval_s: float, seed: int) -> None:
        self.spec = spec
        self.interval_s = interval_s
        self.rng = random.Random(f"{seed}:node")
        self.slots: list[str] = []
        self.help: dict[str, tuple[str, str]] = {k: (v[0], v[1]) for k, v in spec["help"].items()}
        self.series: list[tuple[str, dict[str, str], _Tpl]] = []
        self.uptime = float(spec["uptime_s"])
        self.epoch = float(spec["epoch_at_tick0"])

    def slot(self, key: str) -> int:
        if key not in self.slots:
            self.slots.append(key)
        return self.slots.index(key)

    def _add(self, name: str, labels: Mapping[str, str], tpl: _Tpl) -> None:
        self.series.append((name, dict(labels), tpl))

    def const(self, name: str, labels: Mapping[str, str], v: float) -> None:
        self._add(name, labels, _Tpl(0, name, (), _CONST, float(v), dec=None))

    def gauge(
        self,
        name: str,
        labels: Mapping[str, str],
        c0: float,
        c1: float,
        slot: str,
        *,
        lo: float = 0.0,
        hi: float = _INF,
        dec: int | None = None,
        quantum: int = 0,
    ) -> None:
        """``c0 + c1*S(t)`` of the named shape."""
        tpl = _Tpl(0, name, (), _GAUGE, c0, c1, lo=lo, hi=hi, dec=dec, quantum=quantum, slot=self.slot(slot))
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
        tpl = _Tpl(0, name, (), _COUNTER, start, lin, rate, dec=dec, slot=self.slot(slot))
        self._add(name, labels, tpl)

    def build(self, kepler_raw: Iterable[_RawFamily]) -> None:
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

    def _go_runtime(self, kepler_raw: Iterable[_RawFamily]) -> None:
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
                elif _is_constant(fam.name):
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

    def exposition(self) -> _Exposition:
        families = []
        for name in sorted({_summary_family(name) for name, _, _ in self.series}):
            if name.startswith("node_memory_"):
                self.help.setdefault(name, ("gauge", f"Memory information field {name[12:]}."))
            typ, text = self.help[name]
            families.append(_Family(name, text, typ))
        return _Exposition(families, sorted_output=True)

    def templates(self, expo: _Exposition) -> list[_Tpl]:
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


# --- HTTP ---------------------------------------------------------------------------------------


def negotiate_openmetrics(accept: str) -> str | None:
    """The OpenMetrics version client_golang's promhttp picks for this Accept header, or None (text).

    Like ``expfmt.NegotiateIncludingOpenMetrics``: entries by descending q, the first usable one
    wins; protobuf is skipped (not served here); nothing usable means text.
    """
    entries: list[tuple[float, bool, bool, int, str, dict[str, str]]] = []
    for i, part in enumerate(accept.split(",")):
        fields = [f.strip() for f in part.split(";")]
        media = fields[0].lower()
        if not media:
            continue
        params: dict[str, str] = {}
        q = 1.0
        for f in fields[1:]:
            k, _, v = f.partition("=")
            k, v = k.strip().lower(), v.strip().strip('"')
            if k == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
            else:
                params[k] = v
        entries.append((-q, media.startswith("*/"), media.endswith("/*"), i, media, params))
    entries.sort(key=lambda e: e[:4])
    for *_, media, params in entries:
        version = params.get("version", "")
        if media == "text/plain" and version in ("", "0.0.4"):
            return None
        if media == "application/openmetrics-text" and version in ("", "0.0.1", "1.0.0"):
            return "1.0.0" if version == "1.0.0" else "0.0.1"
    return None


def _accepts_gzip(accept_encoding: str) -> bool:
    for part in accept_encoding.split(","):
        coding, _, params = part.strip().partition(";")
        if coding.strip().lower() in ("gzip", "*"):
            q = params.strip()
            return not (q.startswith("q=") and _float(q[2:]) <= 0)
    return False


def _float(s: str) -> float:
    try:
        return float(s)
    except ValueError:
        return 0.0


class _ExporterHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], exporter: str, owner: SimulatorServer) -> None:
        self.exporter = exporter
        self.owner = owner
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """Wake keep-alive handler threads so they end with the server."""
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class _ExporterHTTPServer6(_ExporterHTTPServer):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Go exporters do
    timeout = 120  # an idle keep-alive connection is dropped after this many seconds

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _ExporterHTTPServer)
        server.owner._handle(self, server.exporter)

    def send_response(self, code: int, message: str | None = None) -> None:
        # Like Go's net/http: a Date header but no Server header.
        self.send_response_only(code, message)
        self.send_header("Date", self.date_time_string())

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the served log (--served-log) records requests; stderr stays quiet


class SimulatorServer:
    """Serves a Simulator's exporters over HTTP, each on its own port, in background threads.

    ``ports`` maps exporter -> port (0: a free port); exporters left out are not served. The tick of
    a request is ``floor((clock() - start) / interval)``; payloads are rendered once per
    (exporter, tick, format) and shared by every scraper.
    """

    def __init__(
        self,
        simulator: Simulator,
        *,
        host: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        served_log: str | Path | None = None,
        fail_every: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if fail_every < 0:
            raise ValueError("fail_every must be >= 0")
        self.simulator = simulator
        self.host = host
        self.ports: dict[str, int] = (
            dict(ports) if ports is not None else dict.fromkeys(simulator.exporters, 0)
        )
        for exporter in self.ports:
            if exporter not in EXPORTERS:
                raise ValueError(f"unknown exporter {exporter!r}")
        self.served_log = Path(served_log) if served_log is not None else None
        self.fail_every = fail_every
        self._clock = clock
        self._start = 0.0
        self.start_ms = 0
        self._servers: dict[str, _ExporterHTTPServer] = {}
        self._threads: list[threading.Thread] = []
        self._cache: dict[tuple[str, int, bool, bool], bytes] = {}
        self._locks = {e: threading.Lock() for e in EXPORTERS}
        self._log_lock = threading.Lock()
        self._log_file: IO[str] | None = None

    @property
    def urls(self) -> dict[str, str]:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {e: f"http://{host}:{self.ports[e]}/metrics" for e in self._servers}

    def tick(self) -> int:
        return max(0, math.floor((self._clock() - self._start) / self.simulator.interval_s))

    def start(self) -> SimulatorServer:
        cls = _ExporterHTTPServer6 if ":" in self.host else _ExporterHTTPServer
        try:
            for exporter, port in self.ports.items():
                server = cls((self.host, port), exporter, self)
                self._servers[exporter] = server
                self.ports[exporter] = server.server_address[1]
        except OSError:
            self._close_servers()
            raise
        if self.served_log is not None:
            self._log_file = self.served_log.open("a", encoding="utf-8")
        self._start = self._clock()
        self.start_ms = int(time.time() * 1000)
        for exporter, server in self._servers.items():
            thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.1},
                name=f"sim-{exporter}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        if self._threads:  # shutdown() would wait forever for a server that never served
            for server in self._servers.values():
                server.shutdown()
            for thread in self._threads:
                thread.join(5)
            self._threads.clear()
            self._close_servers()
        with self._log_lock:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def _close_servers(self) -> None:
        for server in self._servers.values():
            server.close_connections()
            server.server_close()

    def __enter__(self) -> SimulatorServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def payload(self, exporter: str, tick: int, openmetrics: bool = False, gzipped: bool = False) -> bytes:
        """The body served at ``tick``, rendered once and shared by concurrent scrapers."""
        key = (exporter, tick, openmetrics, gzipped)
        with self._locks[exporter]:
            body = self._cache.get(key)
            if body is None:
                plain = self._cache.get((exporter, tick, openmetrics, False))
                if plain is None:
                    plain = self.simulator.render(exporter, tick, openmetrics)
                    self._cache[(exporter, tick, openmetrics, False)] = plain
                body = gzip.compress(plain, compresslevel=6, mtime=0) if gzipped else plain  # Go default
                self._cache[key] = body
                for old in [k for k in self._cache if k[0] == exporter and k[1] < tick - 1]:
                    del self._cache[old]
        return body

    def _handle(self, h: BaseHTTPRequestHandler, exporter: str) -> None:
        if urlsplit(h.path).path != "/metrics":
            self._send(h, 404, "text/plain; charset=utf-8", b"404 page not found\n")
            return
        tick = self.tick()
        sim = self.simulator
        om_version = (
            negotiate_openmetrics(h.headers.get("Accept", "")) if sim.supports_openmetrics(exporter) else None
        )
        om = om_version is not None
        headers: dict[str, str] = {}
        if self.fail_every and (tick + 1) % self.fail_every == 0:
            status, ctype, body = 500, "text/plain; charset=utf-8", b"simulated scrape failure\n"
        else:
            # promhttp gzips when asked; dcgm-exporter's hand-written handler never does.
            gz = exporter != "dcgm" and _accepts_gzip(h.headers.get("Accept-Encoding", ""))
            status, body = 200, self.payload(exporter, tick, om, gz)
            ctype = CONTENT_TYPE_OPENMETRICS_001 if om_version == "0.0.1" else sim.content_type(exporter, om)
            if gz:
                headers["Content-Encoding"] = "gzip"
            if exporter == "dcgm":
                headers["X-Content-Type-Options"] = "nosniff"
        # Logged before the body goes out: once a client has the response, its log line exists.
        self._log(exporter, tick, om, status)
        self._send(h, status, ctype, body, headers)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler,
        status: int,
        ctype: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        h.send_response(status)
        h.send_header("Content-Type", ctype)
        h.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.end_headers()
        try:
            h.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            h.close_connection = True

    def _log(self, exporter: str, tick: int, om: bool, status: int) -> None:
        if self._log_file is None:
            return
        rec = {
            "exporter": exporter,
            "tick": tick,
            "t_ms": int(time.time() * 1000),
            "openmetrics": om,
            "status": status,
        }
        with self._log_lock:
            if self._log_file is not None:
                self._log_file.write(json.dumps(rec) + "\n")
                self._log_file.flush()


def start_in_thread(
    seed: int = 1,
    series: int | None = None,
    interval_s: float = 5.0,
    *,
    churn_ticks: int = 30,
    exporters: Iterable[str] = EXPORTERS,
    host: str = "127.0.0.1",
    served_log: str | Path | None = None,
    fail_every: int = 0,
) -> SimulatorServer:
    """A started SimulatorServer on free loopback ports (``.urls``, ``.stop()``)."""
    sim = Simulator(seed, series, interval_s, churn_ticks=churn_ticks, exporters=exporters)
    return SimulatorServer(sim, host=host, served_log=served_log, fail_every=fail_every).start()


# --- command line -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    for name, exporter in (
        ("kepler", "kepler"),
        ("kepler07", "kepler-0.7"),
        ("dcgm", "dcgm"),
        ("node", "node"),
    ):
        parser.add_argument(
            f"--{name}-port",
            type=int,
            default=DEFAULT_PORTS[exporter],
            metavar="PORT",
            help=f"{exporter} port (default {DEFAULT_PORTS[exporter]}; 0: any free port; -1: disabled)",
        )
    parser.add_argument(
        "--series",
        type=int,
        default=None,
        metavar="N",
        help="total series across the enabled exporters (default: the fixtures' natural size); "
        "grows Kepler pods and processes",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument(
        "--interval", type=float, default=5.0, metavar="SECONDS", help="seconds per tick (default 5)"
    )
    parser.add_argument(
        "--churn-ticks",
        type=int,
        default=30,
        metavar="TICKS",
        help="base period of pod replacement in ticks (default 30; 0: no churn)",
    )
    parser.add_argument(
        "--served-log", default=None, metavar="FILE", help="append one JSON line per served request"
    )
    parser.add_argument(
        "--fail-every",
        type=int,
        default=0,
        metavar="K",
        help="answer HTTP 500 on every K-th tick (default off)",
    )


def run(args: argparse.Namespace) -> int:
    ports = {
        "kepler": args.kepler_port,
        "kepler-0.7": args.kepler07_port,
        "dcgm": args.dcgm_port,
        "node": args.node_port,
    }
    enabled = {e: p for e, p in ports.items() if p != -1}
    problems = []
    if not enabled:
        problems.append("all exporters are disabled")
    if any(not 0 <= p <= 65535 for p in enabled.values()):
        problems.append("ports must be -1 (disabled), 0 (any free port) or 1-65535")
    if args.interval <= 0:
        problems.append("--interval must be > 0")
    if args.churn_ticks < 0:
        problems.append("--churn-ticks must be >= 0")
    if args.fail_every < 0:
        problems.append("--fail-every must be >= 0")
    if args.series is not None and args.series <= 0:
        problems.append("--series must be > 0")
    if problems:
        for p in problems:
            print(f"simulate: {p}", file=sys.stderr)
        return 2
    sim = Simulator(args.seed, args.series, args.interval, churn_ticks=args.churn_ticks, exporters=enabled)
    server = SimulatorServer(
        sim, host=args.host, ports=enabled, served_log=args.served_log, fail_every=args.fail_every
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            server.start()
        except OSError as e:
            print(f"simulate: cannot listen: {e}", file=sys.stderr)
            return 1
        log.info("simulating %d series (%s)", sim.planned_total, sim.planned_series)
        if args.series is not None and abs(sim.planned_total - args.series) > 0.05 * args.series:
            # Only Kepler grows; dcgm / node keep their natural size, and pods stop at max-pods.
            log.warning("--series %d: serving %d series with these exporters", args.series, sim.planned_total)
        ready = {
            "ready": True,
            "exporters": server.urls,
            "series": {e: sim.planned_series[e] for e in sim.exporters},
            "start_ms": server.start_ms,
            "interval_s": sim.interval_s,
        }
        print(json.dumps(ready), flush=True)
        while not stop.wait(0.5):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
