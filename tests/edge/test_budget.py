"""The bandwidth-budget file (edge_relay/budget/model.py, its schema) and ``edge-relay budget plan``."""

from __future__ import annotations

import json
import math
import random
import re
import subprocess
import sys
from array import array
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import yaml

from edge_relay import cli as edge_cli
from edge_relay import settings as relay_settings
from edge_relay.budget import (
    IMPLICIT_CLASS,
    PRESET_COUNTERS,
    PRESETS,
    SCHEMA,
    Budget,
    is_counter,
    load,
    parse,
)
from edge_relay.collect.parse import parse as parse_exposition
from edge_relay.collect.shape import ShapedScrape
from edge_relay.commands import budget_plan
from edge_relay.encode.batches import BatchEncoder
from relay_common import cli as common_cli
from relay_common import config as config_loader
from relay_common import configdoc
from relay_common.config import ConfigError
from schemas import codec
from schemas.model import Labels, metric_name
from simulator import EXPORTERS, Simulator, SimulatorServer, data_path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = data_path()

# The example of the format, as the issue wrote it.
EXAMPLE = """\
version: 1
uplink:
  sustained_bytes_per_second: 16384
  burst_bytes: 262144
  daily_quota_bytes: 0
  timezone: UTC
  windows:
    - {start: "22:00", end: "06:00", sustained_bytes_per_second: 65536, days: [mon, tue, wed, thu, fri]}
  batch_window_seconds: 60
classes:
  - name: gpu-critical
    preset: dcgm-critical
    resolution_seconds: 0
    degrade: {max_resolution_seconds: 0}
  - name: kepler-energy
    preset: kepler
    resolution_seconds: 15
    aggregation: last
    precision: {significant_digits: 6}
    suppress_unchanged: {heartbeat_seconds: 60}
    degrade: {max_resolution_seconds: 120}
    counters: [SOME_COUNTER_WITHOUT_SUFFIX]
  - name: rest
    resolution_seconds: 30
    degrade: {max_resolution_seconds: 300}
"""

MINIMAL = "version: 1\nuplink: {sustained_bytes_per_second: 1000}\n"


def write(tmp_path: Path, text: str, name: str = "budget.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def budget_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    message = str(info.value)
    assert str(path) in message, f"error does not name the file: {message}"
    return message


def with_classes(classes: str, uplink: str = "sustained_bytes_per_second: 1000") -> str:
    return f"version: 1\nuplink: {{{uplink}}}\nclasses:\n{classes}"


def at(iso: str, zone: str = "UTC") -> float:
    return datetime.fromisoformat(iso).replace(tzinfo=ZoneInfo(zone)).timestamp()


# --------------------------------------------------------------------------------------------------
# Loading


def test_example_loads_into_the_typed_objects(tmp_path: Path) -> None:
    b = load(write(tmp_path, EXAMPLE))
    up = b.uplink
    assert (up.sustained_bytes_per_second, up.burst_bytes, up.daily_quota_bytes) == (16384, 262144, 0)
    assert (up.timezone, up.batch_window_seconds) == ("UTC", 60.0)
    (window,) = up.windows
    assert (window.start_minute, window.end_minute, window.bytes_per_second) == (1320, 360, 65536)
    assert window.days == frozenset(range(5))
    assert [c.name for c in b.classes] == ["gpu-critical", "kepler-energy", "rest"]
    critical, kepler, rest = b.classes
    assert not critical.degradable and critical.resolution_s == 0
    assert kepler.resolution_s == 15 and kepler.max_resolution_s == 120 and kepler.degradable
    assert (kepler.aggregation, kepler.significant_digits, kepler.decimals) == ("last", 6, None)
    assert kepler.heartbeat_s == 60
    assert "SOME_COUNTER_WITHOUT_SUFFIX" in kepler.counters
    assert is_counter("SOME_COUNTER_WITHOUT_SUFFIX", kepler.counters)
    assert rest.matchers == () and rest.max_resolution_s == 300
    assert b.source == str(tmp_path / "budget.yaml")


def test_minimal_budget_gets_defaults_and_the_implicit_class(tmp_path: Path) -> None:
    b = load(write(tmp_path, MINIMAL))
    assert b.uplink.burst_bytes == 2 * 1000 * 60  # two batch windows at the rate
    assert (b.uplink.daily_quota_bytes, b.uplink.timezone, b.uplink.windows) == (0, "UTC", ())
    assert b.uplink.batch_window_seconds == 60
    (other,) = b.classes
    assert other.name == IMPLICIT_CLASS == "other"
    assert other.matchers == () and other.resolution_s == 0 and other.max_resolution_s == 300
    assert other.degradable
    assert b.classify((("__name__", "anything"),)) == 0


@pytest.mark.parametrize(
    ("uplink", "burst"),
    [
        ("{sustained_bytes_per_second: 1000, batch_window_seconds: 5}", 16 * 1000),  # 16 x rate at least
        (
            "{sustained_bytes_per_second: 100, batch_window_seconds: 30, windows: "
            '[{start: "22:00", end: "06:00", sustained_bytes_per_second: 400}]}',
            2 * 400 * 30,
        ),
        ("{sustained_bytes_per_second: 100000}", 2_000_000),  # two batches of batch.max_bytes at most
        ("{sustained_bytes_per_second: 280, burst_bytes: 5600}", 5600),
    ],
)
def test_default_burst_holds_two_batch_windows(tmp_path: Path, uplink: str, burst: int) -> None:
    assert load(write(tmp_path, f"version: 1\nuplink: {uplink}\n")).uplink.burst_bytes == burst


def test_a_burst_too_small_for_a_windows_batch_is_warned_about(tmp_path: Path) -> None:
    path = write(tmp_path, "version: 1\nuplink: {sustained_bytes_per_second: 280, burst_bytes: 5600}\n")
    b = load(path)
    assert b.uplink.batch_cap(1_000_000) == 5600 - 512
    assert b.uplink.batch_cap(3000) == 3000
    assert b.uplink.batch_cap(1_000_000) == 5088
    (warning,) = b.warnings()
    assert str(path) in warning and "uplink.burst_bytes" in warning
    assert "280 B/s x 60 s = 16800 B" in warning and "expected burst_bytes >= 17312" in warning
    assert load(write(tmp_path, MINIMAL)).warnings() == []
    # A window larger than batch.max_bytes is split anyway: a burst that holds one such batch is enough.
    big = load(
        write(tmp_path, "version: 1\nuplink: {sustained_bytes_per_second: 100000, burst_bytes: 1000512}\n")
    )
    assert big.warnings(1_000_000) == [] and big.warnings(2_000_000) != []


def test_implicit_class_follows_classes_that_do_not_match_everything(tmp_path: Path) -> None:
    b = load(write(tmp_path, with_classes("  - {name: gpu, preset: dcgm}\n")))
    assert [c.name for c in b.classes] == ["gpu", "other"]
    assert b.classify((("__name__", "DCGM_FI_DEV_GPU_TEMP"),)) == 0
    assert b.classify((("__name__", "node_load1"),)) == 1


def test_the_critical_class_is_live_unless_it_says_windowed(tmp_path: Path) -> None:
    """Issue 13: a class named `critical` or with a `*-critical` preset defaults to `latency: live`;
    every other class to windowed; an explicit `latency` wins either way."""
    b = load(
        write(
            tmp_path,
            with_classes(
                "  - {name: critical, match: [{name: 'a'}]}\n"
                "  - {name: gpu, preset: dcgm-critical}\n"
                "  - {name: quiet, preset: amd-critical, latency: windowed}\n"
                "  - {name: fast, match: [{name: 'b'}], latency: live}\n"
                "  - {name: kepler, preset: kepler}\n"
            ),
        )
    )
    assert [(c.name, c.live) for c in b.classes] == [
        ("critical", True),
        ("gpu", True),
        ("quiet", False),
        ("fast", True),
        ("kepler", False),
        ("other", False),
    ]
    assert b.live_classes == frozenset({0, 1, 3})


def test_parse_takes_a_document_and_leaves_it_alone() -> None:
    doc = yaml.safe_load(EXAMPLE)
    before = json.dumps(doc, sort_keys=True)
    b = parse(doc, "inline.yaml")
    assert isinstance(b, Budget) and b.source == "inline.yaml"
    assert json.dumps(doc, sort_keys=True) == before


def test_match_by_name_and_labels(tmp_path: Path) -> None:
    text = with_classes(
        "  - name: big-pods\n"
        "    match:\n"
        "      - {name: 'kepler_pod_.*', labels: {pod_namespace: 'ml-.*'}}\n"
        "      - {labels: {job: 'edge-relay'}}\n"
    )
    b = load(write(tmp_path, text))
    assert b.classify((("__name__", "kepler_pod_cpu_watts"), ("pod_namespace", "ml-train"))) == 0
    assert b.classify((("__name__", "kepler_pod_cpu_watts"), ("pod_namespace", "default"))) == 1
    assert b.classify((("__name__", "kepler_pod_cpu_watts"),)) == 1  # absent label = ""
    assert b.classify((("__name__", "xkepler_pod_cpu_watts"), ("pod_namespace", "ml-a"))) == 1  # fullmatch
    assert b.classify((("__name__", "process_cpu_seconds_total"), ("job", "edge-relay"))) == 0


def test_window_end_may_be_midnight(tmp_path: Path) -> None:
    text = "version: 1\nuplink:\n  sustained_bytes_per_second: 10\n  windows:\n"
    text += '    - {start: "18:00", end: "24:00", sustained_bytes_per_second: 20}\n'
    b = load(write(tmp_path, text))
    assert b.uplink.windows[0].end_minute == 1440
    assert b.allowed_bytes_per_second(at("2024-01-03T23:59:59")) == 20
    assert b.allowed_bytes_per_second(at("2024-01-04T00:00:00")) == 10


# --------------------------------------------------------------------------------------------------
# Every error names the file, the key path and what was expected.

ERRORS: list[tuple[str, str, list[str]]] = [
    (
        "unknown top-level key",
        MINIMAL + "clases: []\n",
        ["unknown key `clases`", "expected one of: anomaly, classes"],
    ),
    (
        "unknown uplink key",
        "version: 1\nuplink: {sustained_bytes_per_second: 1, burst: 5}\n",
        ["unknown key `burst` under `uplink`", "burst_bytes", "sustained_bytes_per_second"],
    ),
    (
        "unknown class key",
        with_classes("  - {name: a, resolution: 5}\n"),
        ["unknown key `resolution` under `classes[0]`", "resolution_seconds"],
    ),
    (
        "missing version",
        "uplink: {sustained_bytes_per_second: 1}\n",
        ["`(top level)`", "'version' is a required"],
    ),
    (
        "wrong version",
        "version: 2\nuplink: {sustained_bytes_per_second: 1}\n",
        ["key `version`", "1 was expected"],
    ),
    ("missing rate", "version: 1\nuplink: {}\n", ["`uplink`", "'sustained_bytes_per_second' is a required"]),
    (
        "duplicate class name",
        with_classes("  - {name: a, preset: node}\n  - {name: a, preset: dcgm}\n"),
        ["key `classes[1].name`", "unique class name", "'a'", "classes[0].name"],
    ),
    (
        "catch-all class not last",
        with_classes("  - {name: all}\n  - {name: gpu, preset: dcgm}\n"),
        ["key `classes[0]`", "neither `match` nor `preset`", "expected it last"],
    ),
    (
        "name regex does not compile",
        with_classes("  - name: a\n    match: [{name: 'kepler_(pod'}]\n"),
        ["key `classes[0].match[0].name`", "expected a regular expression", "'kepler_(pod'"],
    ),
    (
        "label regex does not compile",
        with_classes("  - name: a\n    match: [{labels: {pod: '[a-'}}]\n"),
        ["key `classes[0].match[0].labels.pod`", "expected a regular expression"],
    ),
    (
        "empty matcher",
        with_classes("  - name: a\n    match: [{}]\n"),
        ["key `classes[0].match[0]`", "should be non-empty"],
    ),
    (
        "heartbeat above the lookback",
        with_classes("  - {name: a, suppress_unchanged: {heartbeat_seconds: 301}}\n"),
        ["key `classes[0].suppress_unchanged.heartbeat_seconds`", "maximum of 300", "lookback is 5 minutes"],
    ),
    (
        "heartbeat of zero",
        with_classes("  - {name: a, suppress_unchanged: {heartbeat_seconds: 0}}\n"),
        ["key `classes[0].suppress_unchanged.heartbeat_seconds`", "0 < seconds <= 300"],
    ),
    (
        "max resolution below resolution",
        with_classes("  - {name: a, resolution_seconds: 30, degrade: {max_resolution_seconds: 20}}\n"),
        [
            "key `classes[0].degrade.max_resolution_seconds`",
            "expected 0 (never degrade) or a value >= classes[0].resolution_seconds (30), got 20",
        ],
    ),
    (
        "window time not HH:MM",
        "version: 1\nuplink:\n  sustained_bytes_per_second: 1\n  windows:\n"
        '    - {start: "25:00", end: "06:00", sustained_bytes_per_second: 2}\n',
        ["key `uplink.windows[0].start`", "does not match", '"HH:MM"'],
    ),
    (
        "window time without quotes",
        "version: 1\nuplink:\n  sustained_bytes_per_second: 1\n  windows:\n"
        "    - {start: 22:00, end: 06:00, sustained_bytes_per_second: 2}\n",
        ["key `uplink.windows[0].start`", 'expected a time "HH:MM" in quotes', "1320", "22:00"],
    ),
    (
        "window of no length",
        "version: 1\nuplink:\n  sustained_bytes_per_second: 1\n  windows:\n"
        '    - {start: "06:00", end: "06:00", sustained_bytes_per_second: 2}\n',
        ["key `uplink.windows[0].end`", "expected a time other than start (06:00)"],
    ),
    (
        "window rate of zero",
        "version: 1\nuplink:\n  sustained_bytes_per_second: 1\n  windows:\n"
        '    - {start: "22:00", end: "06:00", sustained_bytes_per_second: 0}\n',
        ["key `uplink.windows[0].sustained_bytes_per_second`", "minimum of 1", "(> 0)"],
    ),
    (
        "unknown weekday",
        "version: 1\nuplink:\n  sustained_bytes_per_second: 1\n  windows:\n"
        '    - {start: "22:00", end: "06:00", sustained_bytes_per_second: 2, days: [monday]}\n',
        ["key `uplink.windows[0].days[0]`", "'monday' is not one of"],
    ),
    (
        "burst below sustained",
        "version: 1\nuplink: {sustained_bytes_per_second: 16384, burst_bytes: 1000}\n",
        ["key `uplink.burst_bytes`: expected a value >= uplink.sustained_bytes_per_second (16384), got 1000"],
    ),
    (
        "unknown time zone",
        "version: 1\nuplink: {sustained_bytes_per_second: 1, timezone: Mars/Olympus_Mons}\n",
        ["key `uplink.timezone`", "expected an IANA time zone name", "'Mars/Olympus_Mons'"],
    ),
    (
        "time zone that is a path",
        "version: 1\nuplink: {sustained_bytes_per_second: 1, timezone: ../etc/passwd}\n",
        ["key `uplink.timezone`", "expected an IANA time zone name"],
    ),
    (
        "unknown preset",
        with_classes("  - {name: a, preset: prometheus}\n"),
        ["key `classes[0].preset`", "'prometheus' is not one of", "dcgm-critical"],
    ),
    (
        "two precisions",
        with_classes("  - {name: a, precision: {decimals: 3, significant_digits: 6}}\n"),
        ["key `classes[0].precision`", "too many properties", "exactly one"],
    ),
    (
        "reserved class name",
        with_classes("  - {name: other, preset: node}\n"),
        ["key `classes[0].name`", "'other' is the implicit last class"],
    ),
    (
        "negative resolution",
        with_classes("  - {name: a, resolution_seconds: -5}\n"),
        ["key `classes[0].resolution_seconds`", "minimum of 0"],
    ),
    ("not a mapping", "- 1\n", ["expected a mapping of keys at the top level"]),
    ("not YAML", "version: [1\n", ["not valid YAML at line"]),
]


@pytest.mark.parametrize(("text", "expected"), [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_errors_name_file_key_and_expectation(tmp_path: Path, text: str, expected: list[str]) -> None:
    message = budget_error(tmp_path, text)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "missing.yaml"))):
        load(tmp_path / "missing.yaml")


# --------------------------------------------------------------------------------------------------
# The schema and its documentation


# Valid, documented, closed: tests/common/test_config.py checks this schema with the two config schemas.


def test_schema_presets_are_the_code_presets() -> None:
    schema = config_loader.load_schema(SCHEMA)
    assert schema["properties"]["classes"]["items"]["properties"]["preset"]["enum"] == list(PRESETS)


def test_docs_document_the_budget_file() -> None:
    assert configdoc.SCHEMAS["bandwidth-budget"] == SCHEMA
    text = configdoc.markdown("bandwidth-budget")
    assert "| `uplink.sustained_bytes_per_second` | integer | `required` |" in text
    assert "| `classes[].match[].labels` | map of string |  |" in text
    doc = (ROOT / configdoc.DOCUMENT).read_text(encoding="utf-8")
    assert "## Bandwidth budget file reference" in doc
    assert configdoc.section("bandwidth-budget") in doc


def test_relay_config_budget_file_resolves_beside_the_config(tmp_path: Path) -> None:
    base = "node: n1\ntargets: [{name: k, url: 'http://127.0.0.1:1/metrics'}]\n"
    (tmp_path / "etc").mkdir()
    cfg = write(tmp_path / "etc", base, "relay.yaml")
    assert relay_settings.load(str(cfg)).budget_file == ""
    cfg = write(tmp_path / "etc", base + "budget_file: budget/b.yaml\n", "relay.yaml")
    assert relay_settings.load(str(cfg)).budget_file == str(tmp_path / "etc" / "budget" / "b.yaml")
    cfg = write(tmp_path / "etc", base + "budget_file: /srv/b.yaml\n", "relay.yaml")
    assert relay_settings.load(str(cfg)).budget_file == "/srv/b.yaml"


# --------------------------------------------------------------------------------------------------
# Presets against the simulator's and the fixtures' names

PRESET_BUDGET = """\
version: 1
uplink: {sustained_bytes_per_second: 16384}
classes:
  - {name: health, preset: scrape-health}
  - {name: critical, preset: dcgm-critical}
  - {name: dcgm, preset: dcgm}
  - {name: kepler, preset: kepler}
  - {name: node, preset: node}
"""
CRITICAL = {
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_MEMORY_TEMP",
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_MEM_COPY_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_POWER_MGMT_LIMIT",
    "DCGM_FI_DEV_XID_ERRORS",
}


def expected_class(name: str) -> str:
    if name in ("up", "scrape_duration_seconds", "scrape_samples_scraped"):
        return "health"
    if name in CRITICAL:
        return "critical"
    if name.startswith("DCGM_FI_"):
        return "dcgm"
    if name.startswith("kepler_"):
        return "kepler"
    if name.startswith("node_"):
        return "node"
    return "other"


def classify_all(b: Budget, label_sets: list[Labels]) -> dict[str, set[str]]:
    """Metric names by the class they land in."""
    out: dict[str, set[str]] = {}
    for labels in label_sets:
        out.setdefault(b.classes[b.classify(labels)].name, set()).add(metric_name(labels))
    return out


@pytest.fixture(scope="module")
def simulator() -> Simulator:
    return Simulator(seed=1, series=2000)


def test_presets_classify_every_simulated_exporter(simulator: Simulator) -> None:
    b = parse(yaml.safe_load(PRESET_BUDGET), "presets.yaml")
    names: dict[str, set[str]] = {}
    for exporter in EXPORTERS:
        samples = parse_exposition(simulator.render(exporter, 0).decode(), simulator.content_type(exporter))
        synthetic = [(("__name__", n), ("job", exporter)) for n in ("up", "scrape_duration_seconds")]
        by_class = classify_all(b, [s[0] for s in samples] + synthetic)
        for cls, metric_names in by_class.items():
            for name in metric_names:
                assert expected_class(name) == cls, f"{exporter}: {name} landed in {cls}"
            names.setdefault(cls, set()).update(metric_names)
    # Both Kepler lines, dcgm-exporter and node_exporter are all there, each in its class.
    assert {"kepler_container_joules_total", "kepler_node_platform_joules_total"} <= names["kepler"]
    assert {"kepler_node_cpu_watts", "kepler_process_cpu_joules_total", "kepler_pod_gpu_watts"} <= names[
        "kepler"
    ]
    assert {"DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_SM_CLOCK"} <= names["dcgm"]
    assert CRITICAL - {"DCGM_FI_DEV_POWER_MGMT_LIMIT"} <= names["critical"]  # not exported by default
    assert {"node_load1", "node_network_receive_bytes_total"} <= names["node"]
    assert not any(n.startswith(("kepler_", "DCGM_", "node_")) for n in names["other"])


@pytest.mark.parametrize("fixture", sorted(p.name for p in FIXTURES.glob("*.prom")))
def test_presets_classify_the_fixtures_and_know_their_counters(fixture: str) -> None:
    text = (FIXTURES / fixture).read_text(encoding="utf-8")
    b = parse(yaml.safe_load(PRESET_BUDGET), "presets.yaml")
    samples = parse_exposition(text, "text/plain; version=0.0.4")
    for labels, _, _ in samples:
        name = metric_name(labels)
        cls = b.classes[b.classify(labels)]
        assert cls.name == expected_class(name), f"{name} landed in {cls.name}"
    # Every family the exporter declares a counter is aggregated as one, whatever its name.
    counters = re.findall(r"^# TYPE (\S+) counter$", text, re.M)
    assert counters
    for family in counters:
        labels = (("__name__", family),)
        assert is_counter(family, b.classes[b.classify(labels)].counters), family
        assert family.endswith("_total") or family in PRESET_COUNTERS, family


def test_dcgm_energy_counter_is_a_counter_in_any_class(tmp_path: Path) -> None:
    b = load(write(tmp_path, with_classes("  - {name: kepler, preset: kepler}\n")))
    other = b.classes[b.classify((("__name__", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),))]
    assert other.name == "other"
    assert is_counter("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", other.counters)
    assert not is_counter("DCGM_FI_DEV_POWER_USAGE", other.counters)


# --------------------------------------------------------------------------------------------------
# Windows and the daily quota

WINDOWED = """\
version: 1
uplink:
  sustained_bytes_per_second: 16384
  timezone: {tz}
  windows:
    - {{start: "22:00", end: "06:00", sustained_bytes_per_second: 65536, days: [mon, tue, wed, thu, fri]}}
    - {{start: "12:00", end: "13:00", sustained_bytes_per_second: 4096}}
    - {{start: "12:30", end: "14:00", sustained_bytes_per_second: 1024}}
"""


@pytest.mark.parametrize(
    ("when", "rate"),
    [
        ("2024-01-01T21:59:59", 16384),  # Monday, before the night window
        ("2024-01-01T22:00:00", 65536),  # Monday night
        ("2024-01-02T03:00:00", 65536),  # Tuesday morning: the window opened on Monday
        ("2024-01-02T06:00:00", 16384),  # the end is exclusive
        ("2024-01-06T03:00:00", 65536),  # Saturday morning: opened on Friday
        ("2024-01-06T23:00:00", 16384),  # Saturday night: no window on Saturday
        ("2024-01-01T05:59:00", 16384),  # Monday morning belongs to Sunday's (absent) window
        ("2024-01-07T12:45:00", 4096),  # overlapping windows: the first wins, every day by default
        ("2024-01-07T13:30:00", 1024),
        ("2024-01-07T14:00:00", 16384),
    ],
)
def test_windows(when: str, rate: int, tmp_path: Path) -> None:
    b = load(write(tmp_path, WINDOWED.format(tz="UTC")))
    assert b.allowed_bytes_per_second(at(when)) == rate
    assert b.uplink.rate_at(b.local_time(at(when))) == rate


def test_windows_follow_the_budget_timezone(tmp_path: Path) -> None:
    b = load(write(tmp_path, WINDOWED.format(tz="Europe/Berlin")))
    # 21:30 UTC on a winter Monday is 22:30 in Berlin; in summer 20:30 UTC is 22:30.
    assert b.allowed_bytes_per_second(at("2024-01-08T21:30:00")) == 65536
    assert b.allowed_bytes_per_second(at("2024-07-08T20:30:00")) == 65536
    assert b.allowed_bytes_per_second(at("2024-07-08T19:30:00")) == 16384
    assert b.local_time(at("2024-07-08T20:30:00")).hour == 22


def quota_budget(tmp_path: Path, quota: int, tz: str = "UTC", rate: int = 16384) -> Budget:
    uplink = f"sustained_bytes_per_second: {rate}, daily_quota_bytes: {quota}, timezone: {tz}"
    text = f"version: 1\nuplink: {{{uplink}}}\n"
    return load(write(tmp_path, text))


def test_quota_is_spread_over_the_rest_of_the_day(tmp_path: Path) -> None:
    b = quota_budget(tmp_path, 86_400_000)  # 1000 B/s on average
    noon = at("2024-03-05T12:00:00")
    assert b.allowed_bytes_per_second(noon) == 2000  # all of it left for 43200 s
    assert b.allowed_bytes_per_second(noon, used_today_bytes=86_400_000 - 43_200 * 10) == 10
    assert b.allowed_bytes_per_second(noon, used_today_bytes=86_400_000) == 0
    assert b.allowed_bytes_per_second(noon, used_today_bytes=10**12) == 0
    # The window rate still caps it early in the day... and a small rest just before midnight.
    assert b.allowed_bytes_per_second(at("2024-03-05T00:00:00")) == 1000
    assert b.allowed_bytes_per_second(at("2024-03-05T23:59:00")) == 16384
    assert b.allowed_bytes_per_second(at("2024-03-05T23:59:59.9"), used_today_bytes=86_400_000 - 500) == 500


def test_quota_day_follows_the_timezone_and_dst(tmp_path: Path) -> None:
    b = quota_budget(tmp_path, 82_800_000, tz="Europe/Berlin")
    start, end = b.uplink.day_bounds(at("2024-03-31T12:00:00", "Europe/Berlin"))
    assert start == at("2024-03-31T00:00:00", "Europe/Berlin")
    assert end - start == 23 * 3600  # the spring-forward day
    # 10:00 local on that day is 08:00 UTC; 14 h are left, not 15.
    assert b.allowed_bytes_per_second(at("2024-03-31T10:00:00", "Europe/Berlin")) == 82_800_000 // (14 * 3600)
    start, end = b.uplink.day_bounds(at("2024-10-27T01:00:00", "UTC"))
    assert end - start == 25 * 3600


def test_no_quota_means_the_window_rate(tmp_path: Path) -> None:
    b = quota_budget(tmp_path, 0)
    assert b.allowed_bytes_per_second(at("2024-03-05T12:00:00"), used_today_bytes=10**12) == 16384


# --------------------------------------------------------------------------------------------------
# The planner (pure)

PLAN_BUDGET = """\
version: 1
uplink: {sustained_bytes_per_second: 100000, batch_window_seconds: 60}
classes:
  - {name: crit, match: [{name: "crit_.*"}]}
  - {name: a, match: [{name: "a_.*"}], degrade: {max_resolution_seconds: 40}}
  - {name: b, resolution_seconds: 10, degrade: {max_resolution_seconds: 80}}
"""


def samples(prefix: str, n: int) -> list[tuple[Labels, float]]:
    return [
        ((("__name__", f"{prefix}_{i % 7}"), ("instance", f"node:{i}"), ("job", "j")), i * 1.5)
        for i in range(n)
    ]


@pytest.fixture
def plan_budget() -> Budget:
    return parse(yaml.safe_load(PLAN_BUDGET), "plan.yaml")


@pytest.fixture
def by_class() -> dict[str, list[tuple[Labels, float]]]:
    return {"crit": samples("crit", 20), "a": samples("a", 200), "b": samples("b", 400)}


def test_cost_model() -> None:
    assert budget_plan.VALUE_BYTES_PER_SAMPLE == 1.0
    est = budget_plan.estimate_bytes_per_second
    # 60 s window at 5 s: the table once, 11 further scrapes of 100 samples.
    assert est(5000, 100, 5.0, 60.0) == pytest.approx((5000 + 11 * 100) / 60)
    assert est(5000, 100, 60.0, 60.0) == pytest.approx(5000 / 60)
    assert est(5000, 100, 300.0, 60.0) == pytest.approx(5000 / 300)  # one batch in five carries it
    assert est(0, 0, 5.0, 60.0) == 0.0
    # Coarser steps carry larger deltas: 0.4 B more per sample for each doubling over the interval.
    assert est(5000, 100, 20.0, 60.0, 5.0) == pytest.approx((5000 + 2 * 100 * (1.0 + 2 * 0.4)) / 60)
    assert est(5000, 100, 5.0, 60.0, 5.0) == est(5000, 100, 5.0, 60.0)


def test_plan_at_full_resolution_when_it_fits(plan_budget: Budget, by_class: dict[str, Any]) -> None:
    plans = budget_plan.plan(plan_budget, by_class, 5.0)
    assert [p.name for p in plans] == ["crit", "a", "b"]
    assert [(p.series, p.samples_per_scrape) for p in plans] == [(20, 20), (200, 200), (400, 400)]
    assert [p.full_resolution_s for p in plans] == [5.0, 5.0, 10.0]  # 0 = every scrape
    assert [p.degradable for p in plans] == [False, True, True]
    assert [p.max_resolution_s for p in plans] == [5.0, 40.0, 80.0]
    for p in plans:
        assert not p.degraded and p.bytes_per_second == p.full_bytes_per_second
        assert p.table_bytes == budget_plan.encoded_scrape_bytes(by_class[p.name])
        assert p.full_bytes_per_second == pytest.approx(
            budget_plan.estimate_bytes_per_second(
                p.table_bytes, p.samples_per_scrape, p.full_resolution_s, 60, 5.0
            )
        )


def test_plan_degrades_the_last_class_first_by_doubling(
    plan_budget: Budget, by_class: dict[str, Any]
) -> None:
    full = budget_plan.plan(plan_budget, by_class, 5.0)
    est = budget_plan.estimate_bytes_per_second
    crit, a, b = full
    # Just enough when b is at its maximum and a has doubled twice.
    allowed = (
        crit.full_bytes_per_second
        + est(a.table_bytes, a.samples_per_scrape, 20.0, 60, 5.0)
        + est(b.table_bytes, b.samples_per_scrape, 80.0, 60, 5.0)
        + 0.01
    )
    plans = budget_plan.plan(plan_budget, by_class, 5.0, allowed_bytes_per_second=allowed)
    assert [p.resolution_s for p in plans] == [5.0, 20.0, 80.0]
    assert [p.degraded for p in plans] == [False, True, True]
    assert sum(p.bytes_per_second for p in plans) <= allowed
    # A little more room: b alone gives way, only as far as needed (10 -> 20 -> 40).
    allowed = (
        crit.full_bytes_per_second + a.full_bytes_per_second + est(b.table_bytes, 400, 40.0, 60, 5.0) + 0.01
    )
    plans = budget_plan.plan(plan_budget, by_class, 5.0, allowed_bytes_per_second=allowed)
    assert [p.resolution_s for p in plans] == [5.0, 5.0, 40.0]


def test_plan_that_cannot_fit_degrades_everything_but_the_critical(
    plan_budget: Budget, by_class: dict[str, Any]
) -> None:
    plans = budget_plan.plan(plan_budget, by_class, 5.0, allowed_bytes_per_second=1.0)
    assert [p.resolution_s for p in plans] == [5.0, 40.0, 80.0]
    assert sum(p.bytes_per_second for p in plans) > 1.0
    assert plans[0].bytes_per_second == plans[0].full_bytes_per_second


def test_plan_rounds_the_last_step_to_the_maximum(by_class: dict[str, Any]) -> None:
    doc = yaml.safe_load(PLAN_BUDGET)
    doc["classes"][2]["degrade"]["max_resolution_seconds"] = 300
    b = parse(doc, "plan.yaml")
    plans = budget_plan.plan(b, by_class, 5.0, allowed_bytes_per_second=1.0)
    assert plans[2].resolution_s == 300.0  # 10, 20, ... 160, then 300 rather than 320


def test_plan_defaults_to_the_steady_rate_and_checks_its_input(plan_budget: Budget) -> None:
    assert budget_plan.steady_rate(plan_budget) == 100000
    assert budget_plan.plan(plan_budget, {}, 5.0)[2].bytes_per_second == 0.0
    with pytest.raises(ValueError, match="no such class"):
        budget_plan.plan(plan_budget, {"nope": []}, 5.0)
    with pytest.raises(ValueError, match="interval_s"):
        budget_plan.plan(plan_budget, {}, 0)


def test_steady_rate_respects_windows_and_the_quota(tmp_path: Path) -> None:
    b = load(write(tmp_path, WINDOWED.format(tz="UTC")))
    assert budget_plan.steady_rate(b, at("2024-01-01T23:00:00")) == 65536
    assert budget_plan.steady_rate(b) == 16384
    b = quota_budget(tmp_path, 86_400 * 500)
    assert budget_plan.steady_rate(b, at("2024-01-01T23:00:00")) == 500


def test_plan_estimates_with_the_relays_wire_format(plan_budget: Budget, by_class: dict[str, Any]) -> None:
    v1 = budget_plan.plan(plan_budget, by_class, 5.0, version=codec.FORMAT_V1)
    v2 = budget_plan.plan(plan_budget, by_class, 5.0)
    for a, b in zip(v1, v2, strict=True):
        assert a.table_bytes == budget_plan.encoded_scrape_bytes(by_class[a.name], version=codec.FORMAT_V1)
        assert b.table_bytes == budget_plan.encoded_scrape_bytes(by_class[b.name])
    assert v1[2].table_bytes > v2[2].table_bytes  # 400 series: v2's columns beat v1's label sets


def test_plan_counts_what_splitting_a_window_for_a_small_cap_costs(
    plan_budget: Budget, by_class: dict[str, Any]
) -> None:
    whole = budget_plan.plan(plan_budget, by_class, 5.0)
    split = budget_plan.plan(plan_budget, by_class, 5.0, batch_max_bytes=4096)
    assert {p.batch_parts for p in whole} == {1}
    largest = sum(p.bytes_per_second for p in whole) * 60  # every class sends a table each window
    parts = math.ceil(largest / 4096)
    assert parts > 1 and {p.batch_parts for p in split} == {parts}
    everything = [x for xs in by_class.values() for x in xs]
    scale = budget_plan.encoded_scrape_bytes(everything, parts=parts) / budget_plan.encoded_scrape_bytes(
        everything
    )
    assert scale > 1.05  # the parts repeat the strings they share
    for w, p in zip(whole, split, strict=True):
        assert p.full_bytes_per_second == pytest.approx(
            budget_plan.estimate_bytes_per_second(
                round(w.table_bytes * scale), w.samples_per_scrape, p.full_resolution_s, 60, 5.0
            )
        )
    # The split estimate follows what the relay's encoder really builds from such a window.
    scrape = ShapedScrape(
        "t", 1_000, [labels for labels, _ in everything], array("d", (v for _, v in everything))
    )
    encoder = BatchEncoder("default", "node", max_bytes=4096, version=codec.FORMAT_V2)
    batches = encoder.build_window([scrape])
    real = sum(len(encoder.encode(b, 1 << 32)) for b in batches)
    assert budget_plan.encoded_scrape_bytes(everything, parts=len(batches)) == pytest.approx(real, rel=0.1)


def test_a_scrape_too_large_for_one_batch_is_costed_in_parts() -> None:
    rng = random.Random(1)
    # Incompressible label values: more than one MQTT message's worth (codec limit 1 MiB).
    big = [((("__name__", "m"), ("pad", rng.randbytes(150).hex())), float(i)) for i in range(12000)]
    assert budget_plan.encoded_scrape_bytes(big) > codec.DEFAULT_LIMITS.max_payload_bytes


# --------------------------------------------------------------------------------------------------
# `edge-relay budget plan` on the simulator

SIM_BUDGET = """\
version: 1
uplink: {sustained_bytes_per_second: %d, batch_window_seconds: 60}
classes:
  - {name: gpu-critical, preset: dcgm-critical}
  - {name: kepler, preset: kepler, resolution_seconds: 15, degrade: {max_resolution_seconds: 120}}
  - {name: rest, resolution_seconds: 30, degrade: {max_resolution_seconds: 300}}
"""


@pytest.fixture(scope="module")
def sim_server(simulator: Simulator) -> Iterator[SimulatorServer]:
    # A clock that never moves: every request is served tick 0.
    with SimulatorServer(simulator, clock=lambda: 0.0) as server:
        yield server


def relay_config(tmp_path: Path, server: SimulatorServer, rate: int | None) -> Path:
    cfg: dict[str, Any] = {
        "node": "edge-gpu-01",
        "cluster": "test",
        "spool": {"path": str(tmp_path / "spool.db")},
        "targets": [{"name": e, "url": url} for e, url in server.urls.items()],
    }
    if rate is not None:
        write(tmp_path, SIM_BUDGET % rate)
        cfg["budget_file"] = "budget.yaml"
    return write(tmp_path, yaml.safe_dump(cfg), "relay.yaml")


def run_cli(*argv: str) -> int:
    # Only the budget command: the plumbing (exit codes, ConfigError) is the real one.
    commands = {"budget": edge_cli.COMMANDS["budget"]}
    return common_cli.main(commands, "edge-relay", "test", list(argv))


def expected_series(simulator: Simulator) -> dict[str, int]:
    """Series per class of SIM_BUDGET, computed without the planner (tick 0, shaped like the relay)."""
    b = parse(yaml.safe_load(SIM_BUDGET % 1), "sim.yaml")
    counts = dict.fromkeys(("gpu-critical", "kepler", "rest"), 0)
    for exporter in simulator.exporters:
        body = simulator.render(exporter, 0).decode()
        for labels, _, _ in parse_exposition(body, simulator.content_type(exporter)):
            counts[b.classes[b.classify(labels)].name] += 1
        counts["rest"] += 3  # up, scrape_duration_seconds, scrape_samples_scraped
    return counts


def test_cli_plan_table_fits(
    tmp_path: Path, sim_server: SimulatorServer, simulator: Simulator, capsys: pytest.CaptureFixture[str]
) -> None:
    assert edge_cli.COMMANDS["budget"][0] == "edge_relay.commands.budget_plan"
    assert run_cli("budget", "plan", "--config", str(relay_config(tmp_path, sim_server, 16384))) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith(f"budget {tmp_path / 'budget.yaml'}: 4 target(s) scraped once, interval 5s")
    header = lines[1].split()
    assert header[:4] == ["class", "series", "samples/scrape", "full"]
    counts = expected_series(simulator)
    rows = {line.split()[0]: line.split() for line in lines[2:6]}
    assert list(rows) == ["gpu-critical", "kepler", "rest", "total"]
    for name, n in counts.items():
        assert rows[name][1:3] == [str(n), str(n)]
    assert rows["total"][1] == str(sum(counts.values()))
    assert rows["gpu-critical"][3] == "5s" and rows["gpu-critical"][-1] == "critical"
    assert rows["kepler"][3] == rows["kepler"][5] == "15s"
    assert "allowed: 16384.0 B/s" in out
    assert "OK: fits the budget at full resolution" in out
    assert "does not fit" not in out
    assert "WARNING" not in out


def test_cli_plan_json_degrades_and_warns(
    tmp_path: Path, sim_server: SimulatorServer, simulator: Simulator, capsys: pytest.CaptureFixture[str]
) -> None:
    config = relay_config(tmp_path, sim_server, 16384)
    assert run_cli("budget", "plan", "--config", str(config), "--json") == 0
    full = json.loads(capsys.readouterr().out)
    critical = full["classes"][0]["full_bytes_per_second"]
    # A budget barely above what the critical class needs: even fully degraded the rest cannot fit.
    write(tmp_path, SIM_BUDGET % math.ceil(critical + 1), "tight.yaml")
    assert (
        run_cli("budget", "plan", "--config", str(config), "--budget", str(tmp_path / "tight.yaml"), "--json")
        == 0
    )
    captured = capsys.readouterr()
    rep = json.loads(captured.out)
    assert rep["budget"] == str(tmp_path / "tight.yaml")
    assert [c["name"] for c in rep["classes"]] == ["gpu-critical", "kepler", "rest"]
    assert [c["series"] for c in rep["classes"]] == list(expected_series(simulator).values())
    assert [c["resolution_s"] for c in rep["classes"]] == [5.0, 120.0, 300.0]
    assert rep["fits"] is False
    assert any(w.startswith("does not fit") for w in rep["warnings"])
    assert "WARNING: does not fit" in captured.err
    assert rep["total"]["bytes_per_second"] == pytest.approx(
        sum(c["bytes_per_second"] for c in rep["classes"])
    )
    assert rep["estimated_bytes_per_day"] == pytest.approx(rep["total"]["bytes_per_second"] * 86400)
    # The table says the same, with a warning line, and still exits 0.
    assert run_cli("budget", "plan", "--config", str(config), "--budget", str(tmp_path / "tight.yaml")) == 0
    out = capsys.readouterr().out
    assert re.search(r"^WARNING: does not fit: .* above the allowed \d+\.\d B/s", out, re.M)
    assert "OK:" not in out


def test_cli_plan_without_a_budget_is_a_config_error(
    tmp_path: Path, sim_server: SimulatorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    config = relay_config(tmp_path, sim_server, None)
    assert run_cli("budget", "plan", "--config", str(config)) == 2
    err = capsys.readouterr().err
    assert f"{config}: key `budget_file`: expected a bandwidth-budget file" in err
    write(tmp_path, "version: 1\nuplink: {}\n", "bad.yaml")
    assert run_cli("budget", "plan", "--config", str(config), "--budget", str(tmp_path / "bad.yaml")) == 2
    assert "'sustained_bytes_per_second' is a required property" in capsys.readouterr().err


def test_cli_plan_reports_a_failed_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, SIM_BUDGET % 16384)
    cfg = {
        "node": "n",
        "budget_file": "budget.yaml",
        "targets": [{"name": "gone", "url": "http://127.0.0.1:9/metrics"}],
    }
    config = write(tmp_path, yaml.safe_dump(cfg), "relay.yaml")
    assert run_cli("budget", "plan", "--config", str(config)) == 0
    out = capsys.readouterr().out
    assert "WARNING: target gone: scrape failed" in out


def test_cli_plan_counts_the_series_relabeling_keeps(
    tmp_path: Path, sim_server: SimulatorServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan runs the relay's own collect stage: with metric_relabel_configs that keep only the GPU
    temperatures, it plans for those (plus each target's synthetic series), not for every exposed one."""
    config = relay_config(tmp_path, sim_server, 16384)
    cfg = yaml.safe_load(config.read_text())
    keep = [{"source_labels": ["__name__"], "regex": "DCGM_FI_DEV_GPU_TEMP", "action": "keep"}]
    for target in cfg["targets"]:
        target["metric_relabel_configs"] = keep
    config.write_text(yaml.safe_dump(cfg))
    assert run_cli("budget", "plan", "--config", str(config), "--json") == 0
    rep = json.loads(capsys.readouterr().out)
    gpus = sum(
        1
        for line in sim_server.simulator.render("dcgm", 0).decode().splitlines()
        if line.startswith("DCGM_FI_DEV_GPU_TEMP{")
    )
    synthetic = 3 * len(cfg["targets"])  # up, scrape_duration_seconds, scrape_samples_scraped
    assert gpus > 0 and rep["total"]["series"] == gpus + synthetic
    assert rep["relabel_dropped_series"] > 100
    assert "value bytes are a model" in rep["trust"]


def test_budget_command_is_registered_in_the_real_cli() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "edge_relay.cli", "budget", "plan", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout and "--budget" in result.stdout and "--json" in result.stdout


def test_relay_caps_batches_at_the_burst_and_warns_about_a_small_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from edge_relay.app import Relay
    from edge_relay.selfmetrics import RelayMetrics

    budget_path = write(
        tmp_path, "version: 1\nuplink: {sustained_bytes_per_second: 280, burst_bytes: 5600}\n"
    )
    config = tmp_path / "relay.yaml"
    config.write_text(
        "node: n1\ntargets: [{name: k, url: 'http://127.0.0.1:9/metrics'}]\n"
        f"spool: {{path: {tmp_path / 'spool.db'}}}\nbudget_file: budget.yaml\n"
        "mqtt: {port: 9}\nmetrics: {listen: ''}\n"
    )
    with caplog.at_level("WARNING", logger="edge_relay"):
        relay = Relay(relay_settings.load(str(config)), RelayMetrics())
    try:
        assert relay.encoder.max_bytes == 5600 - 512
        assert any(
            "uplink.burst_bytes: 5600" in r.getMessage() and str(budget_path) in r.getMessage()
            for r in caplog.records
        )
        # Reloaded with the default burst (two 60 s windows): one window is one batch again, no warning.
        caplog.clear()
        budget_path.write_text(
            "version: 1\nuplink: {sustained_bytes_per_second: 280}\nclasses: [{name: all}]\n"
        )
        with caplog.at_level("WARNING", logger="edge_relay"):
            relay.budget.maybe_reload()
        assert relay.budget is not None and relay.budget.budget.uplink.burst_bytes == 2 * 280 * 60
        assert relay.encoder.max_bytes == 2 * 280 * 60 - 512
        assert not [r for r in caplog.records if "burst_bytes" in r.getMessage()]
    finally:
        relay.spool.close()
