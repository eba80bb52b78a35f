"""Integration tests of ``cloud-ingest`` against a real mosquitto (and a real Prometheus where it can do).

The test plays the edge with paho-mqtt (MQTT v5): it publishes encoded batches QoS 1 on the batch
topics and collects the application acks on ``<prefix>/v1/+/+/ack``.  Samples go to the real Prometheus
fixture when a real receiver can show the behaviour, and to ``MockReceiver`` (stdlib ``http.server`` on
127.0.0.1) only for what a real one cannot do on demand: 5xx/429 with Retry-After, 400 with a chosen
body, replies that hang.  The ingester runs in-process (``Ingester(settings)``) except in the kill tests,
which run ``cloud-ingest run`` as subprocesses (``testkit/stack.py``) and SIGKILL them.

Readiness: the edge publishes a retained status for the node ``probe`` before any ingester starts.  The
status and batch filters are subscribed in one SUBSCRIBE packet, so once an ingester's
``cloud_ingest_node_online{node="probe"}`` is 1 its batch subscription is live and nothing published
afterwards can miss it.

What mosquitto 2.0.11 does with shared-subscription messages of a killed persistent subscriber (checked by
``test_unfinished_batch_survives_a_killed_replica``): the message stays in the dead client's session and
is redelivered (DUP) only when a client with the *same client id* reconnects; another member of the share
group never gets it.  Worse, the broker keeps assigning new messages round-robin to the dead member too,
and parks them in its session (until it returns or the session expires).  The batch is then recovered by
the edge publishing it again after its ack timeout, which lands on a live replica sooner or later.
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import pytest

from cloud_ingest.outcome.deadletters import DeadLetter
from schemas import codec, topics
from schemas.codec import AckResult
from testkit.batches import CLUSTER, METRIC, make_batch
from testkit.ingest_harness import (
    PREFIX,
    Edge,
    Ingesters,
    MockReceiver,
    Programs,
    Receivers,
    Reply,
    as_expected,
    decode_write_body,
    expected_samples,
    never_arrives,
    sample,
)
from testkit.services import Prometheus, ServiceFactory, free_port, now_ms, wait_until

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# -- 1. happy path against the real Prometheus -----------------------------------------------------------


def test_batches_of_two_nodes_written_to_prometheus_and_acked(
    prometheus: Prometheus, edge: Edge, ingesters: Ingesters
) -> None:
    ingester = ingesters.start(prometheus.remote_write_url, "happy")
    base = now_ms() - 120_000
    batches = [
        make_batch("node-a", 1, base),
        make_batch("node-b", 7, base + 250),
        make_batch("node-a", 2, base + 5_000),
    ]
    for batch in batches:
        edge.publish_batch(batch)

    assert edge.wait_result("node-a", 1) == AckResult(1, "ok")
    assert edge.wait_result("node-a", 2) == AckResult(2, "ok")
    assert edge.wait_result("node-b", 7) == AckResult(7, "ok")
    assert edge.results("node-a") == [AckResult(1, "ok"), AckResult(2, "ok")]
    assert edge.results("node-b") == [AckResult(7, "ok")]
    assert edge.all_topics() == {topics.ack_topic(PREFIX, CLUSTER, n) for n in ("node-a", "node-b")}

    stored = as_expected(prometheus.raw_samples(f'{{__name__="{METRIC}"}}'))
    assert stored == expected_samples(*batches)

    assert sample(ingester, "cloud_ingest_samples_written_total", node="node-a") == 12
    assert sample(ingester, "cloud_ingest_samples_written_total", node="node-b") == 6
    assert sample(ingester, "cloud_ingest_batches_written_total", node="node-a") == 2
    assert sample(ingester, "cloud_ingest_node_last_seq", cluster=CLUSTER, node="node-b") == 7
    assert sample(ingester, "cloud_ingest_acks_published_total", result="ok") == 3
    assert sample(ingester, "cloud_ingest_messages_total", outcome="written") == 3
    assert ingester.dead_letters.list() == []
    # Scraped 120-114.5 s ago by their newest samples: all three in the 60-300 s bucket.
    for stage in ("decoded", "written"):
        assert sample(ingester, "cloud_ingest_batch_age_seconds_count", stage=stage) == 3
        assert sample(ingester, "cloud_ingest_batch_age_seconds_bucket", stage=stage, le="60.0") == 0
        assert sample(ingester, "cloud_ingest_batch_age_seconds_bucket", stage=stage, le="300.0") == 3


def test_acks_echo_the_batch_incarnation_and_only_when_it_has_one(
    prometheus: Prometheus, edge: Edge, ingesters: Ingesters
) -> None:
    ingesters.start(prometheus.remote_write_url, "incarnation")
    base = now_ms() - 60_000
    stamped = make_batch("node-inc", 1, base)
    stamped.incarnation = 987_654_321
    edge.publish_batch(stamped)
    edge.publish_batch(make_batch("node-old", 1, base))  # a relay that predates incarnations
    assert edge.wait_result("node-inc", 1) == AckResult(1, "ok")
    assert edge.wait_result("node-old", 1) == AckResult(1, "ok")
    with edge._lock:
        by_topic = {t: ack for t, ack in edge.acks}
    assert by_topic[topics.ack_topic(PREFIX, CLUSTER, "node-inc")].incarnation == 987_654_321
    assert by_topic[topics.ack_topic(PREFIX, CLUSTER, "node-old")].incarnation == 0


def test_a_partly_refused_batch_is_acked_with_its_counts_only_to_relays_that_know_them(
    prometheus: Prometheus, edge: Edge, ingesters: Ingesters
) -> None:
    ingester = ingesters.start(prometheus.remote_write_url, "partial")
    base = now_ms() - 60_000
    batches = []
    for node, incarnation in (("node-new", 4242), ("node-old", 0)):
        batch = make_batch(node, 3, base, series=3, scrapes=2)
        # One sample of series 1 an hour ahead: it alone must be refused.
        batch.scrapes[1].timestamps = array("q", [base + 500, base + 3_600_000, base + 500])
        batch.incarnation = incarnation
        edge.publish_batch(batch)
        batches.append(batch)
    reason = edge.wait_result("node-new", 3).reason
    assert reason is not None and reason.startswith("future_timestamp: 1 sample(s)")
    assert edge.wait_result("node-new", 3) == AckResult(3, "partial", reason, 5, 1)
    # A relay without incarnations predates partial acks (it would refuse the ack and publish forever).
    assert edge.wait_result("node-old", 3) == AckResult(3, "ok")

    stored = prometheus.raw_samples(f'{{__name__="{METRIC}",node="node-new"}}')
    assert sum(len(v) for v in stored.values()) == 5
    letters = {d.node: d for d in ingester.dead_letters.list()}
    assert set(letters) == {"node-new", "node-old"}
    stored_letter = ingester.dead_letters.payload(letters["node-new"].id)
    assert stored_letter is not None
    refused = codec.decode_batch(stored_letter[1])
    assert refused.sample_count == 1 and refused.last_timestamp_ms == base + 3_600_000
    assert dict(refused.labelsets[0])["zone"] == "pkg1"
    refused_total = sample(
        ingester, "cloud_ingest_samples_refused_total", node="node-new", reason="future_timestamp"
    )
    assert refused_total == 1
    assert sample(ingester, "cloud_ingest_acks_published_total", result="partial") == 1


# -- 2. retries: 5xx then 2xx, 429 with Retry-After ------------------------------------------------------


def test_5xx_retried_with_identical_bodies_then_acked(
    edge: Edge, receivers: Receivers, ingesters: Ingesters
) -> None:
    mock = receivers(script=(Reply(500, b"boom"), Reply(503), Reply(502, b"bad gateway"), Reply(204)))
    ingester = ingesters.start(mock.url, "retry")
    batch = make_batch("node-r", 3, now_ms() - 60_000)
    edge.publish_batch(batch)

    assert edge.wait_result("node-r", 3) == AckResult(3, "ok")
    assert mock.count() == 4
    bodies = mock.bodies()
    assert all(b == bodies[0] for b in bodies)
    assert decode_write_body(bodies[0]) == expected_samples(batch)
    for request in mock.requests:
        assert request.path == "/api/v1/write"
        assert request.headers["content-encoding"] == "snappy"
        assert request.headers["content-type"] == "application/x-protobuf"
        assert request.headers["x-prometheus-remote-write-version"] == "0.1.0"
        assert request.headers.get("user-agent", "").strip()
    assert edge.results("node-r") == [AckResult(3, "ok")]
    assert sample(ingester, "cloud_ingest_messages_total", outcome="written") == 1
    assert sample(ingester, "cloud_ingest_batches_deferred_total") == 0
    assert ingester.dead_letters.list() == []


def test_429_retry_after_is_honoured(edge: Edge, receivers: Receivers, ingesters: Ingesters) -> None:
    retry_after = 1.0
    mock = receivers(script=(Reply(429, b"slow down", (("Retry-After", "1"),)), Reply(204)))
    # retry_max_seconds caps Retry-After, so it must be above the header's value here.
    ingesters.start(mock.url, "429", remote_write__retry_max_seconds=2)
    edge.publish_batch(make_batch("node-t", 1, now_ms() - 60_000))

    assert edge.wait_result("node-t", 1) == AckResult(1, "ok")
    assert mock.count() == 2
    first, second = mock.requests
    assert first.body == second.body
    assert second.at - first.at >= 0.8 * retry_after


# -- 3. 400: dead-lettered, acked rejected, not retried --------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cloud_ingest.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_400_dead_lettered_and_acked_rejected_without_retry(
    edge: Edge, receivers: Receivers, ingesters: Ingesters
) -> None:
    mock = receivers(Reply(400, b"out of order sample\n"))
    ingester = ingesters.start(mock.url, "reject")
    edge.publish_batch(make_batch("node-x", 5, now_ms() - 60_000))

    result = edge.wait_result("node-x", 5)
    assert result.result == "rejected"
    assert result.reason is not None and result.reason.startswith("HTTP 400")
    assert "out of order sample" in result.reason
    # Not retried: the only further requests are the parts of the batch written to find the refused
    # samples (each refused here too, so all of it is dead-lettered, the original payload as it came).
    parts = sample(ingester, "cloud_ingest_isolation_writes_total")
    assert parts >= 1
    assert never_arrives(lambda: mock.count() > 1 + parts, 1.0), "a 400 must not be retried"
    assert edge.results("node-x") == [result]

    letters: list[DeadLetter] = ingester.dead_letters.list()
    assert [(d.cluster, d.node, d.seq) for d in letters] == [(CLUSTER, "node-x", 5)]
    assert "HTTP 400" in letters[0].reason and "out of order sample" in letters[0].reason
    assert sample(ingester, "cloud_ingest_dead_letters_total", reason="receiver_rejected") == 1
    assert sample(ingester, "cloud_ingest_acks_published_total", result="rejected") == 1

    cli = run_cli("dead-letters", "--config", str(ingesters.config_path(ingester)))
    assert cli.returncode == 0, cli.stderr
    line = next(x for x in cli.stdout.splitlines() if "test/node-x" in x)
    assert " 5 " in line and "HTTP 400: out of order sample" in line


def test_400_with_a_long_body_still_acked_rejected(
    edge: Edge, receivers: Receivers, ingesters: Ingesters
) -> None:
    # Mimir and VictoriaMetrics explain a 400 at length, quoting the series; 300+ chars is ordinary.
    body = (
        b"the sample has been rejected because another sample with a more recent timestamp has already "
        b"been ingested and out-of-order samples are not allowed (err-mimir-sample-out-of-order). The "
        b'affected sample has timestamp 2024-05-01T10:00:00Z and is from series {__name__="'
        + METRIC.encode()
        + b'", cluster="test", node="node-l", zone="pkg0"}'
    )
    assert len(body) > 300
    mock = receivers(Reply(400, body))
    ingesters.start(mock.url, "longreason")
    edge.publish_batch(make_batch("node-l", 1, now_ms() - 60_000))

    result = edge.wait_result("node-l", 1, timeout=8)
    assert result.result == "rejected"
    assert result.reason is not None and result.reason.startswith("HTTP 400")


# -- 4. receiver down for longer than max_retry_seconds --------------------------------------------------


def test_receiver_down_defers_batch_without_ack_and_pubacks_it(
    make_service: ServiceFactory, edge: Edge, ingesters: Ingesters
) -> None:
    port = free_port()  # nothing listens here yet: connection refused
    url = f"http://127.0.0.1:{port}/api/v1/write"
    ingester = ingesters.start(url, "down1", client_id="ingest-down", remote_write__max_retry_seconds=1.5)
    base = now_ms() - 60_000
    first = make_batch("node-d", 1, base)
    edge.publish_batch(first)

    wait_until(lambda: sample(ingester, "cloud_ingest_batches_deferred_total") == 1, 20, message="deferral")
    assert sample(ingester, "cloud_ingest_messages_total", outcome="retry_later") == 1
    assert never_arrives(lambda: edge.results("node-d"), 0.5), "a deferred batch must not be acked"
    assert ingester.dead_letters.list() == []

    prometheus = make_service(Prometheus, port=port)
    # The message was PUBACKed: the same session, reconnected, is not handed it again even though the
    # receiver would now take it.
    ingesters.stop(ingester)
    again = ingesters.start(url, "down2", client_id="ingest-down", remote_write__max_retry_seconds=1.5)
    assert never_arrives(lambda: edge.results("node-d"), 2.0), "the deferred batch was redelivered"
    assert sample(again, "cloud_ingest_messages_total", outcome="written") == 0

    # The edge publishes it again after its ack timeout; a new batch flows too.
    second = make_batch("node-d", 2, base + 5_000)
    edge.publish_batch(first)
    edge.publish_batch(second)
    assert edge.wait_result("node-d", 1) == AckResult(1, "ok")
    assert edge.wait_result("node-d", 2) == AckResult(2, "ok")
    assert edge.results("node-d") == [AckResult(1, "ok"), AckResult(2, "ok")]
    stored = as_expected(prometheus.raw_samples('{node="node-d"}'))
    assert stored == expected_samples(first, second)


# -- 5. hostile and invalid input ------------------------------------------------------------------------


def refusal_lines(caplog: pytest.LogCaptureFixture, node: str, reason: str) -> list[str]:
    topic = topics.batch_topic(PREFIX, CLUSTER, node)
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR
        and f"refused batch on {topic}:" in r.getMessage()
        and f"{reason}" in r.getMessage()
    ]


def test_hostile_input_refused_and_other_nodes_still_served(
    prometheus: Prometheus, edge: Edge, ingesters: Ingesters, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ingester = ingesters.start(prometheus.remote_write_url, "hostile", limits__max_payload_bytes=4096)
    base = now_ms() - 60_000

    def refused(outcomes: int) -> Callable[[], bool]:
        return lambda: sample(ingester, "cloud_ingest_messages_total", outcome="refused") >= outcomes

    # Garbage: refused, dead-lettered, no ack (its seq is unknown), logged once for the node.
    edge.publish_raw("node-a", b"\x00\x01 this is not a batch \xff" * 4)
    edge.publish_raw("node-a", b"GET / HTTP/1.1\r\n\r\n")
    wait_until(refused(2), 20, message="two garbage payloads refused")
    assert sample(ingester, "cloud_ingest_batches_refused_total", reason="bad_magic") == 2
    assert len(refusal_lines(caplog, "node-a", "bad_magic")) == 1

    # The ingester keeps serving other nodes, and the same node.
    good_b = make_batch("node-b", 1, base)
    good_a = make_batch("node-a", 1, base)
    edge.publish_batch(good_b)
    edge.publish_batch(good_a)
    assert edge.wait_result("node-b", 1) == AckResult(1, "ok")
    assert edge.wait_result("node-a", 1) == AckResult(1, "ok")

    # A payload claiming another node: rejected on the ack topic of the node whose topic it came on.
    for seq in (2, 3):
        edge.publish_batch(make_batch("node-x", seq, base + seq * 1000), topic_node="node-a")
    assert edge.wait_result("node-a", 3) == AckResult(3, "rejected", "node_mismatch")
    assert edge.results("node-a")[1:] == [
        AckResult(2, "rejected", "node_mismatch"),
        AckResult(3, "rejected", "node_mismatch"),
    ]
    assert edge.results("node-x") == []
    assert len(refusal_lines(caplog, "node-a", "node_mismatch")) == 1

    # Samples far in the future (max_future_seconds is 600 by default).
    edge.publish_batch(make_batch("node-b", 2, now_ms() + 3_600_000))
    assert edge.wait_result("node-b", 2) == AckResult(2, "rejected", "future_timestamp")

    # Over limits.max_payload_bytes: refused before decoding, so no seq and no ack.
    big = make_batch("node-c", 1, base, series=40, blob_bytes=100)
    payload = codec.encode_batch(big)
    assert len(payload) > 4096
    edge.publish_raw("node-c", payload)
    edge.publish_raw("node-c", payload)
    wait_until(refused(7), 20, message="all refusals processed")
    assert sample(ingester, "cloud_ingest_batches_refused_total", reason="oversized") == 2
    assert len(refusal_lines(caplog, "node-c", "oversized")) == 1

    assert sample(ingester, "cloud_ingest_batches_refused_total", reason="node_mismatch") == 2
    assert sample(ingester, "cloud_ingest_batches_refused_total", reason="future_timestamp") == 1
    assert never_arrives(lambda: edge.results("node-c"), 0.5)
    assert edge.results("node-b") == [AckResult(1, "ok"), AckResult(2, "rejected", "future_timestamp")]

    letters = ingester.dead_letters.list()
    got = sorted((d.node or "", -1 if d.seq is None else d.seq, d.reason.split(":")[0]) for d in letters)
    assert got == sorted(
        [
            ("node-a", -1, "bad_magic"),
            ("node-a", -1, "bad_magic"),
            ("node-a", 2, "node_mismatch"),
            ("node-a", 3, "node_mismatch"),
            ("node-b", 2, "future_timestamp"),
            ("node-c", -1, "oversized"),
            ("node-c", -1, "oversized"),
        ]
    )
    assert sample(ingester, "cloud_ingest_dead_letters_total", reason="bad_magic") == 2

    # Only the two good batches reached Prometheus: nothing under node-x, nothing from the future.
    stored = as_expected(
        prometheus.raw_samples(f'{{__name__="{METRIC}"}}', lookback="4h", at=time.time() + 7200)
    )
    assert stored == expected_samples(good_a, good_b)


# -- 6. PUBACK only after the outcome is final: a replica killed mid-write -------------------------------


@pytest.mark.parametrize("replacement", ["same_client_id", "other_client_id"])
def test_unfinished_batch_survives_a_killed_replica(
    replacement: str, edge: Edge, receivers: Receivers, programs: Programs
) -> None:
    mock = receivers(Reply(hang=True))
    long_session = {"mqtt__session_expiry_seconds": 3600, "remote_write__timeout_seconds": 30}
    a = programs.start("ingest-a", mock.url, "ingest-a", **long_session)
    batch = make_batch("node-k", 1, now_ms() - 60_000)
    edge.publish_batch(batch)
    wait_until(lambda: mock.count() >= 1, 20, message="replica A posts the batch")
    a.program.kill()  # SIGKILL while the write hangs: no ack, no PUBACK
    assert edge.results("node-k") == []
    mock.default = Reply(204)
    mock.release.set()

    if replacement == "same_client_id":
        # The restarted replica resumes A's session; mosquitto redelivers the un-PUBACKed message.
        b = programs.start("ingest-a-restarted", mock.url, "ingest-a", **long_session)
        assert edge.wait_result("node-k", 1) == AckResult(1, "ok")
        assert never_arrives(lambda: len(edge.results("node-k")) > 1, 2.0)
        assert b.value("cloud_ingest_messages_total", outcome="written") == 1
    else:
        # Another member of the share group: mosquitto 2.0.11 does not hand it A's unfinished message.
        programs.start("ingest-b", mock.url, "ingest-b", **long_session)
        assert never_arrives(lambda: mock.count() > 1 or edge.results("node-k"), 3.0)
        # The edge publishes the batch again after its ack timeout (short here) until it is acked;
        # round-robin parks some copies with the dead A too.
        for _ in range(6):
            edge.publish_batch(batch)
            with contextlib.suppress(TimeoutError):
                edge.wait_result("node-k", 1, timeout=2.0)
                break
        assert edge.wait_result("node-k", 1, timeout=1) == AckResult(1, "ok")
        assert never_arrives(lambda: len(edge.results("node-k")) > 1, 2.0)
        # Parked, not lost: when A's client id comes back, its session delivers the copies it holds.
        programs.start("ingest-a-back", mock.url, "ingest-a", **long_session)
        wait_until(lambda: len(edge.results("node-k")) > 1, 20, message="A's parked copies")
        assert set(edge.results("node-k")) == {AckResult(1, "ok")}

    # Every write carried the same bytes (duplicates at the receiver are fine: writes are idempotent).
    bodies = mock.bodies()
    assert len(bodies) >= 2 and all(body == bodies[0] for body in bodies)
    assert decode_write_body(bodies[0]) == expected_samples(batch)


# -- 7. per-node ordering --------------------------------------------------------------------------------


def seqs_written(mock: MockReceiver, node: str, base: int) -> list[int]:
    """The seq of every request carrying ``node``'s samples, consecutive repeats (retries) collapsed."""
    out: list[int] = []
    for body in mock.bodies():
        for labels, samples in decode_write_body(body).items():
            if ("node", node) in labels:
                seq = (min(ts for ts, _ in samples) - base) // 1000
                if not out or out[-1] != seq:
                    out.append(seq)
                break
    return out


def test_batches_of_one_node_written_in_publish_order(
    edge: Edge, receivers: Receivers, ingesters: Ingesters
) -> None:
    # A slow receiver that fails now and then, so batches queue up behind each other and get retried.
    script = tuple(Reply(503) if i % 5 == 2 else Reply(204, delay=0.02) for i in range(12))
    mock = receivers(Reply(204, delay=0.01), script)
    ingesters.start(mock.url, "order", workers=2)
    base = (now_ms() - 120_000) // 1000 * 1000
    count = 8
    for seq in range(1, count + 1):
        for node in ("node-p", "node-q", "node-s"):
            edge.publish_batch(make_batch(node, seq, base + seq * 1000, scrapes=1))

    for node in ("node-p", "node-q", "node-s"):
        edge.wait_result(node, count)
        assert [r.seq for r in edge.results(node)] == list(range(1, count + 1))
        assert {r.result for r in edge.results(node)} == {"ok"}
        assert seqs_written(mock, node, base) == list(range(1, count + 1))


# -- 8. retained status ----------------------------------------------------------------------------------


def test_retained_status_updates_node_gauges(edge: Edge, receivers: Receivers, ingesters: Ingesters) -> None:
    edge.publish_status("node-s1", "online", spool_rows=42)  # retained before any ingester runs
    ingester = ingesters.start(receivers().url, "status")

    def gauges(node: str) -> tuple[float | None, float | None]:
        labels = {"cluster": CLUSTER, "node": node}
        registry = ingester.metrics.registry
        return (
            registry.get_sample_value("cloud_ingest_node_online", labels),
            registry.get_sample_value("cloud_ingest_node_backlog_batches", labels),
        )

    wait_until(lambda: gauges("node-s1") == (1, 42), 10, message="retained online status of node-s1")

    edge.publish_status("node-s1", "offline", spool_rows=5)
    wait_until(lambda: gauges("node-s1") == (0, 5), 10, message="offline status of node-s1")

    edge.publish_status("node-s2", "online", spool_rows=0)
    wait_until(lambda: gauges("node-s2") == (1, 0), 10, message="online status of node-s2")

    # A malformed status and a cleared retained message change nothing; the next good one still counts.
    edge.publish(topics.status_topic(PREFIX, CLUSTER, "node-s1"), b'{"v":1,"state":"online"', retain=True)
    edge.publish(topics.status_topic(PREFIX, CLUSTER, "node-s2"), b"", retain=True)
    edge.publish_status("node-s3", "online", spool_rows=3)
    wait_until(lambda: gauges("node-s3") == (1, 3), 10, message="online status of node-s3")
    assert gauges("node-s1") == (0, 5)
    assert gauges("node-s2") == (1, 0)
    assert ingester.dead_letters.list() == []
