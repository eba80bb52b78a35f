"""The three edge systems the benches compare, each with its own link and receiver.

    Ours:   simulator -> edge-relay -> LinkProxy -> mosquitto -> cloud-ingest -> tap -> Prometheus
    Agent:  simulator -> prometheus --enable-feature=agent -> LinkProxy -> tap -> Prometheus
    Vm:     simulator -> vmagent -> LinkProxy -> tap -> Prometheus

A ``System`` owns its simulator copy (``SimulatorProcess``), its uplink (``proxy``, a
``testkit.netfaults.LinkProxy`` that counts bytes and can be cut), its ``testkit.rw_tap.RemoteWriteTap``
and its receiver, and knows its edge processes, their buffer on disk and their own counters.  Used by
``bench/outage_bench.py`` and ``bench/bandwidth_bench.py``, which measure and report.  Every child
process dies with the bench (``die_with_parent``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from testkit.agents import PrometheusAgent, VmAgent
from testkit.netfaults import LinkProxy
from testkit.readings import ProcStats, fmt_bytes, metric_sum, path_bytes, proc_stats, read_metrics
from testkit.rw_tap import RemoteWriteTap
from testkit.services import ManagedProcess, Mosquitto, Prometheus, die_with_parent
from testkit.stack import (
    Program,
    SimulatorProcess,
    ingest_config,
    ledger_totals,
    metrics_url,
    program,
    relay_config,
)

NODE = "edge-gpu-01"
CLUSTER = "test"  # relay_config's cluster
EXTERNAL = {"cluster": CLUSTER, "node": NODE}
SEED = 1
CHURN_TICKS = 30


@dataclass
class System:
    """One edge system: its own simulator copy, link proxy, tap and receiver."""

    key: str
    title: str
    workdir: Path
    interval: float
    series: int | None
    sim: SimulatorProcess = field(init=False)
    receiver: Prometheus = field(init=False)
    tap: RemoteWriteTap = field(init=False)
    proxy: LinkProxy = field(init=False)
    services: list[ManagedProcess] = field(default_factory=list, init=False)
    notes: list[str] = field(default_factory=list, init=False)

    # -- to be provided -----------------------------------------------------------------------------

    def start_edge(self) -> None:
        raise NotImplementedError

    def edge_processes(self) -> dict[str, int]:
        """name -> pid of the edge-side processes (the first one is the edge agent itself)."""
        raise NotImplementedError

    def buffer_bytes(self) -> int:
        raise NotImplementedError

    def read_counters(self) -> None:
        """Read the system's own counters while it still runs (called once, before stop_edge)."""

    def buffer_detail(self) -> str:
        """What makes up buffer_bytes(), for the notes."""
        return ""

    def stop_edge(self) -> None:
        raise NotImplementedError

    def lost_by_intent(self) -> int | None:
        """Samples the system dropped on purpose and counted (None: it keeps no such count)."""
        return 0

    # -- common -------------------------------------------------------------------------------------

    @property
    def timeout_ms(self) -> int:
        return round(self.interval * 800)

    # The scrape timestamp is the scrape's start, the simulator logs the request when it answers:
    # a served request belongs to the sample stamped at most one scrape timeout before it.
    @property
    def skew_before_ms(self) -> int:
        return self.timeout_ms + 200

    @property
    def skew_after_ms(self) -> int:
        return 0

    def start_common(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.receiver = self._service(Prometheus(self.workdir / "receiver", ooo_window="2h"))
        self.tap = RemoteWriteTap(self.receiver.remote_write_url, name=f"{self.key}-tap")
        self.sim = SimulatorProcess(
            self.workdir, seed=SEED, interval=self.interval, churn_ticks=CHURN_TICKS, series=self.series
        )
        self.sim.argv = die_with_parent(self.sim.argv)
        self.sim.start()

    def _service(self, service: ManagedProcess) -> Any:
        self.services.append(service)
        return service.start()

    def instances(self) -> dict[str, str]:
        return {name: f"{NODE}:{url.split(':')[2].split('/')[0]}" for name, url in self.sim.urls.items()}

    def stats(self) -> dict[str, ProcStats]:
        out = {}
        for name, pid in self.edge_processes().items():
            with contextlib.suppress(OSError):
                out[name] = proc_stats(pid)
        return out

    def kill_edge(self) -> None:
        """Teardown after a failure or Ctrl-C: no draining, no waiting (services stop below)."""

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kill_edge()
        with contextlib.suppress(Exception):
            self.sim.stop()
        for svc in reversed(self.services):
            with contextlib.suppress(Exception):
                svc.stop()
        for closer in ("proxy", "tap"):
            obj = getattr(self, closer, None)
            if obj is not None:
                with contextlib.suppress(Exception):
                    obj.close()


@dataclass
class Ours(System):
    """simulator -> edge-relay -> LinkProxy -> mosquitto -> cloud-ingest -> tap -> receiver."""

    relay_overrides: dict[str, Any] = field(default_factory=dict)
    ingest_overrides: dict[str, Any] = field(default_factory=dict)
    drain_seconds: float = 60
    broker_autosave: bool = False
    relay: Program = field(init=False)
    ingest: Program = field(init=False)
    mosquitto: Mosquitto = field(init=False)
    relay_cfg: Path = field(init=False)
    _ledger: dict[str, int] | None = field(default=None, init=False)

    def start_edge(self) -> None:
        extra = "autosave_interval 1" if self.broker_autosave else ""
        self.mosquitto = self._service(
            Mosquitto(self.workdir / "mosquitto", persistence=True, extra_conf=extra)
        )
        self.proxy = LinkProxy(self.mosquitto.port, name=f"{self.key}-uplink")
        self.relay_cfg = relay_config(
            self.workdir,
            urls=self.sim.urls,
            mqtt_port=self.proxy.port,
            interval=self.interval,
            node=NODE,
            **self.relay_overrides,
        )
        ingest_cfg = ingest_config(
            self.workdir,
            mqtt_port=self.mosquitto.port,
            remote_write_url=self.tap.url,
            **self.ingest_overrides,
        )
        self.ingest = _program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, self.workdir).start()
        self.relay = _program(
            "edge-relay",
            "edge_relay.cli",
            self.relay_cfg,
            self.workdir,
            "--drain-seconds",
            str(self.drain_seconds),
        ).start()

    @property
    def spool_path(self) -> Path:
        return Path(yaml.safe_load(self.relay_cfg.read_text())["spool"]["path"])

    @property
    def relay_metrics_url(self) -> str:
        return metrics_url(self.relay_cfg)

    @property
    def ingest_metrics_url(self) -> str:
        return metrics_url(self.workdir / "ingest.yaml")

    def edge_processes(self) -> dict[str, int]:
        out = {}
        for name, prog in (("edge-relay", self.relay), ("cloud-ingest", self.ingest)):
            if prog.alive() and prog.proc is not None:
                out[name] = prog.proc.pid
        if self.mosquitto.pid is not None:
            out["mosquitto"] = self.mosquitto.pid
        return out

    def buffer_bytes(self) -> int:
        p = self.spool_path
        return path_bytes(p, Path(f"{p}-wal"), Path(f"{p}-shm"))

    def buffer_detail(self) -> str:
        p = self.spool_path
        files = f"spool.db {fmt_bytes(path_bytes(p))}, -wal {fmt_bytes(path_bytes(Path(f'{p}-wal')))}"
        try:
            m = read_metrics(self.relay_metrics_url)
        except Exception as exc:
            return f"{files} (relay metrics unavailable: {type(exc).__name__})"
        rows = metric_sum(m, "edge_relay_spool_rows")
        spooled = metric_sum(m, "edge_relay_spool_bytes")
        return f"{files}; edge_relay_spool_bytes {fmt_bytes(int(spooled))} in {rows:.0f} batches"

    def read_counters(self) -> None:
        try:
            m = read_metrics(self.relay_metrics_url)
        except Exception as exc:
            self.notes.append(f"relay metrics unavailable: {type(exc).__name__}")
            return
        first = metric_sum(m, "edge_relay_batches_published_total", kind="first")
        retry = metric_sum(m, "edge_relay_batches_published_total", kind="retry")
        self.notes.append(f"batches published {first:.0f} + {retry:.0f} again (this relay process)")

    def stop_edge(self) -> None:
        if self.relay.alive():
            code = self.relay.stop(timeout=self.drain_seconds + 30)
            if code != 0:
                self.notes.append(f"edge-relay exited with {code}")
        if self.ingest.alive():
            self.ingest.stop()

    def kill_edge(self) -> None:
        for prog in ("relay", "ingest"):
            if hasattr(self, prog):
                getattr(self, prog).kill()

    def lost_by_intent(self) -> int | None:
        if self._ledger is None:
            self._ledger = ledger_totals(self.relay_cfg)
        return sum(self._ledger.values())

    def ledger_note(self) -> str:
        totals = self._ledger or {}
        return ", ".join(f"{k}={v}" for k, v in sorted(totals.items())) or "empty"


def _program(name: str, module: str, config: Path, workdir: Path, *extra: str) -> Program:
    prog = program(name, module, config, workdir, *extra)
    prog.argv = die_with_parent(prog.argv)
    return prog


@dataclass
class Agent(System):
    """simulator -> prometheus --enable-feature=agent -> LinkProxy -> tap -> receiver."""

    max_backoff: float = 5.0
    agent: PrometheusAgent = field(init=False)
    counters: dict[str, float] = field(default_factory=dict, init=False)

    def start_edge(self) -> None:
        self.proxy = LinkProxy(self.tap.port, name=f"{self.key}-uplink")
        url = f"http://127.0.0.1:{self.proxy.port}/api/v1/write"
        self.agent = self._service(
            PrometheusAgent(
                self.workdir / "agent",
                urls=self.sim.urls,
                interval=self.interval,
                remote_write_url=url,
                external_labels=EXTERNAL,
                node=NODE,
                max_backoff=self.max_backoff,
            )
        )

    def edge_processes(self) -> dict[str, int]:
        return {"prometheus-agent": self.agent.pid} if self.agent.pid is not None else {}

    def buffer_detail(self) -> str:
        try:
            m = read_metrics(self.agent.metrics_url)
        except Exception as exc:
            return f"agent metrics unavailable: {type(exc).__name__}"
        pending = metric_sum(m, "prometheus_remote_storage_samples_pending")
        return f"WAL {fmt_bytes(self.buffer_bytes())}; remote_storage_samples_pending {pending:,.0f}"

    def buffer_bytes(self) -> int:
        return path_bytes(self.agent.wal_dir)

    def read_counters(self) -> None:
        m = read_metrics(self.agent.metrics_url)
        for name in (
            "prometheus_remote_storage_samples_total",
            "prometheus_remote_storage_samples_dropped_total",
            "prometheus_remote_storage_samples_failed_total",
            "prometheus_remote_storage_samples_retried_total",
            "prometheus_target_scrapes_exceeded_sample_limit_total",
        ):
            self.counters[name] = metric_sum(m, name)

    def stop_edge(self) -> None:
        self.agent.stop()

    def lost_by_intent(self) -> int | None:
        return int(self.counters.get("prometheus_remote_storage_samples_dropped_total", 0))


@dataclass
class Vm(System):
    """simulator -> vmagent -> LinkProxy -> tap -> receiver."""

    vmagent: VmAgent = field(init=False)
    counters: dict[str, float] = field(default_factory=dict, init=False)

    def start_edge(self) -> None:
        self.proxy = LinkProxy(self.tap.port, name=f"{self.key}-uplink")
        url = f"http://127.0.0.1:{self.proxy.port}/api/v1/write"
        self.vmagent = self._service(
            VmAgent(
                self.workdir / "vmagent",
                urls=self.sim.urls,
                interval=self.interval,
                remote_write_url=url,
                external_labels=EXTERNAL,
                node=NODE,
            )
        )

    def edge_processes(self) -> dict[str, int]:
        return {"vmagent": self.vmagent.pid} if self.vmagent.pid is not None else {}

    def buffer_detail(self) -> str:
        try:
            m = read_metrics(self.vmagent.metrics_url)
        except Exception as exc:
            return f"vmagent metrics unavailable: {type(exc).__name__}"
        pending = metric_sum(m, "vmagent_remotewrite_pending_data_bytes")
        return (
            f"on disk {fmt_bytes(self.buffer_bytes())}; vmagent_remotewrite_pending_data_bytes "
            f"(memory + disk) {fmt_bytes(int(pending))}"
        )

    def buffer_bytes(self) -> int:
        return path_bytes(self.vmagent.queue_dir)

    def read_counters(self) -> None:
        m = read_metrics(self.vmagent.metrics_url)
        for name in (
            "vmagent_remotewrite_packets_dropped_total",
            "vm_persistentqueue_bytes_dropped_total",
            "vmagent_remotewrite_retries_count_total",
            "vm_promscrape_scrapes_failed_total",
            "vm_promscrape_scrapes_timed_out_total",
        ):
            self.counters[name] = metric_sum(m, name)

    def stop_edge(self) -> None:
        self.vmagent.stop()

    def lost_by_intent(self) -> int | None:
        # vmagent counts drops in blocks and bytes, not samples: a number only when nothing was dropped.
        dropped = self.counters.get("vmagent_remotewrite_packets_dropped_total", 0)
        dropped += self.counters.get("vm_persistentqueue_bytes_dropped_total", 0)
        return 0 if dropped == 0 else None
