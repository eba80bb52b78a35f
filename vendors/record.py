"""The shape of one exporter's record: what the relay, the detector, the simulator and the rules know of it.

Data, and the two look-ups that belong to it (``Label.holds``, ``GpuSignals.gpu_key``): each exporter
module (``vendors.dcgm``, ...) fills an ``Exporter``; the budget compiles its presets,
``edge_relay.anomaly.signals`` compiles its ``GpuSignals`` into readers, ``vendors.generate`` writes its
recording rules and the schema's enums. A reading names a signal from ``GAUGE_SIGNALS``; a record that
names another fails on import, so a typo cannot pass silently.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

# What a GPU exporter's gauges can give the detector (``edge_relay.anomaly.detector`` reads them by these
# names): GPU and memory temperature (°C), power and the limit the exporter serves (the exporter's unit),
# utilisation (%), graphics clock, device memory used / free / reserved / total (the exporter's unit),
# AMD's worst violation residency (% of time held back), and Kepler's per-GPU watts (for watts per load).
GAUGE_SIGNALS: Final = frozenset(
    {
        "temp",
        "mem_temp",
        "power",
        "power_limit",
        "util",
        "clock",
        "fb",
        "fb_free",
        "fb_reserved",
        "fb_total",
        "violation",
        "kepler_watts",
    }
)


@dataclass(frozen=True, slots=True)
class Preset:
    """Built-in matchers for one exporter's series (names fully matched), and its unsuffixed counters.

    ``summary`` is the budget schema's short description of it (generated into the schema);
    ``gpus`` names the GPU exporter whose detector the preset's series imply (``kepler-gpu``: Kepler
    reads GPUs through NVML, so the node is dcgm's); a GPU exporter's own presets imply it anyway."""

    description: str
    names: tuple[str, ...]
    counters: frozenset[str] = frozenset()
    summary: str = ""
    gpus: str | None = None


@dataclass(frozen=True, slots=True)
class Label:
    """A condition on one label: its value (``missing`` when the series has no such label) is one of
    ``values``."""

    name: str
    values: frozenset[str]
    missing: str = ""

    def holds(self, have: Mapping[str, str]) -> bool:
        return have.get(self.name, self.missing) in self.values


def label(name: str, *values: str, missing: str = "") -> Label:
    return Label(name, frozenset(values), missing)


@dataclass(frozen=True, slots=True)
class Gauge:
    """A series whose value is a signal, times ``scale``. ``metric`` is a name, or ``prefix*suffix`` for a
    family of them; ``worst``: several series give the signal in one scrape, the highest counts."""

    metric: str
    signal: str
    when: tuple[Label, ...] = ()
    scale: float = 1.0
    worst: bool = False

    def __post_init__(self) -> None:
        if self.signal not in GAUGE_SIGNALS:
            raise ValueError(
                f"{self.metric}: unknown signal {self.signal!r} (one of {sorted(GAUGE_SIGNALS)})"
            )


@dataclass(frozen=True, slots=True)
class Counter:
    """A counter whose every increase is an event (``kind``, ``rule``); a reset (going down) is none.
    Compared per series without the workload's labels: a GPU's label set follows the pod on it."""

    metric: str
    kind: str
    rule: str


@dataclass(frozen=True, slots=True)
class Code:
    """A gauge that holds the last error code (XID): each new non-zero value is an event, ruled
    ``{rule}={value}``."""

    metric: str
    kind: str
    rule: str


@dataclass(frozen=True, slots=True)
class Bits:
    """A bit field (clock throttle reasons): any of ``mask``'s bits set is an event, ruled
    ``{rule}=0x{bits}``."""

    metric: str
    kind: str
    rule: str
    mask: int


@dataclass(frozen=True, slots=True)
class Flag:
    """A gauge whose every non-zero value is an event."""

    metric: str
    kind: str
    rule: str


@dataclass(frozen=True, slots=True)
class State:
    """One series per component and state, 1 while the component is in it (Intel's ``hw_status``): a
    series becoming 1 in one of ``states`` is an event, ruled ``{metric}={what}:{state}``. Not on first
    sight: a state the GPU was already in when the relay started is no event of now."""

    metric: str
    kind: str
    state_label: str
    states: frozenset[str]
    what_label: str


Reading = Gauge | Counter | Code | Bits | Flag | State


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """One GPU model's own limits, in its exporter's units, from its vendor's data sheet (``source`` names
    it). None: no published figure was found; the rule then reads a served, configured or learned limit
    (power) or the record's ``RuleDefaults`` (temperatures), never another model's figure."""

    power_limit: float | None  # the board's maximum power: TDP / TBP / TGP (W; Jetson: the module's, mW)
    memory_bytes: int | None = None  # device memory (Jetson: the module's RAM)
    gpu_temp_c: float | None = None  # the published slowdown / maximum operating temperature
    memory_temp_c: float | None = None
    served_as: tuple[str, ...] = ()  # the values of the record's model label that name this model
    source: str = ""


def model_key(name: str) -> str:
    """A model name as compared: case, the vendor's brand words and punctuation do not count
    (``NVIDIA A100-SXM4-80GB`` and ``A100 SXM4 80GB`` are one model)."""
    key = name.lower()
    for brand in ("nvidia", "intel(r)", "intel", "amd", "tesla"):
        key = key.replace(brand, "")
    return "".join(ch for ch in key if ch.isalnum())


@dataclass(frozen=True, slots=True)
class RuleDefaults:
    """How the detector's rules read a vendor's GPUs (the bench's calibration per vendor): the fractions of
    the limits, and the temperatures that alarm where the model's data sheet gives none."""

    power_fraction: float  # of the power limit, on 3 scrapes
    memory_fraction: float  # of the total memory
    gpu_temp_c: float  # the GPU (junction, tj) temperature that alarms, on 2 scrapes
    memory_temp_c: float | None  # the memory's; None: the exporter serves no memory temperature
    temp_slope_c: float = 4.5  # a rise within slope_seconds that fires when no power rise explains it
    slope_seconds: float = 15.0


@dataclass(frozen=True, slots=True)
class PodJoin:
    """The pod a GPU's own series name (their ``pod`` / ``namespace`` labels, on series named
    ``series_prefix``...): the detector finds the workload series of that pod that carry no GPU label
    (Kepler's per-pod GPU series) through it, while the GPU's window is open."""

    series_prefix: str
    pod: str = "pod"
    namespace: str = "namespace"


@dataclass(frozen=True, slots=True)
class GpuSignals:
    """How the anomaly detector reads one GPU exporter.

    ``owns(name)``: whether a metric is one of this exporter's GPU series (the records' are disjoint);
    ``gpu_labels``: the label(s) naming the GPU, the first non-empty one wins, none: one GPU per node
    (``"0"``); ``strip_prefix``: removed from a name before it is looked up in ``readings`` (AMD's Helm
    chart prefix); ``models``: limits per GPU model (keyed by model name), found by ``model`` from the
    value of ``model_label`` (the label, on the GPU's series, that names the model); ``default_model``:
    the model of an exporter that names none (Jetson's serves one module per node and no model name)."""

    owns: Callable[[str], bool]
    readings: tuple[Reading, ...]
    rules: RuleDefaults
    models: Mapping[str, ModelLimits]
    default_model: str | None = None
    gpu_labels: tuple[str, ...] = ()
    strip_prefix: str = ""
    model_label: str | None = None
    pods: PodJoin | None = None

    def __post_init__(self) -> None:
        if self.default_model is not None and self.default_model not in self.models:
            raise ValueError(f"default_model {self.default_model!r} is not in models")

    @property
    def default_limits(self) -> ModelLimits | None:
        return None if self.default_model is None else self.models[self.default_model]

    def model(self, served: str) -> tuple[str, ModelLimits] | None:
        """The model a value of ``model_label`` names (its name, its limits); None: a model not listed."""
        want = model_key(served)
        for name, limits in self.models.items():
            if want == model_key(name) or any(want == model_key(s) for s in limits.served_as):
                return name, limits
        return None

    def gpu_key(self, labels: tuple[tuple[str, str], ...]) -> str | None:
        """The GPU a series is about (its GPU label's value); None: no GPU's (e.g. Kepler 0.7's)."""
        if not self.gpu_labels:
            return "0"  # one integrated GPU
        have = dict(labels)
        for k in self.gpu_labels:
            v = have.get(k)
            if v:
                return v
        return None


@dataclass(frozen=True, slots=True)
class RecordingRule:
    """One ``gpu:*`` recording rule: ``record`` from ``expr``; ``labels`` beside the record's ``vendor``;
    ``comment``: lines written above it."""

    record: str
    expr: str
    labels: tuple[tuple[str, str], ...] = ()
    comment: str = ""


def rule(record: str, expr: str, comment: str = "", **labels: str) -> RecordingRule:
    return RecordingRule(record, expr, tuple(labels.items()), comment)


def label_gpu(expr: str, label: str) -> str:
    """``expr`` with its ``label`` copied into ``gpu``: the device label every ``gpu:*`` series carries."""
    return f'label_replace({expr}, "gpu", "$1", "{label}", "(.*)")'


@dataclass(frozen=True, slots=True)
class RuleSection:
    """A block of the recording rules file: a heading, notes (the exporter's quirks), its rules."""

    heading: str
    rules: tuple[RecordingRule, ...]
    notes: str = ""


@dataclass(frozen=True, slots=True)
class Exporter:
    """One exporter's record.

    ``name``: the registry's key; ``presets``: the budget's presets, in the schema's order (the full one
    first, then its ``-critical`` subset); ``vendor``: the GPU vendor its series describe, the ``vendor``
    label of its recording rules (the word the simulator's ``--vendor`` uses too); ``gpu``: how the
    detector reads it (None: not a GPU exporter); ``rules``: its ``gpu:*`` recording rules; ``samples``:
    its sample pages in ``simulator/data/`` (the simulator's fixtures); ``hwmon_chips``: the hwmon chip
    names of this vendor's GPUs (node-exporter's ``node_hwmon_chip_names``), which the node's detector
    leaves to the GPU's."""

    name: str
    presets: Mapping[str, Preset]
    vendor: str | None = None
    gpu: GpuSignals | None = None
    rules: tuple[RuleSection, ...] = ()
    samples: tuple[str, ...] = ()
    hwmon_chips: frozenset[str] = field(default_factory=frozenset)
