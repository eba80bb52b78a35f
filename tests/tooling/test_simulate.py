"""The exporter simulator: fixture fidelity, purity, counters, churn, sizing and its HTTP face."""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from simulator import (
    CONTENT_TYPE_OPENMETRICS,
    CONTENT_TYPE_OPENMETRICS_001,
    CONTENT_TYPE_SNIFFED,
    CONTENT_TYPE_TEXT,
    EXPORTERS,
    Simulator,
    SimulatorServer,
    data_path,
    format_go_float,
    format_om_float,
    negotiate_openmetrics,
)
from testkit.services import wait_until

FIXTURES = data_path()
FIXTURE_OF = {
    "kepler": "kepler-current-sample.prom",
    "kepler-0.7": "kepler-0.7-sample.prom",
    "dcgm": "dcgm-exporter-sample.prom",
}
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)

Series = dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, float]]


def series_of(body: bytes) -> Series:
    """(name, labels) -> (family type, value), asserting every series appears once."""
    out: Series = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in out, f"duplicate series {key}"
            out[key] = (fam.type, s.value)
    return out


def value(series: Series, name: str, **labels: str) -> float:
    """The value of the one series called ``name`` that carries ``labels`` (among others)."""
    (found,) = [v for (n, lab), (_, v) in series.items() if n == name and set(labels.items()) <= set(lab)]
    return found


def label_sets(text: str) -> set[str]:
    """'name{a,b,c}' per sample line: metric names with their label names in exposition order."""
    return {re.sub(r'="[^"]*"', "", line.split(" ")[0]) for line in text.splitlines() if line[0] != "#"}


def quick(body: bytes) -> dict[str, tuple[str, float]]:
    """'name{labels}' -> (family type, value): a fast split for loops over many ticks (the payloads
    themselves are checked with prometheus_client elsewhere)."""
    out: dict[str, tuple[str, float]] = {}
    typ = ""
    for line in body.decode().splitlines():
        if line.startswith("# TYPE "):
            typ = line.rsplit(" ", 1)[1]
        elif not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = (typ, float(value))
    return out


def total_series(sim: Simulator, tick: int) -> int:
    return sum(len(quick(sim.render(e, tick))) for e in sim.exporters)


@pytest.fixture(scope="module")
def big() -> Simulator:
    return Simulator(11, 20000, 5.0)


# --- fidelity to the fixtures -----------------------------------------------------------------


@pytest.mark.parametrize("churn", [0, 30])
@pytest.mark.parametrize("exporter", sorted(FIXTURE_OF))
def test_tick_zero_is_the_fixture_byte_for_byte(exporter: str, churn: int) -> None:
    sim = Simulator(3, None, 5.0, churn_ticks=churn)
    assert sim.render(exporter, 0) == (FIXTURES / FIXTURE_OF[exporter]).read_bytes()


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("tick", [0, 1, 37, 500])
def test_payloads_parse_at_natural_size(exporter: str, tick: int) -> None:
    body = Simulator(1).render(exporter, tick)
    assert body.endswith(b"\n")
    assert series_of(body)


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("tick", [0, 61])
def test_payloads_parse_at_20000_series(big: Simulator, exporter: str, tick: int) -> None:
    assert series_of(big.render(exporter, tick))


def test_help_type_and_label_names_stay_the_fixtures() -> None:
    sim = Simulator(5, 3000, 5.0, churn_ticks=4)
    for exporter, name in FIXTURE_OF.items():
        fixture = (FIXTURES / name).read_text()
        want_meta = {line for line in fixture.splitlines() if line.startswith("#")}
        want_labels = label_sets(fixture)
        for tick in (9, 77):
            text = sim.render(exporter, tick).decode()
            assert {line for line in text.splitlines() if line.startswith("#")} <= want_meta
            got_labels = label_sets(text)
            if exporter == "dcgm":  # a GPU between two pods carries no container/namespace/pod
                got_labels = {_without_pod(g) for g in got_labels}
                want_labels = {_without_pod(g) for g in want_labels}
            assert got_labels <= want_labels, got_labels - want_labels


def _without_pod(label_set: str) -> str:
    return re.sub(r",container,(err_code,err_msg,)?namespace,pod", r",\1", label_set).replace(",}", "}")


def test_number_formats_follow_each_exporter(big: Simulator) -> None:
    kepler = big.render("kepler", 123).decode()
    values = [line.rsplit(" ", 1)[1] for line in kepler.splitlines() if not line.startswith("#")]
    # Go 'g' formatting: never fixed notation at or above 1e6, never a trailing ".0".
    assert not [v for v in values if re.fullmatch(r"-?\d{7,}(\.\d+)?", v) or v.endswith(".0")]
    assert any("e+" in v for v in values)
    dcgm = big.render("dcgm", 123).decode()
    fixture_values = {
        line.split("{")[0] + line.split(",")[0]: line.rsplit(" ", 1)[1]
        for line in (FIXTURES / FIXTURE_OF["dcgm"]).read_text().splitlines()
        if not line.startswith("#")
    }
    for line in dcgm.splitlines():
        if line.startswith("#"):
            continue
        assert line.split("{")[1].startswith('gpu="'), "dcgm keeps its fixed label order"
        value = line.rsplit(" ", 1)[1]
        was = fixture_values[line.split("{")[0] + line.split(",")[0]]
        assert re.fullmatch(r"-?\d+\.\d{6}" if "." in was else r"-?\d+", value), line


@pytest.mark.parametrize(
    ("value", "go"),
    [
        (15390577.028, "1.5390577028e+07"),
        (1e6, "1e+06"),
        (127025.0, "127025"),
        (649461.219, "649461.219"),
        (3.4817e-05, "3.4817e-05"),
        (0.000141296, "0.000141296"),
        (9.223372036854776e18, "9.223372036854776e+18"),
        (1.70787780943352e14, "1.70787780943352e+14"),
        (0.0, "0"),
        (-2.5e7, "-2.5e+07"),
        (1e21, "1e+21"),
        (float("nan"), "NaN"),
        (float("inf"), "+Inf"),
    ],
)
def test_format_go_float(value: float, go: str) -> None:
    assert format_go_float(value) == go


def test_format_om_float() -> None:
    got = [format_om_float(v) for v in (1.0, 0.0, 17342.0, 0.25, 2.1e7)]
    assert got == ["1.0", "0.0", "17342.0", "0.25", "2.1e+07"]


# --- purity and determinism -------------------------------------------------------------------


def test_same_seed_same_bytes_in_any_order() -> None:
    a = Simulator(42, 5000, 2.0, churn_ticks=7)
    b = Simulator(42, 5000, 2.0, churn_ticks=7)
    ticks = [0, 3, 15, 16, 300]
    first = {(e, t): a.render(e, t) for e in EXPORTERS for t in ticks}
    second = {(e, t): b.render(e, t) for e in EXPORTERS for t in reversed(ticks)}
    assert first == second
    assert all(a.render(e, t) == first[(e, t)] for e in EXPORTERS for t in ticks)  # no hidden state
    assert a.render("kepler", 15, openmetrics=True) == b.render("kepler", 15, openmetrics=True)


def test_different_seed_different_bytes() -> None:
    a, b = Simulator(1, 3000), Simulator(2, 3000)
    for exporter in EXPORTERS:
        assert a.render(exporter, 5) != b.render(exporter, 5)
    assert a.render("kepler", 0) != b.render("kepler", 0)  # the added pods differ from the start


def test_interval_scales_counter_growth() -> None:
    growth = []
    for interval in (1.0, 10.0):
        sim = Simulator(1, None, interval)
        at = [
            value(series_of(sim.render("kepler", t)), "kepler_node_cpu_joules_total", zone="package")
            for t in (0, 1)
        ]
        growth.append(at[1] - at[0])
    assert growth[1] == pytest.approx(10 * growth[0], rel=1e-3)


# --- dynamics ---------------------------------------------------------------------------------


def test_counters_never_decrease_for_surviving_series() -> None:
    sim = Simulator(9, 2500, 5.0, churn_ticks=6)
    prev = {e: quick(sim.render(e, 0)) for e in EXPORTERS}
    checked = 0
    for tick in range(1, 60):
        cur = {e: quick(sim.render(e, tick)) for e in EXPORTERS}
        for exporter in EXPORTERS:
            for key, (typ, value) in cur[exporter].items():
                counter = typ == "counter" or key.startswith("go_gc_duration_seconds_")
                if counter and key in prev[exporter]:
                    assert value >= prev[exporter][key][1], (exporter, tick, key)
                    checked += 1
        prev = cur
    assert checked > 80000


def test_a_steady_container_keeps_advancing() -> None:
    sim = Simulator(1, None, 5.0)
    name, labels = "kepler_container_cpu_joules_total", {"container_name": "kepler", "zone": "package"}
    values = [value(series_of(sim.render("kepler", t)), name, **labels) for t in range(0, 200, 10)]
    assert values == sorted(values) and values[-1] > values[0]
    # About watts x seconds: 1.8 W for 950 s is far more than nothing and far less than 10 W would give.
    assert 0.5 * 1.818236 * 950 < values[-1] - values[0] < 10 * 950


def test_kepler_process_cpu_time_moves_in_whole_clock_ticks() -> None:
    """As Kepler reads it ((utime + stime) / USER_HZ); a series still at its tick-0 value keeps the
    fixture's spelling, and rounding up never takes a counter below where it started."""
    sim = Simulator(4, 3000, 5.0, churn_ticks=6)
    name = "kepler_process_cpu_seconds_total"
    start = {k: v for k, (_, v) in quick(sim.render("kepler", 0)).items() if k.startswith(name)}
    assert sum(1 for v in start.values() if round(v * 100) / 100 != v) > 10  # the fixture's 17 digits
    moved = 0
    for tick in (1, 2, 7, 40):
        for key, (_, v) in quick(sim.render("kepler", tick)).items():
            if not key.startswith(name) or v == start.get(key):
                continue
            assert v == round(v * 100) / 100, (tick, key, v)  # float64(ticks) / 100, as Kepler computes it
            assert key not in start or v > start[key], (tick, key)
            moved += 1
    assert moved > 400


def test_gauges_stay_in_bounds() -> None:
    sim = Simulator(4, None, 5.0, churn_ticks=5)
    for tick in range(0, 400, 13):
        for (name, _), (_, v) in series_of(sim.render("dcgm", tick)).items():
            if name.endswith("_UTIL"):
                assert 0 <= v <= 100
            if name.startswith("DCGM_FI_PROF_") and name.endswith("_ACTIVE"):
                assert 0 <= v <= 1
            if name.endswith("_TEMP"):
                assert 20 < v < 95
            if name == "DCGM_FI_DEV_POWER_USAGE":
                assert 0 < v <= 300
        kepler = series_of(sim.render("kepler", tick))
        for (name, _), (_, v) in kepler.items():
            if name.endswith("_watts"):
                assert v >= 0
            if name == "kepler_node_cpu_usage_ratio":
                assert 0 <= v <= 1
        node = series_of(sim.render("node", tick))
        free, available, total = (
            value(node, f"node_memory_{field}_bytes") for field in ("MemFree", "MemAvailable", "MemTotal")
        )
        assert 0 < free < available < total


def test_node_cpu_modes_add_up_to_wall_time() -> None:
    sim = Simulator(2, None, 5.0)
    before, after = series_of(sim.render("node", 10)), series_of(sim.render("node", 11))
    for cpu in ("0", "17", "31"):
        keys = [k for k in after if k[0] == "node_cpu_seconds_total" and ("cpu", cpu) in k[1]]
        assert len(keys) == 8
        assert sum(after[k][1] - before[k][1] for k in keys) == pytest.approx(5.0, abs=0.05)


def test_gpu_power_agrees_between_kepler_and_dcgm() -> None:
    sim = Simulator(8, None, 5.0)
    for tick in (3, 50, 333):
        kepler = series_of(sim.render("kepler", tick))
        dcgm = series_of(sim.render("dcgm", tick))
        for gpu in ("0", "1"):
            kepler_watts = value(kepler, "kepler_node_gpu_watts", gpu=gpu)
            assert kepler_watts == pytest.approx(value(dcgm, "DCGM_FI_DEV_POWER_USAGE", gpu=gpu), abs=1e-3)


# --- churn ------------------------------------------------------------------------------------


def pod_names(body: bytes) -> set[str]:
    return set(re.findall(r'pod_name="([^"]+)"', body.decode()))


def test_churn_replaces_pods_and_reports_the_old_one_terminated() -> None:
    sim = Simulator(1, None, 5.0, churn_ticks=4)
    swaps = 0
    for tick in range(1, 60):
        before, now = sim.render("kepler", tick - 1).decode(), sim.render("kepler", tick).decode()
        gone = {n for n in pod_names(before.encode()) - pod_names(now.encode())}
        new = pod_names(now.encode()) - pod_names(before.encode())
        if not new or not any(n.startswith("rtsp-ingest-") for n in new):
            continue
        swaps += 1
        # The replaced pod is reported once more, terminated, with counters frozen.
        old = next(n for n in pod_names(before.encode()) if n.startswith("rtsp-ingest-"))
        assert old not in gone
        assert re.search(rf'pod_name="{old}",pod_namespace="vision",state="terminated"', now)
        assert f'pod_name="{old}"' not in sim.render("kepler", tick + 1).decode()
        # The new pod's counters start near zero.
        new_name = next(n for n in new if n.startswith("rtsp-ingest-"))
        fresh = series_of(now.encode())
        for zone in ("package", "dram"):
            assert value(fresh, "kepler_pod_cpu_joules_total", pod_name=new_name, zone=zone) < 100
    assert swaps >= 5


def test_churn_changes_series_sets_in_every_kepler_and_dcgm() -> None:
    sim = Simulator(2, 3000, 5.0, churn_ticks=5)
    for exporter in ("kepler", "kepler-0.7", "dcgm"):
        seen = [set(quick(sim.render(exporter, t))) for t in range(0, 40)]
        disappeared = sum(len(a - b) for a, b in itertools.pairwise(seen))
        appeared = sum(len(b - a) for a, b in itertools.pairwise(seen))
        assert disappeared > 0 and appeared > 0, exporter
    node = [set(quick(sim.render("node", t))) for t in (0, 40, 79)]
    assert node[0] == node[1] == node[2]


def test_dcgm_drops_pod_labels_while_a_gpu_changes_hands() -> None:
    sim = Simulator(1, None, 5.0, churn_ticks=3)
    pods = []
    for tick in range(120):
        util = value(series_of(sim.render("dcgm", tick)), "DCGM_FI_DEV_GPU_UTIL", gpu="0")
        labels = next(lab for (n, lab) in series_of(sim.render("dcgm", tick)) if n == "DCGM_FI_DEV_GPU_UTIL")
        pods.append(dict(labels).get("pod"))
        assert 0 <= util <= 100
    assert None in pods  # the swap tick: held by no pod
    assert len({p for p in pods if p}) >= 3  # and held by successive triton pods otherwise


def test_no_churn_keeps_the_series_set() -> None:
    sim = Simulator(1, 4000, 5.0, churn_ticks=0)
    for exporter in EXPORTERS:
        assert set(series_of(sim.render(exporter, 0))) == set(series_of(sim.render(exporter, 250)))


# --- sizing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("target", [3000, 20000])
def test_series_flag_sizes_the_total_within_5_percent(big: Simulator, target: int) -> None:
    sim = big if target == 20000 else Simulator(6, target, 5.0)
    for tick in (0, 1, 29, 30, 31, 95):
        assert abs(total_series(sim, tick) - target) <= 0.05 * target


def test_series_flag_counts_only_enabled_exporters() -> None:
    sim = Simulator(6, 5000, 5.0, exporters=["kepler-0.7", "node"])
    assert sim.exporters == ("kepler-0.7", "node")
    assert abs(total_series(sim, 3) - 5000) <= 250


def test_100000_series_still_work() -> None:
    sim = Simulator(1, 100000, 5.0)
    lines = sum(
        sum(1 for line in sim.render(e, 1).splitlines() if not line.startswith(b"#")) for e in sim.exporters
    )
    assert abs(lines - 100000) <= 5000


def test_natural_size_without_series() -> None:
    planned = Simulator(1).planned_series
    assert (planned["kepler"], planned["kepler-0.7"], planned["dcgm"]) == (476, 336, 50)
    assert 300 <= planned["node"] <= 550


# --- OpenMetrics ------------------------------------------------------------------------------


def test_openmetrics_rendering() -> None:
    sim = Simulator(1, 3000)
    om = sim.render("kepler", 7, openmetrics=True).decode()
    assert om.endswith("\n# EOF\n")
    assert "# TYPE kepler_container_cpu_joules counter" in om
    assert "# TYPE kepler_container_cpu_joules_total" not in om
    assert re.search(r"^kepler_container_cpu_joules_total\{", om, re.M)
    assert 'go_gc_duration_seconds{quantile="1.0"}' in om
    assert re.search(r"^go_gc_duration_seconds_count \d+$", om, re.M)
    assert re.search(r"^go_goroutines \d+\.0$", om, re.M)
    # Same samples as the text form at that tick, only written differently.
    text = sim.render("kepler", 7).decode()
    assert len(om.splitlines()) == len(text.splitlines()) + 1
    for exporter in ("kepler-0.7", "dcgm", "node"):
        with pytest.raises(ValueError):
            sim.render(exporter, 7, openmetrics=True)


@pytest.mark.parametrize(
    ("accept", "version"),
    [
        ("", None),
        ("*/*", None),
        ("text/plain;version=0.0.4", None),
        ("application/openmetrics-text", "0.0.1"),
        ("application/openmetrics-text; version=1.0.0; charset=utf-8", "1.0.0"),
        (PROMETHEUS_ACCEPT, "1.0.0"),
        ("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;version=1.0.0;q=0.5", None),
        ("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited", None),
        ("application/openmetrics-text;version=2.0.0", None),
    ],
)
def test_negotiate_openmetrics(accept: str, version: str | None) -> None:
    assert negotiate_openmetrics(accept) == version


# --- HTTP -------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    assert url.startswith("http://127.0.0.1:")
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(tmp_path: Path, clock: FakeClock) -> Iterator[SimulatorServer]:
    sim = Simulator(3, 2000, 5.0, churn_ticks=4)
    srv = SimulatorServer(sim, served_log=tmp_path / "served.jsonl", clock=clock).start()
    try:
        yield srv
    finally:
        srv.stop()


def test_prerender_has_the_next_tick_ready_half_a_tick_ahead_with_the_same_bytes() -> None:
    clock = FakeClock()
    sim = Simulator(3, 2000, 5.0, churn_ticks=4)
    with SimulatorServer(sim, clock=clock, prerender=True) as srv:
        start = clock.now
        clock.now = start + 5 * 7 + 0.1  # tick 7
        assert fetch(srv.urls["kepler"])[0] == 200  # asks for plain kepler: it is rendered ahead now
        assert (8, False, False) not in srv._cache["kepler"]
        clock.now = start + 5 * 7 + 2.6  # past the middle of tick 7
        wait_until(lambda: (8, False, False) in srv._cache["kepler"], 10, message="tick 8 rendered ahead")
        assert (8, False, False) not in srv._cache["node"]  # never asked for
        clock.now = start + 5 * 8 + 0.1
        status, _, body = fetch(srv.urls["kepler"])
    assert (status, body) == (200, Simulator(3, 2000, 5.0, churn_ticks=4).render("kepler", 8))


def test_serves_every_exporter_on_its_own_loopback_port(server: SimulatorServer, clock: FakeClock) -> None:
    assert set(server.urls) == set(EXPORTERS)
    assert len({url.rsplit(":", 1)[1] for url in server.urls.values()}) == 4
    clock.now += 5 * 13 + 0.5  # tick 13
    for exporter, url in server.urls.items():
        status, headers, body = fetch(url)
        assert status == 200
        assert body == server.simulator.render(exporter, 13)
        assert headers["Content-Type"] == (CONTENT_TYPE_SNIFFED if exporter == "dcgm" else CONTENT_TYPE_TEXT)
        assert "Server" not in headers
    status, _, body = fetch(server.urls["node"].replace("/metrics", "/"))
    assert (status, body) == (404, b"404 page not found\n")
    assert fetch(server.urls["kepler"] + "x")[0] == 404


def test_openmetrics_is_negotiated_by_accept(server: SimulatorServer) -> None:
    url = server.urls["kepler"]
    status, headers, body = fetch(url, {"Accept": PROMETHEUS_ACCEPT})
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE_OPENMETRICS
    assert body.endswith(b"# EOF\n") and body == server.simulator.render("kepler", 0, openmetrics=True)
    _, headers, body = fetch(url, {"Accept": "application/openmetrics-text"})
    assert headers["Content-Type"] == CONTENT_TYPE_OPENMETRICS_001 and body.endswith(b"# EOF\n")
    _, headers, body = fetch(url, {"Accept": "text/plain;version=0.0.4"})
    assert headers["Content-Type"] == CONTENT_TYPE_TEXT and not body.endswith(b"# EOF\n")
    for exporter in ("kepler-0.7", "dcgm", "node"):  # text only, whatever the scraper asks for
        _, headers, body = fetch(server.urls[exporter], {"Accept": PROMETHEUS_ACCEPT})
        assert "openmetrics" not in headers["Content-Type"] and b"# EOF" not in body


def test_gzip_when_asked_except_dcgm(server: SimulatorServer) -> None:
    _, headers, body = fetch(server.urls["kepler"], {"Accept-Encoding": "gzip"})
    assert headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(body) == server.simulator.render("kepler", 0)
    _, headers, body = fetch(server.urls["dcgm"], {"Accept-Encoding": "gzip"})
    assert "Content-Encoding" not in headers and body == server.simulator.render("dcgm", 0)


def test_concurrent_scrapers_share_one_render(
    server: SimulatorServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, int, bool]] = []
    render = server.simulator.render

    def counting(exporter: str, tick: int, openmetrics: bool = False) -> bytes:
        calls.append((exporter, tick, openmetrics))
        return render(exporter, tick, openmetrics)

    monkeypatch.setattr(server.simulator, "render", counting)
    with ThreadPoolExecutor(8) as pool:
        bodies = list(pool.map(lambda _: fetch(server.urls["kepler"])[2], range(16)))
    assert len(set(bodies)) == 1 and bodies[0] == render("kepler", 0)
    assert calls == [("kepler", 0, False)]


def test_served_log_records_each_request(server: SimulatorServer, clock: FakeClock, tmp_path: Path) -> None:
    fetch(server.urls["kepler"], {"Accept": PROMETHEUS_ACCEPT})
    clock.now += 5.0
    fetch(server.urls["dcgm"])
    fetch(server.urls["node"] + "/nope")  # not a scrape: not logged
    records = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    assert [(r["exporter"], r["tick"], r["openmetrics"], r["status"]) for r in records] == [
        ("kepler", 0, True, 200),
        ("dcgm", 1, False, 200),
    ]
    assert all(isinstance(r["t_ms"], int) and r["t_ms"] > 1_600_000_000_000 for r in records)


def test_fail_every_answers_500_on_every_kth_tick(tmp_path: Path, clock: FakeClock) -> None:
    sim = Simulator(1, None, 2.0, exporters=["dcgm", "kepler"])
    log = tmp_path / "served.jsonl"
    with SimulatorServer(sim, fail_every=3, served_log=log, clock=clock) as srv:
        statuses = []
        for _ in range(7):
            statuses.append(fetch(srv.urls["dcgm"])[0])
            clock.now += 2.0
    assert statuses == [200, 200, 500, 200, 200, 500, 200]
    assert [json.loads(line)["status"] for line in log.read_text().splitlines()] == statuses
    with SimulatorServer(Simulator(1, exporters=["node"]), fail_every=1) as srv:
        assert fetch(srv.urls["node"])[0] == 500


def test_render_rejects_bad_arguments() -> None:
    sim = Simulator(1)
    with pytest.raises(ValueError):
        sim.render("prometheus", 0)
    with pytest.raises(ValueError):
        sim.render("kepler", -1)
    with pytest.raises(ValueError):
        Simulator(1, exporters=["kepler", "nvidia"])
    with pytest.raises(ValueError):
        Simulator(1, None, 0.0)


def test_cli_prints_ready_serves_and_exits_cleanly_on_sigterm(tmp_path: Path) -> None:
    code = (
        "import argparse, sys\n"
        "from simulator import server as simulate\n"
        "p = argparse.ArgumentParser()\n"
        "simulate.add_arguments(p)\n"
        "sys.exit(simulate.run(p.parse_args(sys.argv[1:])))\n"
    )
    ports = ["--kepler-port", "0", "--kepler07-port", "-1", "--dcgm-port", "0", "--node-port", "0"]
    options = [
        "--seed",
        "4",
        "--interval",
        "1",
        "--series",
        "2000",
        "--served-log",
        str(tmp_path / "served.jsonl"),
    ]
    argv = [sys.executable, "-c", code, *ports, *options]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] is True
        assert set(ready["exporters"]) == {"kepler", "dcgm", "node"}
        status, _, body = fetch(ready["exporters"]["kepler"])
        assert status == 200
        tick = json.loads((tmp_path / "served.jsonl").read_text().splitlines()[0])["tick"]
        sim = Simulator(4, 2000, 1.0, exporters=["kepler", "dcgm", "node"])
        assert body == sim.render("kepler", tick)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_vendor_option_defaults_to_todays_nvidia_node() -> None:
    import argparse

    from simulator import VENDORS, vendor_exporters
    from simulator import server as simulate

    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args([])
    assert args.vendor == "nvidia" and vendor_exporters("nvidia") == EXPORTERS
    # No port given: the vendor's exporters get their defaults, the others stay off.
    names = ("kepler", "kepler07", "dcgm", "node", "amd", "intel", "jetson")
    assert all(getattr(args, f"{name}_port") is None for name in names)
    assert set(VENDORS) == {"nvidia", "amd", "intel", "jetson"}
    with pytest.raises(ValueError, match="unknown vendor"):
        vendor_exporters("arm")
    with pytest.raises(SystemExit):
        parser.parse_args(["--vendor", "arm"])
