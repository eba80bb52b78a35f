"""Shared vocabulary of the exporter models: names, content types, value kinds, load shapes, templates.

Also the package data: ``data_path`` locates the fixtures and JSON specs in ``simulator/data/``,
``fixture`` parses a ``*.prom`` fixture (HELP text, sample order and number spelling kept).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Final

DATA_DIR: Final = Path(__file__).resolve().parent / "data"

# The NVIDIA node's exporters (edge-gpu-01), the default set; the other vendors' GPU exporters follow.
EXPORTERS: Final = ("kepler", "kepler-0.7", "dcgm", "node")
GPU_EXPORTERS: Final = ("amd", "intel", "jetson")
ALL_EXPORTERS: Final = EXPORTERS + GPU_EXPORTERS
# jetson_stats_node_exporter listens on 9100 by default, node_exporter's port: beside node_exporter it
# runs with --port 9110 (deploy/README.md), and so does its simulation.
DEFAULT_PORTS: Final = {
    "kepler": 28282,
    "kepler-0.7": 9102,
    "dcgm": 9400,
    "node": 9100,
    "amd": 5000,
    "intel": 8080,
    "jetson": 9110,
}
# What ``edge-relay simulate --vendor`` serves: Kepler (without GPU series off NVIDIA: Kepler 0.11 reads
# GPUs through NVML only, and Jetson has neither NVML nor RAPL), the GPU exporter, node_exporter.
VENDORS: Final[dict[str, tuple[str, ...]]] = {
    "nvidia": EXPORTERS,
    "amd": ("kepler", "amd", "node"),
    "intel": ("kepler", "intel", "node"),
    "jetson": ("jetson", "node"),
}

CONTENT_TYPE_TEXT: Final = "text/plain; version=0.0.4; charset=utf-8"
CONTENT_TYPE_OPENMETRICS: Final = "application/openmetrics-text; version=1.0.0; charset=utf-8"
CONTENT_TYPE_OPENMETRICS_001: Final = "application/openmetrics-text; version=0.0.1; charset=utf-8"
# dcgm-exporter writes its body without a Content-Type; Go's net/http then sniffs plain text.
CONTENT_TYPE_SNIFFED: Final = "text/plain; charset=utf-8"

Pairs = tuple[tuple[str, str], ...]

# Series value kinds.
CONST, GAUGE, COUNTER = 0, 1, 2
# Number formats: Go strconv 'g' (client_golang), dcgm-exporter's %d and %f, Python prometheus_client,
# and Go 'g' of a CPU time in clock ticks (Kepler v0.11's process CPU time: ticks / USER_HZ).
FMT_GO, FMT_INT, FMT_FLOAT, FMT_PY, FMT_GO_TICKS = 0, 1, 2, 3, 4
USER_HZ: Final = 100
# Instance states: running, reported once more as terminated (Kepler v0.11), GPU held by no pod (dcgm).
RUN, TERM, UNHELD = 0, 1, 2
# Unit kinds.
STATIC, POD, JOB = 0, 1, 2

INF = math.inf


# --- number formatting --------------------------------------------------------------------------


def format_go_float(v: float) -> str:
    """``strconv.FormatFloat(v, 'g', -1, 64)``: how client_golang's text encoder writes a value.

    Shortest round-trip digits, like Python's repr, but Go switches to the exponent form from 1e6
    on (Python's repr only from 1e16): ``15390577.028`` is written ``1.5390577028e+07``.
    """
    if v != v:
        return "NaN"
    if v == INF:
        return "+Inf"
    if v == -INF:
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


def escape_label(v: str) -> str:
    if "\\" in v or '"' in v or "\n" in v:
        v = v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return v


def _escape_help(v: str, openmetrics: bool) -> str:
    v = v.replace("\\", "\\\\").replace("\n", "\\n")
    return v.replace('"', '\\"') if openmetrics else v


# --- load shapes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """``S(t) = 1 + f*(sin(w*t + p) - sin(p))`` and its integral; ``S > 0`` because ``f < 0.5``."""

    f: float
    w: float
    p: float

    def level(self, t: float) -> float:
        return 1.0 + self.f * (math.sin(self.w * t + self.p) - math.sin(self.p))

    def integral(self, t: float, t0: float) -> float:
        f, w, p = self.f, self.w, self.p
        return (t - t0) * (1.0 - f * math.sin(p)) + f / w * (math.cos(w * t0 + p) - math.cos(w * t + p))


FLAT = Shape(0.0, 1.0, 0.0)


# --- series templates ---------------------------------------------------------------------------


@dataclass(slots=True)
class Tpl:
    """One series of one owner: labels as the exporter writes them plus the value model."""

    fam: int  # family index in the exporter's Exposition
    name: str  # sample name (a summary's _sum / _count differ from the family name)
    labels: Pairs
    kind: int
    a: float  # CONST: value; GAUGE: offset; COUNTER: value at tick 0
    b: float = 0.0  # GAUGE: load coefficient; COUNTER: growth per second independent of load
    c: float = 0.0  # COUNTER: growth per second at load 1
    lo: float = -INF
    hi: float = INF
    dec: int | None = None  # round to this many decimals (the fixture's precision)
    quantum: int = 0  # round to a multiple (meminfo kB, filesystem blocks)
    slot: int = 0  # index of the owner shape that drives this series
    fmt: int = FMT_GO
    app: bool = True  # reported when the owner is terminated (Kepler v0.11)
    om_int: bool = False  # a summary's _count: OpenMetrics writes it as an integer

    def scaled(self, factor: float) -> Tpl:
        if self.kind == CONST:
            return dataclasses.replace(self)
        if self.kind == GAUGE:
            return dataclasses.replace(self, a=self.a * factor, b=self.b * factor)
        return dataclasses.replace(self, a=self.a * factor, c=self.c * factor)


@dataclass(slots=True)
class Family:
    name: str
    help: str
    type: str


@dataclass(slots=True)
class Exposition:
    families: list[Family]
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
class RawFamily:
    name: str
    help: str
    type: str
    samples: list[tuple[str, Pairs, str]]


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$")
_LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _parse_fixture(text: str) -> list[RawFamily]:
    """The data fixtures: HELP, TYPE, then samples; HELP text kept byte for byte."""
    helps: dict[str, str] = {}
    out: list[RawFamily] = []
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, text_ = line[7:].partition(" ")
            helps[name] = text_
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            out.append(RawFamily(name, helps.get(name, ""), typ, []))
        elif line and not line.startswith("#"):
            m = _SAMPLE_RE.match(line)
            if m is None or not out:
                raise ValueError(f"simulator data: cannot parse {line!r}")
            pairs = tuple((k, v) for k, v in _LABEL_RE.findall(m.group(2) or ""))
            out[-1].samples.append((m.group(1), pairs, m.group(3)))
    return out


def data_path(name: str | None = None) -> Path:
    """The simulator's data directory (package data), or the file ``name`` in it.

    The ``*.prom`` files are the exporter fixtures the models reproduce byte for byte at tick 0;
    tests read them from here rather than keeping copies.
    """
    if name is None:
        return DATA_DIR
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no simulator data file {name!r} in {DATA_DIR}")
    return path


@cache
def read_data(name: str) -> str:
    return data_path(name).read_text(encoding="utf-8")


@cache
def fixture(name: str) -> tuple[RawFamily, ...]:
    return tuple(_parse_fixture(read_data(name)))


def family_decimals(fam: RawFamily) -> int | None:
    d = max((_decimals(v) for _, _, v in fam.samples), default=0)
    return None if d > 12 else d  # full float precision in the fixture: keep it


def is_constant(family: str) -> bool:
    return family.endswith("_info") or family in (
        "go_gc_gogc_percent",
        "go_gc_gomemlimit_bytes",
        "go_sched_gomaxprocs_threads",
    )
