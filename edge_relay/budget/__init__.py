"""The bandwidth budget: what the uplink may carry, and how the relay keeps to it.

One budget file, four parts that run it:

- ``model``: the budget file (``load``/``parse``) as typed objects: ``Budget`` with its
  ``UplinkBudget`` (sustained rate, burst, daily quota, time windows, batch window) and its
  ``ClassPolicy`` priority classes (the vendors' presets come from the ``vendors`` registry).
- ``shaper`` (the shape stage): ``BudgetShaper`` applies the classes to every scrape (resolution,
  aggregation, precision, suppression) at the level the controller sets per class.
- ``controller`` (once per cycle): ``Controller`` decides the allowed rate (time window, what is left of
  the daily quota), hands rate and burst to the pacer (``uplink.pacer``, on the wire), and degrades or
  restores classes by comparing what the relay produces with what it may send.
- ``runtime``: ``BudgetRuntime``, the budget in force on a running relay: loads the file, builds the
  shaper, the controller and the anomaly detector, reloads the file when it changes, shapes each cycle
  and ticks the controller; the relay holds one only when a budget file is configured.

The offline estimate (``edge-relay budget plan``) is a command: ``edge_relay.commands.budget_plan``.
This package re-exports only the model, so importing the budget file's types does not pull in the
shaper or the controller (import those from their modules).
"""

from edge_relay.budget.model import (
    BURST_DEFAULT_MAX,
    BURST_FACTOR,
    BURST_WINDOWS,
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
    load,
    parse,
)
from schemas.model import COUNTER_SUFFIXES, is_counter

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
