"""Ingest load bench (issue 5): how many samples per second one ``cloud-ingest`` process sustains, what
each costs in CPU, how long a sample takes from its scrape time to being queryable, and how the
ingester scales from 1 to 2 replicas.  Not a test: it prints a markdown table and writes it to
``bench/results/<timestamp>-ingest-load.md``.  See ``bench/README.md`` ("Ingest load bench").

    python bench/ingest_load_bench.py --warmup 120             # 500 nodes x 2000 series / 5 s, v2 windows
    python bench/ingest_load_bench.py --nodes 10 --series 200 --duration 20   # tiny check, ~7 min
    python bench/ingest_load_bench.py --format-version 1 --warmup 60          # one scrape per batch

    load generator --MQTT QoS 1--> mosquitto --$share/ingest--> cloud-ingest x N --> tap --> receiver
    (real wire format, one                                      (subprocesses,     (HTTP    (VictoriaMetrics
     batch per node and period)                                  own client ids)    proxy)   or Prometheus)

The generator (``--publishers`` subprocesses of this script) plays ``--nodes`` edge nodes scraping
``--series`` series every ``--interval`` seconds, each publishing on its own batch topic, in exactly
the bytes ``schemas.codec.encode_batch`` produces.  At start-up a few of the batches it will publish
are compared with ``codec.encode_batch``'s bytes and decoded with ``codec.decode_batch`` to exactly
the samples meant (label sets, timestamps, value bit patterns); any difference stops the bench.

- ``--format-version 2`` (default): the relay's batch windows.  Every ``--window-scrapes`` x
  ``--interval`` seconds (12 x 5 s = the budget's default ``batch_window_seconds`` of 60 s) each node
  publishes one v2 batch holding its last ``--window-scrapes`` scrapes, timestamps one interval apart,
  the newest being the moment the batch is built; nodes spread evenly over the window.  Encoding a
  window costs ~1.7 us/sample, too much for a generator sharing the machine, but in a v2 body every
  stream is its own zstd frame and only TIMES depends on when the window was built: the GROUPS and
  value streams of ``V2_POOL`` windows (values by sorted series position, shared by all nodes) and
  each node's label streams are taken from ``codec.encode_batch`` output once, and a publish only
  compresses the new TIMES stream and packs the header (seq, t0, t1): well under 0.01 us/sample.
- ``--format-version 1``: one v1 batch per node and interval holding one scrape, nodes spread evenly
  over the interval.  Label sets are packed once per node; per tick only the scrape block (timestamp,
  one of 8 value columns) is packed and the body compressed, a few tenths of a us per sample, not
  the encoder's ~5.

A batch bigger than ``--batch-max-bytes`` is split by series, as the relay does (v2: each part keeps
every scrape of its series).  The sample timestamp of the newest scrape of a batch is the moment the
batch is built (its "scrape time"; a real relay adds its own scrape, encode and spool time).

Measured over ``--duration`` seconds after ``--warmup``:

- samples/s per ingester process: ``cloud_ingest_samples_written_total`` from each replica's /metrics;
- CPU us/sample: utime + stime from ``/proc/<pid>/stat`` of each replica over the window, divided by
  the samples it wrote (also shown: the receiver's, mosquitto's and the generator's CPU in cores);
- latency "accepted": the tap (an HTTP proxy in front of the receiver) notes, for every write the
  receiver answered 2xx, the wall time minus the newest sample timestamp of the batch (the ingester
  writes one batch per request);
- latency "queryable": every 0.25 s the receiver is queried for the newest timestamp of a probe series
  of 10 sampled nodes; a new one seen at poll time P counts P - timestamp (an upper bound, 0.25 s
  resolution).  For Prometheus a 2xx means queryable; VictoriaMetrics makes rows searchable up to
  about a second after it accepted them, and not all of a request's rows at once: with windows a
  poll often sees the window's second newest sample first, so only the newest sample of a batch is
  timed (the generators report their timestamps).

Both latencies count from the *newest* sample of a batch, in either format: they measure the cloud
side (MQTT, decode, remote write, receiver), which is what this bench loads.  With windows (v2) the
end-to-end latency of a sample also includes up to one window (60 s by default) of batching on the
edge: the relay holds every scrape until its window closes, so in a generated batch the oldest scrape
is ``(window-scrapes - 1) x interval`` (55 s) older than the newest.  That wait is set by the
bandwidth budget, not by the ingester, and would only shift every figure by the same known amount, so
it is stated next to them rather than mixed in; add it for the age of a window's oldest sample.

The warm-up lasts at least one window, so that the measured span starts after every node's first
batch has created its series in the receiver; measure a whole number of windows (the default
``--duration`` of 60 s is one) so that every node publishes equally often in the span.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
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
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cramjam
import msgpack
import paho.mqtt.client as mqtt
import requests
import yaml
import zstandard

from schemas import codec, columnar, topics
from schemas.model import Batch, Labels, ScrapeBlock
from testkit.benchkit import RESULTS, log
from testkit.netfaults import RemoteWriteProxy
from testkit.readings import cpu_seconds
from testkit.rw_wire import read_varint, wire_fields, wire_timeseries
from testkit.services import ManagedProcess, Mosquitto, Prometheus, VictoriaMetrics, wait_until
from testkit.stack import Program, ingest_config, program

PREFIX = "edgemetrics"
CLUSTER = "bench"
SHARE_GROUP = "ingest"
PROBE_NODE = "bench-probe"  # retained status: tells when a replica's subscriptions are live
PROBE_METRIC = "bench_probe"  # series 0 of every node, polled for the "queryable" latency
POLL_NODES = 10
POLL_INTERVAL_S = 0.25
IDLE_SECONDS = 5.0
V2_POOL = 4  # v2: windows of different values pre-encoded per series range, one picked per publish
TEMPLATE_TS = 1_700_000_000_000  # timestamp of the pre-encoded batches (only TIMES depends on it)
WIDEST_SEQ = 2**62  # sizes are checked with this seq: msgpack never writes a real seq in more bytes
# Positions of a v2 body's streams (codec.V2_STREAMS): the ones that depend on the node's label sets,
# the value streams, and the groups (which depend only on the series and scrape counts).
V2_GROUPS = codec.V2_STREAMS.index("GROUPS")
V2_LABELS = slice(codec.V2_STREAMS.index("LMETA"), codec.V2_STREAMS.index("LIDS") + 1)
V2_VALUES = slice(codec.V2_STREAMS.index("VKIND"), len(codec.V2_STREAMS))

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

    def intended(self, tick: int, ts_ms: int) -> list[Batch]:
        """The batches ``payloads(tick, ts_ms)`` is meant to carry (needs ``keep=True``)."""
        assert self.labelsets, "built without keep=True"
        out = []
        for k, (lo, hi) in enumerate(self.chunks):
            values = array("d")
            values.frombytes(self.values[(tick + self._shift) % len(self.values)][8 * lo : 8 * hi])
            block = ScrapeBlock(ts_ms, array("I", range(hi - lo)), values)
            out.append(
                Batch(CLUSTER, self.node, tick * len(self.chunks) + k + 1, self.labelsets[lo:hi], [block])
            )
        return out


def v2_segments(payload: bytes) -> list[bytes]:
    """The 15 stream segments of a v2 envelope's body, each as written: uvarint(length) + zstd frame.
    The streams are compressed one by one (wire-format.md section 3.2), so a body is the plain
    concatenation of its segments and one segment can be swapped without touching the others."""
    body: bytes = msgpack.unpackb(payload[len(codec.MAGIC) + 1 :], raw=False)["body"]
    segments, pos = [], 0
    while pos < len(body):
        length, start = read_varint(body, pos)
        segments.append(body[pos : start + length])
        pos = start + length
    if len(segments) != len(codec.V2_STREAMS) or pos != len(body):
        raise SystemExit("generator: unexpected v2 body layout")
    return segments


def window_values(names: list[str], scrapes: int, rng: random.Random) -> list[array]:
    """One window of values per series (in the order of ``names``): counters that grow by up to 50 per
    scrape (3 decimals, like Kepler's joules), GPU power in watts with 2 decimals, integer utilisation
    and byte gauges; so the columns code as v2's decimal kinds, as nearly all of a relay's do."""
    out = []
    for name in names:
        if name == "DCGM_FI_DEV_POWER_USAGE":
            vals = [round(rng.uniform(60.0, 300.0), 2) for _ in range(scrapes)]
        elif name == "DCGM_FI_DEV_GPU_UTIL":
            vals = [float(rng.randrange(101)) for _ in range(scrapes)]
        elif name == "node_memory_Active_bytes":
            base = rng.randrange(1 << 30, 64 << 30)
            vals = [float(base + rng.randrange(-(1 << 24), 1 << 24)) for _ in range(scrapes)]
        else:  # counters, the probe series included
            total = round(rng.uniform(0.0, 1e6), 3)
            vals = []
            for _ in range(scrapes):
                total = round(total + rng.uniform(0.0, 50.0), 3)
                vals.append(total)
        out.append(array("d", vals))
    return out


class WindowTemplates:
    """What every node of a generator shares in v2 mode: ``V2_POOL`` windows of values, and per series
    range (a node's batch, or part of it) and pool entry the encoded GROUPS and value streams.

    In a v2 body only the label streams depend on the node and only TIMES on when the window was
    built: GROUPS holds indices into the timestamp table (one group: every series has every scrape),
    the value streams hold the values in series order (series sorted by label set, which orders every
    node's series alike).  So these segments are taken once from ``codec.encode_batch`` output and
    reused by every node, with values assigned by sorted position."""

    def __init__(self, series: int, scrapes: int, interval_ms: int, level: int) -> None:
        self.scrapes = scrapes
        self.interval_ms = interval_ms
        self.level = level
        names = [dict(labels)["__name__"] for labels in sorted(node_labelsets(node_name(0), series))]
        rng = random.Random(2)
        self.values = [window_values(names, scrapes, rng) for _ in range(V2_POOL)]
        self._shared: dict[tuple[int, int], list[tuple[bytes, bytes]]] = {}

    def times(self, ts_ms: int) -> list[int]:
        """The window's scrape timestamps, ``interval_ms`` apart, the newest ``ts_ms``."""
        return [ts_ms - (self.scrapes - 1 - j) * self.interval_ms for j in range(self.scrapes)]

    def batch(self, node: str, labelsets: list[Labels], lo: int, pool: int, seq: int, ts_ms: int) -> Batch:
        """The batch meant: series ``lo + k`` of the node (sorted) is ``labelsets[k]``."""
        values = self.values[pool][lo : lo + len(labelsets)]
        ids = array("I", range(len(labelsets)))
        blocks = [
            ScrapeBlock(t, ids, array("d", [v[j] for v in values])) for j, t in enumerate(self.times(ts_ms))
        ]
        return Batch(CLUSTER, node, seq, labelsets, blocks)

    def shared(self, node: str, labelsets: list[Labels], lo: int) -> list[tuple[bytes, bytes]]:
        """Per pool entry: (GROUPS segment, value segments) of series ``lo … lo+len-1``."""
        key = (lo, len(labelsets))
        if key not in self._shared:
            out = []
            for pool in range(V2_POOL):
                batch = self.batch(node, labelsets, lo, pool, 1, TEMPLATE_TS)
                segments = v2_segments(codec.encode_batch(batch, self.level, version=codec.FORMAT_V2))
                out.append((segments[V2_GROUPS], b"".join(segments[V2_VALUES])))
            self._shared[key] = out
        return self._shared[key]

    def label_segment(self, node: str, labelsets: list[Labels]) -> bytes:
        """The label segments of a batch with ``labelsets``, from a one-scrape batch (cheaper to encode
        than a window; the label streams do not depend on the samples)."""
        zeros = array("d", bytes(8 * len(labelsets)))
        block = ScrapeBlock(TEMPLATE_TS, array("I", range(len(labelsets))), zeros)
        batch = Batch(CLUSTER, node, 1, labelsets, [block])
        return b"".join(
            v2_segments(codec.encode_batch(batch, self.level, version=codec.FORMAT_V2))[V2_LABELS]
        )


class WindowNodeEncoder:
    """Builds one node's v2 window batches in exactly the bytes of ``codec.encode_batch``, cheaply.

    Per publish only the TIMES stream (a dozen varints, one small zstd frame) and the envelope header
    (seq, t0, t1) are new; the node's label segments and the shared GROUPS and value segments of one of
    ``V2_POOL`` windows are concatenated to them.  A window bigger than ``max_bytes`` is split by
    series into parts that keep every scrape, as the relay's ``BatchEncoder.build_window`` does."""

    def __init__(self, node: str, series: int, max_bytes: int, templates: WindowTemplates) -> None:
        self.node = node
        self.series = series
        self.templates = templates
        self._shift = zlib.crc32(node.encode())  # so nodes do not all send the same window in a tick
        self.topic = topics.batch_topic(PREFIX, CLUSTER, node)
        self._zstd = zstandard.ZstdCompressor(
            level=templates.level, write_content_size=True, write_checksum=True
        )
        labelsets = sorted(node_labelsets(node, series))
        parts = 1
        while True:
            per = -(-series // parts)
            self.chunks = [(lo, min(lo + per, series)) for lo in range(0, series, per)]
            self.labels = [templates.label_segment(node, labelsets[lo:hi]) for lo, hi in self.chunks]
            self.shared = [templates.shared(node, labelsets[lo:hi], lo) for lo, hi in self.chunks]
            tries = [self.payloads(tick, TEMPLATE_TS, seq=WIDEST_SEQ) for tick in range(V2_POOL)]
            sizes = [max(len(t[k]) for t in tries) for k in range(len(self.chunks))]
            if max(sizes) <= max_bytes or parts >= series:
                break
            # As the relay: aim for parts of 80% of the cap, at least doubling.
            parts = max(parts * 2, -(-sum(sizes) * 5 // (4 * max_bytes)))

    def payloads(self, tick: int, ts_ms: int, *, seq: int | None = None) -> list[bytes]:
        """The batches of publish number ``tick`` (its window ends at ``ts_ms``); ``seq`` overrides
        every seq (for sizing)."""
        pool = (tick + self._shift) % V2_POOL
        times = self.templates.times(ts_ms)
        frame = self._zstd.compress(bytes(columnar.encode_times(times)))
        times_segment = bytes(columnar.uvarints([len(frame)])) + frame
        out = []
        for k, (lo, hi) in enumerate(self.chunks):
            groups, values = self.shared[k][pool]
            header = {
                "cluster": CLUSTER,
                "node": self.node,
                "seq": seq or tick * len(self.chunks) + k + 1,
                "t0": times[0],
                "t1": times[-1],
                "n": (hi - lo) * len(times),
                "codec": codec.CODEC_V2,
                "body": b"".join((times_segment, groups, self.labels[k], values)),
            }
            out.append(codec.MAGIC + bytes((codec.FORMAT_V2,)) + msgpack.packb(header, use_bin_type=True))
        return out

    def intended(self, tick: int, ts_ms: int) -> list[Batch]:
        """The batches ``payloads(tick, ts_ms)`` is meant to carry (label sets rebuilt, so slow)."""
        labelsets = sorted(node_labelsets(self.node, self.series))
        pool = (tick + self._shift) % V2_POOL
        return [
            self.templates.batch(
                self.node, labelsets[lo:hi], lo, pool, tick * len(self.chunks) + k + 1, ts_ms
            )
            for k, (lo, hi) in enumerate(self.chunks)
        ]


def sample_bits(batch: Batch) -> dict[tuple[Labels, int], int]:
    """A batch as its set of samples: (label set, timestamp) -> the value's IEEE-754 bit pattern."""
    out: dict[tuple[Labels, int], int] = {}
    for block in batch.scrapes:
        bits = array("Q", array("d", block.values).tobytes())
        for i, s in enumerate(block.series):
            key = (batch.labelsets[s], block.sample_timestamp(i))
            if key in out:
                raise SystemExit(f"generator: sample {key} twice in one batch")
            out[key] = bits[i]
    return out


def check_payloads(payloads: list[bytes], batches: list[Batch], level: int, version: int) -> None:
    """What the generator publishes must be the bytes ``codec.encode_batch`` makes of the batches
    meant, and decode with ``codec.decode_batch`` to exactly their samples (label sets, timestamps,
    value bit patterns)."""
    if len(payloads) != len(batches):
        raise SystemExit(f"generator: {len(payloads)} payloads for {len(batches)} batches")
    for payload, batch in zip(payloads, batches, strict=True):
        if payload != codec.encode_batch(batch, level, version=version):
            raise SystemExit(f"generator: fast v{version} encoding differs from codec.encode_batch")
        decoded = codec.decode_batch(payload)
        if (decoded.cluster, decoded.node, decoded.seq) != (batch.cluster, batch.node, batch.seq):
            raise SystemExit("generator: published batch decodes to another cluster, node or seq")
        if sample_bits(decoded) != sample_bits(batch):
            raise SystemExit("generator: published batch does not decode to the samples meant")


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
    series: int = spec["series"]
    level: int = spec["zstd_level"]
    encoders: dict[int, NodeEncoder | WindowNodeEncoder]
    if spec["format_version"] == 1:
        period = spec["interval"]  # one scrape per batch, one batch per node and interval
        per_publish = series
        pool = value_pool(series)
        v1 = {
            i: NodeEncoder(node_name(i), series, spec["max_bytes"], level, pool, keep=i == nodes[0])
            for i in nodes
        }
        ts = TEMPLATE_TS
        check_payloads(v1[nodes[0]].payloads(3, ts), v1[nodes[0]].intended(3, ts), level, codec.FORMAT_V1)
        encoders = dict(v1)
    else:
        scrapes: int = spec["window_scrapes"]
        interval_ms = round(spec["interval"] * 1000)
        period = scrapes * spec["interval"]  # one window of scrapes per batch
        per_publish = series * scrapes
        templates = WindowTemplates(series, scrapes, interval_ms, level)
        v2 = {i: WindowNodeEncoder(node_name(i), series, spec["max_bytes"], templates) for i in nodes}
        for i in dict.fromkeys((nodes[0], nodes[-1])):  # every pool entry of two nodes
            for tick in range(V2_POOL):
                ts = TEMPLATE_TS + 4321 + tick * scrapes * interval_ms
                check_payloads(v2[i].payloads(tick, ts), v2[i].intended(tick, ts), level, codec.FORMAT_V2)
        encoders = dict(v2)
    batches_per_period = sum(len(e.chunks) for e in encoders.values())

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
    print(json.dumps({"ready": True, "batches_per_period": batches_per_period}), flush=True)
    go = sys.stdin.readline().split()
    start = float(go[1])
    end = start + spec["run_seconds"]

    published = samples = payload_bytes = late = 0
    lag_max = 0.0
    built: dict[str, list[int]] = {node_name(i): [] for i in spec["polled"]}  # newest timestamps
    infos: list[mqtt.MQTTMessageInfo] = []
    next_report = time.time() + 1.0

    def progress() -> None:
        nonlocal next_report, infos
        print(json.dumps({"t": time.time(), "samples": samples}), flush=True)
        next_report += 1.0
        infos = [m for m in infos if not m.is_published()]

    tick = 0
    while start + tick * period < end:
        base = start + tick * period
        for i in nodes:
            due = base + period * i / total_nodes
            if due >= end:
                break
            now = time.time()
            if now < due:
                # Progress lines go on while waiting: with windows, publishes can be seconds apart.
                while now < due:
                    if now >= next_report:
                        progress()
                    else:
                        time.sleep(min(due, next_report) - now)
                    now = time.time()
            else:
                late += int(now - due > 0.05)
                lag_max = max(lag_max, now - due)
            enc = encoders[i]
            ts_ms = int(time.time() * 1000)
            if enc.node in built:
                built[enc.node].append(ts_ms)
            for payload in enc.payloads(tick, ts_ms):
                infos.append(client.publish(enc.topic, payload, qos=1))
                payload_bytes += len(payload)
            published += len(enc.chunks)
            samples += per_publish
            if time.time() >= next_report:
                progress()
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
                "built": built,
            }
        ),
        flush=True,
    )
    return 0


# ---------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


_WRITTEN_RE = re.compile(r"^cloud_ingest_samples_written_total\{[^}]*\} (\S+)$", re.M)
_MESSAGES_RE = re.compile(r'^cloud_ingest_messages_total\{outcome="([^"]+)"\} (\S+)$', re.M)


def first_series_node_and_newest_ts(body: bytes) -> tuple[str, int] | None:
    """(node label, newest sample timestamp) of the first TimeSeries of a snappy'd WriteRequest: the
    ingester writes one batch (one node) per request, and every series of a generated batch has a
    sample of every scrape of the batch (v2: of the window), so that is the request's.  Only the first
    TimeSeries is read (``wire_fields`` is lazy)."""
    raw = bytes(cramjam.snappy.decompress_raw(body))
    number, first = next(wire_fields(raw), (0, b""))
    if number != 1 or not isinstance(first, bytes):  # WriteRequest.timeseries = 1
        return None
    lset, samples = wire_timeseries(first)
    node = dict(lset).get("node", "")
    return (node, max((t for t, _ in samples), default=-1)) if node else None


class Tap(RemoteWriteProxy):
    """HTTP reverse proxy in front of the receiver (``testkit.netfaults.RemoteWriteProxy``): forwards
    every write and, for each one the receiver answered 2xx, records (wall time of the answer, node,
    newest sample timestamp)."""

    def __init__(self, upstream_url: str) -> None:
        self.records: list[tuple[float, str, int]] = []
        super().__init__(upstream_url, after_forward=self._time, upstream_timeout_s=60.0, name="tap")

    @property
    def errors(self) -> int:
        """Writes the receiver did not accept (or could not be reached for: 502)."""
        return sum(1 for e in self.history() if not 200 <= e.status < 300)

    def _time(self, n: int, body: bytes) -> None:
        at = time.time()
        with contextlib.suppress(Exception):  # a body we cannot read is not timed
            found = first_series_node_and_newest_ts(body)
            if found is not None:
                with self._lock:
                    self.records.append((at, found[0], found[1]))


class QueryPoller:
    """Polls the receiver for the newest timestamp of ``POLL_NODES`` nodes' probe series.

    Only the newest sample of a batch is timed (``latencies`` gets them from the generators).  A batch
    holding a window of scrapes (v2) has several samples of the probe series, and VictoriaMetrics makes
    a request's rows searchable piece by piece: a poll often sees the window's second newest sample
    first and the newest about a second later."""

    def __init__(self, receiver: ManagedProcess, kind: str, nodes: list[str]) -> None:
        matcher = "|".join(nodes)
        selector = f'{PROBE_METRIC}{{node=~"{matcher}"}}'
        # Prometheus: timestamp() of an instant vector is its raw sample's; MetricsQL: tlast_over_time.
        self.query = f"timestamp({selector})" if kind == "prometheus" else f"tlast_over_time({selector}[5m])"
        self.url = f"http://{receiver.host}:{receiver.port}/api/v1/query"
        self._seen: list[tuple[float, str, int]] = []  # (poll time, node, timestamp ms) first seen then
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
                    self._seen.append((now, node, round(ts * 1000)))
                self._last[node] = max(ts, self._last.get(node, 0.0))

    def latencies(self, since: float, until: float, newest: set[tuple[str, int]]) -> list[float]:
        """Poll time minus timestamp of the samples first seen between ``since`` and ``until`` that are
        in ``newest``: (node, timestamp ms) of the newest sample of every batch published."""
        return [
            at - ts / 1000 for at, node, ts in self._seen if since <= at <= until and (node, ts) in newest
        ]

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
    batches_per_period: int = 0

    def read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg.get("ready"):
                self.batches_per_period = msg["batches_per_period"]
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
    generator_bytes: float  # wire bytes per sample the generator published (whole run)
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


def period(args: argparse.Namespace) -> float:
    """Seconds between two publishes of one node: a scrape interval (v1) or a window of them (v2)."""
    return args.interval * (args.window_scrapes if args.format_version == 2 else 1)


def wire_text(args: argparse.Namespace) -> str:
    if args.format_version == 1:
        return "wire format v1, one scrape per batch"
    return (
        f"wire format v2, windows of {args.window_scrapes} scrapes (one batch per node every "
        f"{period(args):g} s)"
    )


def run_config(args: argparse.Namespace, kind: str, replicas: int, workdir: Path) -> Row:
    load = f"{args.nodes} nodes x {args.series} series every {args.interval:g} s, {wire_text(args)}"
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
        poll_nodes = [round(k * args.nodes / POLL_NODES) for k in range(min(POLL_NODES, args.nodes))]
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
                "format_version": args.format_version,
                "window_scrapes": args.window_scrapes,
                "polled": [i for i in poll_nodes if i % publishers == p],
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
        batches = sum(g.batches_per_period for g in gens)
        log(f"generating {batches} batches per {period(args):g} s; warm-up {args.warmup:g} s")

        poller = QueryPoller(receiver, kind, [node_name(i) for i in poll_nodes]).start()
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
    sent = [(g.final.get("payload_bytes", 0), g.final.get("samples", 0)) for g in gens]
    backlog_a = a.published - sum(a.written)
    backlog_b = b.published - sum(b.written)
    accepted = [at - ts / 1000 for at, _, ts in (tap.records if tap else []) if a.wall <= at <= b.wall]
    newest = {(node, ts) for g in gens for node, stamps in g.final.get("built", {}).items() for ts in stamps}
    queryable = poller.latencies(a.wall, b.wall, newest)
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
        generator_bytes=sum(x for x, _ in sent) / max(1, sum(n for _, n in sent)),
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
        f"measured {args.duration:g} s; {wire_text(args)}; {args.workers} worker threads per ingester; "
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
    if args.format_version == 2:
        lines.append(
            f"- latencies count from the newest sample of each batch (the moment its window was built); "
            f"end to end, a sample also waits up to one window ({period(args):g} s) on the edge: here the "
            f"oldest scrape of a batch is {period(args) - args.interval:g} s older than the newest"
        )
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
        gen_us = r.generator_cores / r.published * 1e6 if r.published > 0 else math.nan
        lines.append(
            f"{who}: generator {r.generator_bytes:.2f} wire bytes/sample, "
            f"{'n/a' if math.isnan(gen_us) else f'{gen_us:.2f}'} us CPU per published sample "
            f"({r.generator_cores:.3f} cores)"
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
    parser.add_argument(
        "--format-version",
        type=int,
        choices=[1, 2],
        default=2,
        help="wire format: 2 = columnar windows (default), 1 = one scrape per batch",
    )
    parser.add_argument(
        "--window-scrapes",
        type=int,
        default=None,
        help="v2 only: scrapes per batch, one batch per node every N intervals (default 12: the "
        "relay's 60 s batch_window_seconds at 5 s)",
    )
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before measuring (default 3 intervals or one window, whichever is longer, + 5)",
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
        "--batch-max-bytes", type=int, default=1_000_000, help="split bigger node scrapes (relay default)"
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
    if args.format_version == 1 and args.window_scrapes is not None:
        parser.error("--window-scrapes needs --format-version 2")
    if args.window_scrapes is None:
        args.window_scrapes = 12
    if args.window_scrapes < 1:
        parser.error("--window-scrapes must be at least 1")
    if args.warmup is None:
        args.warmup = max(3 * args.interval, period(args)) + 5
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
