"""What the cloud refuses is never deleted silently, and no node writes another node's series (issue 12,
items 4 and 10).

End to end on a real mosquitto and a real Prometheus, with the edge's real spool and uplink and the
real ingester in-process:

- a receiver configuration error (a redirect, 401, 404, 413; answered by a ``RemoteWriteProxy`` in
  front of Prometheus) is retried and counted, never acked ``rejected``: nothing leaves the spool, and
  once the proxy forwards again every sample is in Prometheus;
- a sample-level rejection (Prometheus without an out-of-order window: 400 "out of bounds") is
  dead-lettered and acked ``rejected``, and the edge deletes the row together with a loss-ledger entry
  ``rejected_by_cloud`` naming its job, time range and samples;
- a full dead-letter store: the rejected batch is not acked and stays at the edge; once an operator
  makes room it is dead-lettered and ledgered;
- series labelled with another cluster and node end in Prometheus under the topic's, the sent values
  as ``exported_cluster`` / ``exported_node``.

Then, without services: the spool operation (``SendQueue.refused``) and the dead-letter store's cap.
"""

from __future__ import annotations

import uuid
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.outcome.deadletters import DeadLetterFull, DeadLetterStore
from cloud_ingest.sinks.remote_write.client import RemoteWriteClient
from edge_relay.ledger import LossLedger, LossReason
from edge_relay.store.spool import SendQueue, Spool, SpoolRow
from edge_relay.uplink.mqtt import Uplink
from edge_relay.uplink.status import StatusReport
from schemas import codec, topics
from schemas.model import Batch, Labels, ScrapeBlock
from testkit import batches
from testkit.netfaults import RemoteWriteProxy
from testkit.services import Mosquitto, Prometheus, RawSamples, ServiceFactory, now_ms, wait_until
from testkit.stack import ingest_config
from testkit.uplinks import mqtt_settings, spool_uplink

PREFIX = "edgemetrics"
CLUSTER = "test"
NODE = "edge-1"
PROBE_NODE = "probe"
HOUR_MS = 3_600_000


# -- batches, spool rows -------------------------------------------------------------------------------


def labelset(name: str, job: str, i: int, **extra: str) -> Labels:
    pairs = {"__name__": name, "job": job, "instance": f"{NODE}:9102", "zone": f"pkg{i}", **extra}
    return tuple(sorted(pairs.items()))


def make_batch(seq: int, ts_ms: int, job: str = "kepler", series: int = 3, scrapes: int = 2) -> Batch:
    """``series`` x ``scrapes`` samples 1 s apart, labelled as the relay labels them."""
    name = f"{job}_test_joules_total"
    labelsets = [labelset(name, job, i, cluster=CLUSTER, node=NODE) for i in range(series)]
    return batches.make_batch(
        NODE, seq, ts_ms, cluster=CLUSTER, labelsets=labelsets, scrapes=scrapes, step_ms=1000
    )


def spool_batch(spool: Spool, make: Callable[[int], Batch]) -> Batch:
    """Append ``make(seq)`` as the relay does (encoded with its seq); returns the batch stored."""
    probe = make(0)
    seq = spool.batches.append(
        lambda s: codec.encode_batch(make(s)),
        first_ts_ms=probe.first_timestamp_ms,
        last_ts_ms=probe.last_timestamp_ms,
        sample_count=probe.sample_count,
    )
    return make(seq)


def expected(*batches: Batch) -> RawSamples:
    out: RawSamples = {}
    for batch in batches:
        for block in batch.scrapes:
            for i, s in enumerate(block.series):
                key = frozenset(batch.labelsets[s])
                out.setdefault(key, []).append((block.sample_timestamp(i), block.values[i]))
    return {k: sorted(v) for k, v in out.items()}


def spool_seqs(spool: Spool) -> list[int]:
    return [row.seq for row in spool.batches.pending(1_000_000)]


# -- the edge, the cloud -------------------------------------------------------------------------------


def relay_metric(uplink: Uplink, name: str, **labels: str) -> float:
    return uplink.metrics.registry.get_sample_value(name, labels) or 0.0


def ingest_metric(ingester: Ingester, name: str, **labels: str) -> float:
    return ingester.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def make_uplink() -> Iterator[Callable[..., Uplink]]:
    uplinks: list[Uplink] = []

    def make(broker: Mosquitto, spool: Spool, **overrides: Any) -> Uplink:
        uplink = spool_uplink(mqtt_settings(broker.port, **overrides), spool, cluster=CLUSTER, node=NODE)
        uplink.start()
        uplinks.append(uplink)
        return uplink

    yield make
    for uplink in uplinks:
        uplink.stop(0)


@pytest.fixture
def make_ingester(tmp_path: Path, mosquitto: Mosquitto) -> Iterator[Callable[..., Ingester]]:
    """In-process ingesters, started once their batch subscription is live (the probe node's retained
    status is published before, in the same SUBSCRIBE as the batch filter: see tests/cloud/test_ingest.py)."""
    probe = mqtt.Client(callback_api_version=mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    probe.connect(mosquitto.host, mosquitto.port)
    probe.loop_start()
    status = {"node": PROBE_NODE, "cluster": CLUSTER, "state": "online", "ts_ms": now_ms()}
    probe.publish(
        topics.status_topic(PREFIX, CLUSTER, PROBE_NODE), codec.encode_status(status), qos=1, retain=True
    ).wait_for_publish(10)
    running: list[Ingester] = []

    def make(url: str, **overrides: Any) -> Ingester:
        opts: dict[str, Any] = {
            "mqtt__client_id": f"ingest-{uuid.uuid4().hex[:8]}",
            "remote_write__retry_min_seconds": 0.05,
            "remote_write__retry_max_seconds": 0.3,
            "remote_write__max_retry_seconds": 60,
            "remote_write__timeout_seconds": 5,
            "metrics__listen": "",
        }
        opts.update(overrides)
        workdir = tmp_path / f"ingest-{len(running)}"
        workdir.mkdir()
        path = ingest_config(workdir, mqtt_port=mosquitto.port, remote_write_url=url, **opts)
        ingester = Ingester(settings_mod.load(str(path)))
        running.append(ingester)
        ingester.start()
        wait_until(
            lambda: (
                ingest_metric(ingester, "cloud_ingest_node_online", cluster=CLUSTER, node=PROBE_NODE) == 1
            ),
            20,
            message="ingester subscribed",
        )
        return ingester

    yield make
    for ingester in running:
        ingester.stop()
    probe.loop_stop()
    probe.disconnect()


# -- configuration errors: retried, never "rejected" ---------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("status", [302, 401, 404, 413])
def test_receiver_configuration_error_keeps_the_spool_and_everything_arrives_later(
    make_service: ServiceFactory,
    mosquitto: Mosquitto,
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    make_ingester: Callable[..., Ingester],
    status: int,
) -> None:
    """Today's code acks a 3xx/401/404/413 "rejected" and the edge deletes the rows: a cloud
    misconfiguration empties every spool of the fleet."""
    prometheus = make_service(Prometheus)
    proxy = RemoteWriteProxy(prometheus.remote_write_url)
    try:
        proxy.refuse(status)  # a redirect, expired credentials, a wrong URL, a body above its limit
        ingester = make_ingester(proxy.url)
        base = now_ms() - 60_000
        batches = [spool_batch(spool, lambda s, k=k: make_batch(s, base + 5000 * k)) for k in range(3)]
        uplink = make_uplink(mosquitto, spool)

        # Five answers: retries of the first batch (or, the bug, the spool emptied after three).
        wait_until(lambda: len(proxy.exchanges) >= 5 or not spool_seqs(spool), 20, message="answers")
        assert spool_seqs(spool) == [b.seq for b in batches], "a configuration error deleted rows"
        assert relay_metric(uplink, "edge_relay_batches_acked_total", result="rejected") == 0
        errors = ingest_metric(ingester, "cloud_ingest_remote_write_config_errors_total", status=str(status))
        assert errors >= 4, "every answer is counted with its status (the alert's input)"
        assert spool.losses.totals() == {}
        assert ingester.dead_letters.list() == []
        assert ingest_metric(ingester, "cloud_ingest_messages_total", outcome="rejected") == 0

        proxy.forward()  # the operator fixed the configuration
        wait_until(lambda: not spool_seqs(spool), 30, message="every batch acked ok")
        assert relay_metric(uplink, "edge_relay_batches_acked_total", result="ok") == 3
        assert relay_metric(uplink, "edge_relay_batches_acked_total", result="rejected") == 0
        assert spool.losses.totals() == {}
        stored = prometheus.raw_samples('{__name__="kepler_test_joules_total"}')
        assert stored == expected(*batches)
    finally:
        proxy.close()


# -- a sample-level rejection: dead letter in the cloud, ledger entry at the edge -----------------------


@pytest.mark.timeout(120)
def test_out_of_bounds_rejection_is_recorded_in_the_edge_ledger(
    make_service: ServiceFactory,
    mosquitto: Mosquitto,
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    make_ingester: Callable[..., Ingester],
) -> None:
    """Today's code deletes a rejected batch's row and writes no ledger entry: the samples are nowhere
    at the edge, and the cloud keeps only some refused payloads."""
    prometheus = make_service(Prometheus, ooo_window=None)
    fresh_ts = now_ms() - 10_000
    # A fresh sample first: Prometheus' head then refuses anything older than about an hour.
    with RemoteWriteClient(prometheus.remote_write_url, max_retry_s=5) as client:
        assert client.write(make_batch(1000, fresh_ts, job="warmup", series=1, scrapes=1)).status == "written"
    ingester = make_ingester(prometheus.remote_write_url)
    old_ts = now_ms() - 6 * HOUR_MS
    old = spool_batch(spool, lambda s: make_batch(s, old_ts, job="kepler"))
    fresh = spool_batch(spool, lambda s: make_batch(s, fresh_ts, job="dcgm"))
    uplink = make_uplink(mosquitto, spool)

    wait_until(lambda: not spool_seqs(spool), 30, message="both rows acked")
    assert relay_metric(uplink, "edge_relay_batches_acked_total", result="rejected") == 1
    assert relay_metric(uplink, "edge_relay_batches_acked_total", result="ok") == 1

    # The edge: the row left the spool with its samples in the ledger, under the new reason.
    [entry] = spool.losses.entries()
    assert (entry.reason, entry.series) == (LossReason.REJECTED_BY_CLOUD, '{job="kepler"}')
    assert (entry.first_ts_ms, entry.last_ts_ms, entry.samples) == (
        old.first_timestamp_ms,
        old.last_timestamp_ms,
        old.sample_count,
    )
    status = StatusReport(spool, LossLedger(spool.losses), None).fields()
    assert status["lost_samples"] == status["lost_rejected_by_cloud"] == 6

    # The cloud: the batch is dead-lettered with Prometheus' reason; the fresh one is written.
    [letter] = ingester.dead_letters.list()
    assert (letter.node, letter.seq) == (NODE, old.seq)
    assert "HTTP 400" in letter.reason and "out of bounds" in letter.reason
    assert prometheus.raw_samples('{job="dcgm"}') == expected(fresh)
    assert prometheus.raw_samples('{job="kepler"}', lookback="12h") == {}


@pytest.mark.timeout(120)
def test_a_full_dead_letter_store_keeps_the_batch_at_the_edge(
    make_service: ServiceFactory,
    mosquitto: Mosquitto,
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    make_ingester: Callable[..., Ingester],
    tmp_path: Path,
) -> None:
    prometheus = make_service(Prometheus, ooo_window=None)
    with RemoteWriteClient(prometheus.remote_write_url, max_retry_s=5) as client:
        assert client.write(make_batch(1000, now_ms(), job="warmup", series=1, scrapes=1)).status == "written"
    # The store, nearly full of an older letter, as an operator's CLI would see it.
    store_path = tmp_path / "dead-letters.db"
    operator = DeadLetterStore(store_path)
    filler = operator.put(
        "old/topic", b"x" * 130_000, "HTTP 400: out of bounds", cluster=CLUSTER, node="x", seq=1
    )
    ingester = make_ingester(
        prometheus.remote_write_url, dead_letter__path=str(store_path), dead_letter__max_bytes=128 * 1024
    )
    old_ts = now_ms() - 6 * HOUR_MS
    old = spool_batch(spool, lambda s: make_batch(s, old_ts))
    uplink = make_uplink(mosquitto, spool, ack_timeout_seconds=2.0)

    wait_until(
        lambda: (
            ingest_metric(ingester, "cloud_ingest_dead_letter_overflow_total", reason="receiver_rejected")
            >= 2
        ),
        30,
        message="rejected batch refused by the full store, twice (published again after the ack timeout)",
    )
    assert spool_seqs(spool) == [old.seq], "no room for the dead letter, yet the edge deleted the batch"
    assert spool.losses.totals() == {}
    assert relay_metric(uplink, "edge_relay_batches_acked_total", result="rejected") == 0
    assert ingest_metric(ingester, "cloud_ingest_dead_letter_bytes") > 128 * 1024
    assert ingest_metric(ingester, "cloud_ingest_dead_letter_max_bytes") == 128 * 1024

    operator.delete(filler)  # `cloud-ingest dead-letters replay` made room
    wait_until(lambda: not spool_seqs(spool), 30, message="the batch dead-lettered and acked rejected")
    assert [(d.node, d.seq) for d in ingester.dead_letters.list()] == [(NODE, old.seq)]
    assert spool.losses.totals() == {"rejected_by_cloud": old.sample_count}
    operator.close()


# -- a node writes only its own series ------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_series_labelled_as_another_node_end_in_prometheus_under_the_topic_node(
    prometheus: Prometheus,
    mosquitto: Mosquitto,
    spool: Spool,
    make_uplink: Callable[..., Uplink],
    make_ingester: Callable[..., Ingester],
) -> None:
    """Today's code compares only the batch header with the topic and writes the series as sent."""
    ingester = make_ingester(prometheus.remote_write_url)
    ts = now_ms() - 30_000
    name = "kepler_test_joules_total"
    sent = [
        labelset(name, "kepler", 0, cluster="other-cluster", node="other-node"),  # spoofing another node
        labelset(name, "kepler", 1),  # add_node_labels: false: written exactly as sent
        labelset(name, "kepler", 2, cluster=CLUSTER, node=NODE),  # honest
        labelset(name, "kepler", 3, cluster=CLUSTER, node="other-node", exported_node="kept"),
    ]

    def make(seq: int) -> Batch:
        block = ScrapeBlock(ts, array("I", range(4)), array("d", [1.5, 2.5, 3.5, 4.5]))
        return Batch(CLUSTER, NODE, seq, list(sent), [block])

    spool_batch(spool, make)
    make_uplink(mosquitto, spool)
    wait_until(lambda: not spool_seqs(spool), 30, message="batch acked")

    mine = {"cluster": CLUSTER, "node": NODE}
    want = {
        frozenset(
            {
                **dict(sent[0]),
                **mine,
                "exported_cluster": "other-cluster",
                "exported_node": "other-node",
            }.items()
        ),
        frozenset(dict(sent[1]).items()),  # as sent: nothing claims another node
        frozenset(dict(sent[2]).items()),
        frozenset({**dict(sent[3]), **mine, "exported_exported_node": "other-node"}.items()),
    }
    stored = prometheus.raw_samples(f'{{__name__="{name}"}}')
    assert set(stored) == want
    assert [v for samples in stored.values() for _, v in samples] != []
    assert prometheus.raw_samples('{node="other-node"}') == {}
    assert prometheus.raw_samples('{cluster="other-cluster"}') == {}
    assert ingest_metric(ingester, "cloud_ingest_series_identity_overridden_total", node=NODE) == 2


# -- the spool operation behind a "rejected" ack ---------------------------------------------------------


def describe_jobs(row: SpoolRow) -> str:
    jobs = sorted(
        {v for labels in codec.decode_batch(row.payload).labelsets for k, v in labels if k == "job"}
    )
    return "{" + ",".join(f'job="{j}"' for j in jobs) + "}"


def test_refused_deletes_the_row_and_records_the_loss_in_one_transaction(spool: Spool) -> None:
    queue = SendQueue(spool.batches, order="live_first", inflight_limit=4, live_window_s=0)
    kept = spool_batch(spool, lambda s: make_batch(s, 1_000_000, job="dcgm"))
    gone = spool_batch(spool, lambda s: make_batch(s, 2_000_000, job="kepler"))

    loss = queue.refused(gone.seq, describe_jobs)
    assert loss is not None
    assert (loss.reason, loss.series, loss.first_ms, loss.last_ms, loss.samples) == (
        LossReason.REJECTED_BY_CLOUD,
        '{job="kepler"}',
        2_000_000,
        2_001_000,
        6,
    )
    assert spool_seqs(spool) == [kept.seq]
    assert [(e.reason, e.series, e.samples) for e in spool.losses.entries()] == [
        ("rejected_by_cloud", '{job="kepler"}', 6)
    ]
    # An ack that comes twice (a re-published batch) finds nothing and records nothing more.
    assert queue.refused(gone.seq, describe_jobs) is None
    assert spool.losses.totals() == {"rejected_by_cloud": 6}


def test_refused_rolls_back_when_the_ledger_entry_cannot_be_made(spool: Spool) -> None:
    queue = SendQueue(spool.batches, order="live_first", inflight_limit=4, live_window_s=0)
    row = spool_batch(spool, lambda s: make_batch(s, 1_000_000))

    def broken(_row: SpoolRow) -> str:
        raise RuntimeError("cannot describe")

    with pytest.raises(RuntimeError):
        queue.refused(row.seq, broken)
    assert spool_seqs(spool) == [row.seq], "the row went without its ledger entry"
    assert spool.losses.totals() == {}


def test_refused_corrupt_row_is_still_recorded(spool: Spool) -> None:
    queue = SendQueue(spool.batches, order="live_first", inflight_limit=4, live_window_s=0)
    row = spool_batch(spool, lambda s: make_batch(s, 1_000_000))
    spool.store.run(
        "corrupt",
        lambda conn: conn.execute("UPDATE batches SET checksum = checksum + 1 WHERE seq = ?", (row.seq,)),
    )
    loss = queue.refused(row.seq, describe_jobs)
    assert loss is not None and (loss.series, loss.samples) == (f"spool seq {row.seq}", 6)
    assert spool.batches.count() == 0


# -- the dead-letter store's cap ---------------------------------------------------------------------------


def test_dead_letter_store_is_capped_and_room_made_elsewhere_counts(tmp_path: Path) -> None:
    path = tmp_path / "dl.db"
    store = DeadLetterStore(path, max_bytes=256 * 1024)
    first = store.put("t", b"a" * 100_000, "r", cluster="c", node="n", seq=1)
    store.put("t", b"b" * 100_000, "r", cluster="c", node="n", seq=2)
    with pytest.raises(DeadLetterFull):
        store.put("t", b"c" * 100_000, "r", cluster="c", node="n", seq=3)
    assert [d.seq for d in store.list()] == [1, 2]
    assert store.used_bytes() <= 256 * 1024

    other = DeadLetterStore(path)  # the CLI, in another process: replay deletes what it wrote
    other.delete(first)
    other.close()
    store.put("t", b"c" * 100_000, "r", cluster="c", node="n", seq=3)
    assert [d.seq for d in store.list()] == [2, 3]
    store.close()


def test_dead_letter_cap_is_a_config_key(tmp_path: Path) -> None:
    path = ingest_config(tmp_path, mqtt_port=1883, remote_write_url="http://127.0.0.1:1/api/v1/write")
    assert settings_mod.load(str(path)).dead_letter_max_bytes == 1 << 30
    path = ingest_config(
        tmp_path,
        mqtt_port=1883,
        remote_write_url="http://127.0.0.1:1/api/v1/write",
        dead_letter__max_bytes=1024,
    )
    with pytest.raises(settings_mod.ConfigError, match="max_bytes"):
        settings_mod.load(str(path))
