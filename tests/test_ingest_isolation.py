"""No node can cost another node anything on the ingester: real mosquitto, the real ingester.

- Stream state (wire format v3): the topic's (cluster, node) is whatever a publisher wrote, so a flood of
  key frames under made-up names must not push a live node's state out (``StreamState`` keeps nodes
  active in the last ``protect_s`` and drops the newcomer's state instead).
"""

from __future__ import annotations

import pytest
from test_ingest import CLUSTER, PREFIX, Edge, Ingesters, Receivers, make_batch, now_ms, sample
from test_ingest import edge as edge
from test_ingest import ingesters as ingesters
from test_ingest import receivers as receivers

from schemas import topics
from schemas.codec import StreamEncoder
from testkit.rw_mock import no_proxies_fixture as no_proxies_fixture  # shared fixture, explicit re-export
from testkit.services import wait_until

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
