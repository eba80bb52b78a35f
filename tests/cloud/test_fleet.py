"""The fleet view: the ``Fleet`` model (verdicts, seq gaps, forgetting), its ``cloud_ingest_node_*``
export, and ``cloud-ingest fleet`` against a real mosquitto with the in-process ingester writing to a
real Prometheus.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import requests

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.commands import fleet as fleet_cmd
from cloud_ingest.outcome import fleet as fleet_mod
from cloud_ingest.outcome.fleet import Fleet, NodeView, SeqTracker
from cloud_ingest.selfmetrics import IngestMetrics
from relay_common.httpserver import MetricsServer
from schemas import codec, topics
from schemas.model import Batch
from testkit.batches import CLUSTER, METRIC, make_batch
from testkit.services import Mosquitto, Prometheus, ServiceFactory, free_port, now_ms, wait_until
from testkit.stack import ingest_config

REPO = Path(__file__).resolve().parents[2]
PREFIX = "edgemetrics"
T0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def status(state: str = "online", *, ts: float | None = None, **fields: Any) -> dict[str, Any]:
    body = {"v": 1, "cluster": CLUSTER, "node": "n", "state": state, "ts_ms": int((ts or T0) * 1000)}
    return {**body, **fields}


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def fleet(clock: Clock) -> Fleet:
    return Fleet(clock=clock)


def view(fleet: Fleet, node: str = "n") -> NodeView:
    v = fleet.get(CLUSTER, node)
    assert v is not None, f"{node} unknown"
    return v


def write(fleet: Fleet, *seqs: int, node: str = "n", samples: int = 10) -> None:
    for seq in seqs:
        fleet.observe_written(CLUSTER, node, seq=seq, samples=samples, newest_ms=int(T0 * 1000) + seq)


# -- verdicts ---------------------------------------------------------------------------------------------


def test_online_node_is_ok(fleet: Fleet, clock: Clock) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=2, spool_bytes=900, lost_samples=0))
    write(fleet, 1, 2)
    v = view(fleet)
    assert (v.verdict, v.state, v.silent) == ("ok", "online", False)
    assert (v.spool_rows, v.spool_bytes, v.samples_written, v.batches_written) == (2, 900, 20, 2)
    assert v.highest_written == 2 and v.last_batch_ts == pytest.approx(T0 + 0.002)


def test_last_will_keeps_the_backlog_of_the_last_status_that_carried_one(fleet: Fleet, clock: Clock) -> None:
    oldest_ms = int((T0 - 600) * 1000)
    fleet.observe_status(
        CLUSTER, "n", status(spool_rows=40, spool_bytes=1 << 20, oldest_unsent_ms=oldest_ms, lost_samples=0)
    )
    clock.tick(10)
    # The relay's will: no numbers, and stamped when the connection was made.
    fleet.observe_status(CLUSTER, "n", status("offline", ts=T0 - 3600))
    v = view(fleet)
    assert (v.verdict, v.state) == ("offline_buffering", "offline")
    assert (v.spool_rows, v.spool_bytes, v.oldest_unsent) == (40, 1 << 20, oldest_ms / 1000)
    assert v.numbers_ts == T0 and v.status_ts == T0 - 3600
    assert v.status_heard == T0 + 10  # a live message is heard when it arrives, whatever its ts


def test_offline_without_backlog_is_unknown(fleet: Fleet) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, spool_bytes=0, lost_samples=0))
    fleet.observe_status(CLUSTER, "n", status("offline"))
    assert view(fleet).verdict == "offline_unknown"
    fleet.observe_status(CLUSTER, "m", status("offline"))  # never said anything else
    assert view(fleet, "m").verdict == "offline_unknown"


def test_silence_turns_an_online_node_offline(fleet: Fleet, clock: Clock) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=3, lost_samples=0))
    fleet.observe_status(CLUSTER, "m", status(spool_rows=0, lost_samples=0))
    clock.tick(fleet_mod.SILENT_AFTER_SECONDS - 1)
    assert view(fleet).verdict == "ok"
    clock.tick(2)
    assert (view(fleet).verdict, view(fleet).silent) == ("offline_buffering", True)
    assert view(fleet, "m").verdict == "offline_unknown"
    write(fleet, 7)  # a batch is news too
    assert (view(fleet).verdict, view(fleet).silent) == ("ok", False)
    clock.tick(fleet_mod.SILENT_AFTER_SECONDS + 1)
    fleet.observe_acks(CLUSTER, "n", ok=[8], rejected=[])  # so is another replica's ack
    assert view(fleet).verdict == "ok"


def test_retained_status_counts_at_its_own_timestamp(fleet: Fleet, clock: Clock) -> None:
    # A bridged node whose link died: the cloud keeps its retained "online" of 20 minutes ago.
    fleet.observe_status(CLUSTER, "n", status(ts=T0 - 1200, spool_rows=9, lost_samples=0), retained=True)
    v = view(fleet)
    assert (v.status_heard, v.silent, v.verdict) == (T0 - 1200, True, "offline_buffering")
    # A node clock ahead of ours does not make it "heard in the future".
    fleet.observe_status(CLUSTER, "m", status(ts=T0 + 300), retained=True)
    assert view(fleet, "m").status_heard == T0
    # A retained will older than the forget horizon does not bring a long-gone node back.
    gone = T0 - fleet_mod.FORGET_AFTER_SECONDS - 60
    fleet.observe_status(CLUSTER, "gone", status("offline", ts=gone), retained=True)
    assert fleet.get(CLUSTER, "gone") is None


def test_losing_data_when_the_loss_total_grows_not_when_first_seen(fleet: Fleet, clock: Clock) -> None:
    # The first status is a baseline: ledger totals are cumulative for the life of the spool.
    fleet.observe_status(CLUSTER, "n", status(lost_samples=500, lost_max_age=500, spool_rows=1))
    assert view(fleet).verdict == "ok"
    clock.tick(30)
    fleet.observe_status(CLUSTER, "n", status(lost_samples=500, lost_max_age=500, spool_rows=1))
    assert view(fleet).verdict == "ok"
    clock.tick(30)
    fleet.observe_status(
        CLUSTER, "n", status(lost_samples=620, lost_max_age=500, lost_cap_bytes=120, spool_rows=1)
    )
    v = view(fleet)
    assert v.verdict == "losing_data" and v.loss_grew_at == clock.now
    assert (v.lost_samples, v.lost_reasons) == (620, {"cap_bytes": 120, "max_age": 500})
    # Offline does not hide it: losing data beats buffering.
    fleet.observe_status(CLUSTER, "n", status("offline"))
    assert view(fleet).verdict == "losing_data"
    assert view(fleet).lost_samples == 620  # the will carries no totals
    clock.tick(fleet_mod.LOSS_HOLD_SECONDS + 1)
    assert view(fleet).verdict == "offline_buffering"
    # A smaller total (a new spool file) is a new baseline, not a loss.
    fleet.observe_status(CLUSTER, "n", status(lost_samples=0, spool_rows=0))
    assert (view(fleet).verdict, view(fleet).lost_reasons) == ("ok", {})
    fleet.observe_status(CLUSTER, "n", status(lost_samples=3, lost_spool_full=3, spool_rows=0))
    assert view(fleet).verdict == "losing_data"


def test_dead_letters_mean_losing_data(fleet: Fleet, clock: Clock) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    fleet.observe_dead_letter(CLUSTER, "n", seq=4, refused=False)
    fleet.observe_dead_letter(CLUSTER, "n", seq=None, refused=True)
    v = view(fleet)
    assert (v.verdict, v.dead_letters, v.refused) == ("losing_data", 2, 1)
    clock.tick(fleet_mod.LOSS_HOLD_SECONDS + 1)
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    assert view(fleet).verdict == "ok"
    # Another replica's rejection, seen in its ack.
    fleet.observe_acks(CLUSTER, "n", ok=[5], rejected=[6])
    assert view(fleet).verdict == "losing_data"
    assert view(fleet).dead_letters == 2  # counted by the replica that dead-lettered it


def test_budget_fields_are_kept(fleet: Fleet) -> None:
    fleet.observe_status(
        CLUSTER,
        "n",
        status(budget_state="degraded", budget_bytes_per_s=16384, wire_bytes_per_s=1250.5, degrade_level=2),
    )
    v = view(fleet)
    assert (v.budget_state, v.budget_bytes_per_s, v.wire_bytes_per_s, v.degrade_level) == (
        "degraded",
        16384,
        1250.5,
        2,
    )


# -- seq gaps ---------------------------------------------------------------------------------------------


def test_gaps_wait_for_the_grace_period_and_the_reported_backlog(fleet: Fleet, clock: Clock) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    write(fleet, 1, 2, 5)
    assert view(fleet).seq_gaps == 0  # 3 and 4 may still be on their way
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    assert view(fleet).seq_gaps == 2
    # The node says one row is still in its spool: one of them may be it.
    fleet.observe_status(CLUSTER, "n", status(spool_rows=1, lost_samples=0))
    assert view(fleet).seq_gaps == 1
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    write(fleet, 4)  # late, out of order
    write(fleet, 2, 5)  # replays change nothing
    assert view(fleet).seq_gaps == 1
    fleet.observe_acks(CLUSTER, "n", ok=[3], rejected=[])  # another replica wrote it
    assert view(fleet).seq_gaps == 0
    write(fleet, 9)
    assert view(fleet).seq_gaps == 0
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    assert view(fleet).seq_gaps == 3
    # Gaps older than the horizon are no longer counted.
    clock.tick(fleet_mod.GAP_HORIZON_SECONDS)
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    assert view(fleet).seq_gaps == 0


def test_gaps_are_undefined_without_a_complete_view(clock: Clock) -> None:
    fleet = Fleet(clock=clock, complete_view=False)
    write(fleet, 1, 3)
    assert view(fleet).seq_gaps is None
    fleet.set_complete_view(True)
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    assert view(fleet).seq_gaps == 1
    fleet.reset_seq_tracking()  # after a reconnect: acks may have been missed, count afresh
    write(fleet, 10)
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    assert view(fleet).seq_gaps == 0


def test_seq_tracker_ranges_acks_and_jumps() -> None:
    t = SeqTracker()
    t.see(100, 100, 0.0)
    t.see(110, 120, 1.0)  # an ack range
    assert (t.high, t.pending(5.0)) == (120, 9)
    t.see(103, 105, 2.0)
    assert [(r.lo, r.hi) for r in t.missing] == [(101, 102), (106, 109)]
    assert t.pending(0.5) == 0  # none missing since before 0.5
    # The relay continues from unix_ms * 1000 after a corrupt spool: a restart, not 10**15 gaps.
    t.see(1_800_000_000_000_000, 1_800_000_000_000_000, 3.0)
    assert (t.high, t.missing) == (1_800_000_000_000_000, [])
    t.see(150, 150, 4.0)  # a salvaged old row: ignored
    assert (t.high, t.missing) == (1_800_000_000_000_000, [])


def test_seq_tracker_counts_each_spool_incarnation_on_its_own() -> None:
    t = SeqTracker()
    for seq in (1, 2, 5, 40):
        t.see(seq, seq, 0.0, incarnation=7)
    assert t.pending(1.0) == 2 + 34
    # The spool was recreated (an emptyDir after a rollout): seqs start again at 1. Without the
    # incarnation, 1..3 would "fill" the old gaps and nothing of the new spool would be counted.
    t.see(1, 1, 2.0, incarnation=9)
    t.see(3, 3, 2.0, incarnation=9)
    assert (t.high, t.pending(3.0)) == (3, 1)
    t.see(4, 4, 2.5, incarnation=7)  # a late redelivery from the old spool: not this spool's seq 4
    assert (t.high, t.pending(3.0)) == (3, 1)
    t.see(2, 2, 3.0, incarnation=9)
    assert t.pending(4.0) == 0


def test_fleet_gaps_follow_the_incarnation_of_acks_and_batches(fleet: Fleet, clock: Clock) -> None:
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0, lost_samples=0))
    for seq in (1, 2, 3, 10):
        fleet.observe_written(CLUSTER, "n", seq=seq, samples=1, newest_ms=seq, incarnation=5)
    fleet.observe_acks(CLUSTER, "n", ok=[1, 2], rejected=[], incarnation=6)  # the new spool
    fleet.observe_dead_letter(CLUSTER, "n", seq=4, refused=False, incarnation=6)
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    assert view(fleet).seq_gaps == 1  # seq 3 of incarnation 6, not 4..9 of incarnation 5


def test_seq_tracker_memory_is_bounded() -> None:
    t = SeqTracker()
    for seq in range(0, 4 * fleet_mod.MAX_GAP_RANGES, 2):
        t.see(seq, seq, 0.0)
    assert len(t.missing) == fleet_mod.MAX_GAP_RANGES
    # The lowest ranges were dropped: the count can only be too low, never too high.
    assert t.missing[-1].hi == 4 * fleet_mod.MAX_GAP_RANGES - 3
    assert t.pending(1.0) == fleet_mod.MAX_GAP_RANGES


# -- forgetting -------------------------------------------------------------------------------------------


def test_nodes_not_heard_from_are_forgotten(fleet: Fleet, clock: Clock) -> None:
    forgotten: list[tuple[str, str]] = []
    fleet.on_forget(forgotten.extend)
    fleet.observe_status(CLUSTER, "old", status("offline"))
    clock.tick(fleet_mod.FORGET_AFTER_SECONDS - 10)
    write(fleet, 1, node="new")
    assert {v.node for v in fleet.snapshot()} == {"old", "new"}
    clock.tick(20)
    assert [v.node for v in fleet.snapshot()] == ["new"]
    assert forgotten == [(CLUSTER, "old")]
    # It comes back when heard again, with fresh counters.
    write(fleet, 2, node="old")
    assert view(fleet, "old").batches_written == 1


def test_node_count_is_capped(clock: Clock) -> None:
    fleet = Fleet(clock=clock, max_nodes=3)
    forgotten: list[tuple[str, str]] = []
    fleet.on_forget(forgotten.extend)
    for i in range(5):
        write(fleet, 1, node=f"n{i}")
        clock.tick(1)
    assert [v.node for v in fleet.snapshot()] == ["n2", "n3", "n4"]
    assert forgotten == [(CLUSTER, "n0"), (CLUSTER, "n1")]


def test_concurrent_updates(fleet: Fleet) -> None:
    def worker(offset: int) -> None:
        for seq in range(offset, 4000, 8):
            fleet.observe_written(CLUSTER, "n", seq=seq + 1, samples=1, newest_ms=seq)
            if seq % 50 == 0:
                fleet.snapshot()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fleet.observe_status(CLUSTER, "n", status(spool_rows=0))
    v = view(fleet)
    assert (v.samples_written, v.batches_written, v.highest_written) == (4000, 4000, 4000)
    assert not fleet._nodes[(CLUSTER, "n")].seqs.missing  # every seq arrived in the end


# -- export -----------------------------------------------------------------------------------------------


def test_metrics_export_and_forgetting(clock: Clock) -> None:
    metrics = IngestMetrics(fleet=Fleet(clock=clock))
    fleet, reg = metrics.fleet, metrics.registry

    def value(name: str, **labels: str) -> float | None:
        return reg.get_sample_value(name, labels)

    fleet.observe_status(
        CLUSTER,
        "a",
        status(spool_rows=12, spool_bytes=65536, oldest_unsent_ms=int((T0 - 300) * 1000), lost_samples=0),
    )
    fleet.observe_status(CLUSTER, "a", status("offline"))
    fleet.observe_status(CLUSTER, "b", status(spool_rows=0, lost_samples=0))
    fleet.observe_status(CLUSTER, "b", status(spool_rows=0, lost_samples=7, lost_cap_bytes=5))
    write(fleet, 1, 3, node="b", samples=6)
    metrics.samples_written.labels("b").inc(12)
    clock.tick(fleet_mod.GAP_GRACE_SECONDS + 1)
    a, b = {"cluster": CLUSTER, "node": "a"}, {"cluster": CLUSTER, "node": "b"}

    assert value("cloud_ingest_node_online", **a) == 0 and value("cloud_ingest_node_online", **b) == 1
    assert value("cloud_ingest_node_backlog_batches", **a) == 12
    assert value("cloud_ingest_node_backlog_bytes", **a) == 65536
    assert value("cloud_ingest_node_oldest_unsent_timestamp_seconds", **a) == T0 - 300
    assert value("cloud_ingest_node_oldest_unsent_timestamp_seconds", **b) is None
    assert value("cloud_ingest_node_last_status_timestamp_seconds", **a) == T0
    assert value("cloud_ingest_node_state", **a, state="offline_buffering") == 1
    assert value("cloud_ingest_node_state", **a, state="ok") == 0
    assert value("cloud_ingest_node_state", **b, state="losing_data") == 1
    assert value("cloud_ingest_node_lost_samples", **b, reason="cap_bytes") == 5
    assert value("cloud_ingest_node_lost_samples", **b, reason="unknown") == 2
    assert value("cloud_ingest_node_lost_samples", **a, reason="unknown") is None
    assert value("cloud_ingest_node_reported_lost_samples", **a) == 0
    assert value("cloud_ingest_node_reported_lost_samples", **b) == 7
    assert value("cloud_ingest_node_samples_written_total", **b) == 12
    assert value("cloud_ingest_node_batches_written_total", **b) == 2
    assert value("cloud_ingest_node_dead_letters_total", **b) == 0
    assert value("cloud_ingest_node_last_seq", **b) == 3
    assert value("cloud_ingest_node_last_batch_timestamp_seconds", **b) == pytest.approx(T0 + 0.003)
    assert value("cloud_ingest_node_seq_gaps", **b) == 1
    assert value("cloud_ingest_fleet_nodes", state="losing_data") == 1
    assert value("cloud_ingest_fleet_seq_view_complete") == 1

    clock.tick(fleet_mod.FORGET_AFTER_SECONDS)
    assert value("cloud_ingest_node_state", **b, state="losing_data") is None
    assert value("cloud_ingest_node_backlog_batches", **a) is None
    assert value("cloud_ingest_samples_written_total", node="b") is None
    assert value("cloud_ingest_fleet_nodes", state="losing_data") == 0


# -- the CLI's pieces -------------------------------------------------------------------------------------


def test_cli_merges_statuses_with_an_ingester_view() -> None:
    text = "\n".join(
        [
            'cloud_ingest_node_state{cluster="c",node="a",state="ok"} 0',
            'cloud_ingest_node_state{cluster="c",node="a",state="losing_data"} 1',
            'cloud_ingest_node_backlog_batches{cluster="c",node="a"} 5',
            'cloud_ingest_node_lost_samples{cluster="c",node="a",reason="cap_bytes"} 40',
            'cloud_ingest_node_lost_samples{cluster="c",node="a",reason="max_age"} 2',
            'cloud_ingest_node_reported_lost_samples{cluster="c",node="a"} 42',
            'cloud_ingest_node_samples_written_total{cluster="c",node="a"} 1200',
            'cloud_ingest_node_seq_gaps{cluster="c",node="a"} 3',
            'cloud_ingest_node_online{cluster="c",node="z"} 1',
            'cloud_ingest_samples_written_total{node="a"} 1200',
        ]
    )
    remote = fleet_cmd.parse_metrics(text + "\n")
    local = Fleet(clock=lambda: T0)
    local.observe_status("c", "a", {**status("offline"), "cluster": "c"}, retained=True)
    rows = fleet_cmd.build_rows(local.snapshot(), remote)
    assert [(r.cluster, r.node) for r in rows] == [("c", "a"), ("c", "z")]
    a, z = rows
    assert (a.state, a.verdict, a.backlog_rows, a.lost, a.written, a.dead_letters, a.seq_gaps) == (
        "offline",
        "losing_data",
        5,
        42,
        1200,
        0,
        3,
    )
    assert (z.state, z.verdict, z.backlog_rows) == ("online", None, None)
    lines = fleet_cmd.render(rows, T0 + 90)
    assert lines[0].split() == list(fleet_cmd.COLUMNS)
    assert lines[1].split() == [
        "c/a",
        "offline",
        "losing_data",
        "90s",
        "-",
        "5",
        "-",
        "-",
        "42",
        "1200",
        "0",
        "3",
    ]


def test_cli_formats() -> None:
    assert [fleet_cmd.fmt_age(T0 - a, T0) for a in (5, 300, 7300, 200_000)] == ["5s", "5m", "2h", "2d"]
    assert fleet_cmd.fmt_age(None, T0) == "-" and fleet_cmd.fmt_age(T0 + 5, T0) == "0s"
    assert [fleet_cmd.fmt_bytes(n) for n in (0, 1536, 3 << 20, 5 << 30)] == [
        "0B",
        "1.5KiB",
        "3.0MiB",
        "5.0GiB",
    ]


# -- integration: real mosquitto, in-process ingester, real Prometheus ---------------------------------------


class Edge:
    """Publishes batches and retained statuses as relays do (one client for all test nodes)."""

    def __init__(self, broker: Mosquitto) -> None:
        self.broker = broker
        self.client = self._client()
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()

    @staticmethod
    def _client() -> mqtt.Client:
        return mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"edge-test-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(10)
        assert info.is_published()

    def batch(self, batch: Batch) -> None:
        self.publish(topics.batch_topic(PREFIX, CLUSTER, batch.node), codec.encode_batch(batch))

    def status(self, node: str, state: str, **fields: Any) -> None:
        body = {"node": node, "cluster": CLUSTER, "state": state, "ts_ms": now_ms(), **fields}
        self.publish(topics.status_topic(PREFIX, CLUSTER, node), codec.encode_status(body), retain=True)

    def die_with_will(self, node: str) -> None:
        """A relay connection that breaks without DISCONNECT: the broker publishes its last will."""
        relay = self._client()
        will = codec.encode_status({"node": node, "cluster": CLUSTER, "state": "offline", "ts_ms": now_ms()})
        relay.will_set(topics.status_topic(PREFIX, CLUSTER, node), will, qos=1, retain=True)
        connected = threading.Event()
        relay.on_connect = lambda *args: connected.set()
        relay.connect(self.broker.host, self.broker.port, keepalive=10)
        relay.loop_start()
        assert connected.wait(10)
        relay.loop_stop()
        sock = relay.socket()
        assert sock is not None
        sock.close()

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture
def edge(mosquitto: Mosquitto) -> Iterator[Edge]:
    e = Edge(mosquitto)
    yield e
    e.close()


def run_fleet_cli(config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloud_ingest.cli", "fleet", "--config", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def table(stdout: str) -> dict[str, dict[str, str]]:
    lines = stdout.splitlines()
    header = lines[0].split()
    assert header == list(fleet_cmd.COLUMNS)
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        cells = line.split()
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


def test_fleet_view_on_real_broker_and_prometheus(
    tmp_path: Path, mosquitto: Mosquitto, prometheus: Prometheus, edge: Edge
) -> None:
    config = ingest_config(
        tmp_path,
        mqtt_port=mosquitto.port,
        remote_write_url=prometheus.remote_write_url,
        mqtt__client_id="ingest-fleet",
        remote_write__max_retry_seconds=5,
    )
    s = settings_mod.load(str(config))
    assert s.share_group == "ingest"  # the default: seq gaps rely on seeing every replica's acks
    ingester = Ingester(s, fleet=Fleet(gap_grace=0.0))
    server = MetricsServer.start(f"127.0.0.1:{free_port()}", ingester.metrics.registry)
    assert server is not None
    metrics_url = f"http://127.0.0.1:{server.port}/metrics"
    edge.status("probe", "online", spool_rows=0, lost_samples=0)
    ingester.start()
    try:
        wait_until(lambda: ingester.fleet.get(CLUSTER, "probe"), 20, message="ingester subscribed")
        base = now_ms() - 120_000

        # node-a: writes, reports a backlog, then its connection breaks (the last will: no numbers).
        edge.status("node-a", "online", spool_rows=0, spool_bytes=0, lost_samples=0)
        edge.batch(make_batch("node-a", 1, base))
        edge.batch(make_batch("node-a", 2, base + 1000))
        oldest_ms = base + 2000
        edge.status(
            "node-a", "online", spool_rows=12, spool_bytes=65536, oldest_unsent_ms=oldest_ms, lost_samples=0
        )
        # node-b: seq 3 never arrives, and its loss ledger grows.
        edge.status("node-b", "online", spool_rows=0, lost_samples=0)
        for seq in (1, 2, 4):
            edge.batch(make_batch("node-b", seq, base + seq * 1000))
        # node-c: a batch from the future is dead-lettered.
        edge.status("node-c", "online", spool_rows=0, lost_samples=0)
        edge.batch(make_batch("node-c", 1, base))
        edge.batch(make_batch("node-c", 2, now_ms() + 3_600_000))

        def written(node: str) -> float:
            return (
                ingester.metrics.registry.get_sample_value(
                    "cloud_ingest_node_batches_written_total", {"cluster": CLUSTER, "node": node}
                )
                or 0.0
            )

        wait_until(lambda: written("node-a") == 2 and written("node-b") == 3, 20, message="batches written")
        wait_until(lambda: view(ingester.fleet, "node-c").dead_letters == 1, 20, message="dead letter")
        edge.die_with_will("node-a")
        edge.status("node-b", "online", spool_rows=0, lost_samples=120, lost_cap_bytes=100, lost_max_age=20)
        wait_until(lambda: view(ingester.fleet, "node-a").state == "offline", 20, message="node-a's will")
        wait_until(lambda: view(ingester.fleet, "node-b").lost_samples == 120, 20, message="node-b's losses")

        # Everything written is in Prometheus.
        counts = prometheus.query(f"count_over_time({METRIC}[1h])")["result"]
        per_node: dict[str, float] = {}
        for series in counts:
            node = series["metric"]["node"]
            per_node[node] = per_node.get(node, 0) + float(series["value"][1])
        assert per_node == {"node-a": 12, "node-b": 18, "node-c": 6}

        # The exported metrics, read as Prometheus would.
        samples = fleet_cmd.parse_metrics(requests.get(metrics_url, timeout=5).text)
        a, b, c = (samples[(CLUSTER, n)] for n in ("node-a", "node-b", "node-c"))
        assert a["cloud_ingest_node_state{state=offline_buffering}"] == 1
        assert a["cloud_ingest_node_online"] == 0
        assert a["cloud_ingest_node_backlog_batches"] == 12
        assert a["cloud_ingest_node_backlog_bytes"] == 65536
        assert a["cloud_ingest_node_oldest_unsent_timestamp_seconds"] == oldest_ms / 1000
        assert a["cloud_ingest_node_samples_written_total"] == 12
        assert a["cloud_ingest_node_last_seq"] == 2
        assert a["cloud_ingest_node_seq_gaps"] == 0
        assert b["cloud_ingest_node_state{state=losing_data}"] == 1
        assert b["cloud_ingest_node_online"] == 1
        assert b["cloud_ingest_node_lost_samples{reason=cap_bytes}"] == 100
        assert b["cloud_ingest_node_lost_samples{reason=max_age}"] == 20
        assert b["cloud_ingest_node_seq_gaps"] == 1
        assert b["cloud_ingest_node_dead_letters_total"] == 0
        assert c["cloud_ingest_node_state{state=losing_data}"] == 1
        assert c["cloud_ingest_node_dead_letters_total"] == 1
        assert c["cloud_ingest_node_batches_refused_total"] == 1
        assert c["cloud_ingest_node_last_batch_timestamp_seconds"] == pytest.approx((base + 500) / 1000)
        assert ingester.metrics.registry.get_sample_value("cloud_ingest_fleet_seq_view_complete") == 1

        # `cloud-ingest fleet` with the ingester's metrics.
        cli = run_fleet_cli(config, "--metrics-url", metrics_url)
        assert cli.returncode == 0, cli.stderr
        rows = table(cli.stdout)
        assert set(rows) == {f"{CLUSTER}/{n}" for n in ("probe", "node-a", "node-b", "node-c")}
        ra, rb, rc = (rows[f"{CLUSTER}/{n}"] for n in ("node-a", "node-b", "node-c"))
        assert (ra["state"], ra["verdict"], ra["backlog_rows"], ra["backlog_bytes"]) == (
            "offline",
            "offline_buffering",
            "12",
            "64.0KiB",
        )
        assert (ra["written"], ra["dead_letters"], ra["seq_gaps"], ra["lost"]) == ("12", "0", "0", "0")
        assert ra["oldest_unsent"].endswith("m") or ra["oldest_unsent"].endswith("s")
        assert (rb["state"], rb["verdict"], rb["lost"], rb["written"], rb["seq_gaps"]) == (
            "online",
            "losing_data",
            "120",
            "18",
            "1",
        )
        assert (rc["verdict"], rc["dead_letters"], rc["written"]) == ("losing_data", "1", "6")
        assert rows[f"{CLUSTER}/probe"]["verdict"] == "ok"
        assert "4 nodes: 1 ok, 1 offline_buffering, 2 losing_data" in cli.stdout

        # Without it: only what the retained statuses say (the will carries no backlog, no history).
        alone = run_fleet_cli(config)
        assert alone.returncode == 0, alone.stderr
        rows = table(alone.stdout)
        ra, rb = rows[f"{CLUSTER}/node-a"], rows[f"{CLUSTER}/node-b"]
        assert (ra["state"], ra["verdict"], ra["backlog_rows"], ra["written"]) == (
            "offline",
            "offline_unknown",
            "-",
            "-",
        )
        assert (rb["state"], rb["verdict"], rb["lost"]) == ("online", "ok", "120")
        assert "--metrics-url" in alone.stderr

        # A broker that is not there is an error, not an empty fleet.
        (tmp_path / "dead").mkdir()
        dead = ingest_config(
            tmp_path / "dead", mqtt_port=free_port(), remote_write_url=prometheus.remote_write_url
        )
        failed = run_fleet_cli(dead)
        assert failed.returncode == 1 and "cannot connect" in failed.stderr
    finally:
        ingester.stop()
        if server is not None:
            server.stop()


# Anonymous clients may do what the relay and the ingester need, but nobody may read the acks: the
# deployed ACL of deploy/mosquitto/cloud/acl gives the ingester identity `topic write` on them.
ACKS_UNREADABLE_ACL = """\
topic readwrite edgemetrics/v1/+/+/batch
topic readwrite edgemetrics/v1/+/+/status
topic write edgemetrics/v1/+/+/ack
"""


@pytest.mark.parametrize("acks_readable", [True, False], ids=["acks_readable", "acl_hides_acks"])
def test_replicas_of_a_share_group_agree_on_seq_gaps(
    acks_readable: bool, tmp_path: Path, make_service: ServiceFactory, prometheus: Prometheus
) -> None:
    extra = ""
    if not acks_readable:
        acl = tmp_path / "acl"
        acl.write_text(ACKS_UNREADABLE_ACL)
        extra = f"acl_file {acl}"
    broker: Mosquitto = make_service(Mosquitto, extra_conf=extra)
    edge = Edge(broker)
    replicas: list[Ingester] = []
    try:
        edge.status("probe", "online", spool_rows=0, lost_samples=0)
        for name in ("r1", "r2"):
            (tmp_path / name).mkdir()
            config = ingest_config(
                tmp_path / name,
                mqtt_port=broker.port,
                remote_write_url=prometheus.remote_write_url,
                mqtt__client_id=f"ingest-{name}",
            )
            replica = Ingester(settings_mod.load(str(config)), fleet=Fleet(gap_grace=0.0))
            replicas.append(replica)
            replica.start()
            wait_until(lambda r=replica: r.fleet.get(CLUSTER, "probe"), 20, message=f"{name} subscribed")

        edge.status("node-g", "online", spool_rows=0, lost_samples=0)
        base = now_ms() - 60_000
        seqs = (1, 2, 3, 4, 5, 6, 8)  # 7 never arrives
        for seq in seqs:
            edge.batch(make_batch("node-g", seq, base + seq * 1000))

        def batches(r: Ingester) -> int:
            v = r.fleet.get(CLUSTER, "node-g")
            return 0 if v is None else v.batches_written

        wait_until(lambda: sum(batches(r) for r in replicas) == len(seqs), 20, message="all written")
        assert all(batches(r) > 0 for r in replicas), "the share group did not split the batches"

        def gaps(r: Ingester) -> float | None:
            return r.metrics.registry.get_sample_value(
                "cloud_ingest_node_seq_gaps", {"cluster": CLUSTER, "node": "node-g"}
            )

        if acks_readable:
            # Each replica wrote only its share but saw the other's acks: both count exactly seq 7.
            wait_until(lambda: [gaps(r) for r in replicas] == [1, 1], 20, message="gaps from the ack view")
            for r in replicas:
                assert r.metrics.registry.get_sample_value("cloud_ingest_fleet_seq_view_complete") == 1
        else:
            # Without the acks a replica cannot tell the other's batches from lost ones: no estimate.
            time.sleep(1.0)
            for r in replicas:
                assert gaps(r) is None
                assert r.metrics.registry.get_sample_value("cloud_ingest_fleet_seq_view_complete") == 0
                assert view(r.fleet, "node-g").verdict == "ok"
    finally:
        for r in replicas:
            r.stop()
        edge.close()
