"""Scale-out of the ingester (issue 5) on real mosquitto and a real Prometheus.

Three ``cloud-ingest run`` replicas (stable client ids ``ingest-0..2``, one MQTT v5 share group
``ingest``) take the batches of four real ``edge-relay run`` processes (nodes ``edge-a`` .. ``edge-d``)
that scrape one simulator every second, one exporter each, so the simulator's served log says which
node fetched which payload and the oracle of ``testkit/oracle.py`` applies per node.

Each replica writes through its own ``RemoteWriteProxy`` (forwarding to the one Prometheus), which
records every body it forwards: that is how the test knows which replica wrote what. Mid-run the
victim's proxy answers 503, so the victim is stuck in the middle of its batches (decoded, not written,
not acknowledged), and the victim is SIGKILLed. After a few seconds it is started again with the same
client id, which is what makes mosquitto 2.0.11 hand it the messages left in its session (see
``cloud_ingest/intake/mqtt/acker.py``).

The relays' ack timeout is longer than the whole run, so no relay publishes a batch twice (checked:
``edge_relay_batches_published_total{kind="retry"}`` stays 0): what the killed replica had in hand can
only come back through the broker's redelivery. At the end every sample the simulator served is in
Prometheus exactly once per series and timestamp, every relay's spool is empty, every replica wrote
batches, and the batches of every node were written by more than one replica (no affinity, no state).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from testkit.netfaults import RemoteWriteProxy
from testkit.oracle import compare, expected_samples, read_served_log
from testkit.services import Mosquitto, Prometheus, RawSamples, wait_until
from testkit.stack import (
    Program,
    SimulatorProcess,
    ingest_config,
    metrics_url,
    program,
    relay_config,
    spool_rows,
)
from testkit.stack import publish_probe_status as probe_status

CLUSTER = "test"  # relay_config's cluster
PREFIX = "edgemetrics"
PROBE_NODE = "probe"
SHARE_GROUP = "ingest"
# Disjoint exporter sets: the served log's exporter names the node that scraped the payload.  Four
# nodes for three replicas: mosquitto hands shared-subscription messages round-robin, so with as many
# nodes as replicas, publishing in a steady order, each node's batches could all land on one replica.
NODES: dict[str, tuple[str, ...]] = {
    "edge-a": ("kepler",),
    "edge-b": ("kepler-0.7",),
    "edge-c": ("dcgm",),
    "edge-d": ("node",),
}
REPLICAS = ("ingest-0", "ingest-1", "ingest-2")
VICTIM = "ingest-1"
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
RUN_SECONDS = 36.0  # relays start -> relays stopped
KILL_AFTER_SECONDS = 12.0
DEAD_SECONDS = 4.0
# Longer than the run: a batch the relays published once must reach Prometheus without the edge's help.
ACK_TIMEOUT_SECONDS = 120.0
DRAIN_SECONDS = 20
MIN_SAMPLES_PER_NODE = 1_000
MIN_SAMPLES = 40_000

Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape_metrics(url: str) -> Metrics:
    try:
        text = requests.get(url, timeout=3).text
    except requests.RequestException:
        return {}
    return {
        (s.name, frozenset(s.labels.items())): float(s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric_sum(metrics: Metrics, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lset), v in metrics.items() if n == name and want <= lset)


@dataclass
class Replica:
    name: str
    program: Program
    proxy: RemoteWriteProxy
    url: str

    def metrics(self) -> Metrics:
        return scrape_metrics(self.url)

    def wait_ready(self) -> None:
        """Subscribed: the retained probe status arrived, and batches share its SUBSCRIBE packet."""

        def ready() -> bool:
            assert self.program.alive(), f"{self.name} exited:\n{self.program.log_tail()}"
            online = metric_sum(self.metrics(), "cloud_ingest_node_online", node=PROBE_NODE)
            return online == 1

        wait_until(ready, 30, 0.1, f"{self.name} subscribed")


@dataclass
class Relay:
    node: str
    program: Program
    url: str
    spool: Path

    def metrics(self) -> Metrics:
        assert self.program.alive(), f"relay {self.node} died:\n{self.program.log_tail()}"
        return scrape_metrics(self.url)


def publish_probe_status(broker: Mosquitto) -> None:
    probe_status(
        broker.host, broker.port, prefix=PREFIX, cluster=CLUSTER, node=PROBE_NODE, client_id="scaleout-probe"
    )


class Cleanup:
    def __init__(self) -> None:
        self.programs: list[Program] = []
        self.proxies: list[RemoteWriteProxy] = []
        self.sim: SimulatorProcess | None = None


@pytest.fixture
def cleanup(mosquitto: Mosquitto, prometheus: Prometheus) -> Iterator[Cleanup]:
    # Depends on the service fixtures, so it is torn down before them.
    c = Cleanup()
    yield c
    for p in c.programs:
        p.kill()
    for proxy in c.proxies:
        proxy.close()
    if c.sim is not None:
        c.sim.stop()


@pytest.mark.timeout(150)
def test_three_replicas_share_the_load_and_a_killed_one_loses_nothing(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, cleanup: Cleanup
) -> None:
    sim_dir = tmp_path / "sim"
    sim_dir.mkdir()
    sim = cleanup.sim = SimulatorProcess(sim_dir, seed=5, interval=1.0, churn_ticks=10).start()
    publish_probe_status(mosquitto)

    replicas: dict[str, Replica] = {}
    for name in REPLICAS:
        workdir = tmp_path / name
        workdir.mkdir()
        proxy = RemoteWriteProxy(prometheus.remote_write_url)
        cleanup.proxies.append(proxy)
        cfg = ingest_config(
            workdir,
            mqtt_port=mosquitto.port,
            remote_write_url=proxy.url,
            mqtt__client_id=name,
            mqtt__share_group=SHARE_GROUP,
            mqtt__session_expiry_seconds=3600,
        )
        prog = program(name, "cloud_ingest.cli", cfg, workdir)
        cleanup.programs.append(prog)
        replicas[name] = Replica(name, prog.start(), proxy, metrics_url(cfg))
    for replica in replicas.values():
        replica.wait_ready()

    relays: dict[str, Relay] = {}
    for node, exporters in NODES.items():
        workdir = tmp_path / f"relay-{node}"
        workdir.mkdir()
        cfg = relay_config(
            workdir,
            urls={e: sim.urls[e] for e in exporters},
            mqtt_port=mosquitto.port,
            interval=1.0,
            node=node,
            mqtt__ack_timeout_seconds=ACK_TIMEOUT_SECONDS,
            # The redelivery contract of self-contained (v2) batches, exactly: the victim's batches are
            # written again as they were. Stream-coded frames across a replica kill (need_state, then
            # re-sent self-contained) are tests/system/test_stream_e2e.py's.
            stream__enabled=False,
        )
        prog = program(
            f"edge-relay-{node}", "edge_relay.cli", cfg, workdir, "--drain-seconds", str(DRAIN_SECONDS)
        )
        cleanup.programs.append(prog)
        relays[node] = Relay(node, prog.start(), metrics_url(cfg), workdir / "spool.db")
    started = time.monotonic()

    # -- the victim: stuck mid-batch (receiver answers 503 through its proxy), then SIGKILLed ----------
    victim = replicas[VICTIM]
    time.sleep(max(0.0, started + KILL_AFTER_SECONDS - time.monotonic()))
    written_before_kill = victim.proxy.forwarded_ok()
    assert written_before_kill > 0, f"{VICTIM} wrote nothing before the kill: the load is not shared"
    victim.proxy.refuse(503)
    wait_until(lambda: victim.proxy.count(503, "refuse") >= 3, 20, 0.05, f"{VICTIM} retrying a batch")
    # One batch being retried and at least one more received behind it: several batches in hand.
    in_hand = wait_until(
        lambda: (d := metric_sum(victim.metrics(), "cloud_ingest_queue_depth")) >= 2 and d,
        20,
        0.1,
        f"{VICTIM} holding several batches",
    )
    victim.program.kill()  # SIGKILL: its batches were decoded, not written, not acknowledged
    assert victim.program.proc is not None and victim.program.proc.returncode == -9
    stuck = {e.body_sha256 for e in victim.proxy.history() if e.mode == "refuse"}
    time.sleep(DEAD_SECONDS)  # meanwhile the broker parks a share of the new batches in its session
    victim.proxy.forward()
    restarted_at = time.monotonic()
    victim.program.start()  # same config, same client id: resumes the persistent session
    victim.wait_ready()

    def redelivered() -> bool:
        later = {e.body_sha256 for e in victim.proxy.history() if e.at > restarted_at and e.status == 204}
        return stuck <= later

    try:
        wait_until(redelivered, 30, 0.1, "the batches the victim held were redelivered to it and written")
    except TimeoutError as e:
        # What a failure needs to be understood (this wait has timed out once under load in CI): which
        # held batches never came back, and what the victim and its broker session did meanwhile.
        later = {x.body_sha256 for x in victim.proxy.history() if x.at > restarted_at}
        missing = len(stuck - later)
        counts = {
            name: metric_sum(victim.metrics(), name)
            for name in (
                "cloud_ingest_queue_depth",
                "cloud_ingest_messages_total",
                "cloud_ingest_mqtt_connected",
            )
        }
        raise AssertionError(
            f"{e}: {missing} of {len(stuck)} held batches not written again ({in_hand} queued at the "
            f"kill); victim metrics {counts}\n{victim.program.log_tail()}"
        ) from None
    redelivery_s = time.monotonic() - restarted_at

    time.sleep(max(0.0, started + RUN_SECONDS - time.monotonic()))

    # -- the end: nothing published twice by the edge, spools empty, load shared -----------------------
    for relay in relays.values():
        m = relay.metrics()
        assert metric_sum(m, "edge_relay_batches_published_total", kind="retry") == 0, (
            f"relay {relay.node} had to re-publish: the broker's redelivery did not bring everything back"
        )
        assert metric_sum(m, "edge_relay_batches_acked_total", result="rejected") == 0
    for relay in relays.values():
        code = relay.program.stop()
        assert code == 0, f"relay {relay.node} exited with {code}:\n{relay.program.log_tail()}"
        assert spool_rows(relay.spool) == 0, f"relay {relay.node} stopped with unacknowledged batches"
    written: dict[str, Metrics] = {name: r.metrics() for name, r in replicas.items()}
    for replica in replicas.values():
        assert replica.program.alive(), f"{replica.name} died:\n{replica.program.log_tail()}"
        code = replica.program.stop()
        assert code == 0, f"{replica.name} exited with {code}:\n{replica.program.log_tail()}"
    sim.stop()

    batches = {
        (name, node): metric_sum(m, "cloud_ingest_batches_written_total", node=node)
        for name, m in written.items()
        for node in NODES
    }
    per_replica = {name: sum(batches[name, node] for node in NODES) for name in REPLICAS}
    # The victim's figure is its restarted process's: the redelivered batches and its later share.
    assert all(n > 0 for n in per_replica.values()), f"a replica wrote no batch: {per_replica}"
    total = sum(per_replica.values())
    assert min(per_replica[n] for n in REPLICAS if n != VICTIM) >= total / 6, f"uneven: {per_replica}"
    for node in NODES:
        writers = [name for name in REPLICAS if batches[name, node] > 0]
        assert len(writers) >= 2, f"all batches of {node} went to {writers}: replicas are not interchangeable"
    for name, m in written.items():
        for outcome in ("refused", "rejected", "retry_later"):
            assert metric_sum(m, "cloud_ingest_messages_total", outcome=outcome) == 0, (name, outcome)

    # -- the oracle, per node ------------------------------------------------------------------------
    served = read_served_log(sim.served_log)
    compared = 0
    for node, exporters in NODES.items():
        mine = [s for s in served if s.exporter in exporters]
        assert {s.exporter for s in mine} == set(exporters)
        instances = {e: f"{node}:{sim.urls[e].split(':')[2].split('/')[0]}" for e in exporters}
        expected = expected_samples(
            sim.simulator,
            mine,
            jobs={e: e for e in exporters},
            instances=instances,
            extra={"cluster": CLUSTER, "node": node},
        )
        actual: RawSamples = prometheus.raw_samples(f'{{instance=~"{node}:.+"}}', lookback="10m")
        repeated = [
            f"{dict(k).get('__name__')} {dict(k)}"
            for k, v in actual.items()
            if any(a >= b for (a, _), (b, _) in itertools.pairwise(v))
        ]
        assert not repeated, f"{node}: repeated or unordered timestamps:\n" + "\n".join(repeated[:10])
        real = {k: v for k, v in actual.items() if dict(k)["__name__"] not in SYNTHETIC}
        problems = compare(expected, real, max_skew_ms=1000)
        assert not problems, f"{node}:\n" + "\n".join(problems[:20])
        n_samples = sum(len(v) for v in expected.values())
        assert n_samples >= MIN_SAMPLES_PER_NODE, f"{node}: only {n_samples} samples served"
        compared += n_samples
        ups = {dict(k)["job"]: v for k, v in actual.items() if dict(k)["__name__"] == "up"}
        for exporter in exporters:
            n_served = sum(1 for s in mine if s.exporter == exporter)
            assert [v for _, v in ups[exporter]] == [1.0] * n_served, f"{node} {exporter}: up samples"
    assert compared >= MIN_SAMPLES, f"only {compared} samples served: the test would prove little"
    print(
        f"\nscale-out: {compared} samples compared; batches written per replica {per_replica}; "
        f"{in_hand:.0f} batches in the killed replica's hands ({len(stuck)} refused by the receiver), "
        f"rewritten {redelivery_s:.1f}s after its restart"
    )
