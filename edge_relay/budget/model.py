"""The bandwidth-budget file: what the uplink may carry, and how each class of metrics may be shaped.

Format and meaning of every key: ``schemas/bandwidth-budget.schema.json`` (and ``docs/configuration.md``,
"Bandwidth budget file reference"). This module only loads and validates the file into the typed objects below
(``UplinkBudget`` is the file's ``uplink`` section, not to be confused with ``edge_relay.uplink.mqtt.Uplink``,
the MQTT client); ``edge_relay.budget.shaper`` applies the classes, ``edge_relay.budget.controller``
and ``edge_relay.uplink.pacer`` enforce the uplink figures.

Loading goes through ``relay_common.config`` (YAML, JSON Schema, defaults from the schema); the rules a
schema cannot express are checked here, and every error names the file, the key path and what was
expected, like the relay's own config.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta, tzinfo
from datetime import time as dt_time
from functools import cache
from typing import Any, Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from edge_relay.anomaly.detector import AnomalyConfig
from edge_relay.anomaly.detector import parse_config as parse_anomaly
from relay_common import config as config_loader
from relay_common.config import ConfigError
from relay_common.regex import Regex, RegexError
from schemas.model import Labels, metric_name
from vendors import registry
from vendors.record import Preset

SCHEMA = "bandwidth-budget.schema.json"
DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # index = datetime.weekday()
BURST_FACTOR = 16  # burst_bytes default: at least 16 x the sustained rate ...
BURST_WINDOWS = 2  # ... and room for two batch windows at the highest rate ...
BURST_DEFAULT_MAX = 2_000_000  # ... but no more than two batches of the default batch.max_bytes
# Room in the burst for a batch's MQTT framing: a batch is at most burst_bytes minus this.
FRAMING_ROOM_BYTES = 512
MIN_BATCH_CAP_BYTES = 4096
IMPLICIT_CLASS = "other"
IMPLICIT_MAX_RESOLUTION_S = 300.0

Aggregation = Literal["last", "avg", "min", "max"]


# Names that are counters whatever their class says (Prometheus naming conventions); a counter is always
# aggregated as its last value, keeping the sample before a reset so rate() stays right.
@dataclass(frozen=True, slots=True)
class Matcher:
    """All of: ``__name__`` fully matches ``name`` (None: any), and each label fully matches its regex
    (an absent label is the empty string, as in PromQL). Regexes are RE2, as in a PromQL selector."""

    name: Regex | None = None
    labels: tuple[tuple[str, Regex], ...] = ()

    def matches(self, labels: Labels) -> bool:
        if self.name is not None and not self.name.fullmatch(metric_name(labels)):
            return False
        if self.labels:
            have = dict(labels)
            for key, pattern in self.labels:
                if not pattern.fullmatch(have.get(key, "")):
                    return False
        return True


@dataclass(frozen=True, slots=True)
class ClassPolicy:
    """One priority class. Resolutions are seconds; 0 means "every scrape" (the scrape interval)."""

    name: str
    matchers: tuple[Matcher, ...] = ()  # empty: matches every series (only the last class may)
    resolution_s: float = 0.0
    aggregation: Aggregation = "last"  # for gauges; counters always keep their last value
    significant_digits: int = 0  # 0: values as scraped (lossless)
    decimals: int | None = None  # None: no rounding to decimals
    heartbeat_s: float = 0.0  # > 0: suppress unchanged values, but send one at least this often
    max_resolution_s: float = 0.0  # how far the controller may degrade it; <= resolution_s: never
    counters: frozenset[str] = frozenset()  # extra metric names to treat as counters (no suffix)
    live: bool = False  # `latency: live`: sent every cycle, not in the uplink's batch window

    def matches(self, labels: Labels) -> bool:
        return not self.matchers or any(m.matches(labels) for m in self.matchers)

    @property
    def degradable(self) -> bool:
        return self.max_resolution_s > self.resolution_s


@dataclass(frozen=True, slots=True)
class RateWindow:
    """Another sustained rate between two times of day (local to the budget's timezone)."""

    start_minute: int  # minutes after midnight, 0..1439
    end_minute: int  # exclusive; a window may wrap midnight (22:00-06:00)
    bytes_per_second: int
    days: frozenset[int] = frozenset(range(7))  # datetime.weekday() of the window's start

    def covers(self, when: datetime) -> bool:
        minute = when.hour * 60 + when.minute
        if self.start_minute <= self.end_minute:
            return when.weekday() in self.days and self.start_minute <= minute < self.end_minute
        if minute >= self.start_minute:
            return when.weekday() in self.days
        return (when.weekday() - 1) % 7 in self.days and minute < self.end_minute


@dataclass(frozen=True, slots=True)
class UplinkBudget:
    """The budget file's ``uplink`` section: what the broker connection may carry, and when."""

    sustained_bytes_per_second: int
    burst_bytes: int
    daily_quota_bytes: int = 0  # 0: no quota
    timezone: str = "UTC"
    windows: tuple[RateWindow, ...] = ()
    batch_window_seconds: float = 60.0  # seconds of scrapes one wire batch holds

    def rate_at(self, when: datetime) -> int:
        """Sustained bytes/s allowed at ``when`` (an aware datetime in the budget's timezone)."""
        for window in self.windows:
            if window.covers(when):
                return window.bytes_per_second
        return self.sustained_bytes_per_second

    def zone(self) -> tzinfo:
        return _zone(self.timezone)

    @property
    def peak_bytes_per_second(self) -> int:
        return max([self.sustained_bytes_per_second, *(w.bytes_per_second for w in self.windows)])

    def batch_cap(self, batch_max_bytes: int) -> int:
        """Largest batch the relay builds: the pacer sends a batch only when the bucket holds all of it,
        so it must fit the burst (less the MQTT framing); under 4 KiB a batch may overshoot it once."""
        return min(batch_max_bytes, max(MIN_BATCH_CAP_BYTES, self.burst_bytes - FRAMING_ROOM_BYTES))

    def local_time(self, now: float) -> datetime:
        """``now`` (Unix seconds) as an aware datetime in the budget's timezone."""
        return datetime.fromtimestamp(now, self.zone())

    def day_bounds(self, now: float) -> tuple[float, float]:
        """Unix seconds of the local midnights around ``now``: the quota's day (23 or 25 h across DST)."""
        zone = self.zone()
        today = datetime.fromtimestamp(now, zone).date()
        start = datetime.combine(today, dt_time(0), tzinfo=zone).timestamp()
        end = datetime.combine(today + timedelta(days=1), dt_time(0), tzinfo=zone).timestamp()
        return start, end

    def allowed_bytes_per_second(self, now: float, used_today_bytes: int = 0) -> int:
        """The rate of the window open at ``now``; with a daily quota, at most what is left of today's
        quota spread evenly over the rest of the day (0 once it is used up)."""
        rate = self.rate_at(self.local_time(now))
        if not self.daily_quota_bytes:
            return rate
        left = max(0, self.daily_quota_bytes - used_today_bytes)
        seconds_left = max(1.0, self.day_bounds(now)[1] - now)  # never divide by ~0 just before midnight
        return min(rate, int(left / seconds_left))


@dataclass(frozen=True, slots=True)
class Budget:
    source: str  # the file it came from (for messages)
    uplink: UplinkBudget
    classes: tuple[ClassPolicy, ...]  # priority order, most important first; the last matches all
    anomaly: AnomalyConfig | None = (
        None  # the `anomaly` section; None: no detection (edge_relay.anomaly.detector)
    )
    _cache: dict[Labels, int] = field(default_factory=dict, compare=False, repr=False)

    def allowed_bytes_per_second(self, now: float, used_today_bytes: int = 0) -> int:
        """Bytes/s the uplink may use at ``now`` (Unix seconds), given the bytes already used today
        (the day of ``UplinkBudget.day_bounds``); see ``UplinkBudget.allowed_bytes_per_second``."""
        return self.uplink.allowed_bytes_per_second(now, used_today_bytes)

    def local_time(self, now: float) -> datetime:
        return self.uplink.local_time(now)

    def warnings(self, batch_max_bytes: int = 1_000_000) -> list[str]:
        """Settings that work but cost bytes (the relay logs them, ``budget plan`` prints them);
        ``batch_max_bytes`` is the relay's ``batch.max_bytes``."""
        up = self.uplink
        window_bytes = math.ceil(up.peak_bytes_per_second * up.batch_window_seconds)
        if up.batch_cap(batch_max_bytes) >= min(window_bytes, batch_max_bytes):
            return []
        return [
            f"{self.source}: uplink.burst_bytes: {up.burst_bytes} caps a batch at "
            f"{up.batch_cap(batch_max_bytes)} B, less than one batch window at the allowed rate "
            f"({up.peak_bytes_per_second} B/s x {up.batch_window_seconds:g} s = {window_bytes} B): such "
            "windows are split into parts that each repeat their label strings (about 1.6x the bytes on "
            f"the simulator's workload); expected burst_bytes >= {window_bytes + FRAMING_ROOM_BYTES}, or a "
            "shorter uplink.batch_window_seconds"
        ]

    @property
    def live_classes(self) -> frozenset[int]:
        """Indexes of the classes with ``latency: live``."""
        return frozenset(i for i, c in enumerate(self.classes) if c.live)

    def classify(self, labels: Labels) -> int:
        """Index into ``classes`` of the first class that matches (cached per label set)."""
        idx = self._cache.get(labels)
        if idx is None:
            idx = next((i for i, c in enumerate(self.classes) if c.matches(labels)), len(self.classes) - 1)
            if len(self._cache) > 1_000_000:  # series churn must not grow this without bound
                self._cache.clear()
            self._cache[labels] = idx
        return idx


# --------------------------------------------------------------------------------------------------
# Presets: each exporter's record's (vendors.registry), in the schema's order.

PRESETS: Final[Mapping[str, Preset]] = registry.PRESETS
# A name that is a counter in its exporter is one whichever class it lands in (a catch-all class too).
PRESET_COUNTERS: Final = registry.PRESET_COUNTERS


@cache
def _preset_matchers(name: str) -> tuple[Matcher, ...]:
    return tuple(Matcher(name=Regex(pattern)) for pattern in PRESETS[name].names)


# --------------------------------------------------------------------------------------------------
# Loading


@cache
def _zone(name: str) -> tzinfo:
    # UTC without the tz database: a slim image without tzdata still runs the default budget.
    if name == "UTC":
        return UTC
    return ZoneInfo(name)


def load(path: str | os.PathLike[str]) -> Budget:
    """Read and validate a budget file; raises ConfigError naming file, key and expectation."""
    return parse(config_loader.read(path), os.fspath(path))


def parse(doc: dict[str, Any], source: str) -> Budget:
    """Validate a budget document (as YAML loads it) and build the typed Budget."""
    _check_unquoted_times(doc, source)
    raw = config_loader.validate(doc, SCHEMA, source)
    presets = [c["preset"] for c in raw["classes"] if "preset" in c]
    return Budget(
        source=source,
        uplink=_uplink(raw["uplink"], source),
        classes=_classes(raw["classes"], source),
        anomaly=parse_anomaly(raw.get("anomaly"), presets, source),
    )


def _error(source: str, key: str, message: str) -> ConfigError:
    return ConfigError(f"{source}: invalid budget:\n  key `{key}`: {message}")


def _check_unquoted_times(doc: Mapping[str, Any], source: str) -> None:
    # YAML 1.1 reads an unquoted 22:00 as the base-60 integer 1320; the schema would only say "not a
    # string", which hides the real mistake.
    uplink = doc.get("uplink")
    windows = uplink.get("windows") if isinstance(uplink, Mapping) else None
    if not isinstance(windows, list):
        return
    for i, window in enumerate(windows):
        if not isinstance(window, Mapping):
            continue
        for key in ("start", "end"):
            value = window.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                raise _error(
                    source,
                    f"uplink.windows[{i}].{key}",
                    f'expected a time "HH:MM" in quotes, got the number {value} '
                    f"(YAML reads an unquoted {value // 60:02d}:{value % 60:02d} as a base-60 number)",
                )


def _minutes(text: str) -> int:
    hours, minutes = text.split(":")
    return int(hours) * 60 + int(minutes)


def _uplink(raw: dict[str, Any], source: str) -> UplinkBudget:
    sustained = raw["sustained_bytes_per_second"]
    if "burst_bytes" in raw:
        config_loader.check_range(raw, "uplink", "sustained_bytes_per_second", "burst_bytes", source)
    rates = [sustained, *(w["sustained_bytes_per_second"] for w in raw["windows"])]
    burst = raw.get(
        "burst_bytes",
        max(
            BURST_FACTOR * sustained,
            min(BURST_DEFAULT_MAX, math.ceil(BURST_WINDOWS * max(rates) * raw["batch_window_seconds"])),
        ),
    )
    name = raw["timezone"]
    try:
        _zone(name)
    except ZoneInfoNotFoundError:
        why = "not in the time zone database"
    except (ValueError, OSError) as e:
        why = str(e)
    else:
        why = ""
    if why:
        raise _error(
            source,
            "uplink.timezone",
            f"expected an IANA time zone name such as UTC or Europe/Berlin, got {name!r} ({why})",
        )
    windows = []
    for i, w in enumerate(raw["windows"]):
        start, end = _minutes(w["start"]), _minutes(w["end"])
        if start == end % 1440:
            raise _error(
                source,
                f"uplink.windows[{i}].end",
                f"expected a time other than start ({w['start']}): a window of no or 24 hours is "
                "better said by sustained_bytes_per_second and `days`",
            )
        windows.append(
            RateWindow(
                start_minute=start,
                end_minute=end,
                bytes_per_second=w["sustained_bytes_per_second"],
                days=frozenset(DAYS.index(d) for d in w["days"]),
            )
        )
    return UplinkBudget(
        sustained_bytes_per_second=sustained,
        burst_bytes=burst,
        daily_quota_bytes=raw["daily_quota_bytes"],
        timezone=name,
        windows=tuple(windows),
        batch_window_seconds=float(raw["batch_window_seconds"]),
    )


def _compile(source: str, key: str, pattern: str) -> Regex:
    try:
        return Regex(pattern)
    except RegexError as e:
        raise _error(
            source,
            key,
            f"expected a regular expression (RE2 as in Prometheus, matched against the whole value), "
            f"got {pattern!r}: {e.why}",
        ) from None


def _matchers(raw: dict[str, Any], key: str, source: str) -> tuple[Matcher, ...]:
    matchers: list[Matcher] = []
    if "preset" in raw:
        matchers.extend(_preset_matchers(raw["preset"]))
    for j, m in enumerate(raw.get("match", ())):
        where = f"{key}.match[{j}]"
        name = _compile(source, f"{where}.name", m["name"]) if "name" in m else None
        labels = tuple(
            (label, _compile(source, f"{where}.labels.{label}", pattern))
            for label, pattern in sorted(m.get("labels", {}).items())
        )
        matchers.append(Matcher(name=name, labels=labels))
    return tuple(matchers)


def _default_latency(raw: dict[str, Any]) -> str:
    """The critical class is live unless it says otherwise: its series are the ones an operator watches
    (a class named ``critical``, or one with a ``*-critical`` preset); every other class is windowed."""
    critical = raw["name"] == "critical" or str(raw.get("preset", "")).endswith("-critical")
    return "live" if critical else "windowed"


def _classes(raw: list[dict[str, Any]], source: str) -> tuple[ClassPolicy, ...]:
    classes: list[ClassPolicy] = []
    seen: dict[str, int] = {}
    for i, c in enumerate(raw):
        key = f"classes[{i}]"
        name = c["name"]
        if name in seen:
            raise _error(
                source,
                f"{key}.name",
                f"expected a unique class name, got {name!r} (also classes[{seen[name]}].name)",
            )
        seen[name] = i
        matchers = _matchers(c, key, source)
        if not matchers and i != len(raw) - 1:
            raise _error(
                source,
                key,
                f"class {name!r} has neither `match` nor `preset`, so it matches every series: expected "
                f"it last (the {len(raw) - 1 - i} class(es) after it would never match anything)",
            )
        resolution = float(c["resolution_seconds"])
        max_resolution = float(c.get("degrade", {}).get("max_resolution_seconds", 0))
        if max_resolution and max_resolution < resolution:
            raise _error(
                source,
                f"{key}.degrade.max_resolution_seconds",
                f"expected 0 (never degrade) or a value >= {key}.resolution_seconds ({resolution:g}), "
                f"got {max_resolution:g}",
            )
        precision = c.get("precision", {})
        classes.append(
            ClassPolicy(
                name=name,
                matchers=matchers,
                resolution_s=resolution,
                aggregation=c["aggregation"],
                significant_digits=precision.get("significant_digits", 0),
                decimals=precision.get("decimals"),
                heartbeat_s=float(c.get("suppress_unchanged", {}).get("heartbeat_seconds", 0)),
                max_resolution_s=max_resolution,
                counters=PRESET_COUNTERS | frozenset(c.get("counters", ())),
                live=c.get("latency", _default_latency(c)) == "live",
            )
        )
    if not classes or classes[-1].matchers:
        if IMPLICIT_CLASS in seen:
            raise _error(
                source,
                f"classes[{seen[IMPLICIT_CLASS]}].name",
                f"expected another name: {IMPLICIT_CLASS!r} is the implicit last class that takes every "
                "series no class matches (or make this class the last one, without match and preset)",
            )
        classes.append(
            ClassPolicy(
                name=IMPLICIT_CLASS, max_resolution_s=IMPLICIT_MAX_RESOLUTION_S, counters=PRESET_COUNTERS
            )
        )
    return tuple(classes)
