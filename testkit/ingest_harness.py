"""The cloud tests' harness: a test edge (paho-mqtt v5) that publishes batches and statuses as the relay
does and records every ack, a scripted remote-write receiver that can also hang or delay (what a real
receiver cannot do on demand), and ingesters run in-process or as ``cloud-ingest run`` subprocesses.

Readiness: the edge publishes a retained status for the node ``probe`` before any ingester starts. The
status and batch filters are subscribed in one SUBSCRIBE packet, so once an ingester's
``cloud_ingest_node_online{node="probe"}`` is 1 its batch subscription is live and nothing published
afterwards can miss it. The fixtures (``edge``, ``receivers``, ``ingesters``, ``programs``) are in
``tests/cloud/conftest.py``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import cramjam
import paho.mqtt.client as mqtt
import requests
from prometheus_client.parser import text_string_to_metric_families

from cloud_ingest import settings as settings_mod
from cloud_ingest.app import Ingester
from schemas import codec, remote_write_pb, topics
from schemas.codec import AckResult
from schemas.model import Batch
from testkit.batches import CLUSTER
from testkit.services import Mosquitto, RawSamples, free_port, now_ms, wait_until
from testkit.stack import Program, ingest_config, program

PREFIX = "edgemetrics"
PROBE_NODE = "probe"
ACK_FILTER = f"{PREFIX}/v1/+/+/ack"

# -- batches ---------------------------------------------------------------------------------------------

Expected = dict[frozenset[tuple[str, str]], list[tuple[int, float]]]


def expected_samples(*batches: Batch) -> Expected:
    out: Expected = {}
    for batch in batches:
        for block in batch.scrapes:
            for i, s in enumerate(block.series):
                key = frozenset(batch.labelsets[s])
                out.setdefault(key, []).append((block.sample_timestamp(i), block.values[i]))
    for samples in out.values():
        samples.sort()
    return out


def decode_write_body(body: bytes) -> Expected:
    """A snappy-compressed remote-write body, decoded with the protobuf message classes."""
    request = remote_write_pb.WriteRequest()
    request.ParseFromString(bytes(cramjam.snappy.decompress_raw(body)))
    out: Expected = {}
    for ts in request.timeseries:  # type: ignore[attr-defined]
        key = frozenset((label.name, label.value) for label in ts.labels)
        out.setdefault(key, []).extend((s.timestamp, s.value) for s in ts.samples)
    return out


def as_expected(raw: RawSamples) -> Expected:
    return {key: list(samples) for key, samples in raw.items()}


# -- the edge: a paho-mqtt v5 client ---------------------------------------------------------------------


class Edge:
    """Publishes batches and statuses like the relay does and records every ack it receives."""

    def __init__(self, broker: Mosquitto) -> None:
        self.acks: list[tuple[str, codec.Ack]] = []
        self.bad_acks: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = mqtt.Client(
            callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
            client_id=f"edge-test-{uuid.uuid4().hex[:8]}",
            protocol=mqtt.MQTTv5,
        )
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe
        self.client.on_message = self._on_message
        self.client.connect(broker.host, broker.port, keepalive=10)
        self.client.loop_start()
        assert self._subscribed.wait(10), "the test edge could not subscribe to the ack topics"
        # Readiness probe for every ingester started later (see the module docstring).
        self.publish_status(PROBE_NODE, "online")

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, rc: Any, props: Any) -> None:
        client.subscribe(ACK_FILTER, qos=1)

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, rcs: Any, props: Any) -> None:
        self._subscribed.set()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            ack = codec.decode_ack(message.payload)
        except codec.DecodeError:
            with self._lock:
                self.bad_acks.append((message.topic, bytes(message.payload)))
            return
        with self._lock:
            self.acks.append((message.topic, ack))

    def publish(self, topic: str, payload: bytes, *, retain: bool = False) -> None:
        info = self.client.publish(topic, payload, qos=1, retain=retain)
        info.wait_for_publish(10)
        assert info.is_published(), f"publish on {topic} not confirmed by the broker"

    def publish_batch(self, batch: Batch, *, topic_node: str | None = None) -> bytes:
        payload = codec.encode_batch(batch)
        self.publish(topics.batch_topic(PREFIX, batch.cluster, topic_node or batch.node), payload)
        return payload

    def publish_raw(self, node: str, payload: bytes) -> None:
        self.publish(topics.batch_topic(PREFIX, CLUSTER, node), payload)

    def publish_status(self, node: str, state: str, **fields: Any) -> None:
        status = {"node": node, "cluster": CLUSTER, "state": state, "ts_ms": now_ms(), **fields}
        self.publish(topics.status_topic(PREFIX, CLUSTER, node), codec.encode_status(status), retain=True)

    def results(self, node: str, cluster: str = CLUSTER) -> list[AckResult]:
        """Every ack result received on ``node``'s ack topic, in arrival order."""
        topic = topics.ack_topic(PREFIX, cluster, node)
        with self._lock:
            acks = [ack for t, ack in self.acks if t == topic]
            assert not self.bad_acks, f"undecodable acks: {self.bad_acks}"
        for ack in acks:
            assert ack.node == node, f"ack for node {ack.node!r} on the ack topic of {node!r}"
        return [r for ack in acks for r in ack.results]

    def all_topics(self) -> set[str]:
        with self._lock:
            return {t for t, _ in self.acks}

    def wait_result(self, node: str, seq: int, timeout: float = 20.0) -> AckResult:
        def find() -> AckResult | None:
            return next((r for r in self.results(node) if r.seq == seq), None)

        return wait_until(find, timeout, message=f"ack for {node} seq {seq}")

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


# -- the mock remote-write receiver ----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int = 204
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()
    hang: bool = False  # read the request, then answer nothing until released
    delay: float = 0.0


@dataclass(frozen=True)
class Request:
    at: float  # time.monotonic() when the request had been read
    path: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


class MockReceiver:
    """Remote-write endpoint on 127.0.0.1 answering ``script`` first, then ``default``."""

    def __init__(self, default: Reply = Reply(), script: tuple[Reply, ...] = ()) -> None:
        self.default = default
        self.script: deque[Reply] = deque(script)
        self.requests: list[Request] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        mock = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                reply = mock._record(self, body)
                if reply.hang:
                    mock.release.wait(60)
                    self.close_connection = True
                    return
                if reply.delay:
                    time.sleep(reply.delay)
                self.send_response(reply.status)
                for name, value in reply.headers:
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def _record(self, handler: BaseHTTPRequestHandler, body: bytes) -> Reply:
        headers = {name.lower(): value for name, value in handler.headers.items()}
        with self._lock:
            self.requests.append(Request(time.monotonic(), handler.path, headers, body))
            return self.script.popleft() if self.script else self.default

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/api/v1/write"

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def bodies(self) -> list[bytes]:
        with self._lock:
            return [r.body for r in self.requests]

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


# -- ingesters: in-process and subprocess ----------------------------------------------------------------


def write_config(workdir: Path, broker: Mosquitto, url: str, client_id: str, **overrides: Any) -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    opts: dict[str, Any] = {
        "mqtt__client_id": client_id,
        "remote_write__retry_min_seconds": 0.05,
        "remote_write__retry_max_seconds": 0.5,
        "remote_write__max_retry_seconds": 5,
        "remote_write__timeout_seconds": 5,
        "metrics__listen": "",
    }
    opts.update(overrides)
    return ingest_config(workdir, mqtt_port=broker.port, remote_write_url=url, **opts)


def sample(ingester: Ingester, name: str, **labels: str) -> float:
    value = ingester.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Ingesters:
    """In-process ingesters; stopped at teardown after the mock receivers let go of hung requests."""

    def __init__(self, tmp_path: Path, broker: Mosquitto, receivers: Receivers) -> None:
        self.tmp_path = tmp_path
        self.broker = broker
        self.receivers = receivers
        self.running: list[Ingester] = []
        self.configs: dict[int, Path] = {}

    def start(self, url: str, name: str, *, client_id: str | None = None, **overrides: Any) -> Ingester:
        path = write_config(
            self.tmp_path / name, self.broker, url, client_id or f"ingest-{name}", **overrides
        )
        ingester = Ingester(settings_mod.load(str(path)))
        self.configs[id(ingester)] = path
        self.running.append(ingester)
        ingester.start()
        wait_until(
            lambda: sample(ingester, "cloud_ingest_node_online", cluster=CLUSTER, node=PROBE_NODE) == 1,
            20,
            message=f"ingester {name} subscribed",
        )
        return ingester

    def config_path(self, ingester: Ingester) -> Path:
        return self.configs[id(ingester)]

    def stop(self, ingester: Ingester) -> None:
        self.running.remove(ingester)
        ingester.stop()

    def stop_all(self) -> None:
        self.receivers.release_all()
        for ingester in list(self.running):
            self.stop(ingester)


class Receivers:
    def __init__(self) -> None:
        self.mocks: list[MockReceiver] = []

    def __call__(self, default: Reply = Reply(), script: tuple[Reply, ...] = ()) -> MockReceiver:
        mock = MockReceiver(default, script)
        self.mocks.append(mock)
        return mock

    def release_all(self) -> None:
        for mock in self.mocks:
            mock.release.set()

    def close_all(self) -> None:
        for mock in self.mocks:
            mock.close()


@dataclass
class Subprocess:
    program: Program
    metrics_port: int

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        try:
            text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2).text
        except requests.RequestException:
            return {}
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, frozenset(labels.items())), 0.0)


@dataclass
class Programs:
    tmp_path: Path
    broker: Mosquitto
    started: list[Subprocess] = field(default_factory=list)

    def start(self, name: str, url: str, client_id: str, **overrides: Any) -> Subprocess:
        workdir = self.tmp_path / name
        port = free_port()
        path = write_config(
            workdir, self.broker, url, client_id, metrics__listen=f"127.0.0.1:{port}", **overrides
        )
        proc = Subprocess(program(name, "cloud_ingest.cli", path, workdir), port)
        self.started.append(proc)
        proc.program.start()

        def ready() -> bool:
            assert proc.program.alive(), f"{name} exited:\n{proc.program.log_tail()}"
            return proc.value("cloud_ingest_node_online", cluster=CLUSTER, node=PROBE_NODE) == 1

        wait_until(ready, 30, message=f"{name} subscribed")
        return proc

    def kill_all(self) -> None:
        for proc in self.started:
            proc.program.kill()


def never_arrives(predicate: Callable[[], object], seconds: float) -> bool:
    """True if ``predicate`` stays falsy for ``seconds`` (used only for "nothing more happens" checks)."""
    with contextlib.suppress(TimeoutError):
        wait_until(predicate, seconds)
        return False
    return True
