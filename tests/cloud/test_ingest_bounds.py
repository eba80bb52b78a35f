"""Memory a peer can make the ingester spend (issue 12, items 14 and 15).

Item 14: a small legal batch may stand for a huge remote-write request (wire format v2 names each label
string once per batch, the request once per series). ``decode`` refuses a batch whose request would be
over ``REQUEST_EXPANSION`` x the decompression limit, before anything is built, with the reason
``expansion_limit`` (dead-lettered and acked ``rejected`` like the codec's refusals); and
``build_write_request`` references each encoded label pair instead of copying it into every series.

Item 15: QoS 0 batches have no flow control at all, so a flood of them queued without bound; they are
refused and counted now. QoS 1 batches at work are capped at the Receive Maximum the ingester
announces, whatever the broker does (``cloud_ingest.intake.mqtt.admission.Admission``), and what a
broker sends beyond it waits in line without holding up paho's network thread, so batches slower than
the keepalive do not drop the connection. Real mosquitto for all of them.
"""

from __future__ import annotations

import threading
import tracemalloc
from array import array
from collections.abc import Callable
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import yaml

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.intake.mqtt.admission import Admission
from cloud_ingest.pipeline.decode import REQUEST_EXPANSION, Decoded, Refused, decode
from cloud_ingest.sinks.remote_write.request import build_write_request, request_size_bound
from schemas import codec, topics
from schemas.model import Batch, Labels, ScrapeBlock
from testkit.batches import CLUSTER as INGEST_CLUSTER
from testkit.batches import make_batch
from testkit.ingest_harness import PREFIX, Edge, Ingesters, Receivers, Reply, sample
from testkit.services import Mosquitto, now_ms, wait_until

MiB = 1 << 20
CLUSTER, NODE = "c1", "n1"
TOPIC = topics.batch_topic(PREFIX, CLUSTER, NODE)
T = 1_700_000_000_000


def shared_values_batch(series: int, *, value_bytes: int = 4000, seq: int = 1) -> Batch:
    """``series`` series that share four label values of ``value_bytes`` bytes each."""
    shared = {name: name * value_bytes for name in ("a", "b", "c", "d")}
    labelsets: list[Labels] = [
        tuple(sorted({"__name__": "m", "cluster": CLUSTER, "node": NODE, "i": str(k), **shared}.items()))
        for k in range(series)
    ]
    block = ScrapeBlock(T, array("I", range(series)), array("d", [1.0] * series))
    return Batch(CLUSTER, NODE, seq, labelsets, [block])


def traced_peak(call: Callable[[], object]) -> tuple[object, int]:
    tracemalloc.start()
    try:
        try:
            result: object = call()
        except Refused as r:
            result = r
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return result, peak


def run_decode(payload: bytes) -> Decoded:
    return decode(
        TOPIC, payload, prefix=PREFIX, limits=codec.DEFAULT_LIMITS, max_future_seconds=600, now_ms=T
    )


# -- item 14: the expanded size of a batch --------------------------------------------------------------


def test_a_small_batch_of_an_800_mb_request_is_refused_at_bounded_cost() -> None:
    batch = shared_values_batch(50_000, seq=9)
    payload = codec.encode_batch(batch)
    assert len(payload) < 64 << 10, len(payload)  # legal: far under the 1 MiB payload cap
    assert request_size_bound(batch) > 800_000_000
    del batch
    refused, peak = traced_peak(lambda: run_decode(payload))
    assert isinstance(refused, Refused), "accepted: the write stage would build an 800 MB request"
    assert refused.reason == "expansion_limit"
    assert (refused.cluster, refused.node, refused.seq) == (CLUSTER, NODE, 9)
    cap = REQUEST_EXPANSION * codec.DEFAULT_LIMITS.max_decompressed_bytes
    assert f"more than {cap}" in str(refused)
    # The decoded batch (~16 MiB of label tuples sharing the four strings) and the measuring pass.
    assert peak < 48 * MiB, f"refusing cost {peak / MiB:.1f} MiB"


def test_the_service_dead_letters_and_rejects_such_a_batch(tmp_path: Path) -> None:
    config = tmp_path / "ingest.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "remote_write": {"url": "http://127.0.0.1:9/api/v1/write"},
                "dead_letter": {"path": str(tmp_path / "dead.db")},
                "metrics": {"listen": ""},
            }
        )
    )
    ingester = Ingester(settings_mod.load(str(config)))  # not started: handle() is what a worker runs
    published: list[tuple[str, bytes]] = []
    ingester.session.publish = lambda topic, payload, *, qos=1: published.append((topic, payload))  # type: ignore[method-assign]
    try:
        message = mqtt.MQTTMessage(mid=1, topic=TOPIC.encode())
        message.qos = 1
        message.payload = codec.encode_batch(shared_values_batch(50_000, seq=3))
        outcome, peak = traced_peak(lambda: ingester.batches.handle(message))
        assert outcome == "refused"
        assert peak < 64 * MiB, f"handling cost {peak / MiB:.1f} MiB"
        assert sample(ingester, "cloud_ingest_batches_refused_total", reason="expansion_limit") == 1
        letters = ingester.dead_letters.list(limit=10)
        assert len(letters) == 1 and letters[0].reason.startswith("expansion_limit: ")
        assert [t for t, _ in published] == [topics.ack_topic(PREFIX, CLUSTER, NODE)]
        ack = codec.decode_ack(published[0][1])
        assert ack.results == [codec.AckResult(3, "rejected", "expansion_limit")]
    finally:
        ingester.dead_letters.close()
        ingester.writer.close()


def test_a_batch_under_the_cap_is_accepted() -> None:
    # 1,500 series x 16 kB of shared labels: a 24 MB request, a fifth of the 128 MiB cap.
    decoded = run_decode(codec.encode_batch(shared_values_batch(1_500)))
    assert isinstance(decoded, Decoded) and len(decoded.batch.labelsets) == 1_500


def test_building_a_request_does_not_copy_shared_label_values_per_series() -> None:
    batch = shared_values_batch(2_000)  # 2,000 x 16 kB: a 32 MB request
    request, peak = traced_peak(lambda: build_write_request(batch))
    assert isinstance(request, bytes)
    # The request itself plus the list of references; before: every series' own bytes, then the join.
    assert peak < 1.1 * len(request) + 2 * MiB, f"peak {peak / MiB:.1f} MiB for {len(request) / MiB:.1f} MiB"


@pytest.mark.parametrize(
    "batch",
    [
        shared_values_batch(10, value_bytes=300),
        make_batch("n", 1, T, series=40, scrapes=12),
        Batch(
            CLUSTER,
            NODE,
            1,
            [(("__name__", "m"), ("unicode", "Grüße 漢字 🔥" * 20)), (("__name__", "z"),)],
            [
                ScrapeBlock(T, array("I", [0, 1]), array("d", [0.0, float("nan")])),
                ScrapeBlock(T, array("I", [0, 1]), array("d", [2.0, -0.0])),  # same timestamp: last wins
                ScrapeBlock(0, array("I", [0, 1]), array("d", [1.5, 3.0]), timestamps=array("q", [2**62, 0])),
            ],
        ),
    ],
    ids=["shared", "windowed", "odd"],
)
def test_the_size_bound_is_an_upper_bound_and_a_close_one(batch: Batch) -> None:
    actual = len(build_write_request(batch))
    bound = request_size_bound(batch)
    assert actual <= bound <= actual + 22 * batch.sample_count + 6 * len(batch.labelsets)


# -- item 15: what the subscriber holds --------------------------------------------------------------------


def test_admission_holds_at_most_its_limit_and_lets_go_on_stop() -> None:
    """Never waits: a batch beyond the limit is queued and started when a place frees up."""
    stop = threading.Event()
    admission = Admission(2, stop)
    admitted: list[int] = []
    admission.offer(lambda: admitted.append(1))
    admission.offer(lambda: admitted.append(2))
    admission.offer(lambda: admitted.append(3))  # returns at once, queued
    assert admitted == [1, 2] and admission.held == 2 and admission.waits == 1 and admission.queued == 1
    admission.done()
    assert admitted == [1, 2, 3] and admission.held == 2 and admission.queued == 0
    admission.offer(lambda: admitted.append(4))
    stop.set()
    admission.done()  # stopping: the queued one is not started (the broker delivers it again)
    admission.offer(lambda: admitted.append(5))
    assert admitted == [1, 2, 3] and admission.held == 1


class Depth:
    """Samples an ingester's queue depth every 10 ms on a thread: the highest value seen."""

    def __init__(self, ingester: Ingester) -> None:
        self.ingester = ingester
        self.highest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.highest = max(self.highest, sample(self.ingester, "cloud_ingest_queue_depth"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.highest


def test_a_qos0_flood_is_refused_counted_and_never_queued(
    edge: Edge, ingesters: Ingesters, receivers: Receivers
) -> None:
    """3,000 QoS 0 batches against a slow receiver (0.3 s a write): none is queued (before: 4,071
    messages in memory after 4 s), every one is counted; the QoS 1 batches in between are written."""
    receiver = receivers(Reply(delay=0.3))
    ingester = ingesters.start(receiver.url, "qos0")
    depth = Depth(ingester)
    base = now_ms() - 60_000
    flood = 3_000
    payload = codec.encode_batch(make_batch("flooder", 1, base, series=20))
    topic = topics.batch_topic(PREFIX, INGEST_CLUSTER, "flooder")
    good = [make_batch("good", seq, base + 1000 * seq) for seq in range(1, 4)]
    for i in range(flood):
        edge.client.publish(topic, payload, qos=0)
        if i % 1000 == 0:
            edge.publish_batch(good[i // 1000])
    wait_until(
        lambda: sample(ingester, "cloud_ingest_batches_refused_total", reason="qos0") >= flood,
        60,
        message="every QoS 0 batch counted",
    )
    for batch in good:
        assert edge.wait_result("good", batch.seq, timeout=30).result == "ok"
    highest = depth.stop()
    assert sample(ingester, "cloud_ingest_batches_refused_total", reason="qos0") == flood
    assert highest <= len(good), f"{highest} batches queued"
    assert receiver.count() == len(good)  # nothing of the flood reached the receiver
    assert sample(ingester, "cloud_ingest_samples_written_total", node="flooder") == 0


def publish_40_at_once_all_written(edge: Edge) -> None:
    """40 batches of 8 nodes published without waiting for one another; each is acked ok in the end."""
    base = now_ms() - 60_000
    batches = [make_batch(f"node-{seq % 8}", seq, base + 100 * seq) for seq in range(1, 41)]
    infos = [
        edge.client.publish(topics.batch_topic(PREFIX, INGEST_CLUSTER, b.node), codec.encode_batch(b), qos=1)
        for b in batches
    ]
    for info in infos:
        info.wait_for_publish(10)
    for b in batches:
        assert edge.wait_result(b.node, b.seq, timeout=60).result == "ok"


def test_qos1_batches_held_never_exceed_the_receive_maximum(
    edge: Edge, ingesters: Ingesters, receivers: Receivers
) -> None:
    """Receive Maximum 4, a receiver taking 0.2 s a write, 40 batches published at once: never more than
    4 held, whatever mosquitto releases per PUBACK; all of them written in the end."""
    receiver = receivers(Reply(delay=0.2))
    ingester = ingesters.start(receiver.url, "rm", mqtt__receive_maximum=4)
    depth = Depth(ingester)
    publish_40_at_once_all_written(edge)
    assert depth.stop() <= 4
    assert ingester.admission.held == 0


def test_batches_slower_than_the_keepalive_do_not_drop_the_connection(
    mosquitto: Mosquitto, edge: Edge, ingesters: Ingesters, receivers: Receivers
) -> None:
    """Keepalive 2 s, Receive Maximum 4, 40 batches at once; once mosquitto has sent more than the
    Receive Maximum (it does after the first PUBACKs), four writes take 6 s each. paho's network
    thread keeps pinging meanwhile: before, it waited in the message callback for a place, and the
    broker dropped the connection after 1.5 x the keepalive."""
    fast, slow = Reply(delay=0.05), Reply(delay=6.0)
    receiver = receivers(Reply(), script=(fast,) * 8 + (slow,) * 4)
    ingester = ingesters.start(
        receiver.url,
        "slow",
        mqtt__receive_maximum=4,
        mqtt__keepalive_seconds=2,
        remote_write__timeout_seconds=10,
    )
    publish_40_at_once_all_written(edge)
    log = mosquitto.log_path.read_text(errors="replace")
    assert "ingest-slow has exceeded timeout" not in log
    assert log.count(" as ingest-slow ") == 1, "the ingester connected more than once"
    assert sample(ingester, "cloud_ingest_mqtt_connected") == 1
