"""``cloud-ingest fleet``: one line per edge node: state, verdict, backlog, losses, what was written.

Sources: the retained status messages of all nodes, read from the broker by a throwaway clean-session
client (nothing stays on the broker), and, with ``--metrics-url``, an ingester's ``/metrics``, which adds
what only an ingester knows: samples written, dead letters, seq gaps, the newest sample written, the
backlog a node reported before its last will (the will carries no numbers), and the verdict, which needs
history (did the loss total *grow*?). Without it the verdict is judged from the statuses alone, so it
cannot say ``losing_data``. With several replicas, point it at any one: each keeps the whole fleet view,
but written samples and dead letters are that replica's share.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
import requests
from prometheus_client.parser import text_string_to_metric_families

from cloud_ingest import settings as settings_mod
from cloud_ingest.commands.broker import tool_client, tool_connect
from cloud_ingest.outcome.fleet import VERDICTS, Fleet, NodeKey, NodeView
from schemas import codec, topics

COLUMNS = (
    "node",
    "state",
    "verdict",
    "status_age",
    "batch_age",
    "backlog_rows",
    "backlog_bytes",
    "oldest_unsent",
    "lost",
    "written",
    "dead_letters",
    "seq_gaps",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="cloud ingester config file (YAML): the broker")
    parser.add_argument(
        "--metrics-url",
        help="an ingester's /metrics (e.g. http://127.0.0.1:9902/metrics): written samples, dead letters, "
        "seq gaps and verdicts",
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=1.0,
        help="seconds to collect retained status messages after subscribing (default 1)",
    )


# --- sources ----------------------------------------------------------------------------------


@dataclass
class Statuses:
    by_node: dict[NodeKey, dict[str, Any]] = field(default_factory=dict)
    malformed: int = 0


class BrokerError(Exception):
    pass


def collect_statuses(s: settings_mod.Settings, wait: float, timeout: float = 10.0) -> Statuses:
    """The retained status of every node, read by a clean-session client that leaves nothing behind."""
    found = Statuses()
    lock = threading.Lock()
    subscribed = threading.Event()
    refused: list[str] = []
    client = tool_client(s, f"cloud-ingest-fleet-{uuid.uuid4().hex[:12]}")
    status_filter = topics.status_subscription(s.topic_prefix)

    def on_connect(c: mqtt.Client, userdata: Any, flags: Any, reason_code: Any, props: Any) -> None:
        if reason_code.is_failure:
            refused.append(f"the broker refused the connection: {reason_code}")
            subscribed.set()
            return
        c.subscribe(status_filter, qos=1)

    def on_subscribe(c: mqtt.Client, userdata: Any, mid: int, reason_codes: Any, props: Any) -> None:
        if any(rc.is_failure for rc in reason_codes):
            refused.append(f"the broker refused the subscription to {status_filter}: {reason_codes[0]}")
        subscribed.set()

    def on_message(c: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        if not message.payload:
            return
        try:
            cluster, node, _ = topics.parse_topic(s.topic_prefix, message.topic)
            status = codec.decode_status(message.payload)
        except (ValueError, codec.DecodeError):
            with lock:
                found.malformed += 1
            return
        with lock:
            found.by_node[(cluster, node)] = status

    client.on_connect = on_connect
    client.on_subscribe = on_subscribe
    client.on_message = on_message
    try:
        tool_connect(client, s)
    except (OSError, ValueError) as e:
        raise BrokerError(f"cannot connect to MQTT {s.mqtt_host}:{s.mqtt_port}: {e}") from e
    client.loop_start()
    try:
        if not subscribed.wait(timeout):
            raise BrokerError(f"no answer from MQTT {s.mqtt_host}:{s.mqtt_port} within {timeout:g}s")
        if refused:
            raise BrokerError(refused[0])
        # Retained messages follow the SUBACK at once; the wait covers a large fleet and a slow link.
        time.sleep(max(0.0, wait))
    finally:
        client.disconnect()
        client.loop_stop()
    with lock:
        return Statuses(dict(found.by_node), found.malformed)


# (cluster, node) -> {sample name or "name{label=value}": value}
RemoteNodes = dict[NodeKey, dict[str, float]]


def read_metrics(url: str, timeout: float = 10.0) -> RemoteNodes:
    """Per-node ``cloud_ingest_node_*`` samples of an ingester's /metrics."""
    response = requests.get(url, timeout=timeout)
    response.raise_for_status()
    return parse_metrics(response.text)


def parse_metrics(text: str) -> RemoteNodes:
    out: RemoteNodes = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("cloud_ingest_node_"):
            continue
        for sample in family.samples:
            cluster, node = sample.labels.get("cluster"), sample.labels.get("node")
            if cluster is None or node is None or math.isnan(sample.value):
                continue
            extra = {k: v for k, v in sample.labels.items() if k not in ("cluster", "node")}
            key = sample.name
            if extra:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) + "}"
            out.setdefault((cluster, node), {})[key] = sample.value
    return out


# --- one row per node -------------------------------------------------------------------------


@dataclass
class Row:
    cluster: str
    node: str
    state: str | None = None
    silent: bool = False
    verdict: str | None = None
    status_at: float | None = None
    batch_at: float | None = None
    backlog_rows: float | None = None
    backlog_bytes: float | None = None
    oldest_unsent: float | None = None
    lost: float | None = None
    written: float | None = None
    dead_letters: float | None = None
    seq_gaps: float | None = None


def _max(*values: float | None) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def _first(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


def build_rows(views: Iterable[NodeView], remote: RemoteNodes | None) -> list[Row]:
    """Merge the statuses (fresh from the broker) with an ingester's view (history, batches)."""
    local = {(v.cluster, v.node): v for v in views}
    rows: list[Row] = []
    for key in sorted(set(local) | set(remote or {})):
        view = local.get(key)
        m = (remote or {}).get(key, {})
        row = Row(*key)
        if view is not None:
            row.state, row.silent, row.verdict = view.state, view.silent, view.verdict
            row.status_at = view.status_heard
            row.backlog_rows, row.backlog_bytes = view.spool_rows, view.spool_bytes
            row.oldest_unsent, row.lost = view.oldest_unsent, view.lost_samples
        if row.state is None and "cloud_ingest_node_online" in m:
            row.state = "online" if m["cloud_ingest_node_online"] == 1 else "offline"
        remote_verdict = next(
            (v for v in VERDICTS if m.get(f"cloud_ingest_node_state{{state={v}}}") == 1), None
        )
        if remote_verdict is not None:
            row.verdict = remote_verdict
        row.status_at = _max(row.status_at, m.get("cloud_ingest_node_last_status_timestamp_seconds"))
        row.batch_at = m.get("cloud_ingest_node_last_batch_timestamp_seconds")
        # A status without numbers (the last will) leaves them to what the ingester remembers.
        row.backlog_rows = _first(row.backlog_rows, m.get("cloud_ingest_node_backlog_batches"))
        row.backlog_bytes = _first(row.backlog_bytes, m.get("cloud_ingest_node_backlog_bytes"))
        row.oldest_unsent = _first(
            row.oldest_unsent, m.get("cloud_ingest_node_oldest_unsent_timestamp_seconds")
        )
        row.lost = _first(row.lost, m.get("cloud_ingest_node_reported_lost_samples"))
        if m:
            row.written = m.get("cloud_ingest_node_samples_written_total", 0.0)
            row.dead_letters = m.get("cloud_ingest_node_dead_letters_total", 0.0)
            row.seq_gaps = m.get("cloud_ingest_node_seq_gaps")
        rows.append(row)
    return rows


# --- rendering --------------------------------------------------------------------------------


def fmt_age(at: float | None, now: float) -> str:
    if at is None:
        return "-"
    age = max(0.0, now - at)
    for unit, size, limit in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if age < limit:
            return f"{age / size:.0f}{unit}"
    return f"{age / 86400:.0f}d"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_count(n: float | None) -> str:
    return "-" if n is None else f"{n:.0f}"


def render(rows: list[Row], now: float) -> list[str]:
    cells = [list(COLUMNS)]
    for r in rows:
        state = r.state or "-"
        if r.silent and r.state == "online":
            state = "silent"
        cells.append(
            [
                f"{r.cluster}/{r.node}",
                state,
                r.verdict or "-",
                fmt_age(r.status_at, now),
                fmt_age(r.batch_at, now),
                fmt_count(r.backlog_rows),
                fmt_bytes(r.backlog_bytes),
                fmt_age(r.oldest_unsent, now),
                fmt_count(r.lost),
                fmt_count(r.written),
                fmt_count(r.dead_letters),
                fmt_count(r.seq_gaps),
            ]
        )
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = []
    for row in cells:
        left = [row[i].ljust(widths[i]) for i in range(3)]
        right = [row[i].rjust(widths[i]) for i in range(3, len(COLUMNS))]
        lines.append("  ".join(left + right).rstrip())
    return lines


def run(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    try:
        statuses = collect_statuses(s, args.wait)
    except BrokerError as e:
        print(f"cloud-ingest fleet: {e}", file=sys.stderr)
        return 1
    fleet = Fleet()
    for (cluster, node), status in statuses.by_node.items():
        fleet.observe_status(cluster, node, status, retained=True)
    remote: RemoteNodes | None = None
    failed = False
    if args.metrics_url:
        try:
            remote = read_metrics(args.metrics_url)
        except (requests.RequestException, ValueError) as e:
            print(f"cloud-ingest fleet: cannot read {args.metrics_url}: {e}", file=sys.stderr)
            failed = True
    rows = build_rows(fleet.snapshot(), remote)
    now = time.time()
    if not rows:
        print(f"no nodes: no retained status under {topics.status_subscription(s.topic_prefix)}")
    else:
        print("\n".join(render(rows, now)))
        counts = {v: sum(1 for r in rows if r.verdict == v) for v in VERDICTS}
        summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
        print(f"\n{len(rows)} nodes: {summary}")
    if statuses.malformed:
        print(f"{statuses.malformed} malformed status messages ignored", file=sys.stderr)
    if remote is None:
        print(
            "verdicts from the retained statuses alone (no --metrics-url): loss growth, dead letters, "
            "written samples and seq gaps unknown",
            file=sys.stderr,
        )
    return 1 if failed else 0
