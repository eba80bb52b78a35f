"""The bandwidth budget: what the uplink may carry, and how the relay keeps to it.

One budget file, five parts that run it, one that plans it:

- ``model``: the budget file (``load``/``parse``) as typed objects: ``Budget`` with its
  ``UplinkBudget`` (sustained rate, burst, daily quota, time windows, batch window) and its
  ``ClassPolicy`` priority classes (presets in ``PRESETS``: the exporters' records', ``vendors``).
- ``shaper`` (the shape stage): ``BudgetShaper`` applies the classes to every scrape (resolution,
  aggregation, precision, suppression) at the level the controller sets per class.
- ``controller`` (once per cycle): ``Controller`` decides the allowed rate (time window, what is left of
  the daily quota), hands rate and burst to the pacer, and degrades or restores classes by comparing
  what the relay produces with what it may send.
- ``pacer`` (on the wire, in the uplink's thread): ``Pacer`` holds the token bucket and the wire meter;
  the uplink publishes a batch only when the bucket holds it, and every byte the kernel counts on the
  broker connection (both directions) is charged to it.
- ``runtime``: ``BudgetRuntime``, the budget in force on a running relay: loads the file, builds the
  shaper and the controller on the relay's pacer, reloads the file when it changes, shapes each cycle
  and ticks the controller; the relay holds one only when a budget file is configured.
- ``plan`` (offline): ``edge-relay budget plan`` scrapes the targets once and estimates each class's
  bytes/s at full resolution and degraded the way the controller would.

This package re-exports only the model, so importing the budget file's types does not pull in the
shaper, the controller or the pacer (import those from their modules).
"""

from edge_relay.budget.model import (
    BURST_DEFAULT_MAX,
    BURST_FACTOR,
    BURST_WINDOWS,
    COUNTER_SUFFIXES,
    DAYS,
    FRAMING_ROOM_BYTES,
    IMPLICIT_CLASS,
    IMPLICIT_MAX_RESOLUTION_S,
    MIN_BATCH_CAP_BYTES,
    PRESET_COUNTERS,
    PRESETS,
    SCHEMA,
    Aggregation,
    Budget,
    ClassPolicy,
    ConfigError,
    Matcher,
    Preset,
    RateWindow,
    UplinkBudget,
    is_counter,
    load,
    parse,
)

__all__ = [
    "BURST_DEFAULT_MAX",
    "BURST_FACTOR",
    "BURST_WINDOWS",
    "COUNTER_SUFFIXES",
    "DAYS",
    "FRAMING_ROOM_BYTES",
    "IMPLICIT_CLASS",
    "IMPLICIT_MAX_RESOLUTION_S",
    "MIN_BATCH_CAP_BYTES",
    "PRESETS",
    "PRESET_COUNTERS",
    "SCHEMA",
    "Aggregation",
    "Budget",
    "ClassPolicy",
    "ConfigError",
    "Matcher",
    "Preset",
    "RateWindow",
    "UplinkBudget",
    "is_counter",
    "load",
    "parse",
]
