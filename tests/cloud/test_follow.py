"""Live mode on the ingester (issue 13): stream state, following, ``need_state``
(cloud_ingest/pipeline/stream_state.py, cloud_ingest/intake/mqtt/follow.py).

Unit tests of ``StreamState`` / ``Follower`` (LRU, keep, the decode cache, the wait for the follow path,
hostile frames; a hypothesis model of the two deliveries interleaved), then integration tests on a real
mosquitto and a real Prometheus (module-scoped) with in-process ingesters: the test plays the relay with
a ``StreamEncoder`` and paho (QoS 1 on the batch topic, ``inc`` in the header), as
``tests/cloud/test_ingest.py``
does with v2 batches. Each integration test uses its own share group, client ids and node, so the
sessions that stopped replicas leave at the broker do not reach into the next test.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from cloud_ingest.intake.mqtt.follow import Follower
from cloud_ingest.intake.mqtt.session import MqttSession
from cloud_ingest.intake.mqtt.subscriber import FOLLOW_ID, SHARED_ID, Subscriber
from cloud_ingest.pipeline.finish import replayable
from cloud_ingest.pipeline.stream_state import StreamState, is_v3
from cloud_ingest.selfmetrics import IngestMetrics
from schemas import codec, topics
from schemas.codec import AckResult, DecodeError, StreamEncoder
from schemas.codec.stream import frame_ids
from schemas.model import Batch
from testkit import batches
from testkit.ingest_harness import (
    PREFIX,
    Edge,
    MockReceiver,
    Reply,
    as_expected,
    expected_samples,
    sample,
    write_config,
)
from testkit.services import Mosquitto, Prometheus, ServiceFactory, now_ms, wait_until

CLUSTER = "test"
METRIC = "follow_test_value"
T0 = 1_700_000_000_000


def make_batch(node: str, seq: int, ts_ms: int, *, cluster: str = CLUSTER, inc: int = 0) -> Batch:
    """3..5 series (one comes and goes: dictionary churn) x 2 scrapes; values unique per sample."""
    return batches.make_batch(
        node, seq, ts_ms, cluster=cluster, metric=METRIC, series=3 + seq % 3, zone="z", incarnation=inc
    )


def chain(node: str, n: int, *, cluster: str = CLUSTER, start: int = 1) -> tuple[list[Batch], list[bytes]]:
    enc = StreamEncoder(cluster, node)
    batches = [make_batch(node, s, T0 + 5000 * s, cluster=cluster) for s in range(start, start + n)]
    return batches, [enc.encode(b) for b in batches]


def view(batch: Batch) -> tuple[Any, ...]:
    return (
        batch.cluster,
        batch.node,
        batch.seq,
        sorted(
            (batch.labelsets[i], b.sample_timestamp(j), b.values[j])
            for b in batch.scrapes
            for j, i in enumerate(b.series)
        ),
    )


def need_state(fn: Any) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        fn()
    assert info.value.reason == "need_state"
    return info.value


# -- StreamState ----------------------------------------------------------------------------------------


def test_follow_then_shared_decodes_each_frame_once() -> None:
    metrics = IngestMetrics()
    state = StreamState(wait_s=0, metrics=metrics)
    batches, frames = chain("n1", 6)
    assert all(is_v3(f) for f in frames)
    for frame in frames:
        assert state.advance(CLUSTER, "n1", frame) == "decoded"
    for batch, frame in zip(batches, frames, strict=True):
        assert view(state.decode(frame)) == view(batch)
        assert state.advance(CLUSTER, "n1", frame) == "cached"  # a late follow copy
    assert state.decodes == len(frames)
    assert state.nodes == 1
    assert metrics.registry.get_sample_value("cloud_ingest_stream_state_nodes") == 1


def test_shared_path_alone_advances_the_state() -> None:
    state = StreamState(wait_s=0)
    batches, frames = chain("n1", 5)
    for batch, frame in zip(batches, frames, strict=True):
        assert view(state.decode(frame)) == view(batch)
    need_state(lambda: StreamState(wait_s=0).decode(frames[3]))  # another replica: no key frame


def test_v1_v2_need_no_state() -> None:
    state = StreamState(wait_s=5)
    batch = make_batch("n1", 1, T0)
    for version in (codec.FORMAT_V1, codec.FORMAT_V2):
        data = codec.encode_batch(batch, version=version)
        assert not is_v3(data)
        assert view(state.decode(data)) == view(batch)
        assert state.advance(CLUSTER, "n1", data) == "ignored"
    assert state.decodes == 0 and state.nodes == 0


def test_decoded_batches_are_copies() -> None:
    state = StreamState(wait_s=0)
    batches, frames = chain("n1", 2)
    first = state.decode(frames[0])
    first.labelsets = []  # what decode.py's identity pinning does: rebinding
    first.seq = 99
    again = state.decode(frames[0])
    assert view(again) == view(batches[0])


def test_the_shared_copy_waits_for_the_follow_path() -> None:
    state = StreamState(wait_s=5)
    batches, frames = chain("n1", 4)
    for frame in frames[:2]:
        state.advance(CLUSTER, "n1", frame)
    result: dict[str, Any] = {}

    def shared() -> None:
        started = time.monotonic()
        result["batch"] = state.decode(frames[3])  # needs frame 2's state: not decoded yet
        result["s"] = time.monotonic() - started

    t = threading.Thread(target=shared)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()
    assert state.advance(CLUSTER, "n1", frames[2]) == "decoded"
    t.join(5)
    assert view(result["batch"]) == view(batches[3])
    assert 0.15 < result["s"] < 2
    assert state.advance(CLUSTER, "n1", frames[3]) == "cached"
    assert state.decodes == 4


def test_a_timed_out_wait_is_not_repeated_until_the_node_moves() -> None:
    state = StreamState(wait_s=0.3)
    _, frames = chain("n1", 6)
    started = time.monotonic()
    need_state(lambda: state.decode(frames[2]))
    assert time.monotonic() - started >= 0.3
    started = time.monotonic()
    need_state(lambda: state.decode(frames[3]))  # the node is stuck: no second wait
    need_state(lambda: state.decode(frames[4]))
    assert time.monotonic() - started < 0.2
    # A key frame decodes: the node moves, the next frame that lacks its base waits again.
    _, fresh = chain("n1", 3, start=10)
    state.decode(fresh[0])
    started = time.monotonic()
    need_state(lambda: state.decode(fresh[2]))
    assert time.monotonic() - started >= 0.3
    assert view(state.decode(fresh[1])) is not None


def test_a_replica_that_lost_the_chain_does_not_wait() -> None:
    """After a restart the follow copies fail too: a shared copy whose own follow copy (or its base's)
    already failed is refused at once, and one that came first stops waiting when its copy fails."""
    state = StreamState(wait_s=5)
    _, frames = chain("n1", 6)
    assert state.advance(CLUSTER, "n1", frames[2]) == "need_state"  # the chain began before us
    started = time.monotonic()
    need_state(lambda: state.decode(frames[2]))  # its own follow copy failed
    assert state.advance(CLUSTER, "n1", frames[3]) == "need_state"
    need_state(lambda: state.decode(frames[4]))  # its base's follow copy failed
    assert time.monotonic() - started < 0.5
    need_state(lambda: state.decode(frames[5]))  # the base of this one failed just above
    assert time.monotonic() - started < 0.5
    _, other = chain("n2", 4)
    result: dict[str, Any] = {}

    def shared() -> None:
        t0 = time.monotonic()
        with pytest.raises(DecodeError) as info:
            state.decode(other[2])
        result["s"], result["reason"] = time.monotonic() - t0, info.value.reason

    t = threading.Thread(target=shared)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting: the follow copy of its base may still come
    assert state.advance(CLUSTER, "n2", other[2]) == "need_state"  # its own came, and failed
    t.join(5)
    assert result["reason"] == "need_state" and 0.25 < result["s"] < 2
    assert state.decodes == 0


def test_frame_ids_name_the_state_without_decoding() -> None:
    _, frames = chain("n1", 3)
    decoder = codec.StreamDecoder()
    sids = [decoder.decode_with_header(f)[2] for f in frames]
    assert codec.frame_base(frames[0]) is None
    assert [frame_ids(f) for f in frames] == [(None, sids[0]), (sids[0], sids[1]), (sids[1], sids[2])]
    with pytest.raises(DecodeError):
        frame_ids(codec.encode_batch(make_batch("n1", 1, T0)))


def test_lru_forgets_whole_nodes() -> None:
    metrics = IngestMetrics()
    state = StreamState(max_nodes=2, wait_s=0, cache_samples=0, protect_s=0, metrics=metrics)
    frames = {node: chain(node, 3)[1] for node in ("a", "b", "c")}
    state.decode(frames["a"][0])
    state.decode(frames["b"][0])
    state.decode(frames["a"][1])  # a is now the most recently used
    state.decode(frames["c"][0])  # evicts b
    assert state.nodes == 2
    need_state(lambda: state.decode(frames["b"][1]))
    assert state.decode(frames["a"][2]).seq == 3
    assert state.decode(frames["c"][1]).seq == 2
    assert metrics.registry.get_sample_value("cloud_ingest_stream_state_evictions_total") == 1


def test_keep_bounds_how_far_back_a_redelivery_finds_its_base() -> None:
    state = StreamState(keep=3, wait_s=0, cache_samples=0)  # no cache: only the states answer
    batches, frames = chain("n1", 6)
    for frame in frames:
        state.decode(frame)  # holds the states frames 4, 5 and 6 left
    assert view(state.decode(frames[5])) == view(batches[5])  # base: the state of frame 5
    assert view(state.decode(frames[4])) == view(batches[4])  # base: frame 4's
    need_state(lambda: state.decode(frames[3]))  # base: frame 3's, gone
    assert view(state.decode(frames[5])) == view(batches[5])  # the newest state is still held


def test_the_decode_cache_is_bounded() -> None:
    state = StreamState(wait_s=0, cache_entries=3)
    _, frames = chain("n1", 10)
    for frame in frames:
        state.advance(CLUSTER, "n1", frame)
    assert len(state._cache) == 3
    small = StreamState(wait_s=0, cache_samples=20)  # 3..5 series x 2 scrapes per frame
    for frame in frames:
        small.advance(CLUSTER, "n1", frame)
    assert small._cached_samples <= 20 and len(small._cache) >= 1
    assert small.advance(CLUSTER, "n1", frames[-1]) == "cached"


def test_follow_copies_are_checked_against_their_topic() -> None:
    state = StreamState(wait_s=0)
    _, frames = chain("n1", 2)
    assert state.advance(CLUSTER, "other", frames[0]) == "invalid"
    assert state.advance("elsewhere", "n1", frames[0]) == "invalid"
    assert state.nodes == 0
    assert state.advance(CLUSTER, "n1", b"ERB\x03garbage") == "invalid"
    assert state.advance(CLUSTER, "n1", frames[1]) == "need_state"


def test_a_refused_frame_is_remembered_and_refused_the_same_again() -> None:
    state = StreamState(wait_s=0)
    _, frames = chain("n1", 1)
    bad = bytearray(frames[0])
    bad[-3] ^= 0xFF  # inside the compressed body
    with pytest.raises(DecodeError) as first:
        state.decode(bytes(bad))
    with pytest.raises(DecodeError) as second:
        state.decode(bytes(bad))
    assert first.value.reason == second.value.reason != "need_state"
    assert state.decodes == 0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_two_deliveries_interleaved_model(data: st.DataObject) -> None:
    """Follow copies (some lost) and shared copies (a subset) in any interleaving that keeps each
    delivery's own order: a shared frame decodes exactly iff its predecessor was decoded by either
    path (or it is a key frame), else it is need_state; every frame is decoded at most once."""
    n = data.draw(st.integers(2, 12))
    enc = StreamEncoder(CLUSTER, "n1", keyframe_every=data.draw(st.integers(2, 20)))
    batches = [make_batch("n1", s, T0 + 5000 * s) for s in range(1, n + 1)]
    frames = [enc.encode(b) for b in batches]
    keys = {i for i, f in enumerate(frames) if codec.frame_base(f) is None}
    follow = [i for i in range(n) if data.draw(st.booleans(), label=f"follow copy {i} arrives")]
    shared = [i for i in range(n) if data.draw(st.booleans(), label=f"shared copy {i}")]
    events: list[tuple[str, int]] = []
    fi = si = 0
    while fi < len(follow) or si < len(shared):
        take_follow = si >= len(shared) or (fi < len(follow) and data.draw(st.booleans()))
        if take_follow:
            events.append(("follow", follow[fi]))
            fi += 1
        else:
            events.append(("shared", shared[si]))
            si += 1
    state = StreamState(wait_s=0, keep=64)
    decoded: set[int] = set()
    for path, i in events:
        decodable = i in keys or (i - 1) in decoded
        if path == "follow":
            outcome = state.advance(CLUSTER, "n1", frames[i])
            expect = "cached" if i in decoded else "decoded" if decodable else "need_state"
            assert outcome == expect
        elif i in decoded or decodable:
            assert view(state.decode(frames[i])) == view(batches[i])
        else:
            need_state(lambda i=i: state.decode(frames[i]))
        if decodable:
            decoded.add(i)
    assert state.decodes == len(decoded)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 400), st.integers(0, 255))
def test_hostile_frames_are_refused_with_a_reason(blob: bytes, pos: int, xor: int) -> None:
    state = StreamState(wait_s=0)
    _, frames = chain("n1", 2)
    state.decode(frames[0])
    mutated = bytearray(frames[1])
    mutated[pos % len(mutated)] ^= xor
    for payload in (b"ERB\x03" + blob, bytes(mutated), blob):
        try:
            state.decode(payload)
        except DecodeError as e:
            assert e.reason in codec.REASONS
            assert not e.message.startswith("unhandled"), e
        assert state.advance(CLUSTER, "n1", payload) in {
            "decoded",
            "cached",
            "need_state",
            "invalid",
            "ignored",
        }


def test_replayable_keeps_no_v3_frame() -> None:
    batches, frames = chain("n1", 2)
    v2 = codec.encode_batch(batches[0])
    assert replayable(v2, None, codec.DEFAULT_LIMITS) is v2
    letter = replayable(frames[1], batches[1], codec.DEFAULT_LIMITS)
    assert letter is not None and letter[3] == codec.FORMAT_V2
    assert view(codec.decode_batch(letter)) == view(batches[1])
    assert replayable(frames[1], None, codec.DEFAULT_LIMITS) is None


# -- Follower -------------------------------------------------------------------------------------------


def _message(topic: str, payload: bytes) -> Any:
    return SimpleNamespace(topic=topic, payload=payload, qos=0)


def test_follower_decodes_in_order_and_drops_when_full() -> None:
    metrics = IngestMetrics()
    state = StreamState(wait_s=0)
    follower = Follower(state, PREFIX, threads=2, metrics=metrics)
    follower.start()
    try:
        chains = {node: chain(node, 8) for node in ("a", "b", "c")}
        for i in range(8):
            for node, (_, frames) in chains.items():
                follower.submit(_message(topics.batch_topic(PREFIX, CLUSTER, node), frames[i]))
        follower.submit(
            _message(topics.batch_topic(PREFIX, CLUSTER, "a"), codec.encode_batch(make_batch("a", 1, T0)))
        )
        follower.submit(_message(f"{PREFIX}/v1/{CLUSTER}/a/status", chains["a"][1][0]))
        wait_until(lambda: sum(follower.outcomes.values()) == 26, 10)
        assert follower.outcomes == {"decoded": 24, "ignored": 1, "invalid": 1}
        assert (
            metrics.registry.get_sample_value("cloud_ingest_frames_followed_total", {"outcome": "decoded"})
            == 24
        )
        for _, (batches, frames) in chains.items():
            assert view(state.decode(frames[-1])) == view(batches[-1])  # cached
        assert state.decodes == 24
    finally:
        follower.stop()
    tiny = Follower(StreamState(wait_s=0), PREFIX, max_queued_bytes=10)  # never started: stays full
    tiny.submit(_message(topics.batch_topic(PREFIX, CLUSTER, "a"), chains["a"][1][0]))
    assert tiny.outcomes == {"dropped": 1}


# -- Subscriber: telling the deliveries apart ---------------------------------------------------------


class _Recorder:
    """Stands for every part the subscriber routes to; notes what each was handed in ``got``."""

    def __init__(self, got: list[tuple[str, Any]]) -> None:
        self.got = got

    def offer(self, m: Any) -> None:
        self.got.append(("batch", m))

    def status(self, m: Any) -> None:
        self.got.append(("status", m))

    def submit(self, m: Any) -> None:
        self.got.append(("follow", m))

    def following(self, on: bool) -> None:
        self.got.append(("following", on))


def _subscriber(group: str | None, follow: bool, got: list[tuple[str, Any]]) -> Subscriber:
    session = MqttSession(
        host="127.0.0.1",
        port=1,
        client_id="t",
        keepalive_seconds=5,
        session_expiry_seconds=0,
        receive_maximum=4,
        reconnect_min_seconds=1,
        reconnect_max_seconds=1,
    )
    parts: Any = _Recorder(got)
    return Subscriber(
        session,
        prefix=PREFIX,
        share_group=group,
        batches=parts,
        statuses=parts,
        follow=follow,
        follower=parts,
    )


@pytest.mark.parametrize(
    ("ids", "route"),
    [([FOLLOW_ID], "follow"), ([SHARED_ID], "batch"), ([SHARED_ID, FOLLOW_ID], "batch"), (None, "batch")],
)
def test_subscription_identifiers_route_the_deliveries(ids: list[int] | None, route: str) -> None:
    got: list[tuple[str, Any]] = []
    sub = _subscriber("g", True, got)
    props = SimpleNamespace(SubscriptionIdentifier=ids) if ids is not None else SimpleNamespace()
    message = SimpleNamespace(
        topic=topics.batch_topic(PREFIX, CLUSTER, "n"), payload=b"", qos=0, properties=props
    )
    sub._on_message(sub.client, None, message)  # type: ignore[arg-type]
    assert [kind for kind, _ in got] == [route]


class _FakeClient:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any]] = []

    def subscribe(self, topic: Any, qos: int = 0, properties: Any = None) -> tuple[int, int]:
        ids = getattr(properties, "SubscriptionIdentifier", None)
        self.calls.append(
            ("subscribe", topic if isinstance(topic, str) else [t for t, _ in topic], (qos, ids))
        )
        return 0, 1

    def unsubscribe(self, topic: str) -> tuple[int, int]:
        self.calls.append(("unsubscribe", topic, None))
        return 0, 1


@pytest.mark.parametrize(
    ("group", "follow", "connack", "expect"),
    [
        ("g", True, SimpleNamespace(), [("subscribe", "edgemetrics/v1/+/+/batch", (0, [FOLLOW_ID]))]),
        ("g", False, SimpleNamespace(), [("unsubscribe", "edgemetrics/v1/+/+/batch", None)]),
        (
            "g",
            True,
            SimpleNamespace(SubscriptionIdentifierAvailable=0),
            [("unsubscribe", "edgemetrics/v1/+/+/batch", None)],
        ),
        (None, True, SimpleNamespace(), []),
    ],
)
def test_the_follow_subscription_comes_first_and_only_with_a_group(
    group: str | None, follow: bool, connack: Any, expect: list[Any]
) -> None:
    sub = _subscriber(group, follow, [])
    client = _FakeClient()
    sub._on_connect(
        client, None, SimpleNamespace(session_present=False), SimpleNamespace(is_failure=False), connack
    )  # type: ignore[arg-type]
    shared = ("subscribe", [sub.batch_filter, sub.status_filter], (0, [SHARED_ID]))
    assert client.calls == [*expect, shared]
    assert sub.following == (expect[:1] == [("subscribe", "edgemetrics/v1/+/+/batch", (0, [FOLLOW_ID]))])


def test_a_refused_follow_subscription_stops_the_waiting() -> None:
    got: list[tuple[str, Any]] = []
    sub = _subscriber("g", True, got)
    client = _FakeClient()
    connack = SimpleNamespace()
    sub._on_connect(
        client, None, SimpleNamespace(session_present=True), SimpleNamespace(is_failure=False), connack
    )  # type: ignore[arg-type]
    assert sub.following and got == [("following", True)]
    sub._on_subscribe(client, None, 99, [SimpleNamespace(is_failure=True)], None)  # type: ignore[arg-type]
    assert sub.following  # another subscription's answer
    sub._on_subscribe(client, None, 1, [SimpleNamespace(is_failure=True)], None)  # type: ignore[arg-type]
    assert not sub.following and got[-1] == ("following", False)


# -- integration: real mosquitto + Prometheus --------------------------------------------------------------


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Mosquitto, Prometheus]]:
    factory = ServiceFactory(tmp_path_factory.mktemp("follow-services"))
    try:
        yield factory(Mosquitto), factory(Prometheus)
    finally:
        factory.stop_all()


@pytest.fixture
def edge(services: tuple[Mosquitto, Prometheus]) -> Iterator[Edge]:
    e = Edge(services[0])
    yield e
    e.close()


class Replicas:
    def __init__(self, tmp_path: Path, services: tuple[Mosquitto, Prometheus]) -> None:
        self.tmp_path, (self.broker, self.prometheus) = tmp_path, services
        self.running: list[Ingester] = []

    def start(self, name: str, group: str, **overrides: Any) -> Ingester:
        opts = {"mqtt__share_group": group, "mqtt__session_expiry_seconds": 0, **overrides}
        path = write_config(self.tmp_path / name, self.broker, self.prometheus.remote_write_url, name, **opts)
        ingester = Ingester(settings_mod.load(str(path)))
        self.running.append(ingester)
        ingester.start()
        wait_until(
            lambda: sample(ingester, "cloud_ingest_node_online", cluster="test", node="probe") == 1,
            20,
            message=f"ingester {name} subscribed",
        )
        return ingester

    def stop_all(self) -> None:
        for ingester in self.running:
            ingester.stop()


@pytest.fixture
def replicas(tmp_path: Path, services: tuple[Mosquitto, Prometheus], edge: Edge) -> Iterator[Replicas]:
    group = Replicas(tmp_path, services)
    yield group
    group.stop_all()


class Relay:
    """The relay's side of live mode: a ``StreamEncoder`` per node, frames published QoS 1."""

    INC = 4242

    def __init__(self, edge: Edge, node: str) -> None:
        self.edge, self.node = edge, node
        self.encoder = StreamEncoder(CLUSTER, node)
        self.base_ms = now_ms() - 300_000
        self.batches: dict[int, Batch] = {}

    def batch(self, seq: int) -> Batch:
        return self.batches.setdefault(
            seq, make_batch(self.node, seq, self.base_ms + 5000 * seq, inc=self.INC)
        )

    def publish(self, seq: int, *, key: bool = False) -> None:
        self.edge.publish_raw(self.node, self.encoder.encode(self.batch(seq), key=key))

    def resend(self, seq: int) -> None:
        """What the relay does on need_state: the seq self-contained, the chain untouched."""
        self.edge.publish_raw(self.node, self.encoder.self_contained(self.batch(seq)))

    def wait_acks(self, seqs: list[int], timeout: float = 20) -> dict[int, list[AckResult]]:
        def done() -> dict[int, list[AckResult]] | None:
            got: dict[int, list[AckResult]] = {}
            for r in self.edge.results(self.node):
                got.setdefault(r.seq, []).append(r)
            return got if all(s in got for s in seqs) else None

        return wait_until(done, timeout, message=f"acks of {self.node} seqs {seqs}")

    def wait_ok(self, seqs: list[int], timeout: float = 20) -> None:
        def done() -> bool:
            ok = {r.seq for r in self.edge.results(self.node) if r.result == "ok"}
            return ok.issuperset(seqs)

        wait_until(done, timeout, message=f"ok acks of {self.node} seqs {seqs}")

    def stored(self, prometheus: Prometheus) -> dict[Any, Any]:
        return as_expected(prometheus.raw_samples(f'{{__name__="{METRIC}",node="{self.node}"}}', "1h"))


def _acks(ingester: Ingester, result: str) -> float:
    return sample(ingester, "cloud_ingest_acks_published_total", result=result)


@pytest.mark.integration
def test_two_followers_split_a_chain_of_delta_frames(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    a = replicas.start("follow-a0", "g-split")
    b = replicas.start("follow-a1", "g-split")
    relay = Relay(edge, "live-split")
    seqs = list(range(1, 13))
    for seq in seqs:
        relay.publish(seq)
    acks = relay.wait_acks(seqs)
    assert {seq: [r.result for r in results] for seq, results in acks.items()} == {s: ["ok"] for s in seqs}
    assert relay.stored(services[1]) == expected_samples(*relay.batches.values())
    # Each replica acked only its share, and both had one: every delta frame whose predecessor went to
    # the other replica decoded against the state the follow path built.
    assert _acks(a, "ok") + _acks(b, "ok") == len(seqs)
    assert _acks(a, "ok") > 0 and _acks(b, "ok") > 0
    for replica in (a, b):
        followed = {
            outcome: sample(replica, "cloud_ingest_frames_followed_total", outcome=outcome)
            for outcome in ("decoded", "cached", "need_state", "dropped", "invalid")
        }
        assert followed["decoded"] + followed["cached"] == len(seqs), followed
        assert followed["need_state"] == followed["dropped"] == followed["invalid"] == 0
        assert replica.stream.decodes == len(seqs)  # each frame decoded once of its two deliveries
        assert sample(replica, "cloud_ingest_need_state_total") == 0
        assert sample(replica, "cloud_ingest_batches_refused_total", reason="qos0") == 0
        assert sample(replica, "cloud_ingest_stream_state_nodes") == 1
        assert replica.admission.held == 0
        assert replica.dead_letters.list() == []
    with edge._lock:
        assert all(ack.incarnation == Relay.INC for _, ack in edge.acks if ack.node == relay.node)


@pytest.mark.integration
def test_a_replica_that_missed_the_key_frame_acks_need_state(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    early = replicas.start("follow-b0", "g-late", stream__state_wait_seconds=1)
    relay = Relay(edge, "live-late")
    for seq in range(1, 5):
        relay.publish(seq)
    relay.wait_acks([1, 2, 3, 4])
    late = replicas.start("follow-b1", "g-late", stream__state_wait_seconds=1)
    started = time.monotonic()
    seqs = list(range(5, 13))
    for seq in seqs:
        relay.publish(seq)
    acks = relay.wait_acks(seqs)
    assert time.monotonic() - started < 8  # one wait of 1 s, then the stuck node is refused at once
    results = {seq: [r.result for r in acks[seq]] for seq in seqs}
    assert all(len(r) == 1 for r in results.values()), results
    missing = [seq for seq in seqs if results[seq] == ["need_state"]]
    assert missing, results  # round robin gave the late replica some of them
    assert all(results[seq] == ["ok"] for seq in seqs if seq not in missing)
    assert sample(late, "cloud_ingest_need_state_total") == len(missing)
    assert _acks(late, "need_state") == len(missing) and _acks(late, "ok") == 0
    assert sample(late, "cloud_ingest_frames_followed_total", outcome="need_state") == len(seqs)
    assert sample(early, "cloud_ingest_need_state_total") == 0
    assert late.dead_letters.list() == [] and early.dead_letters.list() == []
    assert sample(late, "cloud_ingest_messages_total", outcome="need_state") == len(missing)
    # The relay re-sends those seqs self-contained and makes its next frame a key frame: from then on
    # both replicas follow the new chain.
    for seq in missing:
        relay.resend(seq)
    relay.publish(13, key=True)
    for seq in range(14, 19):
        relay.publish(seq)
    final = relay.wait_acks(list(range(13, 19)))
    relay.wait_ok(missing)
    assert all([r.result for r in final[s]] == ["ok"] for s in range(13, 19))
    assert sample(late, "cloud_ingest_need_state_total") == len(missing)
    assert _acks(late, "ok") > 0
    assert relay.stored(services[1]) == expected_samples(*relay.batches.values())


@pytest.mark.integration
def test_without_following_a_share_group_acks_need_state(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    a = replicas.start("follow-c0", "g-nofollow", mqtt__follow=False)
    b = replicas.start("follow-c1", "g-nofollow", mqtt__follow=False)
    relay = Relay(edge, "live-nofollow")
    seqs = list(range(1, 9))
    started = time.monotonic()
    for seq in seqs:
        relay.publish(seq)
    acks = relay.wait_acks(seqs)
    assert time.monotonic() - started < 5  # nothing follows: no waiting for a base
    results = {seq: [r.result for r in acks[seq]] for seq in seqs}
    assert results[1] == ["ok"]  # the key frame decodes anywhere
    missing = [seq for seq in seqs if results[seq] == ["need_state"]]
    assert missing and all(results[s] in (["ok"], ["need_state"]) for s in seqs), results
    assert sample(a, "cloud_ingest_need_state_total") + sample(b, "cloud_ingest_need_state_total") == len(
        missing
    )
    for replica in (a, b):
        assert not replica.subscriber.following
        assert sample(replica, "cloud_ingest_frames_followed_total", outcome="decoded") == 0
        assert replica.dead_letters.list() == []
    for seq in missing:
        relay.resend(seq)
    relay.wait_ok(missing)
    assert relay.stored(services[1]) == expected_samples(*relay.batches.values())


@pytest.mark.integration
def test_a_v3_frame_the_receiver_rejects_is_dead_lettered_as_v2(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    """Samples far in the future are dead-lettered: as a v2 batch, which a replay can decode."""
    replica = replicas.start("follow-d0", "g-letter", limits__max_future_seconds=60)
    relay = Relay(edge, "live-letter")
    relay.publish(1)
    future = make_batch(relay.node, 2, now_ms() + 3_600_000, inc=Relay.INC)
    relay.batches[2] = future
    relay.publish(2)
    acks = relay.wait_acks([1, 2])
    assert [r.result for r in acks[2]] == ["rejected"]
    (letter,) = replica.dead_letters.list()
    stored = replica.dead_letters.payload(letter.id)
    assert stored is not None
    payload = stored[1]
    assert payload[3] == codec.FORMAT_V2
    assert view(codec.decode_batch(payload))[3] == view(future)[3]


@pytest.mark.integration
def test_the_state_a_frame_leaves_is_kept_when_its_write_fails(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    """No share group (one delivery, nothing follows): frame 2's write gives up (503s, not acked), yet
    frame 3 decodes against the state frame 2 left, and frame 2 published again is written."""
    receiver = MockReceiver()
    try:
        replica = replicas.start(
            "follow-e0",
            "",
            remote_write__url=receiver.url,
            remote_write__max_retry_seconds=0.3,
            remote_write__retry_max_seconds=0.1,
        )
        relay = Relay(edge, "live-kept")
        relay.publish(1)
        relay.wait_acks([1])
        receiver.default = Reply(503)
        first = relay.encoder.encode(relay.batch(2))
        relay.edge.publish_raw(relay.node, first)
        wait_until(lambda: sample(replica, "cloud_ingest_messages_total", outcome="retry_later") == 1, 10)
        receiver.default = Reply()
        relay.publish(3)
        assert [r.result for r in relay.wait_acks([3])[3]] == ["ok"]
        relay.edge.publish_raw(relay.node, first)  # the relay's re-send after its ack timeout
        assert [r.result for r in relay.wait_acks([2])[2]] == ["ok"]
        assert sample(replica, "cloud_ingest_need_state_total") == 0
        assert not replica.subscriber.following and replica.stream.wait_s == 0
        assert replica.stream.decodes == 3  # the re-sent frame 2 came from the decode cache
    finally:
        receiver.close()


@pytest.mark.integration
def test_a_v3_frame_the_receiver_refuses_is_dead_lettered_as_v2(
    services: tuple[Mosquitto, Prometheus], edge: Edge, replicas: Replicas
) -> None:
    receiver = MockReceiver(Reply(400, b"out of bounds: sample timestamp too old"))
    try:
        replica = replicas.start(
            "follow-f0", "g-refuse", remote_write__url=receiver.url, remote_write__isolate_max_writes=0
        )
        relay = Relay(edge, "live-refuse")
        relay.publish(1)
        relay.publish(2)  # a delta frame
        acks = relay.wait_acks([1, 2])
        assert [r.result for r in acks[2]] == ["rejected"]
        letters = {d.seq: d for d in replica.dead_letters.list()}
        for seq in (1, 2):
            stored = replica.dead_letters.payload(letters[seq].id)
            assert stored is not None and stored[1][3] == codec.FORMAT_V2
            assert view(codec.decode_batch(stored[1]))[3] == view(relay.batch(seq))[3]
    finally:
        receiver.close()
