"""Ingest load bench (issue 5): how many samples per second one ``cloud-ingest`` process sustains, what
each costs in CPU, how long a sample takes from its scrape time to being queryable, and how the
ingester scales from 1 to 2 replicas.  Not a test: it prints a markdown table and writes it to
``bench/results/<timestamp>-ingest-load.md``.  See ``bench/README.md`` ("Ingest load bench").

    python bench/ingest_load_bench.py                                    # 500 nodes x 2000 series / 5 s
    python bench/ingest_load_bench.py --nodes 10 --series 200 --duration 20   # tiny check, ~3 min

    load generator --MQTT QoS 1--> mosquitto --$share/ingest--> cloud-ingest x N --> tap --> receiver
    (real wire format, one                                      (subprocesses,     (HTTP    (VictoriaMetrics
     batch per node and tick)                                    own client ids)    proxy)   or Prometheus)

The generator (``--publishers`` subprocesses of this script) plays ``--nodes`` edge nodes: every
``--interval`` seconds each node publishes its scrape of ``--series`` series on its own batch topic,
nodes spread evenly over the interval, in exactly the bytes ``schemas.codec.encode_batch`` produces
(checked at start-up); the sample timestamp is the moment the batch is built (the "scrape time").
Label sets are packed once per node; per tick only the scrape block (timestamp, values) is packed and
the body compressed, so the generator costs a few us per sample, not the encoder's ~5.

Measured over ``--duration`` seconds after ``--warmup``:

- samples/s per ingester process: ``cloud_ingest_samples_written_total`` from each replica's /metrics;
- CPU us/sample: utime + stime from ``/proc/<pid>/stat`` of each replica over the window, divided by
  the samples it wrote (also shown: the receiver's, mosquitto's and the generator's CPU in cores);
- latency "accepted": the tap (an HTTP proxy in front of the receiver) notes, for every write the
  receiver answered 2xx, the wall time minus the newest sample timestamp of the batch;
- latency "queryable": every 0.25 s the receiver is queried for the newest timestamp of a probe series
  of 10 sampled nodes; a new one seen at poll time P counts P - timestamp (an upper bound, 0.25 s
  resolution).  For Prometheus a 2xx means queryable; VictoriaMetrics makes rows searchable up to
  about a second after it accepted them.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import http.client
import itertools
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import zlib
from array import array
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import cramjam  # noqa: E402
import msgpack  # noqa: E402
import paho.mqtt.client as mqtt  # noqa: E402
import requests  # noqa: E402
import yaml  # noqa: E402
import zstandard  # noqa: E402
from services import ManagedProcess, Mosquitto, Prometheus, VictoriaMetrics, wait_until  # noqa: E402
from stack import Program, ingest_config, program  # noqa: E402

from schemas import codec, topics  # noqa: E402
from schemas.model import Batch, Labels, ScrapeBlock  # noqa: E402

RESULTS = ROOT / "bench" / "results"
PREFIX = "edgemetrics"
CLUSTER = "bench"
SHARE_GROUP = "ingest"
PROBE_NODE = "bench-probe"  # retained status: tells when a replica's subscriptions are live
PROBE_METRIC = "bench_probe"  # series 0 of every node, polled for the "queryable" latency
POLL_NODES = 10
POLL_INTERVAL_S = 0.25
IDLE_SECONDS = 5.0
CLK_TCK = os.sysconf("SC_CLK_TCK")

# Kepler / dcgm / node-exporter-like series: (metric, job, port).
METRICS = [
    ("kepler_container_joules_total", "kepler", 9102),
    ("kepler_container_package_joules_total", "kepler", 9102),
    ("kepler_container_dram_joules_total", "kepler", 9102),
    ("kepler_container_gpu_joules_total", "kepler", 9102),
    ("kepler_container_cpu_cycles_total", "kepler", 9102),
    ("kepler_container_cpu_instructions_total", "kepler", 9102),
    ("kepler_container_cache_miss_total", "kepler", 9102),
    ("kepler_container_bpf_cpu_time_ms_total", "kepler", 9102),
    ("DCGM_FI_DEV_POWER_USAGE", "dcgm", 9400),
    ("DCGM_FI_DEV_GPU_UTIL", "dcgm", 9400),
    ("node_cpu_seconds_total", "node", 9100),
    ("node_memory_Active_bytes", "node", 9100),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# The load generator (runs as `ingest_load_bench.py --generator SPEC_JSON`)
# ---------------------------------------------------------------------------------------------------


def node_name(i: int) -> str:
    return f"edge-{i:05d}"


def node_labelsets(node: str, series: int) -> list[Labels]:
    """``series`` distinct, sorted label sets of one node; series 0 is the probe series."""
    out: list[Labels] = [
        tuple(
            sorted(
                {
                    "__name__": PROBE_METRIC,
                    "cluster": CLUSTER,
                    "node": node,
                    "job": "bench",
                    "instance": f"{node}:9901",
                }.items()
            )
        )
    ]
    for i in range(1, series):
        metric, job, port = METRICS[i % len(METRICS)]
        pod = i // len(METRICS)  # (metric, pod) is unique per series
        labels = {
            "__name__": metric,
            "cluster": CLUSTER,
            "node": node,
            "job": job,
            "instance": f"{node}:{port}",
            "container_id": f"{(pod * 0x9E3779B97F4A7C15) & (2**64 - 1):016x}{pod:08x}",
            "pod_name": f"workload-{pod % 37}-{pod:05d}",
            "container_namespace": f"team-{pod % 7}",
            "mode": "dynamic" if i % 2 else "idle",
        }
        out.append(tuple(sorted(labels.items())))
    return out


class NodeEncoder:
    """Builds one node's batches in exactly the bytes of ``codec.encode_batch``, cheaply per tick.

    The body is ``zstd(msgpack({"labelsets": [...], "scrapes": [...]}))``; the packed label sets are
    the same every tick, so they are packed once and only the scrape block is packed per tick.  A node
    whose scrape is bigger than ``max_bytes`` is split by series into several batches, as the relay
    does."""

    def __init__(
        self, node: str, series: int, max_bytes: int, level: int, values: list[bytes], *, keep: bool = False
    ) -> None:
        self.node = node
        self.level = level
        self.values = values  # pool of value columns (raw float64 bytes), one picked per tick
        self._shift = zlib.crc32(node.encode())  # so nodes do not all send the same column in a tick
        self.topic = topics.batch_topic(PREFIX, CLUSTER, node)
        self._zstd = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=True)
        labelsets = node_labelsets(node, series)
        parts = 1
        while True:
            bounds = [round(k * series / parts) for k in range(parts + 1)]
            self.chunks = [(bounds[k], bounds[k + 1]) for k in range(parts)]
            self.prefixes = [self._prefix(labelsets[lo:hi]) for lo, hi in self.chunks]
            self.indices = [array("I", range(hi - lo)).tobytes() for lo, hi in self.chunks]
            if max(len(p) for p in self.payloads(0, 1_700_000_000_000)) <= max_bytes or parts >= series:
                break
            parts *= 2
        # Only the packed form is kept: a million label-set tuples would cost the generator gigabytes.
        self.labelsets = labelsets if keep else []

    @staticmethod
    def _prefix(labelsets: list[Labels]) -> bytes:
        flat = [[part for pair in labels for part in pair] for labels in labelsets]
        return b"\x82" + msgpack.packb("labelsets") + msgpack.packb(flat, use_bin_type=True)

    def payloads(self, tick: int, ts_ms: int) -> list[bytes]:
        out = []
        column = self.values[(tick + self._shift) % len(self.values)]
        for k, ((lo, hi), prefix) in enumerate(zip(self.chunks, self.prefixes, strict=True)):
            n = hi - lo
            scrape = {"t": ts_ms, "s": self.indices[k], "v": column[8 * lo : 8 * hi]}
            raw = prefix + msgpack.packb("scrapes") + msgpack.packb([scrape], use_bin_type=True)
            header = {
                "cluster": CLUSTER,
                "node": self.node,
                "seq": tick * len(self.chunks) + k + 1,
                "t0": ts_ms,
                "t1": ts_ms,
                "n": n,
                "codec": codec.CODEC_V1,
                "body": self._zstd.compress(raw),
            }
            out.append(codec.MAGIC + bytes((codec.FORMAT_V1,)) + msgpack.packb(header, use_bin_type=True))
        return out

    def check_against_codec(self) -> None:
        """The fast path must produce what ``codec.encode_batch`` produces for the same batches
        (needs ``keep=True``)."""
        assert self.labelsets, "built without keep=True"
        ts = 1_700_000_000_000
        for k, ((lo, hi), payload) in enumerate(zip(self.chunks, self.payloads(3, ts), strict=True)):
            values = array("d")
            values.frombytes(self.values[(3 + self._shift) % len(self.values)][8 * lo : 8 * hi])
            batch = Batch(
                CLUSTER,
                self.node,
                3 * len(self.chunks) + k + 1,
                self.labelsets[lo:hi],
                [ScrapeBlock(ts, array("I", range(hi - lo)), values)],
            )
            if payload != codec.encode_batch(batch, self.level):
                raise SystemExit("generator: fast encoding differs from codec.encode_batch")


def value_pool(series: int, size: int = 8, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    base = [rng.uniform(0, 1e6) for _ in range(series)]
    pool = []
    for k in range(size):
        col = array("d", [b + k * rng.uniform(0, 50) for b in base])
        pool.append(col.tobytes())
    return pool


def run_generator(spec: dict[str, Any]) -> int:
    """Publish the schedule in ``spec``; print "ready", wait for "go <epoch>" on stdin, then a JSON
    progress line per second and a final one with "done": true."""
    nodes: list[int] = spec["nodes"]
    total_nodes: int = spec["total_nodes"]
    interval: float = spec["interval"]
    pool = value_pool(spec["series"])
    encoders = {
        i: NodeEncoder(
            node_name(i), spec["series"], spec["max_bytes"], spec["zstd_level"], pool, keep=i == nodes[0]
        )
        for i in nodes
    }
    encoders[nodes[0]].check_against_codec()
    batches_per_tick = sum(len(e.chunks) for e in encoders.values())

    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2,
        client_id=spec["client_id"],
        protocol=mqtt.MQTTv5,
    )
    client.max_inflight_messages_set(1000)
    client.max_queued_messages_set(0)
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set()
    client.connect(spec["host"], spec["port"], keepalive=30)
    client.loop_start()
    if not connected.wait(10):
        raise SystemExit("generator: no CONNACK from the broker")
    print(json.dumps({"ready": True, "batches_per_tick": batches_per_tick}), flush=True)
    go = sys.stdin.readline().split()
    start = float(go[1])
    end = start + spec["run_seconds"]

    published = samples = payload_bytes = late = 0
    lag_max = 0.0
    infos: list[mqtt.MQTTMessageInfo] = []
    next_report = time.time() + 1.0
    tick = 0
    while start + tick * interval < end:
        base = start + tick * interval
        for i in nodes:
            due = base + interval * i / total_nodes
            now = time.time()
            if now < due:
                time.sleep(due - now)
            else:
                late += int(now - due > 0.05)
                lag_max = max(lag_max, now - due)
            enc = encoders[i]
            ts_ms = int(time.time() * 1000)
            for payload in enc.payloads(tick, ts_ms):
                infos.append(client.publish(enc.topic, payload, qos=1))
                payload_bytes += len(payload)
            published += len(enc.chunks)
            samples += spec["series"]
            if time.time() >= next_report:
                print(json.dumps({"t": time.time(), "samples": samples}), flush=True)
                next_report += 1.0
                infos = [m for m in infos if not m.is_published()]
        tick += 1
    deadline = time.time() + 30
    for info in infos:
        info.wait_for_publish(max(0.1, deadline - time.time()))
    client.disconnect()
    client.loop_stop()
    cpu = os.times()
    print(
        json.dumps(
            {
                "t": time.time(),
                "samples": samples,
                "done": True,
                "batches": published,
                "payload_bytes": payload_bytes,
                "late_batches": late,
                "lag_max_s": lag_max,
                "cpu_s": cpu.user + cpu.system,
            }
        ),
        flush=True,
    )
    return 0


# ---------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------


def cpu_seconds(pid: int | None) -> float:
    """utime + stime of ``pid`` (0.0 if it is gone)."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


_WRITTEN_RE = re.compile(r"^cloud_ingest_samples_written_total\{[^}]*\} (\S+)$", re.M)
_MESSAGES_RE = re.compile(r'^cloud_ingest_messages_total\{outcome="([^"]+)"\} (\S+)$', re.M)


def read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, pos


def first_series_node_and_newest_ts(body: bytes) -> tuple[str, int] | None:
    """(node label, newest sample timestamp) of the first TimeSeries of a snappy'd WriteRequest: the
    ingester writes one batch (one node, one scrape) per request, so that is the request's."""
    raw = bytes(cramjam.snappy.decompress_raw(body))
    if not raw or raw[0] != 0x0A:
        return None
    length, pos = read_varint(raw, 1)
    end = pos + length
    node, newest = "", -1
    while pos < end:
        key, pos = read_varint(raw, pos)
        size, pos = read_varint(raw, pos)
        sub = raw[pos : pos + size]
        pos += size
        if key == 0x0A:  # Label {name = 1, value = 2}
            name_len, p = read_varint(sub, 1)
            if sub[p : p + name_len] == b"node":
                p += name_len
                value_len, p = read_varint(sub, p + 1)
                node = sub[p : p + value_len].decode()
        elif key == 0x12:  # Sample {value = 1 (fixed64), timestamp = 2 (varint)}
            p = 9 if sub[:1] == b"\x09" else 0
            ts = read_varint(sub, p + 1)[0] if p < len(sub) else 0
            newest = max(newest, ts)
    return (node, newest) if node else None


class Tap:
    """HTTP reverse proxy in front of the receiver: forwards every write and, for each one the receiver
    answered 2xx, records (wall time of the answer, node, newest sample timestamp)."""

    def __init__(self, upstream_url: str) -> None:
        parts = urllib.parse.urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.path = parts.path
        self.records: list[tuple[float, str, int]] = []
        self.errors = 0
        self._lock = threading.Lock()
        self._local = threading.local()
        tap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {
                    k: v
                    for k in (
                        "Content-Encoding",
                        "Content-Type",
                        "X-Prometheus-Remote-Write-Version",
                        "User-Agent",
                    )
                    if (v := self.headers.get(k)) is not None
                }
                status, reply = tap._forward(self.path, body, headers)
                if 200 <= status < 300:
                    at = time.time()
                    with contextlib.suppress(Exception):  # a body we cannot read is not timed
                        found = first_series_node_and_newest_ts(body)
                        if found is not None:
                            with tap._lock:
                                tap.records.append((at, found[0], found[1]))
                else:
                    with tap._lock:
                        tap.errors += 1
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.2,), daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}{self.path}"

    def _forward(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        for attempt in (1, 2):
            conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
            if conn is None:
                conn = self._local.conn = http.client.HTTPConnection(*self.upstream, timeout=60)
            try:
                conn.request("POST", path, body, headers)
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._local.conn = None
                if attempt == 2:
                    return 502, f"tap: {type(exc).__name__}".encode()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class QueryPoller:
    """Polls the receiver for the newest timestamp of ``POLL_NODES`` nodes' probe series."""

    def __init__(self, receiver: ManagedProcess, kind: str, nodes: list[str]) -> None:
        matcher = "|".join(nodes)
        selector = f'{PROBE_METRIC}{{node=~"{matcher}"}}'
        # Prometheus: timestamp() of an instant vector is its raw sample's; MetricsQL: tlast_over_time.
        self.query = f"timestamp({selector})" if kind == "prometheus" else f"tlast_over_time({selector}[5m])"
        self.url = f"http://{receiver.host}:{receiver.port}/api/v1/query"
        self.samples: list[tuple[float, float]] = []  # (poll time, latency s)
        self.failures = 0
        self._last: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._session = requests.Session()

    def start(self) -> QueryPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL_S):
            try:
                resp = self._session.get(self.url, params={"query": self.query}, timeout=5)
                result = resp.json()["data"]["result"]
            except (requests.RequestException, ValueError, KeyError):
                self.failures += 1
                continue
            now = time.time()
            for series in result:
                node = series["metric"].get("node", "")
                ts = float(series["value"][1])
                if node in self._last and ts > self._last[node]:
                    self.samples.append((now, now - ts))
                self._last[node] = max(ts, self._last.get(node, 0.0))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._session.close()


@dataclass
class Generator:
    proc: subprocess.Popen[str]
    progress: list[tuple[float, int]] = field(default_factory=list)
    final: dict[str, Any] = field(default_factory=dict)
    ready: threading.Event = field(default_factory=threading.Event)
    batches_per_tick: int = 0

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                self.batches_per_tick = msg["batches_per_tick"]
                self.ready.set()
            elif msg.get("done"):
                self.final = msg
                self.progress.append((msg["t"], msg["samples"]))
            else:
                self.progress.append((msg["t"], msg["samples"]))

    def published_at(self, t: float) -> float:
        """Samples published by wall time ``t`` (interpolated between progress lines)."""
        points = [(0.0, 0), *self.progress]
        for (t0, s0), (t1, s1) in itertools.pairwise(points):
            if t0 <= t <= t1:
                return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else float(s1)
        return float(points[-1][1])


@dataclass
class Snapshot:
    wall: float
    written: list[float]
    ingest_cpu: list[float]
    receiver_cpu: float
    broker_cpu: float
    generator_cpu: float
    published: float


@dataclass
class Row:
    receiver: str
    replicas: int
    offered: float  # nominal samples/s
    published: float  # samples/s the generator really published in the window
    written: list[float]  # samples/s per replica
    us_per_sample: list[float]  # ingester CPU over the window / samples it wrote
    marginal_us: list[float]  # the same without the CPU the replica burns idle
    ingest_cores: list[float]
    idle_cores: list[float]
    accepted: list[float]  # latency samples, s
    queryable: list[float]
    receiver_cores: float
    broker_cores: float
    generator_cores: float
    backlog_growth: float  # samples/s by which published - written grew in the window
    notes: list[str]

    @property
    def total(self) -> float:
        return sum(self.written)

    @property
    def saturated(self) -> bool:
        return self.total < 0.95 * self.published or self.backlog_growth > 0.05 * self.published


def replica_metrics(url: str) -> tuple[float, dict[str, float]]:
    try:
        text = requests.get(url, timeout=10).text
    except requests.RequestException:
        return math.nan, {}
    written = sum(float(v) for v in _WRITTEN_RE.findall(text))
    outcomes = {k: float(v) for k, v in _MESSAGES_RE.findall(text)}
    return written, outcomes


@dataclass
class Ingest:
    name: str
    program: Program
    metrics_url: str

    @property
    def pid(self) -> int | None:
        return None if self.program.proc is None else self.program.proc.pid


def publish_probe_status(broker: Mosquitto) -> None:
    client = mqtt.Client(
        callback_api_version=mqtt.CallbackAPIVersion.VERSION2, client_id="bench-probe", protocol=mqtt.MQTTv5
    )
    client.connect(broker.host, broker.port, keepalive=10)
    client.loop_start()
    status = {"node": PROBE_NODE, "cluster": CLUSTER, "state": "online", "ts_ms": int(time.time() * 1000)}
    info = client.publish(
        topics.status_topic(PREFIX, CLUSTER, PROBE_NODE), codec.encode_status(status), qos=1, retain=True
    )
    info.wait_for_publish(10)
    client.disconnect()
    client.loop_stop()


def run_config(args: argparse.Namespace, kind: str, replicas: int, workdir: Path) -> Row:
    load = f"{args.nodes} nodes x {args.series} series every {args.interval:g} s"
    log(f"== {kind}, {replicas} replica(s): {load}")
    stack = contextlib.ExitStack()
    with stack:
        broker = Mosquitto(workdir / "mosquitto").start()
        stack.callback(broker.stop)
        receiver: Prometheus | VictoriaMetrics
        if kind == "prometheus":
            receiver = Prometheus(workdir / "prometheus")
        else:
            receiver = VictoriaMetrics(workdir / "victoria-metrics")
        receiver.start()
        stack.callback(receiver.stop)
        tap: Tap | None = None
        write_url = receiver.remote_write_url
        if not args.no_tap:
            tap = Tap(receiver.remote_write_url)
            stack.callback(tap.close)
            write_url = tap.url
        publish_probe_status(broker)

        ingests: list[Ingest] = []
        for r in range(replicas):
            name = f"ingest-{r}"
            rdir = workdir / name
            rdir.mkdir(parents=True)
            cfg = ingest_config(
                rdir,
                mqtt_port=broker.port,
                remote_write_url=write_url,
                mqtt__client_id=name,
                mqtt__share_group=SHARE_GROUP,
                mqtt__keepalive_seconds=30,
                workers=args.workers,
                remote_write__retry_min_seconds=0.5,
                remote_write__retry_max_seconds=5,
            )
            listen = yaml.safe_load(cfg.read_text())["metrics"]["listen"]
            prog = program(name, "cloud_ingest.cli", cfg, rdir).start()
            stack.callback(prog.kill)
            stack.callback(prog.stop, 30)
            ingests.append(Ingest(name, prog, f"http://{listen}/metrics"))
        for ing in ingests:

            def subscribed(ing: Ingest = ing) -> bool:
                if not ing.program.alive():
                    raise SystemExit(f"{ing.name} exited:\n{ing.program.log_tail()}")
                try:
                    text = requests.get(ing.metrics_url, timeout=2).text
                except requests.RequestException:
                    return False
                return f'cloud_ingest_node_online{{cluster="{CLUSTER}",node="{PROBE_NODE}"}} 1.0' in text

            wait_until(subscribed, 60, 0.2, f"{ing.name} subscribed")

        # -- the load generator(s) ------------------------------------------------------------------
        run_seconds = args.warmup + args.duration + 1.0
        gens: list[Generator] = []
        publishers = max(1, min(args.publishers, args.nodes))
        for p in range(publishers):
            spec = {
                "host": broker.host,
                "port": broker.port,
                "client_id": f"bench-gen-{p}",
                "nodes": list(range(p, args.nodes, publishers)),
                "total_nodes": args.nodes,
                "series": args.series,
                "interval": args.interval,
                "run_seconds": run_seconds,
                "max_bytes": args.batch_max_bytes,
                "zstd_level": args.zstd_level,
            }
            glog = (workdir / f"generator-{p}.log").open("w")
            proc = subprocess.Popen(
                [sys.executable, __file__, "--generator", json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=glog,
                text=True,
                start_new_session=True,
            )
            glog.close()
            gen = Generator(proc)
            threading.Thread(target=gen.read, daemon=True).start()
            stack.callback(lambda proc=proc: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL))
            gens.append(gen)
        # What the replicas burn without load (MQTT keepalives, self-metrics): measured while the
        # generators pack their label sets, at least IDLE_SECONDS.
        idle_wall, idle_cpu = time.time(), [cpu_seconds(i.pid) for i in ingests]
        for gen in gens:
            if not gen.ready.wait(600):
                raise SystemExit(f"generator not ready; see {workdir}/generator-*.log")
        time.sleep(max(0.0, idle_wall + IDLE_SECONDS - time.time()))
        idle_span = time.time() - idle_wall
        idle_cores = [(cpu_seconds(i.pid) - c) / idle_span for i, c in zip(ingests, idle_cpu, strict=True)]
        start = time.time() + 1.0
        for gen in gens:
            assert gen.proc.stdin is not None
            gen.proc.stdin.write(f"go {start}\n")
            gen.proc.stdin.flush()
        batches_per_tick = sum(g.batches_per_tick for g in gens)
        log(f"generating {batches_per_tick} batches per {args.interval:g} s; warm-up {args.warmup:g} s")

        poll_nodes = [
            node_name(round(k * args.nodes / POLL_NODES)) for k in range(min(POLL_NODES, args.nodes))
        ]
        poller = QueryPoller(receiver, kind, poll_nodes).start()
        stack.callback(poller.stop)

        def snapshot() -> Snapshot:
            wall = time.time()
            written = [replica_metrics(i.metrics_url)[0] for i in ingests]
            return Snapshot(
                wall,
                written,
                [cpu_seconds(i.pid) for i in ingests],
                cpu_seconds(receiver.pid),
                cpu_seconds(broker.pid),
                sum(cpu_seconds(g.proc.pid) for g in gens),
                sum(g.published_at(wall) for g in gens),
            )

        time.sleep(max(0.0, start + args.warmup - time.time()))
        a = snapshot()
        log(f"measuring for {args.duration:g} s")
        time.sleep(max(0.0, start + args.warmup + args.duration - time.time()))
        b = snapshot()
        poller.stop()
        notes: list[str] = []
        for ing in ingests:
            _, outcomes = replica_metrics(ing.metrics_url)
            odd = {k: v for k, v in outcomes.items() if k != "written" and v}
            if odd:
                notes.append(f"{ing.name} message outcomes besides written: {odd}")
            if not ing.program.alive():
                notes.append(f"{ing.name} died: see {ing.program.log_path}")
        for gen in gens:
            gen.proc.wait(run_seconds + 60)
        time.sleep(0.5)
        for gen in gens:
            if gen.final.get("late_batches"):
                notes.append(
                    f"generator fell behind: {gen.final['late_batches']} batches published over 50 ms late "
                    f"(max {gen.final['lag_max_s']:.2f} s)"
                )
        if tap is not None and tap.errors:
            notes.append(f"receiver answered {tap.errors} writes with an error")
        if poller.failures:
            notes.append(f"{poller.failures} latency polls failed")

    span = b.wall - a.wall
    written = [(y - x) / span for x, y in zip(a.written, b.written, strict=True)]
    cpu = [y - x for x, y in zip(a.ingest_cpu, b.ingest_cpu, strict=True)]
    us = [c / (w * span) * 1e6 if w > 0 else math.nan for c, w in zip(cpu, written, strict=True)]
    marginal = [
        (c - idle * span) / (w * span) * 1e6 if w > 0 else math.nan
        for c, idle, w in zip(cpu, idle_cores, written, strict=True)
    ]
    backlog_a = a.published - sum(a.written)
    backlog_b = b.published - sum(b.written)
    accepted = [at - ts / 1000 for at, _, ts in (tap.records if tap else []) if a.wall <= at <= b.wall]
    queryable = [lat for at, lat in poller.samples if a.wall <= at <= b.wall]
    return Row(
        receiver=kind,
        replicas=replicas,
        offered=args.nodes * args.series / args.interval,
        published=(b.published - a.published) / span,
        written=written,
        us_per_sample=us,
        marginal_us=marginal,
        ingest_cores=[c / span for c in cpu],
        idle_cores=idle_cores,
        accepted=accepted,
        queryable=queryable,
        receiver_cores=(b.receiver_cpu - a.receiver_cpu) / span,
        broker_cores=(b.broker_cpu - a.broker_cpu) / span,
        generator_cores=(b.generator_cpu - a.generator_cpu) / span,
        backlog_growth=(backlog_b - backlog_a) / span,
        notes=notes,
    )


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def fmt_rate(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:,.0f}"


def fmt_lat(values: list[float]) -> str:
    if not values:
        return "n/a"
    return f"{percentile(values, 0.5):.3f} / {percentile(values, 0.99):.3f} s ({len(values)})"


def fmt_list(values: list[float], spec: str) -> str:
    return " / ".join("n/a" if math.isnan(v) else format(v, spec) for v in values)


def mean(values: list[float]) -> float:
    ok = [v for v in values if not math.isnan(v)]
    return sum(ok) / len(ok) if ok else math.nan


def report(args: argparse.Namespace, rows: list[Row]) -> str:
    lines = [
        f"# Ingest load bench, {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
        "",
        f"`{' '.join(['python bench/ingest_load_bench.py', *sys.argv[1:]])}`",
        "",
        f"{args.nodes} nodes x {args.series} series every {args.interval:g} s "
        f"(offered {args.nodes * args.series / args.interval:,.0f} samples/s), warm-up {args.warmup:g} s, "
        f"measured {args.duration:g} s; {args.workers} worker threads per ingester; "
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        "| receiver | replicas | published samples/s | written samples/s | per ingester process samples/s "
        "| ingester CPU us/sample (marginal) | ingester CPU cores (idle) | latency accepted p50 / p99 (n) "
        "| latency queryable p50 / p99 (n) | saturated | receiver / mosquitto / generator cores |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r.receiver} | {r.replicas} | {fmt_rate(r.published)} | {fmt_rate(r.total)} "
            f"| {' / '.join(fmt_rate(w) for w in r.written)} "
            f"| {fmt_list(r.us_per_sample, '.1f')} ({fmt_list(r.marginal_us, '.1f')}) "
            f"| {fmt_list(r.ingest_cores, '.2f')} ({fmt_list(r.idle_cores, '.3f')}) "
            f"| {fmt_lat(r.accepted)} | {fmt_lat(r.queryable)} "
            f"| {'yes' if r.saturated else 'no'} "
            f"| {r.receiver_cores:.2f} / {r.broker_cores:.2f} / {r.generator_cores:.2f} |"
        )
    lines += ["", "Scaling and goals:", ""]
    for kind in dict.fromkeys(r.receiver for r in rows):
        by_n = {r.replicas: r for r in rows if r.receiver == kind}
        if 1 in by_n and 2 in by_n and by_n[1].total > 0:
            one, two = by_n[1], by_n[2]
            why = (
                "1 replica was saturated"
                if one.saturated
                else "1 replica was not saturated: the offered load, not the ingester, bounds both"
            )
            lines.append(
                f"- {kind}: 1 -> 2 replicas: {fmt_rate(one.total)} -> {fmt_rate(two.total)} samples/s "
                f"(x{two.total / one.total:.2f}; {why})"
            )
    for r in rows:
        who = f"- {r.receiver}, {r.replicas} replica(s)"
        marginal = mean(r.marginal_us)
        if not math.isnan(marginal) and marginal > 0:
            ceiling = 1e6 / marginal
            per_process = r.total / r.replicas
            measured = (
                f"; {per_process:,.0f} samples/s per process measured at saturation" if r.saturated else ""
            )
            best = min(ceiling, per_process) if r.saturated else ceiling
            lines.append(
                f"{who}: {marginal:.1f} us of ingester CPU per sample beyond idle, i.e. at most "
                f"~{ceiling:,.0f} samples/s for a process with a whole core{measured} "
                f"(goal 250,000 samples/s per process: {'met' if best >= 250_000 else 'not met'})"
            )
        accepted, queryable = percentile(r.accepted, 0.99), percentile(r.queryable, 0.99)
        if not math.isnan(queryable):
            if r.saturated:
                goal = "n/a, saturated"
            elif queryable < 1:
                goal = "met"
            elif queryable - POLL_INTERVAL_S < 1:
                goal = f"within the {POLL_INTERVAL_S:g} s poll resolution of 1 s"
            else:
                goal = "not met"
            lines.append(
                f"{who}: p99 scrape-to-queryable latency <= {queryable:.3f} s (polls every "
                f"{POLL_INTERVAL_S:g} s), scrape-to-accepted "
                f"{'n/a (no tap)' if math.isnan(accepted) else f'{accepted:.3f} s'} (goal under 1 s below "
                f"saturation: {goal})"
            )
        for note in r.notes:
            lines.append(f"{who}: {note}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=500, help="simulated edge nodes (default 500)")
    parser.add_argument("--series", type=int, default=2000, help="series per node (default 2000)")
    parser.add_argument("--interval", type=float, default=5.0, help="scrape interval, s (default 5)")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds before measuring (default 3 intervals + 5)"
    )
    parser.add_argument(
        "--replicas", type=int, nargs="+", default=[1, 2], help="replica counts to run (default 1 2)"
    )
    parser.add_argument(
        "--receiver",
        nargs="+",
        choices=["victoriametrics", "prometheus"],
        default=["victoriametrics", "prometheus"],
        help="receivers to run against (default both)",
    )
    parser.add_argument(
        "--workers", type=int, default=2, help="ingester worker threads (default 2, the product's)"
    )
    parser.add_argument("--publishers", type=int, default=1, help="load generator processes (default 1)")
    parser.add_argument(
        "--batch-max-bytes", type=int, default=196608, help="split bigger node scrapes (relay default)"
    )
    parser.add_argument("--zstd-level", type=int, default=3, help="batch compression level (relay default 3)")
    parser.add_argument(
        "--no-tap", action="store_true", help="write straight to the receiver (no accepted latency)"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the working directory (logs, configs, data)"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="working directory (implies --keep)")
    parser.add_argument("--generator", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.generator is not None:
        return run_generator(json.loads(args.generator))
    if args.warmup is None:
        args.warmup = 3 * args.interval + 5
    keep = args.keep or args.workdir is not None
    base = args.workdir or Path(tempfile.mkdtemp(prefix="ingest-load-"))
    base.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    try:
        for kind in args.receiver:
            for replicas in args.replicas:
                rows.append(run_config(args, kind, replicas, base / f"{kind}-{replicas}"))
                log(f"written {fmt_rate(rows[-1].total)} samples/s")
    except KeyboardInterrupt:
        log("interrupted")
    finally:
        if keep:
            log(f"working directory kept: {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    if not rows:
        return 1
    text = report(args, rows)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-ingest-load.md"
    out.write_text(text)
    log(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
