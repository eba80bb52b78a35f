"""The product's two programs as real processes, plus the oracle that says what must have arrived.

Used by the end-to-end and fault tests: the simulator runs in-process (its payloads are a pure
function of the tick, so the oracle can recompute what was served), ``edge-relay run`` and
``cloud-ingest run`` run as subprocesses exactly as an operator starts them.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families
from services import RawSamples, free_port

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
    ) -> None:
        from edge_relay.simulate import Simulator

        self.simulator = Simulator(seed, series, interval, churn_ticks=churn_ticks)
        self.served_log = workdir / "served.jsonl"
        self.argv = [sys.executable, "-m", "edge_relay.cli", "simulate", "--seed", str(seed)]
        self.argv += ["--interval", str(interval), "--churn-ticks", str(churn_ticks)]
        self.argv += ["--served-log", str(self.served_log)]
        self.argv += ["--kepler-port", "0", "--kepler07-port", "0", "--dcgm-port", "0", "--node-port", "0"]
        if series:
            self.argv += ["--series", str(series)]
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


# --- the oracle -------------------------------------------------------------------------------


def _parse_independently(body: bytes, openmetrics: bool) -> list[tuple[str, dict[str, str], float]]:
    """Samples of one payload, parsed by prometheus_client (not by the relay's own parser)."""
    text = body.decode()
    if openmetrics:
        assert text.endswith("# EOF\n")
    # Comment lines go: prometheus_client renames typed counters lacking `_total`, and its strict
    # OpenMetrics parser refuses client_golang's family-name clashes (go_memstats_alloc_bytes gauge vs.
    # go_memstats_alloc_bytes_total counter). Without timestamps or exemplars the sample lines of both
    # formats are plain text-format lines.
    text = "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"
    assert " # {" not in text, "exemplars are not expected from the simulator"
    families = text_string_to_metric_families(text)
    return [(s.name, dict(s.labels), float(s.value)) for fam in families for s in fam.samples]


@dataclass(frozen=True)
class Served:
    exporter: str
    tick: int
    t_ms: int
    openmetrics: bool


def read_served_log(path: Path) -> list[Served]:
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("status", 200) == 200:
            out.append(Served(rec["exporter"], rec["tick"], rec["t_ms"], bool(rec.get("openmetrics"))))
    return out


def expected_samples(
    sim: Any,
    served: list[Served],
    *,
    jobs: dict[str, str],
    instances: dict[str, str],
    extra: dict[str, str],
) -> dict[frozenset[tuple[str, str]], list[tuple[int, float]]]:
    """labelset -> [(served time ms, value)] for every sample the simulator served."""
    out: dict[frozenset[tuple[str, str]], list[tuple[int, float]]] = defaultdict(list)
    for rec in served:
        body = sim.render(rec.exporter, rec.tick, openmetrics=rec.openmetrics)
        for name, labels, value in _parse_independently(body, rec.openmetrics):
            full = {k: v for k, v in labels.items() if v != ""}
            for k in ("job", "instance"):
                if k in full:
                    full[f"exported_{k}"] = full[k]
            full.update({"__name__": name, "job": jobs[rec.exporter], "instance": instances[rec.exporter]})
            for k, v in extra.items():
                full.setdefault(k, v)
            out[frozenset(full.items())].append((rec.t_ms, value))
    return out


def same_value(a: float, b: float, rel_tol: float = 0.0) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b or (rel_tol > 0 and math.isclose(a, b, rel_tol=rel_tol))


def compare(
    expected: dict[frozenset[tuple[str, str]], list[tuple[int, float]]],
    actual: RawSamples,
    *,
    max_skew_ms: int = 1000,
    rel_tol: float = 0.0,
) -> list[str]:
    """Every expected sample must be in ``actual`` with its exact value, at the relay's scrape time
    (at most ``max_skew_ms`` before the simulator served it), and nothing else may be there."""
    problems: list[str] = []
    for key in sorted(set(expected) | set(actual), key=sorted):
        want, got = expected.get(key, []), actual.get(key, [])
        name = dict(key).get("__name__")
        if len(want) != len(got):
            problems.append(f"{name} {dict(key)}: expected {len(want)} samples, got {len(got)}")
            continue
        for (t_served, v_want), (t_got, v_got) in zip(want, got, strict=True):
            if not same_value(v_want, v_got, rel_tol):
                problems.append(f"{name} at {t_got}: expected value {v_want!r}, got {v_got!r}")
            if not (t_served - max_skew_ms <= t_got <= t_served):
                problems.append(
                    f"{name}: sample at {t_got} ms does not belong to the scrape served at {t_served} ms"
                )
        if len(problems) > 20:
            break
    return problems
