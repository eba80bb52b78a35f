"""``edge-relay status``: what the relay on this node is doing, read from its spool and its /metrics.

Two sources, each optional:

- **the spool file** (``spool.path``), opened read-only: backlog, oldest unsent sample, the loss
  ledger, today's quota use. Safe while the relay runs (SQLite WAL: a reader never blocks the writer).
  A missing spool is reported, never created; an old schema is read as far as it goes, never migrated.
- **the relay's /metrics** (``metrics.listen``): connected or not and since when, why the last connection
  failed, acks and bytes sent and when the cloud last acked, the budget's state and degrade levels, each
  target's scrape results and last error. A relay that does not answer is reported as "relay not running
  / metrics unreachable"; the spool part still shows.

Rates (drain, ETA) need two readings: a single ``status`` reads twice, ``--rate-seconds`` apart; ``--watch``
keeps a ``History`` of the readings of the last ``RATE_WINDOW_S`` seconds since the link last went up or
down. The rendering is ``edge_relay.commands.statusview`` (text, and HTML); ``--json`` prints
``snapshot`` (keys documented in ``docs/operations.md``, "edge-relay status").

The relay serves the same snapshot of itself as a web page (``StatusPage``, ``/status`` on the metrics
port): read in the relay's process, its /metrics from its own registry instead of over HTTP, with a
``History`` across page loads for the rates.
"""

from __future__ import annotations

import argparse
import json
import math
import sqlite3
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from edge_relay import settings as settings_mod
from edge_relay.commands import statusview
from edge_relay.settings import Settings
from relay_common.httpserver import split_host_port

JSON_VERSION = 1
RATE_WINDOW_S = 30.0
_FETCH_TIMEOUT_S = 2.0

# name -> [(labels, value)], as the relay's /metrics served them.
Samples = dict[str, list[tuple[dict[str, str], float]]]


@dataclass(frozen=True, slots=True)
class SpoolView:
    """The spool file's numbers, as ``Spool.stats()`` and the ledger compute them (same SQL)."""

    rows: int = 0
    bytes: int = 0
    samples: int = 0
    oldest_ms: int | None = None  # of batches and staged cycles
    quarantined_rows: int = 0
    last_seq: int = 0
    staged_rows: int = 0
    staged_bytes: int = 0
    staged_samples: int = 0
    losses: dict[str, int] = field(default_factory=dict)
    quota_used_bytes: int | None = None  # today's budget quota use, when a daily quota keeps it
    recorder_bytes: int = 0  # the flight recorder's blocks (schema 4)
    recorder_oldest_ms: int | None = None
    recorder_newest_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Reading:
    """One look at both sources; ``spool`` / ``metrics`` are None when unavailable (see the errors)."""

    at: float
    spool: SpoolView | None
    spool_error: str | None
    metrics: Samples | None
    metrics_error: str | None
    spool_exists: bool = True


# --- the spool, read-only ---------------------------------------------------------------------------


def _connect_read_only(path: Path, *, immutable: bool) -> sqlite3.Connection:
    # Without a -wal file no relay has the spool open (its connection keeps the WAL) and everything is
    # in the main file: ``immutable=1`` then reads it without creating -wal/-shm files, which, made by
    # another user (root in a `kubectl exec`), could lock the relay out of its own spool later.
    mode = "immutable=1" if immutable else "mode=ro"
    conn = sqlite3.connect(f"{path.resolve().as_uri()}?{mode}", uri=True, timeout=5)
    conn.execute("PRAGMA query_only = 1")
    return conn


def read_spool(path: str | Path) -> SpoolView:
    """The spool at ``path``, read-only; FileNotFoundError if there is none, sqlite3.Error if unreadable."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"spool {p} does not exist")
    immutable = not Path(f"{p}-wal").exists()
    try:
        return _read(_connect_read_only(p, immutable=immutable))
    except sqlite3.DatabaseError:
        if not immutable:
            raise
        # A relay that started between the check and the read changes the "immutable" file: read again
        # the ordinary way, through its WAL.
        return _read(_connect_read_only(p, immutable=False))


def _read(conn: sqlite3.Connection) -> SpoolView:
    try:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        if "batches" not in tables:
            raise sqlite3.DatabaseError("not a spool file (no batches table)")
        rows, size, samples, oldest = conn.execute(
            "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0), "
            "min(first_ts_ms) FROM batches"
        ).fetchone()
        quarantined = (
            conn.execute("SELECT count(*) FROM quarantine").fetchone()[0] if "quarantine" in tables else 0
        )
        meta = dict(conn.execute("SELECT key, value FROM meta").fetchall()) if "meta" in tables else {}
        staged = (0, 0, 0, None)
        if "staging" in tables:  # schema 3
            staged = conn.execute(
                "SELECT count(*), coalesce(sum(byte_size), 0), coalesce(sum(sample_count), 0), "
                "min(first_ts_ms) FROM staging"
            ).fetchone()
        if staged[3] is not None and (oldest is None or staged[3] < oldest):
            oldest = staged[3]
        losses: dict[str, int] = {}
        if "ledger" in tables:  # schema 2
            losses = {
                str(r): int(n)
                for r, n in conn.execute(
                    "SELECT reason, sum(samples) FROM ledger GROUP BY reason ORDER BY reason"
                )
            }
        used = meta.get("x:budget_used_bytes")
        recorder = (0, None, None)
        if "recorder" in tables:  # schema 4
            recorder = conn.execute(
                "SELECT coalesce(sum(byte_size), 0), min(first_ts_ms), max(last_ts_ms) FROM recorder"
            ).fetchone()
        return SpoolView(
            rows=int(rows),
            bytes=int(size),
            samples=int(samples),
            oldest_ms=None if oldest is None else int(oldest),
            quarantined_rows=int(quarantined),
            last_seq=int(meta.get("last_seq", 0)),
            staged_rows=int(staged[0]),
            staged_bytes=int(staged[1]),
            staged_samples=int(staged[2]),
            losses=losses,
            quota_used_bytes=int(used) if isinstance(used, int) else None,
            recorder_bytes=int(recorder[0]),
            recorder_oldest_ms=None if recorder[1] is None else int(recorder[1]),
            recorder_newest_ms=None if recorder[2] is None else int(recorder[2]),
        )
    finally:
        conn.close()


# --- the relay's /metrics -----------------------------------------------------------------------------


def metrics_url(listen: str) -> str | None:
    """Where the relay serves /metrics, from ``metrics.listen`` (a wildcard address means this host)."""
    if not listen:
        return None
    host, port = split_host_port(listen)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"


def fetch_metrics(url: str, timeout_s: float = _FETCH_TIMEOUT_S) -> Samples:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse_metrics(response.read().decode("utf-8", "replace"))


def parse_metrics(text: str) -> Samples:
    """A Prometheus text exposition as ``Samples``."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def read(s: Settings, now: float | None = None, metrics: Callable[[], Samples] | None = None) -> Reading:
    """Both sources now; ``metrics`` reads the relay's metrics in place of fetching ``metrics.listen``."""
    spool: SpoolView | None = None
    spool_error: str | None = None
    exists = True
    try:
        spool = read_spool(s.spool_path)
    except FileNotFoundError as e:
        spool_error, exists = f"{e} (not created here: the relay makes it when it first runs)", False
    except sqlite3.Error as e:
        spool_error = f"cannot read spool {s.spool_path}: {e}"
    samples: Samples | None = None
    metrics_error: str | None = None
    url = metrics_url(s.metrics_listen)
    if metrics is not None:
        samples = metrics()
    elif url is None:
        metrics_error = "metrics disabled (metrics.listen is empty)"
    else:
        try:
            samples = fetch_metrics(url)
        except (OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            reason = getattr(reason, "strerror", None) or reason  # without the "[Errno 111]"
            metrics_error = f"relay not running / metrics unreachable at {url}: {reason}"
    return Reading(time.time() if now is None else now, spool, spool_error, samples, metrics_error, exists)


# --- from readings to the snapshot ------------------------------------------------------------------------


def _value(m: Samples | None, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples matching ``labels``; None if there is none."""
    if m is None or name not in m:
        return None
    found = [v for lab, v in m[name] if all(lab.get(k) == x for k, x in labels.items())]
    return sum(found) if found else None


def _by_label(m: Samples | None, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for lab, v in (m or {}).get(name, []):
        out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def _rate(first: Reading, last: Reading, pick: Any) -> float | None:
    a, b = pick(first), pick(last)
    dt = last.at - first.at
    if a is None or b is None or dt <= 0:
        return None
    return (b - a) / dt if b >= a else None  # a counter that went back: the relay restarted


def _counter(name: str, **labels: str) -> Any:
    # A labelled counter has no sample before its first increment: 0 then, when the relay answered.
    return lambda r: None if r.metrics is None else _value(r.metrics, name, **labels) or 0.0


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, digits)


def _drain(readings: list[Reading]) -> dict[str, Any]:
    last = readings[-1]
    # Each rate from the oldest reading that has its source (a relay or spool that came up meanwhile).
    first = next((r for r in readings if r.metrics is not None), last)
    acked = _rate(first, last, _counter("edge_relay_batches_acked_total"))
    spooled = _rate(first, last, _counter("edge_relay_batches_spooled_total"))
    sent = _rate(first, last, _counter("edge_relay_publish_payload_bytes_total"))
    wire = _rate(first, last, _counter("edge_relay_wire_bytes_total"))
    net_rows = net_bytes = None
    first_spool = next((r for r in readings if r.spool is not None), last)
    dt = last.at - first_spool.at
    if first_spool.spool is not None and last.spool is not None and dt > 0:
        net_rows = (last.spool.rows - first_spool.spool.rows) / dt
        net_bytes = (last.spool.bytes - first_spool.spool.bytes) / dt
    dt = max(last.at - first.at, dt)
    rows = None if last.spool is None else last.spool.rows
    eta: float | None = None
    if rows is None:
        state = "unknown"
    elif rows == 0:
        state, eta = "empty", 0.0
    elif net_rows is None:
        state = "unknown"
    elif net_rows < 0:
        state, eta = "draining", rows / -net_rows
    elif net_rows > 0:
        state = "growing"
    else:
        state = "steady"
    return {
        "interval_seconds": _round(dt if len(readings) > 1 else 0.0),
        "state": state,
        "acked_batches_per_second": _round(acked),
        "spooled_batches_per_second": _round(spooled),
        "sent_payload_bytes_per_second": _round(sent, 1),
        "wire_bytes_per_second": _round(wire, 1),
        "backlog_rows_per_second": _round(net_rows),
        "backlog_bytes_per_second": _round(net_bytes, 1),
        "eta_seconds": _round(eta, 1),
    }


def _link_up(r: Reading) -> bool | None:
    connected = _value(r.metrics, "edge_relay_mqtt_connected")
    return None if connected is None else connected >= 1


def _last_mqtt_error(m: Samples | None) -> dict[str, Any] | None:
    info = [lab for lab, v in (m or {}).get("edge_relay_mqtt_last_error_info", []) if v >= 1]
    if not info:
        return None
    reason = info[-1].get("reason", "other")
    when = _value(m, "edge_relay_mqtt_last_error_timestamp_seconds", reason=reason)
    return {"reason": reason, "message": info[-1].get("message", ""), "timestamp_seconds": when or None}


def _connection(s: Settings, r: Reading) -> dict[str, Any]:
    m = r.metrics
    up = _link_up(r)
    since = None
    if up is not None:
        since = _value(
            m,
            "edge_relay_mqtt_connected_since_timestamp_seconds"
            if up
            else "edge_relay_mqtt_disconnected_since_timestamp_seconds",
        )
    since = since or None  # 0 = not known (a relay older than these gauges)
    inflight = _value(m, "edge_relay_inflight_batches")
    last_ack = _value(m, "edge_relay_last_ack_timestamp_seconds") or None
    # Acks can only come while connected: the cloud is late once the ack timeout has passed both
    # since the last ack and since the connection came up, with batches waiting for theirs.
    stalled_since = None
    quiet_since = None if since is None else max(last_ack or 0.0, since)
    if up and inflight and quiet_since is not None and r.at - quiet_since > s.mqtt.ack_timeout_seconds:
        stalled_since = last_ack or since
    return {
        "relay_reachable": m is not None,
        "metrics_url": metrics_url(s.metrics_listen),
        "error": r.metrics_error,
        "broker": f"{s.mqtt.host}:{s.mqtt.port}",
        "connected": up,
        "since": since,
        "inflight_batches": inflight,
        "last_error": _last_mqtt_error(m),
        "last_ack_timestamp_seconds": last_ack,
        "ack_timeout_seconds": s.mqtt.ack_timeout_seconds,
        "acked_nothing_since": stalled_since,
    }


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _spool(s: Settings, r: Reading) -> dict[str, Any]:
    v = r.spool
    out: dict[str, Any] = {"path": s.spool_path, "exists": r.spool_exists, "error": r.spool_error}
    if v is None:
        return out
    oldest = None if v.oldest_ms is None else v.oldest_ms / 1000
    out.update(
        rows=v.rows,
        bytes=v.bytes,
        samples=v.samples,
        staged_rows=v.staged_rows,
        staged_bytes=v.staged_bytes,
        staged_samples=v.staged_samples,
        oldest_unsent_timestamp_seconds=oldest,
        oldest_unsent_age_seconds=None if oldest is None else _round(max(0.0, r.at - oldest), 1),
        quarantined_rows=v.quarantined_rows,
        last_seq=v.last_seq,
        recorder_bytes=v.recorder_bytes,
        recorder_oldest_timestamp_seconds=_seconds(v.recorder_oldest_ms),
        recorder_newest_timestamp_seconds=_seconds(v.recorder_newest_ms),
    )
    return out


def _budget(s: Settings, r: Reading) -> dict[str, Any] | None:
    if not s.budget_file:
        return None
    m = r.metrics
    states = _by_label(m, "edge_relay_budget_state", "state")
    levels = _by_label(m, "edge_relay_budget_degrade_level", "class")
    resolutions = _by_label(m, "edge_relay_budget_resolution_seconds", "class")
    return {
        "file": s.budget_file,
        "state": next((k for k, v in states.items() if v >= 1), None),
        "degrade_level": int(sum(levels.values())) if levels else None,
        "classes": {
            c: {"degrade_level": int(levels[c]), "resolution_seconds": resolutions.get(c)} for c in levels
        },
        "allowed_bytes_per_second": _value(m, "edge_relay_budget_bytes_per_second"),
        "quota_used_bytes": _value(m, "edge_relay_budget_quota_used_bytes")
        if m is not None
        else (r.spool.quota_used_bytes if r.spool is not None else None),
    }


def _losses(r: Reading) -> dict[str, Any]:
    if r.spool is not None:
        by_reason, source = dict(r.spool.losses), "spool"
    elif r.metrics is not None:
        by_reason = {
            k: int(v)
            for k, v in sorted(_by_label(r.metrics, "edge_relay_samples_dropped_total", "reason").items())
        }
        source = "metrics"
    else:
        return {"source": None, "total": None, "by_reason": {}}
    return {"source": source, "total": sum(by_reason.values()), "by_reason": by_reason}


def _targets(s: Settings, r: Reading) -> dict[str, Any]:
    m = r.metrics
    errors: dict[str, tuple[str, float]] = {}
    for lab, v in (m or {}).get("edge_relay_scrape_last_error_timestamp_seconds", []):
        errors[lab.get("target", "")] = (lab.get("error", ""), v)
    # A failure within two intervals (plus the scrape's own timeout) is the target's state now.
    recent = 2 * s.interval_seconds + s.timeout_seconds
    out: dict[str, Any] = {}
    for t in s.targets:
        ok = _value(m, "edge_relay_scrapes_total", target=t.name, result="ok")
        total = _value(m, "edge_relay_scrapes_total", target=t.name)
        scraped = _value(m, "edge_relay_samples_scraped_total", target=t.name)
        took = _value(m, "edge_relay_scrape_duration_seconds_sum", target=t.name)
        timed = _value(m, "edge_relay_scrape_duration_seconds_count", target=t.name)
        error, when = errors.get(t.name, (None, None))
        if m is None:
            health = "unknown"
        elif when is not None and r.at - when <= recent:
            health = "failing"
        else:
            health = "ok" if total else "not scraped yet"
        out[t.name] = {
            "health": health,
            "scrapes_ok": None if m is None else int(ok or 0),
            "scrapes_failed": None if m is None else int((total or 0) - (ok or 0)),
            "last_error": error,
            "last_error_timestamp_seconds": when,
            "samples_scraped": None if m is None else int(scraped or 0),
            "samples_per_scrape": _round(scraped / ok, 1) if scraped is not None and ok else None,
            "mean_scrape_seconds": _round(took / timed, 4) if took is not None and timed else None,
        }
    return out


def snapshot(s: Settings, readings: list[Reading]) -> dict[str, Any]:
    """The status as one JSON-able dict (stable keys, ``JSON_VERSION``), from readings oldest first."""
    last = readings[-1]
    return {
        "version": JSON_VERSION,
        "timestamp_seconds": round(last.at, 3),
        "config": s.source,
        "cluster": s.cluster,
        "node": s.node,
        "relay": _connection(s, last),
        "spool": _spool(s, last),
        "drain": _drain(readings),
        "budget": _budget(s, last),
        "losses": _losses(last),
        "targets": _targets(s, last),
    }


class History:
    """The readings rates are taken over: the last ``RATE_WINDOW_S`` seconds, since the link last went up
    or down (a rate across an outage's edge says nothing: the drain starts at the reconnection)."""

    def __init__(self) -> None:
        self._readings: deque[Reading] = deque()
        self._lock = threading.Lock()  # the page's requests come on several threads

    def snapshot(self, s: Settings, r: Reading) -> dict[str, Any]:
        """Add ``r`` and return the snapshot of the readings kept."""
        with self._lock:
            history = self._readings
            if history and _link_up(history[-1]) != _link_up(r):
                history.clear()
            history.append(r)
            while len(history) > 2 and r.at - history[1].at >= RATE_WINDOW_S:
                history.popleft()
            return snapshot(s, list(history))


class StatusPage:
    """The ``/status`` page of a running relay: its snapshot as HTML, read in its own process."""

    def __init__(self, s: Settings, registry: CollectorRegistry) -> None:
        self.settings = s
        self.registry = registry
        self.history = History()

    def __call__(self) -> bytes:
        own = self.registry

        def metrics() -> Samples:
            return parse_metrics(generate_latest(own).decode("utf-8", "replace"))

        snap = self.history.snapshot(self.settings, read(self.settings, metrics=metrics))
        return statusview.render_html(snap).encode("utf-8")


# --- the command ------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="edge relay config file (YAML)")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=2.0,
        default=None,
        metavar="SECONDS",
        help="redraw every SECONDS (default 2) until Ctrl-C, with a bar of the backlog draining",
    )
    parser.add_argument(
        "--json", action="store_true", help="print the status as JSON (one object per reading)"
    )
    parser.add_argument(
        "--rate-seconds",
        type=float,
        default=2.0,
        help="without --watch: read twice this far apart for the drain rate and ETA (0: read once)",
    )
    parser.add_argument("--plain", action="store_true", help="plain text even where rich is installed")


def run(args: argparse.Namespace) -> int:
    s = settings_mod.load(args.config)
    if args.watch is None:
        readings = [read(s)]
        if args.rate_seconds > 0:
            time.sleep(args.rate_seconds)
            readings.append(read(s))
        snap = snapshot(s, readings)
        if args.json:
            print(json.dumps(snap, sort_keys=True))
        else:
            print(statusview.render_plain(snap))
        return 0
    interval = max(0.2, args.watch)
    history = History()
    peak = statusview.Peak()

    def next_snapshot() -> dict[str, Any]:
        return history.snapshot(s, read(s))

    try:
        if args.json:
            while True:
                print(json.dumps(next_snapshot(), sort_keys=True), flush=True)
                time.sleep(interval)
        statusview.watch(next_snapshot, interval, peak, plain=args.plain or not sys.stdout.isatty())
    except KeyboardInterrupt:
        return 0
    return 0
