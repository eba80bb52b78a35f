"""What a scrape says about a GPU: the vendor records' readings compiled, the signals taken from their
series, and the EWMA z-score over them (``edge_relay.anomaly.detector`` runs the rules and keeps the windows).

Which series a GPU exporter serves, which label names the GPU and how each series reads (a gauge into a
signal, a counter, an error code, a bit field, a state) are its record's (``vendors``, ``GpuSignals``);
this module only compiles them: ``Reader`` turns one sample into a signal (``x``) or a fired rule, with
the GPU's own state (``prev_counters``, ``prev_xid``, ``prev_status``). ``DEFAULT_THRESHOLDS`` are each
record's default model's limits with its rule defaults; ``Ewma`` is the score both the GPU and the node
detectors (``edge_relay.anomaly.node``) use, over their own signals and floors. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from schemas.model import Labels
from vendors import registry
from vendors.record import Bits, Code, Counter, Flag, Gauge, GpuSignals, Reading, State

SIGNALS: Final = ("util", "power", "temp", "mem_temp", "fb", "clock", "w_per_util")
# z-score floors (the bench's): a flat signal's near-zero spread must not turn noise into alarms.
FLOORS: Final = {"util": 3.0, "power": 5.0, "temp": 1.0, "mem_temp": 1.0, "fb": 256.0, "clock": 20.0,
                 "w_per_util": 0.2}  # fmt: skip
EWMA_ALPHA: Final = 0.016  # half-life ~43 scrapes
EWMA_WARMUP: Final = 24  # scrapes before the score counts
SCORE_DEBOUNCE: Final = 2  # scrapes in a row over the threshold


@dataclass(frozen=True, slots=True)
class Thresholds:
    """One vendor's rule settings (the budget file's ``anomaly.thresholds`` over the record's defaults);
    ``None``: that rule is off (the exporter has no such field). ``power_limit`` is a configured limit
    (None by default): it wins over the one the exporter serves, which wins over the model's data sheet."""

    gpu_temp_c: float
    memory_temp_c: float | None
    power_fraction: float  # of the limit
    power_limit: float | None  # the exporter's unit (W; Jetson mW); None: served, model's or learned
    memory_fraction: float  # of the total memory
    temp_slope_c: float  # rise within ``slope_seconds`` that fires when no power or load rise explains it
    slope_seconds: float


THRESHOLD_KEYS: Final = tuple(Thresholds.__dataclass_fields__)


class Ewma:
    """Per signal |x - mean| / sqrt(var + floor²) with EWMA mean and variance; the max over signals."""

    __slots__ = ("floors", "mean", "n", "signals", "var")

    def __init__(self, signals: tuple[str, ...] = SIGNALS, floors: Mapping[str, float] = FLOORS) -> None:
        self.signals = signals
        self.floors = floors
        self.n = 0
        self.mean: dict[str, float] = {}
        self.var: dict[str, float] = {}

    def score(self, x: Mapping[str, float]) -> float:
        z, a = 0.0, EWMA_ALPHA
        floors = self.floors
        for s in self.signals:
            v = x.get(s)
            if v is None or v != v:
                continue
            if s not in self.mean:
                self.mean[s], self.var[s] = v, 0.0
                continue
            d = v - self.mean[s]
            if self.n >= EWMA_WARMUP:
                z = max(z, abs(d) / math.sqrt(self.var[s] + floors[s] ** 2))
            self.mean[s] += a * d
            self.var[s] = (1 - a) * (self.var[s] + a * d * d)
        self.n += 1
        return z


def thresholds_of(gpu: GpuSignals) -> Thresholds:
    """A GPU exporter's default rule settings: its record's rule defaults, no configured power limit."""
    rules = gpu.rules
    return Thresholds(
        gpu_temp_c=rules.gpu_temp_c,
        memory_temp_c=rules.memory_temp_c,
        power_fraction=rules.power_fraction,
        power_limit=None,
        memory_fraction=rules.memory_fraction,
        temp_slope_c=rules.temp_slope_c,
        slope_seconds=rules.slope_seconds,
    )


DEFAULT_THRESHOLDS: Final = {name: thresholds_of(gpu) for name, gpu in registry.GPUS.items()}

# Labels a series of a GPU carries for the workload on it: a counter is compared without them (dcgm's
# and AMD's label sets follow the pod on the GPU, and a pod's label set coming back must not compare
# with the value it had minutes ago).
WORKLOAD_LABELS: Final = frozenset(
    ("pod", "namespace", "container", "exported_pod", "exported_namespace", "exported_container")
)

# One sample of GPU ``g``: (g, metric name, labels, value, its signals, the rules it fired).
Read = Callable[[Any, str, Labels, float, dict[str, float], list[tuple[str, str]]], None]


def _gauge(r: Gauge) -> Read:
    signal, when, scale, worst = r.signal, r.when, r.scale, r.worst

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        if when:
            have = dict(labels)
            if not all(c.holds(have) for c in when):
                return
        if scale != 1.0:
            value *= scale
        x[signal] = max(value, x.get(signal, 0.0)) if worst else value

    return read


def _counter(r: Counter) -> Read:
    event = (r.kind, r.rule)

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        key = (name, tuple(kv for kv in labels if kv[0] not in WORKLOAD_LABELS))
        prev = g.prev_counters.get(key)
        g.prev_counters[key] = value
        if prev is not None and value > prev:  # a reset (going down) is never an event
            fired.append(event)

    return read


def _code(r: Code) -> Read:
    kind, rule = r.kind, r.rule

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        if value and value != g.prev_xid:  # one code series per GPU: its last value is the GPU's
            fired.append((kind, f"{rule}={value:g}"))
        g.prev_xid = value

    return read


def _bits(r: Bits) -> Read:
    kind, rule, mask = r.kind, r.rule, r.mask

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        bits = int(value) & mask
        if bits:
            fired.append((kind, f"{rule}=0x{bits:x}"))

    return read


def _flag(r: Flag) -> Read:
    event = (r.kind, r.rule)

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        if value:
            fired.append(event)

    return read


def _state(r: State) -> Read:
    kind, metric, states, state_label, what_label = r.kind, r.metric, r.states, r.state_label, r.what_label

    def read(g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        prev = g.prev_status.get(labels)
        g.prev_status[labels] = value
        have = dict(labels)
        state = have.get(state_label)
        if value == 1 and prev is not None and prev != 1 and state in states:
            fired.append((kind, f"{metric}={have.get(what_label, '')}:{state}"))

    return read


def _compile(r: Reading) -> Read:
    if isinstance(r, Gauge):
        return _gauge(r)
    if isinstance(r, Counter):
        return _counter(r)
    if isinstance(r, Code):
        return _code(r)
    if isinstance(r, Bits):
        return _bits(r)
    if isinstance(r, Flag):
        return _flag(r)
    return _state(r)


class Reader:
    """One GPU exporter's readings compiled: a sample's metric name (less ``strip_prefix``) finds what
    reads it, by name or by a ``prefix*suffix`` family."""

    __slots__ = ("by_name", "families", "strip")

    def __init__(self, gpu: GpuSignals) -> None:
        by_name: dict[str, list[Read]] = {}
        families: list[tuple[str, str, Read]] = []
        for r in gpu.readings:
            if isinstance(r, Gauge) and "*" in r.metric:
                prefix, _, suffix = r.metric.partition("*")
                families.append((prefix, suffix, _compile(r)))
            else:
                by_name.setdefault(r.metric, []).append(_compile(r))
        self.by_name = {name: tuple(reads) for name, reads in by_name.items()}
        self.families = tuple(families)
        self.strip = gpu.strip_prefix

    def take(self, g: Any, name: str, labels: Labels, value: float, x: dict[str, float],
             fired: list[tuple[str, str]]) -> None:  # fmt: skip
        """One sample of GPU ``g``: a signal into ``x``, or a counter / code / state rule into ``fired``
        (kind, rule)."""
        strip = self.strip
        bare = name[len(strip) :] if strip and name.startswith(strip) else name
        reads = self.by_name.get(bare)
        if reads is None:
            for prefix, suffix, read in self.families:
                if bare.startswith(prefix) and bare.endswith(suffix):
                    read(g, name, labels, value, x, fired)
            return
        for read in reads:
            read(g, name, labels, value, x, fired)


READERS: Final = {name: Reader(gpu) for name, gpu in registry.GPUS.items()}


def take(
    g: Any, vendor: str, name: str, labels: Labels, value: float, x: dict[str, float],
    fired: list[tuple[str, str]],
) -> None:  # fmt: skip
    """One sample of GPU ``g`` of GPU exporter ``vendor`` (its ``prev_xid``, ``prev_status``,
    ``prev_counters``): ``Reader.take`` of that exporter."""
    READERS[vendor].take(g, name, labels, value, x, fired)


def gpu_key(vendor: str, labels: Labels) -> str | None:
    """The GPU a series of ``vendor`` is about (its label's value); None: no GPU's (e.g. Kepler 0.7)."""
    return registry.GPUS[vendor].gpu_key(labels)


def vendor_of(name: str) -> str | None:
    """The GPU exporter a metric name comes from (Kepler's GPU series: dcgm's); None: not a GPU's."""
    return registry.gpu_exporter_of(name)
