"""The shipped broker configuration on a real mosquitto: mTLS, per-node ACL, passwords, the edge bridge.

``deploy/mosquitto/cloud/mosquitto.conf`` and its ``acl`` run as shipped, only with loopback ports
and temporary paths substituted; ``deploy/mosquitto/edge/bridge.conf`` is rendered the way its
container renders it. A throw-away CA and certificates are made here with ``cryptography``. The
relay and the ingester run as real processes (``edge-relay run`` / ``cloud-ingest run``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
import requests
import yaml

from testkit.pki import Pki, make_pki
from testkit.services import ManagedProcess, Mosquitto, Prometheus, ServiceFactory, free_port, wait_until
from testkit.stack import Program, SimulatorProcess, ingest_config, program, relay_config

ROOT = Path(__file__).resolve().parents[2]
CLOUD_CONF = ROOT / "deploy/mosquitto/cloud/mosquitto.conf"
CLOUD_ACL = ROOT / "deploy/mosquitto/cloud/acl"
CLOUD_INGEST_ACL = ROOT / "deploy/mosquitto/cloud/ingest.acl"
BRIDGE_CONF = ROOT / "deploy/mosquitto/edge/bridge.conf"

NODE_A = "edge-gpu-a"
NODE_B = "edge-gpu-b"
INGEST_IDENTITY = "cloud-ingest"
CLUSTER = "test"  # what testkit/stack.py's relay_config() uses
PREFIX = "edgemetrics"
NOT_AUTHORIZED = 135  # MQTT 5 reason code


def topic(node: str, kind: str, cluster: str = CLUSTER) -> str:
    return f"{PREFIX}/v1/{cluster}/{node}/{kind}"


def identity(name: str) -> str:
    """A client's identity at the broker (certificate CN, user name): ``<cluster>/<node>`` for a node
    (deploy/mosquitto/cloud/acl), the name itself for anything else."""
    return f"{CLUSTER}/{name}" if name in (NODE_A, NODE_B) else name


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"), [NODE_A, NODE_B, INGEST_IDENTITY], identity=identity)


@pytest.fixture(scope="module")
def ingest_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """The ingester CA: it signs only the ingester's certificate (the fleet CA signs the nodes')."""
    return make_pki(
        tmp_path_factory.mktemp("ingest-pki"), [INGEST_IDENTITY], ca_name="ingester CA", identity=identity
    )


@pytest.fixture(scope="module")
def rogue_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Certificates from a CA the broker does not trust, with a legitimate-looking CN."""
    return make_pki(tmp_path_factory.mktemp("rogue"), [NODE_A], ca_name="rogue CA", identity=identity)


# --- the shipped configurations, rendered for loopback ------------------------------------------


def substitute(text: str, replacements: dict[str, str], source: Path) -> str:
    for old, new in replacements.items():
        assert old in text, f"{source.relative_to(ROOT)} no longer contains {old!r}: update this test"
        text = text.replace(old, new)
    return text


class CloudBroker(ManagedProcess):
    """deploy/mosquitto/cloud/mosquitto.conf + acl + ingest.acl; ``port`` is the edge mTLS listener,
    ``ingest_port`` the ingester listener."""

    name = "mosquitto-cloud"
    default_binary = Mosquitto.default_binary
    package = Mosquitto.package

    def __init__(
        self, tmpdir: str | os.PathLike[str], *, pki: Pki, ingest_pki: Pki, passwords: dict[str, str]
    ) -> None:
        super().__init__(tmpdir)
        self.pki = pki
        self.ingest_pki = ingest_pki
        self.passwords = passwords
        self.password_port = self.ingest_port = 0  # chosen by command(), distinct from self.port

    def probe(self) -> bool:
        # mosquitto opens its listeners one after another (each loads its certificates): ready when all are.
        return all(_accepts(self.host, port) for port in (self.port, self.password_port, self.ingest_port))

    def ingester(self, client_id: str) -> Probe:
        """An ingester replica on its listener: the ingester CA's certificate, the broker's CA."""
        cert, key = self.ingest_pki.cert(INGEST_IDENTITY), self.ingest_pki.key(INGEST_IDENTITY)
        return connect(self.ingest_port, client_id, ca=self.pki.ca, cert=cert, key=key)

    def command(self) -> list[str]:
        # Fresh for every start attempt, and distinct: free_port() may hand out one port twice.
        taken = {self.port}
        for attr in ("password_port", "ingest_port"):
            port = free_port()
            while port in taken:
                port = free_port()
            taken.add(port)
            setattr(self, attr, port)
        password_file = self.dir / "passwords"
        # mosquitto_passwd refuses to write a file that does not exist yet without -c.
        password_file.write_text("")
        for user, password in self.passwords.items():
            _mosquitto_passwd(password_file, user, password)
        certs = self.dir / "certs"
        certs.mkdir(exist_ok=True)
        for src, dst in (
            (self.pki.ca, "ca.crt"),
            (self.ingest_pki.ca, "ingest-ca.crt"),
            (self.pki.cert("broker"), "tls.crt"),
        ):
            (certs / dst).write_bytes(Path(src).read_bytes())
        (certs / "tls.key").write_bytes(Path(self.pki.key("broker")).read_bytes())
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        conf = substitute(
            CLOUD_CONF.read_text(),
            {
                "listener 8883\n": f"listener {self.port} 127.0.0.1\n",
                "listener 8884\n": f"listener {self.password_port} 127.0.0.1\n",
                "listener 8885\n": f"listener {self.ingest_port} 127.0.0.1\n",
                "/mosquitto/config/ingest.acl": str(CLOUD_INGEST_ACL),
                "/mosquitto/certs/": f"{certs}/",
                "/mosquitto/config/acl": str(CLOUD_ACL),
                "/mosquitto/data/": f"{data}/",
                "/mosquitto/passwords/passwords": str(password_file),
            },
            CLOUD_CONF,
        )
        if os.geteuid() == 0:
            conf += "user root\n"  # as root mosquitto would switch to "mosquitto", locked out of tmp
        path = self.dir / "mosquitto.conf"
        path.write_text(conf)
        return [self.binary, "-c", str(path)]


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
    except OSError:
        return False
    return True


def _mosquitto_passwd(path: Path, user: str, password: str) -> None:
    tool = Path(Mosquitto.default_binary).with_name("mosquitto_passwd")
    binary = str(tool) if tool.exists() else "/usr/bin/mosquitto_passwd"
    subprocess.run([binary, "-b", str(path), user, password], check=True, capture_output=True)


class EdgeBridge(ManagedProcess):
    """deploy/mosquitto/edge/bridge.conf for ``node``, bridged to ``cloud`` over mTLS."""

    name = "mosquitto-edge"
    default_binary = Mosquitto.default_binary
    package = Mosquitto.package

    def __init__(self, tmpdir: str | os.PathLike[str], *, pki: Pki, node: str, cloud: CloudBroker) -> None:
        super().__init__(tmpdir)
        self.pki = pki
        self.node = node
        self.cloud = cloud

    def command(self) -> list[str]:
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        conf = substitute(
            BRIDGE_CONF.read_text(),
            {
                "${NODE_NAME}": self.node,
                "${CLOUD_BROKER}": f"127.0.0.1:{self.cloud.port}",
                "listener 1883 127.0.0.1\n": f"listener {self.port} 127.0.0.1\n",
                "/var/lib/edge-relay/mosquitto/": f"{data}/",
                "/etc/edge-relay/mqtt/ca.crt": self.pki.ca,
                "/etc/edge-relay/pki/tls.crt": self.pki.cert(self.node),
                "/etc/edge-relay/pki/tls.key": self.pki.key(self.node),
            },
            BRIDGE_CONF,
        )
        assert "${" not in conf, "bridge.conf has a placeholder the container does not fill"
        if os.geteuid() == 0:
            conf += "user root\n"
        path = self.dir / "mosquitto.conf"
        path.write_text(conf)
        return [self.binary, "-c", str(path)]


@pytest.fixture
def cloud_broker(make_service: ServiceFactory, pki: Pki, ingest_pki: Pki) -> CloudBroker:
    return make_service(
        CloudBroker,
        pki=pki,
        ingest_pki=ingest_pki,
        passwords={identity(NODE_A): "secret-a", identity(NODE_B): "secret-b"},
    )


# --- a small MQTT client that records what happened --------------------------------------------


@dataclass
class Probe:
    client: mqtt.Client
    connack: Any = None
    messages: list[tuple[str, bytes]] = field(default_factory=list)
    puback: dict[int, int] = field(default_factory=dict)
    connected: threading.Event = field(default_factory=threading.Event)
    answered: threading.Event = field(default_factory=threading.Event)

    def publish(self, topic_name: str, payload: bytes) -> int:
        """Publish with QoS 1 and return the broker's PUBACK reason code."""
        info = self.client.publish(topic_name, payload, qos=1)
        wait_until(lambda: info.mid in self.puback, timeout=5, message=f"PUBACK for {topic_name}")
        return self.puback[info.mid]

    def subscribe(self, filt: str) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *args: done.set()
        self.client.subscribe(filt, qos=1)
        assert done.wait(5), f"no SUBACK for {filt}"

    def received(self, topic_name: str) -> list[bytes]:
        return [p for t, p in list(self.messages) if t == topic_name]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def connect(
    port: int,
    client_id: str,
    *,
    ca: str,
    cert: str | None = None,
    key: str | None = None,
    username: str | None = None,
    password: str | None = None,
) -> Probe:
    """Connect with MQTT 5 over TLS; the Probe's ``connack`` says whether the broker accepted us
    (None: the TLS handshake or the connection failed before any CONNACK)."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    client.tls_set(ca_certs=ca, certfile=cert, keyfile=key)
    if username is not None:
        client.username_pw_set(username, password)
    probe = Probe(client)

    def on_connect(c: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        probe.connack = reason
        if not reason.is_failure:
            probe.connected.set()
        probe.answered.set()

    client.on_connect = on_connect
    client.on_disconnect = lambda *args: probe.answered.set()
    client.on_message = lambda c, u, m: probe.messages.append((m.topic, bytes(m.payload)))
    client.on_publish = lambda c, u, mid, reason, props: probe.puback.__setitem__(mid, reason.value)
    client.reconnect_delay_set(30, 30)  # no retry storm from a client that is refused
    try:
        client.connect("127.0.0.1", port, keepalive=10)
    except OSError:
        return probe  # refused during the handshake
    client.loop_start()
    probe.answered.wait(5)
    return probe


@pytest.fixture
def probes() -> Iterator[list[Probe]]:
    opened: list[Probe] = []
    yield opened
    for p in opened:
        p.close()


# --- the tests ----------------------------------------------------------------------------------


def test_acl_pins_each_node_to_its_own_topics(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    port = cloud_broker.port
    ingest = cloud_broker.ingester("ingest-1")
    a = connect(port, "edge-relay-test-a", ca=pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A))
    b = connect(port, "edge-relay-test-b", ca=pki.ca, cert=pki.cert(NODE_B), key=pki.key(NODE_B))
    probes += [ingest, a, b]
    for p in (ingest, a, b):
        assert p.connected.is_set(), f"mTLS client refused: {p.connack}"

    ingest.subscribe(f"$share/ingest/{PREFIX}/v1/+/+/batch")
    ingest.subscribe(f"{PREFIX}/v1/+/+/status")
    # A tries to listen to B: its own acks, B's acks by name and by wildcard, and every batch.
    for filt in (
        topic(NODE_A, "ack"),
        topic(NODE_B, "ack"),
        f"{PREFIX}/v1/+/+/ack",
        f"{PREFIX}/v1/+/+/batch",
    ):
        a.subscribe(filt)
    b.subscribe(topic(NODE_B, "ack"))

    # Publishing: own batch and status yes; B's batch, B's status and any ack no.
    assert a.publish(topic(NODE_A, "batch"), b"a-batch") == 0
    assert a.publish(topic(NODE_A, "status"), b"a-status") == 0
    assert a.publish(topic(NODE_B, "batch"), b"spoofed-batch") == NOT_AUTHORIZED
    assert a.publish(topic(NODE_B, "status"), b"spoofed-status") == NOT_AUTHORIZED
    assert a.publish(topic(NODE_B, "ack"), b"spoofed-ack") == NOT_AUTHORIZED
    assert b.publish(topic(NODE_B, "batch"), b"b-batch") == 0

    # The ingester identity reads all batches and writes every node's acks.
    assert ingest.publish(topic(NODE_A, "ack"), b"ack-for-a") == 0
    assert ingest.publish(topic(NODE_B, "ack"), b"ack-for-b") == 0
    assert ingest.publish(topic(NODE_A, "batch"), b"ingester-batch") == NOT_AUTHORIZED

    wait_until(lambda: b.received(topic(NODE_B, "ack")), message="B's ack at B")
    wait_until(lambda: a.received(topic(NODE_A, "ack")), message="A's ack at A")
    wait_until(lambda: ingest.received(topic(NODE_B, "batch")), message="B's batch at the ingester")
    wait_until(lambda: ingest.received(topic(NODE_A, "status")), message="A's status at the ingester")
    time.sleep(0.3)  # anything that should not arrive has had time to

    assert ingest.received(topic(NODE_A, "batch")) == [b"a-batch"]
    assert ingest.received(topic(NODE_B, "batch")) == [b"b-batch"]
    assert ingest.received(topic(NODE_B, "status")) == []
    assert b.received(topic(NODE_B, "ack")) == [b"ack-for-b"]
    # A's wildcard subscriptions match B's topics, but the broker delivers nothing of B's.
    assert {t for t, _ in a.messages} == {topic(NODE_A, "ack")}, a.messages


def test_a_node_cannot_publish_under_another_cluster(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    """The identity names the cluster too: node A's own node name under any other cluster is refused,
    for every topic a node may write (a made-up cluster would otherwise give it fresh stream state
    and series under a cluster label of its choosing)."""
    ingest = cloud_broker.ingester("ingest-clusters")
    a = connect(cloud_broker.port, "a", ca=pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A))
    probes += [ingest, a]
    assert ingest.connected.is_set() and a.connected.is_set()
    ingest.subscribe(f"{PREFIX}/v1/+/+/+")
    for kind in ("batch", "status", "cmd_result"):
        for cluster in ("made-up", "other-cluster"):
            assert a.publish(topic(NODE_A, kind, cluster=cluster), b"spoofed") == NOT_AUTHORIZED
        assert a.publish(topic(NODE_A, kind), b"own") == 0
    wait_until(lambda: ingest.received(topic(NODE_A, "cmd_result")), message="A's own topics at the ingester")
    time.sleep(0.3)
    assert {t for t, _ in ingest.messages} == {topic(NODE_A, k) for k in ("batch", "status", "cmd_result")}


def test_only_the_ingester_identity_may_publish_commands(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    """Backfill commands: a node reads its own cmd topic and answers on its own cmd_result topic, but
    cannot publish a command, neither to itself nor to another node; the ingester can, and reads results."""
    ingest = cloud_broker.ingester("cloud-ingest-cmd")
    a = connect(cloud_broker.port, "a", ca=pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A))
    b = connect(cloud_broker.port, "b", ca=pki.ca, cert=pki.cert(NODE_B), key=pki.key(NODE_B))
    fake = connect(
        cloud_broker.port, "x", ca=pki.ca, cert=pki.cert(INGEST_IDENTITY), key=pki.key(INGEST_IDENTITY)
    )
    probes += [ingest, a, b, fake]
    assert all(p.connected.is_set() for p in (ingest, a, b, fake))
    a.subscribe(topic(NODE_A, "cmd"))
    a.subscribe(f"{PREFIX}/v1/+/+/cmd_result")
    b.subscribe(topic(NODE_B, "cmd"))
    ingest.subscribe(f"{PREFIX}/v1/+/+/cmd_result")
    assert a.publish(topic(NODE_A, "cmd"), b"self-command") == NOT_AUTHORIZED
    assert a.publish(topic(NODE_B, "cmd"), b"cross-command") == NOT_AUTHORIZED
    assert fake.publish(topic(NODE_B, "cmd"), b"fake-ingester-command") == NOT_AUTHORIZED
    assert b.publish(topic(NODE_A, "cmd_result"), b"spoofed-result") == NOT_AUTHORIZED
    assert ingest.publish(topic(NODE_A, "cmd"), b"command-for-a") == 0
    assert ingest.publish(topic(NODE_A, "cmd_result"), b"ingester-result") == NOT_AUTHORIZED
    assert a.publish(topic(NODE_A, "cmd_result"), b"a-result") == 0
    wait_until(lambda: a.received(topic(NODE_A, "cmd")), message="the ingester's command at A")
    wait_until(lambda: ingest.received(topic(NODE_A, "cmd_result")), message="A's result at the ingester")
    time.sleep(0.3)
    assert a.received(topic(NODE_A, "cmd")) == [b"command-for-a"]
    assert b.received(topic(NODE_B, "cmd")) == []
    assert ingest.received(topic(NODE_A, "cmd_result")) == [b"a-result"]
    # A's wildcard on every result topic delivers nothing (not even its own: it may only write there).
    assert a.received(topic(NODE_A, "cmd_result")) == []


def test_no_client_can_take_over_another_clients_session(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    """A CONNECT with a client id in use disconnects its holder (and with a clean start wipes its
    persistent session, with the acks queued in it). Node A tries every id it could guess."""
    ingest = cloud_broker.ingester("cloud-ingest-0")
    b = connect(cloud_broker.port, "edge-relay-test-b", ca=pki.ca, cert=pki.cert(NODE_B), key=pki.key(NODE_B))
    probes += [ingest, b]
    assert ingest.connected.is_set() and b.connected.is_set()
    for stolen in ("edge-relay-test-b", NODE_B, identity(NODE_B), "cloud-ingest-0", "edge-bridge-" + NODE_B):
        thief = connect(cloud_broker.port, stolen, ca=pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A))
        probes.append(thief)
        assert thief.connected.is_set(), thief.connack  # let in, but under its own identity
        time.sleep(0.5)
        assert b.client.is_connected(), f"{stolen!r}: node B was disconnected"
        assert ingest.client.is_connected(), f"{stolen!r}: the ingester was disconnected"
    log = cloud_broker.log_path.read_text()
    assert f"as {identity(NODE_A)} (p5, c1" in log, log[-2000:]  # every thief connected as itself
    # A node certificate does not open the ingester listener, whatever client id it claims.
    sneak = connect(
        cloud_broker.ingest_port, "cloud-ingest-0", ca=pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A)
    )
    probes.append(sneak)
    assert not sneak.connected.is_set()
    time.sleep(0.3)
    assert ingest.client.is_connected()


def test_the_ingester_identity_has_node_rights_only_on_the_edge_listener(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    """A fleet-CA certificate named like the ingester (CN cloud-ingest) is just another node there."""
    fake = connect(
        cloud_broker.port, "x", ca=pki.ca, cert=pki.cert(INGEST_IDENTITY), key=pki.key(INGEST_IDENTITY)
    )
    b = connect(cloud_broker.port, "b", ca=pki.ca, cert=pki.cert(NODE_B), key=pki.key(NODE_B))
    ingest = cloud_broker.ingester("cloud-ingest-0")
    probes += [fake, b, ingest]
    assert fake.connected.is_set() and b.connected.is_set() and ingest.connected.is_set()
    fake.subscribe(f"{PREFIX}/v1/+/+/batch")
    ingest.subscribe(f"$share/ingest/{PREFIX}/v1/+/+/batch")
    assert fake.publish(topic(NODE_B, "ack"), b"forged-ack") == NOT_AUTHORIZED
    assert b.publish(topic(NODE_B, "batch"), b"b-batch") == 0
    wait_until(lambda: ingest.received(topic(NODE_B, "batch")), message="B's batch at the real ingester")
    time.sleep(0.3)
    assert fake.received(topic(NODE_B, "batch")) == []


def test_clients_without_a_trusted_certificate_are_refused(
    cloud_broker: CloudBroker, pki: Pki, rogue_pki: Pki, probes: list[Probe]
) -> None:
    no_cert = connect(cloud_broker.port, "no-cert", ca=pki.ca)
    rogue = connect(
        cloud_broker.port, "rogue", ca=pki.ca, cert=rogue_pki.cert(NODE_A), key=rogue_pki.key(NODE_A)
    )
    # Even with the right password, the mTLS listener wants a certificate.
    password_only = connect(
        cloud_broker.port, "pw-on-mtls", ca=pki.ca, username=identity(NODE_A), password="secret-a"
    )
    probes += [no_cert, rogue, password_only]
    for p in (no_cert, rogue, password_only):
        assert not p.connected.is_set(), f"{p.client._client_id!r} was let in: {p.connack}"
    # And the client side checks the broker: a CA that did not sign the broker's certificate fails.
    wrong_ca = connect(
        cloud_broker.port, "wrong-ca", ca=rogue_pki.ca, cert=pki.cert(NODE_A), key=pki.key(NODE_A)
    )
    probes.append(wrong_ca)
    assert not wrong_ca.connected.is_set()


def test_username_and_password_over_tls_is_the_alternative(
    cloud_broker: CloudBroker, pki: Pki, probes: list[Probe]
) -> None:
    port = cloud_broker.password_port
    ingest = cloud_broker.ingester("ingest-1")
    a = connect(port, "edge-relay-test-a", ca=pki.ca, username=identity(NODE_A), password="secret-a")
    wrong = connect(port, "wrong", ca=pki.ca, username=identity(NODE_A), password="secret-b")
    anonymous = connect(port, "anonymous", ca=pki.ca)
    probes += [ingest, a, wrong, anonymous]
    assert a.connected.is_set(), a.connack
    assert (
        not wrong.connected.is_set() and wrong.connack is not None and wrong.connack.value == NOT_AUTHORIZED
    )
    assert not anonymous.connected.is_set()

    ingest.subscribe(f"$share/ingest/{PREFIX}/v1/+/+/batch")
    assert a.publish(topic(NODE_A, "batch"), b"a-batch") == 0
    assert a.publish(topic(NODE_B, "batch"), b"spoofed") == NOT_AUTHORIZED
    assert a.publish(topic(NODE_A, "batch", cluster="made-up"), b"spoofed") == NOT_AUTHORIZED
    wait_until(lambda: ingest.received(topic(NODE_A, "batch")), message="A's batch via the password listener")
    time.sleep(0.3)
    assert ingest.received(topic(NODE_B, "batch")) == []


# --- the product over mTLS ------------------------------------------------------------------------


def _metric(listen: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name{labels...}`` on a /metrics endpoint (0 if absent)."""
    text = requests.get(f"http://{listen}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels and labels not in line:
                continue
            total += float(line.rsplit(" ", 1)[1])
    return total


def _listen(config: Path) -> str:
    return str(yaml.safe_load(config.read_text())["metrics"]["listen"])


def _tls(pki: Pki, identity: str) -> dict[str, str]:
    return {"ca_file": pki.ca, "cert_file": pki.cert(identity), "key_file": pki.key(identity)}


def _run_pipeline(
    tmp_path: Path,
    make_service: ServiceFactory,
    pki: Pki,
    cloud: CloudBroker,
    *,
    relay_mqtt: dict[str, Any],
) -> tuple[Prometheus, SimulatorProcess, Program, Path, Program, Path]:
    prom = make_service(Prometheus)
    sim = SimulatorProcess(tmp_path, interval=1.0).start()
    urls = {k: v for k, v in sim.urls.items() if k in ("kepler", "dcgm")}
    relay_dir, ingest_dir = tmp_path / "relay", tmp_path / "ingest"
    relay_dir.mkdir()
    ingest_dir.mkdir()
    relay_cfg = relay_config(
        relay_dir, urls=urls, mqtt_port=relay_mqtt.pop("port"), node=NODE_A, **relay_mqtt
    )
    ingest_cfg = ingest_config(
        ingest_dir,
        mqtt_port=cloud.ingest_port,
        remote_write_url=prom.remote_write_url,
        mqtt__tls={**_tls(cloud.ingest_pki, INGEST_IDENTITY), "ca_file": pki.ca},
    )
    ingest = program("cloud-ingest", "cloud_ingest.cli", ingest_cfg, ingest_dir).start()
    relay = program("edge-relay", "edge_relay.cli", relay_cfg, relay_dir).start()
    return prom, sim, relay, relay_cfg, ingest, ingest_cfg


def _assert_delivered(prom: Prometheus, relay: Program, relay_cfg: Path, ingest: Program) -> None:
    def arrived() -> bool:
        assert relay.alive(), relay.log_tail()
        assert ingest.alive(), ingest.log_tail()
        result = prom.query(f'count(count_over_time(up{{node="{NODE_A}"}}[10m]))')["result"]
        return bool(result) and float(result[0]["value"][1]) >= 2

    try:
        wait_until(arrived, timeout=40, interval=0.5, message="samples of the relay in Prometheus")
        listen = _listen(relay_cfg)
        wait_until(
            lambda: _metric(listen, "edge_relay_batches_acked_total", 'result="ok"') > 0,
            timeout=20,
            interval=0.5,
            message="application acks back at the relay",
        )
    except (TimeoutError, AssertionError):
        print("--- edge-relay\n" + relay.log_tail() + "\n--- cloud-ingest\n" + ingest.log_tail())
        raise
    dcgm = prom.query(f'DCGM_FI_DEV_GPU_UTIL{{node="{NODE_A}", cluster="{CLUSTER}"}}')["result"]
    assert dcgm, "dcgm-exporter samples did not arrive"


def _assert_backfill(ingest_cfg: Path, relay: Program) -> None:
    """``cloud-ingest backfill`` with the ingester's identity reaches the relay and gets its answer."""
    now = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "cloud_ingest.cli", "backfill", "--config", str(ingest_cfg),
         "--cluster", CLUSTER, "--node", NODE_A, "--from", f"{now - 30:.3f}", "--to", f"{now:.3f}",
         "--match", '{__name__="up"}', "--wait", "20", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr + relay.log_tail()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["result"] == "done" and result.get("samples", 0) > 0 and result["node"] == NODE_A, (
        json.dumps(result)
    )


def test_relay_and_ingester_work_over_mtls(
    tmp_path: Path, make_service: ServiceFactory, pki: Pki, cloud_broker: CloudBroker
) -> None:
    prom, sim, relay, relay_cfg, ingest, ingest_cfg = _run_pipeline(
        tmp_path,
        make_service,
        pki,
        cloud_broker,
        relay_mqtt={"port": cloud_broker.port, "mqtt__tls": _tls(pki, NODE_A)},
    )
    try:
        _assert_delivered(prom, relay, relay_cfg, ingest)
        _assert_backfill(ingest_cfg, relay)
    finally:
        sim.stop()
        assert relay.stop() == 0, relay.log_tail()
        assert ingest.stop() == 0, ingest.log_tail()


def test_relay_over_the_edge_bridge(
    tmp_path: Path, make_service: ServiceFactory, pki: Pki, cloud_broker: CloudBroker
) -> None:
    """relay -> edge mosquitto (bridge.conf, persistent, mTLS as the node) -> cloud broker -> ingester."""
    bridge = make_service(EdgeBridge, pki=pki, node=NODE_A, cloud=cloud_broker)
    prom, sim, relay, relay_cfg, ingest, ingest_cfg = _run_pipeline(
        tmp_path, make_service, pki, cloud_broker, relay_mqtt={"port": bridge.port}
    )
    try:
        _assert_delivered(prom, relay, relay_cfg, ingest)
        # The relay's status crosses the bridge too: the ingester sees the node online.
        wait_until(
            lambda: _metric(_listen(ingest_cfg), "cloud_ingest_node_online", f'node="{NODE_A}"') == 1,
            timeout=20,
            message="the node's status at the ingester",
        )
        # Commands cross the bridge in, and their results out.
        _assert_backfill(ingest_cfg, relay)
    finally:
        sim.stop()
        assert relay.stop() == 0, relay.log_tail()
        assert ingest.stop() == 0, ingest.log_tail()
    # The bridge connected as the node (certificate CN), which is also its client id on the edge
    # listener, with a persistent session (c0: clean session off).
    cloud_log = cloud_broker.log_path.read_text()
    assert f"as {identity(NODE_A)} (p2, c0, k30, u'{identity(NODE_A)}')" in cloud_log, cloud_log[-3000:]


# --- docker-compose.yml's two brokers ---------------------------------------------------------------


class ComposeBroker(ManagedProcess):
    """deploy/docker/mosquitto-{edge,cloud}.conf on loopback (the compose service names -> 127.0.0.1)."""

    name = "mosquitto-compose"
    default_binary = Mosquitto.default_binary
    package = Mosquitto.package

    def __init__(self, tmpdir: str | os.PathLike[str], *, side: str, cloud_port: int = 0) -> None:
        super().__init__(tmpdir)
        self.source = ROOT / f"deploy/docker/mosquitto-{side}.conf"
        self.cloud_port = cloud_port

    def command(self) -> list[str]:
        data = self.dir / "data"
        data.mkdir(exist_ok=True)
        replacements = {
            "listener 1883 0.0.0.0\n": f"listener {self.port} 127.0.0.1\n",
            "/mosquitto/data/": f"{data}/",
        }
        if self.cloud_port:
            replacements["address mosquitto-cloud:1883\n"] = f"address 127.0.0.1:{self.cloud_port}\n"
        conf = substitute(self.source.read_text(), replacements, self.source)
        if os.geteuid() == 0:
            conf += "user root\n"
        path = self.dir / "mosquitto.conf"
        path.write_text(conf)
        return [self.binary, "-c", str(path)]


def _plain(port: int, client_id: str) -> Probe:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, protocol=mqtt.MQTTv5)
    probe = Probe(client)
    client.on_connect = lambda c, u, f, reason, p: probe.connected.set()
    client.on_message = lambda c, u, m: probe.messages.append((m.topic, bytes(m.payload)))
    client.on_publish = lambda c, u, mid, reason, props: probe.puback.__setitem__(mid, reason.value)
    client.connect("127.0.0.1", port, keepalive=10)
    client.loop_start()
    assert probe.connected.wait(5)
    return probe


def test_compose_brokers_bridge_batches_up_and_acks_down(
    make_service: ServiceFactory, probes: list[Probe]
) -> None:
    cloud = make_service(ComposeBroker, side="cloud")
    edge = make_service(ComposeBroker, side="edge", cloud_port=cloud.port)
    ingest = _plain(cloud.port, "ingest")
    relay = _plain(edge.port, "relay")
    probes += [ingest, relay]
    ingest.subscribe(f"$share/ingest/{PREFIX}/v1/+/+/batch")
    relay.subscribe(topic(NODE_A, "ack"))
    # The bridge subscribes on the cloud side once connected; until then an ack would go nowhere.
    wait_until(
        lambda: "as edge-bridge-edge-gpu-01 (p2, c0" in cloud.log_tail(200), message="the bridge at the cloud"
    )
    assert relay.publish(topic(NODE_A, "batch"), b"batch-1") == 0
    wait_until(
        lambda: ingest.received(topic(NODE_A, "batch")) == [b"batch-1"], message="batch across the bridge"
    )
    assert ingest.publish(topic(NODE_A, "ack"), b"ack-1") == 0
    wait_until(
        lambda: relay.received(topic(NODE_A, "ack")) == [b"ack-1"], message="ack back across the bridge"
    )
