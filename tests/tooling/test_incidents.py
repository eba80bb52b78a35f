"""Incident injection in the simulator: each kind moves exactly its GPU's series, in the intended
direction, inside its window; everything else stays byte for byte the simulator without incidents."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from simulator import Simulator
from simulator.incidents import KINDS, Incident, parse_incident
from simulator.server import add_arguments, run

START, LENGTH = 12, 24
END = START + LENGTH
TICKS = range(START - 3, END + 4)
# Series that keep what an incident added after it (a counter never gives anything back).
COUNTERS = re.compile(r"_joules_total|TOTAL_ENERGY|REMAPPED_ROWS|ECC_[SD]BE|gpu_energy|gpu_ecc_")


def lines(sim: Simulator, exporter: str, tick: int) -> dict[str, str]:
    """'name{labels}' -> value text; the XID series is keyed without its err_* labels (they carry the
    XID, so an XID burst renames the series)."""
    out = {}
    for line in sim.render(exporter, tick).decode().splitlines():
        if not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[re.sub(r',err_code="[^"]*",err_msg="[^"]*"', "", key)] = value
    return out


def dcgm(sim: Simulator, field: str, gpu: int, tick: int) -> float:
    (v,) = [
        float(v)
        for k, v in lines(sim, "dcgm", tick).items()
        if k.startswith(field + "{") and f'gpu="{gpu}"' in k
    ]
    return v


def changed(a: Simulator, b: Simulator, exporter: str, tick: int) -> dict[str, tuple[float, float]]:
    la, lb = lines(a, exporter, tick), lines(b, exporter, tick)
    assert la.keys() == lb.keys()
    return {k: (float(la[k]), float(lb[k])) for k in la if la[k] != lb[k]}


@pytest.fixture(scope="module")
def base() -> Simulator:
    return Simulator(7, dcgm_health_fields=True)


@pytest.fixture(scope="module")
def sims() -> dict[tuple[str, int], Simulator]:
    return {
        (kind, gpu): Simulator(7, incidents=[Incident(kind, gpu, START, LENGTH)], dcgm_health_fields=True)
        for kind in KINDS
        for gpu in (0, 1)
    }


def test_no_incident_is_the_plain_simulator() -> None:
    plain, empty = Simulator(3), Simulator(3, incidents=[])
    assert plain._overlay is None and empty._overlay is None
    for tick in (0, 5, 100):
        for exporter in plain.exporters:
            assert plain.render(exporter, tick) == empty.render(exporter, tick)
    # The health fields are extra families at the end of dcgm's payload, steady at 0.
    text = Simulator(3, dcgm_health_fields=True).render("dcgm", 9).decode()
    assert text.startswith(Simulator(3).render("dcgm", 9).decode())
    assert text.count("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{") == 2
    assert re.findall(r"ECC_[SD]BE_VOL_TOTAL\{[^}]*\} (\S+)", text) == ["0"] * 4


@pytest.mark.parametrize("kind", KINDS)
def test_only_the_gpu_and_the_window_move(kind: str, base: Simulator, sims: dict) -> None:
    for exporter in ("dcgm", "kepler", "kepler-0.7", "node"):
        moved: dict[int, set[str]] = {0: set(), 1: set()}
        for gpu in (0, 1):
            sim = sims[(kind, gpu)]
            after: dict[str, float] = {}
            for tick in [*TICKS, 200]:
                diff = changed(base, sim, exporter, tick)
                moved[gpu] |= diff.keys()
                if not START <= tick < END:
                    # Outside the window only counters differ, by what they gained in it.
                    assert all(COUNTERS.search(k) for k in diff), (tick, diff)
                    for k, (a, b) in diff.items():
                        if tick >= END and k in after and "pod_id" not in k:
                            assert b - a == pytest.approx(after[k], rel=1e-9, abs=2), (k, tick)
                        after.setdefault(k, b - a)
                    assert tick >= END or not diff
            if exporter == "dcgm":
                assert all(f'gpu="{gpu}"' in k for k in moved[gpu])
            elif exporter == "kepler":
                assert all("_gpu_" in k and "idle" not in k for k in moved[gpu])
                if kind != "memleak":
                    assert any(k.startswith("kepler_node_gpu_watts") for k in moved[gpu])
            else:
                assert not moved[gpu], f"{exporter} has no per-GPU power that follows dcgm"
        assert not moved[0] & moved[1]


def _window(sim: Simulator, base: Simulator, field: str, gpu: int = 1) -> list[tuple[float, float]]:
    return [(dcgm(base, field, gpu, t), dcgm(sim, field, gpu, t)) for t in range(START, END)]


def test_thermal_runaway_heats_then_throttles(base: Simulator, sims: dict) -> None:
    sim = sims[("thermal", 1)]
    temps = _window(sim, base, "DCGM_FI_DEV_GPU_TEMP")
    assert all(b >= a for a, b in temps) and sum(b > a + 10 for a, b in temps) >= LENGTH // 2
    assert all(30 <= b <= 100 for _, b in temps)
    assert temps[3][1] - temps[0][1] >= 6  # fast: several °C per scrape at first
    clocks = _window(sim, base, "DCGM_FI_DEV_SM_CLOCK")
    assert all(210 <= b <= a for a, b in clocks) and min(b / a for a, b in clocks) < 0.7
    bits = [int(b) for _, b in _window(sim, base, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")]
    assert any(b & 0x20 for b in bits) and not any(b & 0x4 for b in bits)
    power = _window(sim, base, "DCGM_FI_DEV_POWER_USAGE")
    assert all(b <= 300 for _, b in power) and any(b < a - 20 for a, b in power)  # throttled down
    mem = _window(sim, base, "DCGM_FI_DEV_MEMORY_TEMP")
    assert all(a <= b <= 95 for a, b in mem)


def test_powercap_pins_power_at_the_limit(base: Simulator, sims: dict) -> None:
    sim = sims[("powercap", 0)]
    power = _window(sim, base, "DCGM_FI_DEV_POWER_USAGE", gpu=0)
    assert all(b >= a for a, b in power)
    assert sum(b > 300 for _, b in power) == 1 and max(b for _, b in power) <= 306.5  # one overshoot
    assert sum(290 <= b <= 300 for _, b in power) >= LENGTH // 2
    clocks = _window(sim, base, "DCGM_FI_DEV_SM_CLOCK", gpu=0)
    assert all(210 <= b <= a for a, b in clocks) and sum(b < 0.85 * a for a, b in clocks) >= LENGTH // 2
    bits = [int(b) for _, b in _window(sim, base, "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS", gpu=0)]
    assert bits[0] == 0 and sum(b == 0x4 for b in bits) >= LENGTH // 2
    util = _window(sim, base, "DCGM_FI_DEV_GPU_UTIL", gpu=0)
    assert all(b >= a for a, b in util) and max(b for _, b in util) <= 100


def test_xid_burst_sets_codes_and_steps_counters(base: Simulator, sims: dict) -> None:
    sim = sims[("xid", 1)]
    codes = [dcgm(sim, "DCGM_FI_DEV_XID_ERRORS", 1, t) for t in range(START, END)]
    assert codes[0] == 94 and codes[1] == 63 and codes[-1] == 43
    text = sim.render("dcgm", START).decode()
    assert (
        'gpu="1"'
        in re.search(r'XID_ERRORS\{[^}]*err_code="94",err_msg="Contained ECC error"[^}]*\}', text)[0]
    )
    assert dcgm(sim, "DCGM_FI_DEV_XID_ERRORS", 1, END) == 0
    for field, gain in (
        ("UNCORRECTABLE_REMAPPED_ROWS", 1),
        ("ECC_DBE_VOL_TOTAL", 1),
        ("ECC_SBE_VOL_TOTAL", 3),
    ):
        got = [
            dcgm(sim, f"DCGM_FI_DEV_{field}", 1, t) - dcgm(base, f"DCGM_FI_DEV_{field}", 1, t) for t in TICKS
        ]
        assert got == sorted(got) and got[-1] == gain  # kept after the window
    util = _window(sim, base, "DCGM_FI_DEV_GPU_UTIL")
    assert util[-1][1] == 0 and util[0][1] == util[0][0]  # the application dies after the burst


def test_memleak_fills_the_frame_buffer(base: Simulator, sims: dict) -> None:
    sim = sims[("memleak", 1)]
    used = _window(sim, base, "DCGM_FI_DEV_FB_USED")
    free = _window(sim, base, "DCGM_FI_DEV_FB_FREE")
    reserved = dcgm(base, "DCGM_FI_DEV_FB_RESERVED", 1, START)
    total = used[0][0] + free[0][0] + reserved
    grow = int(0.8 * LENGTH)
    assert [b for _, b in used[:grow]] == sorted(b for _, b in used[:grow])
    assert all(b >= a for a, b in used) and used[grow - 1][1] >= 0.99 * (total - reserved)
    assert all(0 <= b <= a for a, b in free) and free[grow - 1][1] <= 0.01 * total
    assert all(abs(u + f + reserved - total) <= 2 for (_, u), (_, f) in zip(used, free, strict=True))


def _counters(sim: Simulator, exporter: str) -> Iterator[tuple[str, list[float]]]:
    series: dict[str, list[float]] = {}
    for tick in range(0, END + 6):
        for k, v in lines(sim, exporter, tick).items():
            if COUNTER_NAMES.search(k):
                series.setdefault(k, []).append(float(v))
    yield from series.items()


COUNTER_NAMES = re.compile(r"_total\{|TOTAL_ENERGY|REMAPPED_ROWS|gpu_energy|gpu_ecc_")


@pytest.mark.parametrize("kind", KINDS)
def test_counters_stay_monotonic(kind: str, sims: dict) -> None:
    sim = sims[(kind, 1)]
    for exporter in ("dcgm", "kepler"):
        for key, values in _counters(sim, exporter):
            assert values == sorted(values), key


@pytest.mark.parametrize("vendor", ["amd", "intel", "jetson"])
@pytest.mark.parametrize("kind", KINDS)
def test_other_vendors_move_their_gpu_only(vendor: str, kind: str) -> None:
    plain = Simulator(2, exporters=[vendor], kepler_gpu=False)
    sim = Simulator(2, exporters=[vendor], kepler_gpu=False, incidents=[Incident(kind, 0, START, LENGTH)])
    other = {"amd": 'gpu_id="1"', "intel": "0000-0000-b1"}.get(vendor)
    seen = set()
    for tick in (START - 1, START + 3, START + 15, END, END + 5):
        diff = changed(plain, sim, vendor, tick)
        if not START <= tick < END:
            assert all(COUNTERS.search(k) for k in diff), diff
        else:
            seen |= diff.keys()
        if other is not None:
            assert not [k for k in diff if other in k]
    if kind != "xid" or vendor == "amd":
        assert seen


def test_incident_specs_parse_and_bad_ones_say_why() -> None:
    assert parse_incident("thermal:gpu=1:at=120:for=60") == Incident("thermal", 1, 120, 60)
    assert parse_incident("memleak:for=8:at=0:gpu=0") == Incident("memleak", 0, 0, 8)
    for spec, why in (
        ("heat:gpu=1:at=1:for=9", "unknown kind"),
        ("thermal:gpu=1:at=1", "missing for"),
        ("thermal:gpu=1:at=x:for=9", "not an integer"),
        ("thermal:gpu=1:gpu=2:at=1:for=9", "given twice"),
        ("thermal:gpu=1:when=1:for=9", "is not gpu=N"),
        ("thermal:gpu=-1:at=1:for=9", ">= 0"),
        ("thermal:gpu=1:at=1:for=2", ">= 4 ticks"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_incident(spec)
    with pytest.raises(ValueError, match="GPUs 0-1"):
        Simulator(1, incidents=[Incident("xid", 2, 0, 9)])
    with pytest.raises(ValueError, match="overlap"):
        Simulator(1, incidents=[Incident("xid", 1, 0, 9), Incident("thermal", 1, 8, 9)])
    with pytest.raises(ValueError, match="GPUs 0-0"):
        Simulator(1, exporters=["jetson"], incidents=[Incident("thermal", 1, 0, 9)])


def test_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="simulate")
    add_arguments(parser)
    args = parser.parse_args(
        ["--incident", "thermal:gpu=1:at=120:for=60", "--incident", "xid:gpu=0:at=5:for=9"]
    )
    assert args.incident == [Incident("thermal", 1, 120, 60), Incident("xid", 0, 5, 9)]
    with pytest.raises(SystemExit):
        parser.parse_args(["--incident", "thermal:gpu=1"])
    assert "argument --incident: incident 'thermal:gpu=1': missing at, for" in capsys.readouterr().err
    args = parser.parse_args(["--incident", "thermal:gpu=3:at=1:for=10", "--dcgm-health-fields"])
    assert run(args) == 2
    assert "simulate: incident on gpu 3: the simulated node has GPUs 0-1" in capsys.readouterr().err


def test_simulate_serves_the_incident(tmp_path: Path) -> None:
    """``simulate --incident``: the ready line says what an oracle needs, and what is served is what
    ``Simulator(..., incidents=...)`` renders at the served tick."""
    code = (
        "import argparse, sys\n"
        "from simulator import server as simulate\n"
        "p = argparse.ArgumentParser()\n"
        "simulate.add_arguments(p)\n"
        "sys.exit(simulate.run(p.parse_args(sys.argv[1:])))\n"
    )
    ports = ["--kepler-port", "-1", "--kepler07-port", "-1", "--dcgm-port", "0", "--node-port", "-1"]
    options = ["--seed", "4", "--incident", "xid:gpu=1:at=0:for=400", "--dcgm-health-fields"]
    log = tmp_path / "served.jsonl"
    argv = [sys.executable, "-c", code, *ports, *options, "--served-log", str(log)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        assert ready["incidents"] == [{"kind": "xid", "gpu": 1, "start_tick": 0, "duration_ticks": 400}]
        assert ready["dcgm_health_fields"] is True
        with urllib.request.urlopen(ready["exporters"]["dcgm"], timeout=10) as resp:
            body = resp.read()
        tick = json.loads(log.read_text().splitlines()[0])["tick"]
        incident = Incident(**ready["incidents"][0])
        sim = Simulator(4, exporters=["dcgm"], incidents=[incident], dcgm_health_fields=True)
        assert body == sim.render("dcgm", tick)
        assert re.search(rb'XID_ERRORS\{gpu="1"[^}]*err_code="(94|63)"', body)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
