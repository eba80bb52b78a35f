"""The NVML source (``url: nvml://local``): dcgm-exporter's fields read from NVML, against a stand-in of the
NVML API that replays a real H200 trace (no GPU in CI).

- the families are dcgm-exporter's (names, types, HELP and labels of its default fields, as in the fixture);
- the values are the trace's, row for row, in dcgm-exporter's units;
- a relay cycle with an nvml target spools those samples, and an NVML error is a failed scrape (``up`` 0);
- the config accepts the target, and ``check-config`` refuses it without pynvml.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_relay import settings as relay_settings
from edge_relay.app import Relay
from edge_relay.collect import nvml
from edge_relay.collect.parse import parse
from edge_relay.collect.targets import TargetLoop
from edge_relay.commands import checkconfig
from edge_relay.selfmetrics import RelayMetrics
from relay_common.config import ConfigError
from schemas import codec
from schemas.model import Labels
from simulator import dcgm as simulated_dcgm
from simulator.base import DATA_DIR
from testkit.nvml_replay import GPU_IS_LOST, MODEL, ReplayNvml, load_trace

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = DATA_DIR / "dcgm-exporter-sample.prom"
ROWS = load_trace()
# What NVML has no reading for (DCGM's profiling module, NVLink counters, vGPU licensing).
NOT_FROM_NVML = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE",
    "DCGM_FI_PROF_DRAM_ACTIVE",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS",
}
POD_LABELS = {"container", "namespace", "pod"}  # dcgm-exporter's, only while a pod holds the GPU
HEALTH = {
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
}


def fixture_families() -> dict[str, tuple[str, str, set[str]]]:
    """name -> (type, HELP, label names) of the dcgm-exporter fixture."""
    text = FIXTURE.read_text(encoding="utf-8")
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    labels: dict[str, set[str]] = {}
    for name, block in re.findall(r"^(\w+)\{(.*)\} \S+$", text, re.M):
        labels[name] = set(re.findall(r'(\w+)="', block))
    return {name: (types[name], helps[name], labels[name]) for name in types}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[ReplayNvml]:
    replay = ReplayNvml(ROWS, gpus=2, offset=150)
    monkeypatch.setitem(sys.modules, "pynvml", replay.module)
    yield replay


def by_family(
    samples: list[tuple[Labels, float, None]],
) -> dict[tuple[str, str], tuple[dict[str, str], float]]:
    out = {}
    for labels, value, ts in samples:
        assert ts is None
        pairs = dict(labels)
        out[(pairs["__name__"], pairs["gpu"])] = (pairs, value)
    return out


def test_families_are_dcgm_exporters_default_fields() -> None:
    served = {f.name: f for f in nvml.FAMILIES}
    fixture = fixture_families()
    # Every default field NVML can read, nothing renamed.
    assert set(fixture) - set(served) == NOT_FROM_NVML
    for name, (type_, help_, _) in fixture.items():
        if name in served:
            assert (served[name].type, served[name].help) == (type_, help_), name
    # The health fields as the simulator's dcgm model serves them.
    for name, type_, help_ in simulated_dcgm.HEALTH_FIELDS:
        assert (served[name].type, served[name].help) == (type_, help_)
    assert set(served) >= HEALTH


def test_series_carry_dcgm_exporters_labels(fake: ReplayNvml) -> None:
    samples = nvml.NvmlReader("edge-gpu-07").read()
    fixture = fixture_families()
    served = {dict(labels)["__name__"] for labels, _, _ in samples}
    # Retired pages: Hopper remaps rows instead, NVML answers "not supported" and the rows are left out.
    assert served == {f.name for f in nvml.FAMILIES} - {"DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE"}
    idle_gpu_labels = fixture["DCGM_FI_DEV_SM_CLOCK"][2] - POD_LABELS
    for labels, _, _ in samples:
        pairs = dict(labels)
        name = pairs.pop("__name__")
        want = fixture[name][2] - POD_LABELS if name in fixture else idle_gpu_labels
        assert set(pairs) == want, name
        assert pairs["modelName"] == MODEL
        assert pairs["Hostname"] == "edge-gpu-07"
        assert pairs["DCGM_FI_DRIVER_VERSION"] == "580.159.04"
        assert pairs["device"] == f"nvidia{pairs['gpu']}"
        assert re.fullmatch(r"[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-9]", pairs["pci_bus_id"])
        assert pairs["UUID"].startswith("GPU-")
    assert labels == tuple(sorted(labels))  # as parse gives them


def test_values_follow_the_trace_row_for_row_in_dcgm_units(fake: ReplayNvml) -> None:
    reader = nvml.NvmlReader("n")
    columns = {  # dcgm-exporter field -> (trace column, factor to dcgm-exporter's unit)
        "DCGM_FI_DEV_SM_CLOCK": ("sm_clock", 1),
        "DCGM_FI_DEV_MEM_CLOCK": ("mem_clock", 1),
        "DCGM_FI_DEV_GPU_TEMP": ("gpu_temp", 1),
        "DCGM_FI_DEV_MEMORY_TEMP": ("mem_temp", 1),
        "DCGM_FI_DEV_POWER_USAGE": ("power_w", 1),
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_mj", 1),
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": ("pcie_replay", 1),
        "DCGM_FI_DEV_GPU_UTIL": ("gpu_util", 1),
        "DCGM_FI_DEV_MEM_COPY_UTIL": ("mem_copy_util", 1),
        "DCGM_FI_DEV_FB_USED": ("fb_used_mib", 1),
        "DCGM_FI_DEV_FB_FREE": ("fb_free_mib", 1),
        "DCGM_FI_PROF_PCIE_TX_BYTES": ("pcie_tx_kbs", 1024),
        "DCGM_FI_PROF_PCIE_RX_BYTES": ("pcie_rx_kbs", 1024),
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS": ("throttle_reasons", 1),
        "DCGM_FI_DEV_POWER_MGMT_LIMIT": ("power_limit_w", 1),
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": ("ecc_sbe_vol", 1),
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": ("ecc_dbe_vol", 1),
    }
    for _ in ROWS:
        got = by_family(reader.read())
        for gpu in (0, 1):
            row = fake.row(gpu)
            for name, (column, factor) in columns.items():
                assert got[(name, str(gpu))][1] == float(row[column]) * factor, (name, row["t"])
            assert got[("DCGM_FI_DEV_ENC_UTIL", str(gpu))][1] == 0
            assert got[("DCGM_FI_DEV_XID_ERRORS", str(gpu))][1] == 0
        fake.step()
    assert fake.inits == 1  # NVML initialised once, not every cycle


def test_the_page_reads_as_dcgm_exporters(fake: ReplayNvml) -> None:
    samples = nvml.NvmlReader("n").read()
    page = nvml.exposition(samples)
    assert parse(page) == samples
    assert "# TYPE DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION counter\n" in page
    first = next(line for line in page.splitlines() if line.startswith("DCGM_FI_DEV_POWER_USAGE{"))
    assert re.fullmatch(
        r'DCGM_FI_DEV_POWER_USAGE\{gpu="0",UUID="GPU-[^"]+",pci_bus_id="[^"]+",device="nvidia0",'
        r'modelName="NVIDIA H200",Hostname="n",DCGM_FI_DRIVER_VERSION="580.159.04"\} \d+\.\d{6}',
        first,
    )


def test_xid_events_are_read_without_waiting_and_held(fake: ReplayNvml) -> None:
    reader = nvml.NvmlReader("n")
    reader.read()  # registers the GPUs for XID events
    fake.xid(1, 79)
    for _ in range(2):  # held: the field is the last XID, as DCGM's
        got = by_family(reader.read())
        labels, value = got[("DCGM_FI_DEV_XID_ERRORS", "1")]
        assert value == 79
        assert (labels["err_code"], labels["err_msg"]) == ("79", "GPU has fallen off the bus")
        labels, value = got[("DCGM_FI_DEV_XID_ERRORS", "0")]
        assert (value, labels["err_code"], labels["err_msg"]) == (0, "0", "No Error")


def write_config(tmp_path: Path, url: str = "nvml://local", extra: str = "") -> Path:
    config = tmp_path / "relay.yaml"
    config.write_text(
        "node: edge-gpu-07\ncluster: c1\nscrape: {interval_seconds: 1, timeout_seconds: 0.8}\n"
        f"targets: [{{name: gpus, url: '{url}'{extra}}}]\nspool: {{path: {tmp_path / 'spool.db'}}}\n"
        "mqtt: {port: 9}\nmetrics: {listen: ''}\n"
    )
    return config


def test_a_relay_cycle_spools_the_gpus_samples(tmp_path: Path, fake: ReplayNvml) -> None:
    relay = Relay(relay_settings.load(str(write_config(tmp_path))), RelayMetrics())
    try:
        relay.cycle()
        spooled: dict[str, float] = {}
        for row in relay.spool.batches.pending(10_000):
            batch = codec.decode_batch(row.payload)
            for block in batch.scrapes:
                for idx, value in zip(block.series, block.values, strict=True):
                    labels = dict(batch.labelsets[idx])
                    assert (labels["job"], labels["instance"]) == ("gpus", "edge-gpu-07:nvml")
                    spooled[f"{labels['__name__']}/{labels.get('gpu', '')}"] = value
    finally:
        relay.collector.close()
        relay.spool.close()
    assert spooled["up/"] == 1
    assert spooled["DCGM_FI_DEV_POWER_USAGE/1"] == float(fake.row(1)["power_w"])
    assert spooled["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION/0"] == float(fake.row(0)["energy_mj"])
    assert spooled["scrape_samples_scraped/"] == len([k for k in spooled if k.startswith("DCGM_")])


def test_an_nvml_error_is_a_failed_scrape_and_the_next_read_starts_again(
    tmp_path: Path, fake: ReplayNvml
) -> None:
    s = relay_settings.load(str(write_config(tmp_path)))
    metrics = RelayMetrics()
    loop = TargetLoop(s.targets[0], s, metrics)

    def up() -> float:
        shaped = loop.run_once()
        return dict(zip([dict(lbl)["__name__"] for lbl in shaped.labels], shaped.values, strict=True))["up"]

    try:
        assert up() == 1
        fake.fail_with(GPU_IS_LOST)
        assert up() == 0
        assert metrics.scrapes.labels("gpus", "nvml_error")._value.get() == 1
        assert fake.shutdowns == 1  # NVML let go of, set up again on the next read
        fake.fail_with(None)
        assert up() == 1
        assert fake.inits == 2
    finally:
        loop.scraper.close()


def test_a_read_past_the_deadline_fails_and_never_piles_up(fake: ReplayNvml) -> None:
    source = nvml.NvmlSource("n", timeout_s=0.2)
    try:
        fake.delay_s = 0.05  # each call: a read of 2 GPUs takes about 2 s
        reading = source.read(time.monotonic() + 0.2)
        assert (reading.samples, reading.result) == (None, "timeout")
        assert reading.error == "timeout after 0.2s reading NVML"
        started = time.monotonic()
        reading = source.read(time.monotonic() + 0.2)  # the stuck read still runs: fails at once
        assert time.monotonic() - started < 0.1
        assert (reading.samples, reading.error) == (None, "the previous NVML read has not returned yet")
        fake.delay_s = 0.0
        for _ in range(100):  # once the stuck read has returned, reads work again
            reading = source.read(time.monotonic() + 5)
            if reading.result == "ok":
                break
            time.sleep(0.05)
        assert reading.samples and reading.result == "ok"
    finally:
        source.close()


def test_the_config_takes_an_nvml_target(tmp_path: Path, fake: ReplayNvml) -> None:
    s = relay_settings.load(str(write_config(tmp_path)))
    (target,) = s.targets
    assert (target.kind, target.instance, target.job) == ("nvml", "edge-gpu-07:nvml", "gpus")
    checkconfig.validate(s, host=False)
    for url in ("nvml://10.0.0.7", "nvml://local/gpu0"):  # NVML reads only this machine's GPUs
        with pytest.raises(ConfigError, match=rf"key `targets\[0\].url`: '{url}' does not match"):
            relay_settings.load(str(write_config(tmp_path, url)))


def test_check_config_refuses_an_nvml_target_without_pynvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    s = relay_settings.load(str(write_config(tmp_path)))
    with pytest.raises(ConfigError, match=r"target\(s\) gpus: an nvml:// target needs the `pynvml` module"):
        checkconfig.validate(s, host=False)
    # The command line too, in a process where pynvml cannot be imported either.
    no_pynvml = "import sys; sys.modules['pynvml'] = None; from edge_relay.cli import main; sys.exit(main())"
    config = str(write_config(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", no_pynvml, "check-config", "--config-only", "--config", config],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'kepler-edge-relay[nvml]'" in result.stderr


def test_nvml_check_script_says_what_is_missing() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "nvml_check.py")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/nonexistent"},
        check=False,
    )
    assert result.returncode == 2
    assert "pynvml" in result.stderr or "nvidia-smi" in result.stderr
