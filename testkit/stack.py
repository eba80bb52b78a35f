"""The product's programs as real processes, and their configuration files.

``edge-relay run`` and ``cloud-ingest run`` run as subprocesses exactly as an operator starts them
(``Program``, ``program``), with configs for loopback services (``relay_config``, ``ingest_config``,
``write_budget``); ``SimulatorProcess`` is ``edge-relay simulate`` on free ports with an in-process twin
whose payloads are a pure function of the tick, so ``testkit.oracle`` can recompute what was served.
Also the relay's own answers about a config (``check_relay_config``, ``relay_schema_defaults``) and its
loss ledger (``ledger_totals``).
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import paho.mqtt.client as mqtt
import requests
import yaml

from schemas import codec, topics
from testkit.services import free_port, wait_until

if TYPE_CHECKING:
    from simulator.incidents import Incident

EXPORTERS = ("kepler", "kepler-0.7", "dcgm", "node")


@dataclass
class Program:
    """A product process (edge-relay / cloud-ingest) with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Program:
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()
        return self

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not stop within {timeout}s:\n{self.log_tail()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def program(name: str, module: str, config: Path, workdir: Path, *extra: str) -> Program:
    return Program(
        name, [sys.executable, "-m", module, "run", "--config", str(config), *extra], workdir / f"{name}.log"
    )


def run_relay_and_ingester(
    workdir: Path, relay_cfg: Path, ingest_cfg: Path, seconds: float, *, drain_seconds: float = 20
) -> Program:
    """cloud-ingest and edge-relay for ``seconds``, then a clean stop of both (the relay drains its
    spool, up to ``drain_seconds``, before the ingester stops). Returns the stopped relay, for its log;
    raises AssertionError with the relay's log when it died or did not stop cleanly."""
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, workdir).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, workdir, "--drain-seconds", str(drain_seconds))
    try:
        wait_connected(ingest, metrics_url(ingest_cfg), "cloud_ingest_mqtt_connected")
        relay.start()
        time.sleep(seconds)
        assert relay.alive(), relay.log_tail()
        assert relay.stop() == 0, relay.log_tail()
    finally:
        relay.kill()
        ingest.stop()
    return relay


def metrics_url(config: Path) -> str:
    """The self-metrics page of the relay or ingester that ``config`` configures."""
    return f"http://{yaml.safe_load(config.read_text())['metrics']['listen']}/metrics"


def wait_connected(prog: Program, url: str, gauge: str, timeout: float = 30) -> None:
    """Until ``gauge`` on the metrics page ``url`` is 1. For the ingester's
    ``cloud_ingest_mqtt_connected`` this means subscribed: it sends its SUBSCRIBE before it sets the
    gauge, so a relay started afterwards never publishes into a broker without a subscriber (its first
    batches would come back only after the ack timeout, behind later ones: out of order)."""

    def connected() -> bool:
        assert prog.alive(), f"{prog.name} exited:\n{prog.log_tail()}"
        try:
            page = requests.get(url, timeout=2).text
        except requests.RequestException:
            return False
        return any(line.split() == [gauge, "1.0"] for line in page.splitlines())

    wait_until(connected, timeout, 0.1, f"{prog.name} connected ({gauge})")


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> None:
    """``mqtt__keepalive_seconds=3`` sets cfg["mqtt"]["keepalive_seconds"]; ``targets=[...]`` a top key."""
    for key, value in overrides.items():
        section, _, sub = key.partition("__")
        if sub:
            cfg.setdefault(section, {})[sub] = value
        else:
            cfg[section] = value


def relay_config(
    workdir: Path,
    *,
    urls: dict[str, str],
    mqtt_port: int,
    interval: float = 1.0,
    node: str = "edge-gpu-01",
    openmetrics: tuple[str, ...] = ("kepler",),
    **overrides: Any,
) -> Path:
    cfg: dict[str, Any] = {
        "node": node,
        "cluster": "test",
        "scrape": {"interval_seconds": interval, "timeout_seconds": max(0.5, interval * 0.8)},
        "targets": [
            {"name": name, "url": url, "format": "openmetrics" if name in openmetrics else "text"}
            for name, url in urls.items()
        ],
        "spool": {"path": str(workdir / "spool.db")},
        "mqtt": {
            "host": "127.0.0.1",
            "port": mqtt_port,
            "keepalive_seconds": 5,
            "ack_timeout_seconds": 10,
            "reconnect_min_seconds": 0.2,
            "reconnect_max_seconds": 2,
            "status_interval_seconds": 5,
        },
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
    }
    apply_overrides(cfg, overrides)
    return write_yaml(workdir / "relay.yaml", cfg)


def ingest_config(workdir: Path, *, mqtt_port: int, remote_write_url: str, **overrides: Any) -> Path:
    cfg: dict[str, Any] = {
        "mqtt": {
            "host": "127.0.0.1",
            "port": mqtt_port,
            "client_id": "ingest-test-1",
            "keepalive_seconds": 5,
        },
        "remote_write": {"url": remote_write_url, "retry_min_seconds": 0.1, "retry_max_seconds": 1},
        "dead_letter": {"path": str(workdir / "dead-letter.db")},
        "metrics": {"listen": f"127.0.0.1:{free_port()}"},
    }
    apply_overrides(cfg, overrides)
    return write_yaml(workdir / "ingest.yaml", cfg)


class SimulatorProcess:
    """``edge-relay simulate`` as a subprocess on free ports, plus an in-process twin for the oracle."""

    def __init__(
        self,
        workdir: Path,
        *,
        seed: int = 1,
        interval: float = 1.0,
        churn_ticks: int = 30,
        series: int | None = None,
        vendor: str = "nvidia",
        incidents: Sequence[Incident] = (),
        dcgm_health_fields: bool = False,
        prerender: bool = False,
    ) -> None:
        from simulator import Simulator
        from simulator.server import PORT_OPTIONS, vendor_exporters

        exporters = vendor_exporters(vendor)
        self.simulator = Simulator(
            seed,
            series,
            interval,
            churn_ticks=churn_ticks,
            exporters=exporters,
            kepler_gpu=vendor == "nvidia",
            incidents=incidents,
            dcgm_health_fields=dcgm_health_fields,
        )
        self.served_log = workdir / "served.jsonl"
        self.argv = [sys.executable, "-m", "edge_relay.cli", "simulate", "--seed", str(seed)]
        self.argv += ["--vendor", vendor, "--interval", str(interval), "--churn-ticks", str(churn_ticks)]
        self.argv += ["--served-log", str(self.served_log)]
        for option, exporter in PORT_OPTIONS:  # every one of the vendor's exporters on a free port
            if exporter in exporters:
                self.argv += [f"--{option}-port", "0"]
        if series:
            self.argv += ["--series", str(series)]
        for inc in incidents:  # the same incidents in the process and in the oracle's twin
            self.argv += [
                "--incident",
                f"{inc.kind}:gpu={inc.gpu}:at={inc.start_tick}:for={inc.duration_ticks}",
            ]
        if dcgm_health_fields:
            self.argv.append("--dcgm-health-fields")
        if prerender:
            self.argv.append("--prerender")
        self.log_path = workdir / "simulator.log"
        self.proc: subprocess.Popen[str] | None = None
        self.urls: dict[str, str] = {}

    def start(self) -> SimulatorProcess:
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.argv, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
            )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"simulator did not start: {self.log_path.read_text()}")
        self.urls = json.loads(line)["exporters"]
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


# --- what the relay says about a config, and its ledger ------------------------------------------


def relay_schema_defaults(section: str) -> dict[str, Any]:
    """The product defaults of one section of the relay's config (``schemas/edge-relay-config``)."""
    from relay_common.config import load_schema

    props = load_schema("edge-relay-config.schema.json")["properties"][section]["properties"]
    return {key: prop["default"] for key, prop in props.items() if "default" in prop}


def check_relay_config(path: Path) -> str | None:
    """``edge-relay check-config``: None if the relay accepts the file, else its error message (one
    problem a line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "edge_relay.cli", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return "\n".join(lines) or f"exit status {proc.returncode}"


def write_budget(
    path: Path,
    *,
    bytes_per_second: int,
    burst_bytes: int | None,
    batch_window_seconds: float,
    classes: list[dict[str, Any]],
) -> Path:
    """A relay bandwidth-budget file (``budget_file``, ``schemas/bandwidth-budget.schema.json``
    version 1): the uplink's figures (``burst_bytes`` None: the file's default) and the classes."""
    uplink: dict[str, Any] = {"sustained_bytes_per_second": bytes_per_second}
    if burst_bytes is not None:
        uplink["burst_bytes"] = burst_bytes
    uplink["batch_window_seconds"] = batch_window_seconds
    return write_yaml(path, {"version": 1, "uplink": uplink, "classes": classes})


def ledger_totals(relay_cfg: Path) -> dict[str, int]:
    """``edge-relay ledger --config``: the persistent loss ledger's totals, by reason."""
    out = subprocess.run(
        [sys.executable, "-m", "edge_relay.cli", "ledger", "--config", str(relay_cfg), "--limit", "1"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    totals: dict[str, int] = {}
    for line in out.splitlines():
        if line.startswith("totals: "):
            for item in line.removeprefix("totals: ").split(", "):
                reason, _, n = item.partition("=")
                totals[reason] = int(n)
    return totals


def spool_rows(path: Path) -> int:
    """Rows in a relay's spool file (``batches``), read beside the running relay."""
    with closing(sqlite3.connect(path)) as db:
        return int(db.execute("SELECT count(*) FROM batches").fetchone()[0])


def publish_probe_status(
    host: str, port: int, *, prefix: str, cluster: str, node: str, client_id: str = "probe"
) -> None:
    """A retained status message of a node nobody runs: an ingester whose fleet view reports it online
    has subscribed (a readiness probe for tests and benches)."""
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5
    )
    client.connect(host, port, keepalive=10)
    client.loop_start()
    try:
        status = {"node": node, "cluster": cluster, "state": "online", "ts_ms": int(time.time() * 1000)}
        info = client.publish(
            topics.status_topic(prefix, cluster, node), codec.encode_status(status), qos=1, retain=True
        )
        info.wait_for_publish(10)
        if not info.is_published():
            raise RuntimeError(f"the probe status of {node!r} was not published")
    finally:
        client.disconnect()
        client.loop_stop()


# The environment neither a test nor the product's processes may take from the shell running the
# tests: proxies (loopback traffic goes straight) and every environment override of the programs'
# configuration (edge_relay.settings, cloud_ingest.settings).
_PROXY_VARS = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
_OVERRIDE_VARS = (
    "CLOUD_INGEST_CLIENT_ID",
    "CLOUD_INGEST_REMOTE_WRITE_URL",
    "CLOUD_INGEST_MQTT_PASSWORD",
    "EDGE_RELAY_NODE",
    "NODE_NAME",
    "EDGE_RELAY_SCRAPE_INTERVAL",
    "EDGE_RELAY_MQTT_USERNAME",
    "EDGE_RELAY_MQTT_PASSWORD",
)


def clean_environment(monkeypatch: Any) -> None:
    """``monkeypatch`` (pytest's) the environment: no proxies, no configuration overrides
    (``tests/conftest.py`` does it for every test)."""
    for var in (*_PROXY_VARS, *_OVERRIDE_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")


def incident_budget(
    *,
    rate: int,
    burst_seconds: int,
    gpu_resolution_seconds: int,
    anomaly: dict[str, Any] | None,
    window_seconds: float = 5,
) -> dict[str, Any]:
    """The budget of the anomaly proofs (tests and ``bench/incident_plot.py``): scrape health at full
    resolution (``up`` carries the relay's scrape times), dcgm and everything else coarse (``last``),
    and the ``anomaly`` section when given."""
    coarse = {"resolution_seconds": gpu_resolution_seconds, "aggregation": "last"}
    doc: dict[str, Any] = {
        "version": 1,
        "uplink": {
            "sustained_bytes_per_second": rate,
            "burst_bytes": rate * burst_seconds,
            "batch_window_seconds": window_seconds,
        },
        "classes": [
            {"name": "health", "preset": "scrape-health"},
            {"name": "gpu", "preset": "dcgm", **coarse},
            {"name": "rest", **coarse},
        ],
    }
    if anomaly is not None:
        doc["anomaly"] = anomaly
    return doc
