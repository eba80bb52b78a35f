"""No node can cost another node anything on the ingester: real mosquitto, the real ingester.

- Stream state (wire format v3): the topic's (cluster, node) is whatever a publisher wrote, so a flood of
  key frames under made-up names must not push a live node's state out (``StreamState`` keeps nodes
  active in the last ``protect_s`` and drops the newcomer's state instead).
- Labels: no series may claim another node, and nothing more: with ``add_node_labels: false`` a relay's
  series reach Prometheus exactly as scraped (``cloud_ingest.pipeline.decode.pin_identity``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas import topics
from schemas.codec import StreamEncoder
from testkit.batches import CLUSTER, make_batch
from testkit.ingest_harness import PREFIX, Edge, Ingesters, Receivers, sample
from testkit.services import Mosquitto, Prometheus, ServiceFactory, now_ms, wait_until
from testkit.stack import SimulatorProcess, ingest_config, metrics_url, program, relay_config, wait_connected

pytestmark = pytest.mark.integration

FLOOD = 1_100  # above stream.max_nodes' default of 1,000


def test_made_up_nodes_do_not_push_a_live_nodes_stream_state_out(
    edge: Edge, ingesters: Ingesters, receivers: Receivers
) -> None:
    """1,100 key frames under made-up cluster names between two delta frames of a live node: the live
    node's frames are still decoded (acked ok, not need_state); the flood pays for itself."""
    receiver = receivers()
    ingester = ingesters.start(receiver.url, "flood")
    base = now_ms() - 60_000
    live = StreamEncoder(CLUSTER, "live")
    batches = [make_batch("live", seq, base + 1000 * seq) for seq in range(1, 6)]
    live_topic = topics.batch_topic(PREFIX, CLUSTER, "live")
    for batch in batches[:2]:
        edge.publish(live_topic, live.encode(batch))
        assert edge.wait_result("live", batch.seq).result == "ok"

    for i in range(FLOOD):
        cluster = f"made-up-{i}"
        frame = StreamEncoder(cluster, "n").encode(make_batch("n", 1, base, cluster=cluster, series=1))
        edge.client.publish(topics.batch_topic(PREFIX, cluster, "n"), frame, qos=1)
    wait_until(lambda: len(edge.all_topics()) >= FLOOD + 1, 120, message="every flood frame answered")

    for batch in batches[2:]:
        edge.publish(live_topic, live.encode(batch))
        assert edge.wait_result("live", batch.seq).result == "ok"
    assert sample(ingester, "cloud_ingest_stream_state_nodes") <= 1000
    assert sample(ingester, "cloud_ingest_stream_state_newcomers_refused_total") >= FLOOD - 1000


# -- add_node_labels: false, end to end -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_add_node_labels_false_writes_series_as_scraped_and_still_no_other_nodes(
    tmp_path: Path, make_service: ServiceFactory, mosquitto: Mosquitto
) -> None:
    """Two real relays -> mosquitto -> cloud-ingest -> Prometheus, both with ``add_node_labels: false``:
    one honest (its series reach Prometheus without ``cluster`` and ``node``, as Prometheus would scrape
    them), one whose ``external_labels`` claim another node (overwritten with its own, the claim kept
    as ``exported_node``)."""
    prom = make_service(Prometheus)
    sim = SimulatorProcess(tmp_path, interval=1.0).start()
    try:
        urls = {k: v for k, v in sim.urls.items() if k == "kepler"}
        configs = []
        for node, extra in (("plain-node", {}), ("claiming-node", {"node": "victim-node"})):
            workdir = tmp_path / node
            workdir.mkdir()
            configs.append(
                relay_config(
                    workdir,
                    urls=urls,
                    mqtt_port=mosquitto.port,
                    node=node,
                    add_node_labels=False,
                    external_labels=extra,
                )
            )
        ingest_dir = tmp_path / "ingest"
        ingest_dir.mkdir()
        ingest_cfg = ingest_config(
            ingest_dir, mqtt_port=mosquitto.port, remote_write_url=prom.remote_write_url
        )
        ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, ingest_dir).start()
        relays = [program("edge-relay", "edge_relay.cli", cfg, cfg.parent) for cfg in configs]
        try:
            wait_connected(ingest, metrics_url(ingest_cfg), "cloud_ingest_mqtt_connected")
            for relay in relays:
                relay.start()

            def arrived() -> bool:
                for relay in relays:
                    assert relay.alive(), relay.log_tail()
                plain = prom.query('count(up{instance=~"plain-node:.*"})')["result"]
                claiming = prom.query('count(up{instance=~"claiming-node:.*"})')["result"]
                return bool(plain) and bool(claiming)

            wait_until(arrived, timeout=60, interval=0.5, message="both relays' samples in Prometheus")
        finally:
            for relay in relays:
                relay.stop()
            ingest.stop()
    finally:
        sim.stop()
    plain = prom.raw_samples('{instance=~"plain-node:.*"}')
    assert plain, "nothing of the honest relay"
    for labels in plain:
        names = {name for name, _ in labels}
        assert not names & {"cluster", "node", "exported_cluster", "exported_node"}, sorted(labels)
    claiming = prom.raw_samples('{instance=~"claiming-node:.*"}')
    assert claiming
    for labels in claiming:
        pairs = dict(labels)
        assert pairs["node"] == "claiming-node" and pairs["exported_node"] == "victim-node", pairs
        assert "cluster" not in pairs
    assert prom.raw_samples('{node="victim-node"}') == {}
