"""Building blocks of ``bench/outage_bench.py``: link faults, a counting remote-write tap, the two
reference agents as managed processes, /proc readings, and the per-sample oracle score.

Everything listens on 127.0.0.1 only.  The test harness (``tests/services.py``, ``tests/stack.py``) is
reused by putting ``tests/`` on ``sys.path``, as ``scripts/demo.py`` does.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import select
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import cramjam
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))

from services import LOOPBACK, ManagedProcess, RawSamples  # noqa: E402
from stack import Served  # noqa: E402

from schemas.remote_write_pb import WriteRequest  # noqa: E402

# Series every scraper adds per target and scrape (the union of ours, Prometheus' and vmagent's); they
# are left out of every count so that the three systems are compared on the exporters' samples only.
SYNTHETIC = frozenset(
    {
        "up",
        "scrape_duration_seconds",
        "scrape_samples_scraped",
        "scrape_samples_post_metric_relabeling",
        "scrape_series_added",
        "scrape_timeout_seconds",
    }
)

_SETPRIV = shutil.which("setpriv")


def die_with_parent(argv: list[str]) -> list[str]:
    """Prefix argv so the kernel SIGKILLs the child when this process dies (setpriv execs, same pid)."""
    if _SETPRIV is None or threading.current_thread() is not threading.main_thread():
        return argv
    return [_SETPRIV, "--pdeathsig", "KILL", "--", *argv]


def duration(seconds: float) -> str:
    """A Prometheus / vmagent duration string (whole milliseconds)."""
    return f"{round(seconds * 1000)}ms"


# ---------------------------------------------------------------------------------- the link: CutProxy

LinkMode = Literal["forward", "cut", "blackhole"]


class CutProxy:
    """TCP proxy on 127.0.0.1 in front of ``target_port`` whose link can fail in two ways.

    - ``cut()``: the listening socket is closed (new connections are refused: ECONNREFUSED) and every
      open connection is reset (RST) on both sides, as when the uplink interface goes away;
    - ``blackhole()``: nothing is closed and nothing more is forwarded or accepted; bytes wait in the
      kernel buffers (so the stream is intact if the link comes back before either side gives up), and
      only keepalives/timeouts can tell, as on a silent partition;
    - ``heal()``: back to forwarding (after a cut, on the same port).

    Counts bytes forwarded each way (``bytes_up``: client -> target).
    """

    def __init__(self, target_port: int, name: str = "proxy") -> None:
        self.target = (LOOPBACK, target_port)
        self.name = name
        self.bytes_up = 0
        self.bytes_down = 0
        self.connections = 0
        self._mode: LinkMode = "forward"
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._listener_closed = threading.Event()
        self._listening = threading.Event()
        self._listening.set()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._closing = False
        self._listener: socket.socket | None = socket.create_server((LOOPBACK, 0), backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name=f"{name}-accept", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> LinkMode:
        with self._lock:
            return self._mode

    @property
    def bytes_total(self) -> int:
        with self._lock:
            return self.bytes_up + self.bytes_down

    def cut(self) -> None:
        with self._lock:
            self._mode = "cut"
            self._listener_closed.clear()
            pairs, self._pairs = self._pairs, []
        self._flowing.set()  # paused pumps must wake up to see their sockets reset
        if not self._listener_closed.wait(5):
            raise RuntimeError(f"{self.name}: listener did not close")
        for pair in pairs:
            for s in pair:
                _reset(s)

    def blackhole(self) -> None:
        with self._lock:
            self._mode = "blackhole"
            self._flowing.clear()

    def heal(self) -> None:
        with self._lock:
            self._mode = "forward"
        self._flowing.set()
        if not self._listening.wait(35):
            raise RuntimeError(f"{self.name}: could not listen on port {self.port} again")

    def close(self) -> None:
        self._closing = True
        self._flowing.set()
        self._thread.join(5)
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for s in pair:
                _reset(s)

    # -- internals ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closing:
            mode = self.mode
            if mode == "cut":
                if self._listener is not None:
                    self._listening.clear()
                    self._listener.close()
                    self._listener = None
                self._listener_closed.set()
                time.sleep(0.05)
                continue
            if self._listener is None:
                self._listener = self._rebind()
                self._listening.set()
            if mode == "blackhole":  # connections wait in the backlog, as SYNs on a dead link would
                time.sleep(0.05)
                continue
            ready, _, _ = select.select([self._listener], [], [], 0.1)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            threading.Thread(
                target=self._connect, args=(client,), name=f"{self.name}-conn", daemon=True
            ).start()
        if self._listener is not None:
            self._listener.close()

    def _rebind(self) -> socket.socket:
        deadline = time.monotonic() + 30
        while True:
            try:
                return socket.create_server((LOOPBACK, self.port), backlog=128)  # SO_REUSEADDR is set
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        client.settimeout(None)
        with self._lock:
            if self._mode == "cut":
                _reset(client)
                _reset(upstream)
                return
            self.connections += 1
            self._pairs.append((client, upstream))
        for src, dst, up in ((client, upstream, True), (upstream, client, False)):
            threading.Thread(
                target=self._pump, args=(src, dst, up), name=f"{self.name}-pump", daemon=True
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while True:
                self._flowing.wait()
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()  # blackholed while we read: hold the bytes until healed
                if self.mode == "cut":
                    break
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
        except OSError:
            pass
        with self._lock, contextlib.suppress(ValueError):
            self._pairs.remove((src, dst) if up else (dst, src))
        cut = self.mode == "cut"
        for s in (src, dst):
            if not cut:  # a clean close; after a cut, close() alone sends the RST (SO_LINGER 0)
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            s.close()


def _reset(s: socket.socket) -> None:
    """Abort a TCP connection: RST to the peer, and wake up a thread blocked in recv() on it."""
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RD)  # sends nothing; recv() returns b"" in the pump, which closes (RST)


# ------------------------------------------------------------------------------ the remote-write tap


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # a client reset by the CutProxy mid-request is the point of the exercise


_FORWARDED = ("Content-Encoding", "Content-Type", "X-Prometheus-Remote-Write-Version", "User-Agent")


class RemoteWriteTap:
    """HTTP reverse proxy in front of a remote-write receiver that decodes what the receiver accepted.

    For every request the receiver answered 2xx it decodes the body (snappy + protobuf) and records,
    per series, the timestamps of its samples (synthetic series and NaNs -- stale markers -- left out):
    a timestamp seen again for the same series is a *duplicate*: a sample the receiver was given more
    than once (Prometheus keeps one copy, so the receiver itself cannot show them).  It also keeps,
    per (job, timestamp) -- one scrape of one target -- the number of distinct samples and the
    monotonic time the last new one arrived, which is how drain times are measured without querying
    the receiver, and the scrapes the scraper reported as failed (``up`` 0: nothing to deliver).
    """

    def __init__(self, upstream_url: str, name: str = "tap") -> None:
        self.upstream_url = upstream_url
        self.name = name
        self.requests_ok = 0
        self.requests_failed = 0
        self.duplicates = 0
        self.decode_errors = 0
        self._seen: dict[tuple[tuple[str, str], ...], set[int]] = {}
        self._scrapes: dict[tuple[str, int], int] = defaultdict(int)
        self._last_new: dict[tuple[str, int], float] = {}
        self._failed: set[tuple[str, int]] = set()
        self._lock = threading.Lock()
        self._local = threading.local()
        self._server = _QuietServer((LOOPBACK, 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"{name}-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self._server.server_address[1]}/api/v1/write"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def scrapes(
        self,
    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], float], set[tuple[str, int]]]:
        """Snapshot: (job, timestamp) -> distinct samples accepted, -> when the last new one came, and
        the (job, timestamp) of failed scrapes."""
        with self._lock:
            return dict(self._scrapes), dict(self._last_new), set(self._failed)

    def distinct_samples(self) -> int:
        with self._lock:
            return sum(self._scrapes.values())

    # -- internals ------------------------------------------------------------------------------------

    def _session(self) -> requests.Session:
        session: requests.Session | None = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            self._local.session = session
        return session

    def _account(self, body: bytes, now: float) -> None:
        try:
            request = WriteRequest.FromString(bytes(cramjam.snappy.decompress_raw(body)))
        except Exception:
            with self._lock:
                self.decode_errors += 1
            return
        batch: list[tuple[tuple[tuple[str, str], ...], str, list[int]]] = []
        failed: list[tuple[str, int]] = []
        for series in request.timeseries:
            labels = tuple(sorted((lab.name, lab.value) for lab in series.labels))
            names = dict(labels)
            name = names.get("__name__", "")
            if name == "up":
                failed += [(names.get("job", ""), s.timestamp) for s in series.samples if s.value == 0]
            if name in SYNTHETIC:
                continue
            stamps = [s.timestamp for s in series.samples if not math.isnan(s.value)]
            if stamps:
                batch.append((labels, names.get("job", ""), stamps))
        with self._lock:
            self._failed.update(failed)
            for key in failed:
                self._last_new.setdefault(key, now)
            for labels, job, stamps in batch:
                seen = self._seen.get(labels)
                if seen is None:
                    seen = self._seen[labels] = set()
                for t in stamps:
                    if t in seen:
                        self.duplicates += 1
                    else:
                        seen.add(t)
                        key = (job, t)
                        self._scrapes[key] += 1
                        self._last_new[key] = now

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        tap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length > 0 else b""
                headers = {k: v for k in _FORWARDED if (v := self.headers.get(k)) is not None}
                try:
                    resp = tap._session().post(tap.upstream_url, data=body, headers=headers, timeout=60)
                    status, reply = resp.status_code, resp.content
                except requests.RequestException as exc:
                    status, reply = 502, f"tap: upstream unreachable: {type(exc).__name__}\n".encode()
                if 200 <= status < 300:
                    tap._account(body, time.monotonic())
                    with tap._lock:
                        tap.requests_ok += 1
                else:
                    with tap._lock:
                        tap.requests_failed += 1
                with contextlib.suppress(OSError):
                    self.send_response(status)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


# ---------------------------------------------------------------------------- the reference agents


def scrape_configs(urls: Mapping[str, str], node: str) -> list[dict[str, Any]]:
    """One job per exporter, named like the exporter, ``instance`` = ``<node>:<port>`` as the relay does."""
    out = []
    for job, url in urls.items():
        hostport = url.split("/")[2]
        port = hostport.rsplit(":", 1)[1]
        out.append(
            {
                "job_name": job,
                "metrics_path": "/" + url.split("/", 3)[3],
                "static_configs": [{"targets": [hostport], "labels": {"instance": f"{node}:{port}"}}],
            }
        )
    return out


class PrometheusAgent(ManagedProcess):
    """``prometheus --enable-feature=agent`` scraping ``urls`` and remote-writing to ``remote_write_url``."""

    name = "prometheus-agent"
    default_binary = "/usr/bin/prometheus"
    package = "prometheus"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        urls: Mapping[str, str],
        interval: float,
        remote_write_url: str,
        external_labels: Mapping[str, str],
        node: str,
        max_backoff: float,
    ) -> None:
        super().__init__(tmpdir)
        self.config_path = self.dir / "agent.yml"
        self.wal_dir = self.dir / "wal"
        self.config: dict[str, Any] = {
            "global": {
                "scrape_interval": duration(interval),
                "scrape_timeout": duration(interval * 0.8),
                "external_labels": dict(external_labels),
            },
            "scrape_configs": scrape_configs(urls, node),
            "remote_write": [
                {"url": remote_write_url, "queue_config": {"max_backoff": duration(max_backoff)}},
            ],
        }

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def command(self) -> list[str]:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return [
            self.binary,
            "--enable-feature=agent",
            f"--config.file={self.config_path}",
            f"--storage.agent.path={self.wal_dir}",
            f"--web.listen-address={self.host}:{self.port}",
        ]

    def probe(self) -> bool:
        return self._http_ok("/-/ready")


class VmAgent(ManagedProcess):
    """``vmagent`` scraping ``urls`` and remote-writing to ``remote_write_url`` (on-disk queue in tmp)."""

    name = "vmagent"
    default_binary = "/usr/bin/vmagent"
    package = "victoria-metrics"

    def __init__(
        self,
        tmpdir: str | os.PathLike[str],
        *,
        urls: Mapping[str, str],
        interval: float,
        remote_write_url: str,
        external_labels: Mapping[str, str],
        node: str,
    ) -> None:
        super().__init__(tmpdir)
        self.config_path = self.dir / "scrape.yml"
        self.queue_dir = self.dir / "remotewrite-data"
        self.remote_write_url = remote_write_url
        self.external_labels = dict(external_labels)
        self.config: dict[str, Any] = {
            "global": {"scrape_interval": duration(interval), "scrape_timeout": duration(interval * 0.8)},
            "scrape_configs": scrape_configs(urls, node),
        }

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def command(self) -> list[str]:
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        return [
            self.binary,
            f"-promscrape.config={self.config_path}",
            f"-remoteWrite.url={self.remote_write_url}",
            f"-remoteWrite.tmpDataPath={self.queue_dir}",
            f"-httpListenAddr={self.host}:{self.port}",
            *(f"-remoteWrite.label={k}={v}" for k, v in self.external_labels.items()),
        ]

    def probe(self) -> bool:
        return self._http_ok("/health")


# ------------------------------------------------------------------------------------------ readings


@dataclass(frozen=True)
class ProcStats:
    peak_rss_bytes: int  # VmHWM
    rss_bytes: int  # VmRSS
    cpu_seconds: float  # utime + stime


def proc_stats(pid: int) -> ProcStats:
    """VmHWM / VmRSS from /proc/<pid>/status, utime + stime from /proc/<pid>/stat."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                fields[key] = int(rest.split()[0]) * 1024  # reported in kB
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    after = stat[stat.rindex(")") + 2 :].split()  # fields from 3 (state) on; comm may contain spaces
    ticks = int(after[11]) + int(after[12])  # fields 14 and 15: utime, stime
    return ProcStats(fields.get("VmHWM", 0), fields.get("VmRSS", 0), ticks / os.sysconf("SC_CLK_TCK"))


def path_bytes(*paths: Path) -> int:
    """Apparent size of files and directory trees (missing ones count 0)."""
    total = 0
    for p in paths:
        if p.is_file():
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        elif p.is_dir():
            for root, _, files in os.walk(p):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += (Path(root) / name).stat().st_size
    return total


def read_metrics(url: str, timeout: float = 5) -> list[tuple[str, dict[str, str], float]]:
    resp = requests.get(url, timeout=timeout)
    resp.raise_for_status()
    return [
        (s.name, dict(s.labels), float(s.value))
        for fam in text_string_to_metric_families(resp.text)
        for s in fam.samples
    ]


def metric_sum(samples: Iterable[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items()))


# ------------------------------------------------------------------------------------------ the oracle


class SampleCounts:
    """Samples in what the simulator served at (exporter, tick, format): every non-comment line."""

    def __init__(self, simulator: Any) -> None:
        self.simulator = simulator
        self._cache: dict[tuple[str, int, bool], int] = {}

    def __call__(self, rec: Served) -> int:
        key = (rec.exporter, rec.tick, rec.openmetrics)
        n = self._cache.get(key)
        if n is None:
            body = self.simulator.render(rec.exporter, rec.tick, openmetrics=rec.openmetrics).decode()
            n = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
            self._cache[key] = n
        return n


@dataclass
class DrainWatch:
    """Which served scrapes of a window the receiver has accepted whole, according to a tap."""

    tap: RemoteWriteTap
    wanted: list[tuple[str, int, int]]  # (job, served t_ms, samples)
    skew_before_ms: int
    skew_after_ms: int
    since: float  # monotonic time of the heal
    done_at: float | None = None  # monotonic time the last wanted sample arrived, once all are there
    last_progress: float | None = None  # monotonic time of the newest arrival of a window sample
    missing: int = 0  # wanted scrapes not yet complete

    def poll(self) -> bool:
        """Update; True once every wanted scrape is complete."""
        scrapes, last_new, failed = self.tap.scrapes()
        by_job: dict[str, list[int]] = defaultdict(list)
        for job, t in scrapes.keys() | failed:
            by_job[job].append(t)
        for stamps in by_job.values():
            stamps.sort()
        missing = 0
        newest: float | None = None
        for job, t_served, n in self.wanted:
            stamps = by_job.get(job, [])
            # The scrape a served request belongs to is the latest one stamped before it was served
            # (a relay restarted between grid points may scrape twice within one interval).
            i = bisect.bisect_right(stamps, t_served + self.skew_after_ms) - 1
            if i >= 0 and stamps[i] >= t_served - self.skew_before_ms:
                key = (job, stamps[i])
                at = last_new[key]
                newest = at if newest is None else max(newest, at)
                if key in failed or scrapes.get(key, 0) >= n:
                    continue
            missing += 1
        self.missing = missing
        self.last_progress = newest
        if missing == 0 and self.done_at is None:
            self.done_at = newest if newest is not None else self.since
        return missing == 0

    def drain_seconds(self) -> float | None:
        """Heal -> last window sample accepted (0 if none was outstanding at the heal)."""
        end = self.done_at if self.done_at is not None else self.last_progress
        return None if end is None else max(0.0, end - self.since)


@dataclass
class Score:
    """Expected samples matched against what the receiver holds."""

    expected: int = 0
    delivered: int = 0
    value_mismatches: int = 0
    max_rel_error: float = 0.0  # of the mismatched values
    extra: int = 0
    missing_by_scrape: Counter[tuple[str, int]] = field(default_factory=Counter)  # (job, served t_ms)

    @property
    def missing(self) -> int:
        return self.expected - self.delivered


def score(
    expected: Mapping[frozenset[tuple[str, str]], list[tuple[int, float]]],
    actual: RawSamples,
    *,
    skew_before_ms: int,
    skew_after_ms: int,
    until_ms: int,
    same_value: Callable[[float, float], bool],
) -> Score:
    """Match every expected (served time, value) to the latest receiver sample of the same series
    stamped in ``[served - skew_before, served + skew_after]`` and not matched yet.

    Unmatched receiver samples up to ``until_ms - skew_before`` count as extra (later ones may belong
    to scrapes served after ``until_ms``).
    """
    out = Score()
    limit = until_ms - skew_before_ms
    for key, want in expected.items():
        got = actual.get(key, [])
        stamps = [t for t, _ in got]
        used: set[int] = set()
        job = dict(key).get("job", "")
        for t_served, value in want:
            out.expected += 1
            # The latest sample not yet taken that was stamped before the request was served.
            i = bisect.bisect_right(stamps, t_served + skew_after_ms) - 1
            while i >= 0 and i in used:
                i -= 1
            if i >= 0 and stamps[i] >= t_served - skew_before_ms:
                used.add(i)
                out.delivered += 1
                if not same_value(value, got[i][1]):
                    out.value_mismatches += 1
                    with contextlib.suppress(ArithmeticError):
                        rel = abs(got[i][1] - value) / max(abs(value), abs(got[i][1]))
                        out.max_rel_error = max(out.max_rel_error, rel)
            else:
                out.missing_by_scrape[(job, t_served)] += 1
        out.extra += sum(1 for i, t in enumerate(stamps) if i not in used and t <= limit)
    for key, got in actual.items():
        if key not in expected:
            out.extra += sum(1 for t, _ in got if t <= limit)
    return out


# ------------------------------------------------------------------- additions for bandwidth_bench.py

# Response headers the ReplayTap does not copy: hop-by-hop ones (RFC 9110, 7.6.1), and the length,
# which it writes itself (the body it has is de-chunked).
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)


class ReplayTap(RemoteWriteTap):
    """A ``RemoteWriteTap`` that a client cannot tell from the receiver by the bytes it gets back.

    The plain tap answers with Python's own status line and headers (``Server``, ``Content-Type``,
    ...), which a byte-counting proxy in front of it would count as the receiver's.  This one passes
    the client's request headers on (``Accept-Encoding`` too), returns the receiver's status line,
    headers and raw body (only re-framed with ``Content-Length`` if it came chunked), and forwards
    GETs as well (protocol probes, e.g. newer vmagents asking for the VictoriaMetrics protocol).

    It also decodes zstd bodies (the VictoriaMetrics remote-write protocol: the same protobuf,
    zstd instead of snappy) and counts the requests by ``Content-Encoding`` and
    ``X-Prometheus-Remote-Write-Version`` (``encodings``), i.e. which protocol the client spoke.
    """

    def __init__(self, upstream_url: str, name: str = "tap") -> None:
        parts = urlsplit(upstream_url)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.encodings: Counter[str] = Counter()
        super().__init__(upstream_url, name)

    def _account(self, body: bytes, now: float) -> None:
        if getattr(self._local, "encoding", "") == "zstd":
            try:  # the parent decodes snappy only: hand it the same protobuf that way
                body = bytes(cramjam.snappy.compress_raw(cramjam.zstd.decompress(body)))
            except Exception:
                with self._lock:
                    self.decode_errors += 1
                return
        super()._account(body, now)

    def _relay(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        headers = {k: v for k, v in handler.headers.items() if k.lower() not in _HOP_BY_HOP | {"host"}}
        headers.pop("Content-Length", None)
        headers.setdefault("Accept-Encoding", "identity")  # not requests' default: answer as to the client
        encoding = handler.headers.get("Content-Encoding", "identity").lower()
        if handler.command == "POST":
            version = handler.headers.get("X-Prometheus-Remote-Write-Version")
            with self._lock:
                self.encodings[encoding + (f", remote-write {version}" if version else "")] += 1
        try:
            resp = self._session().request(
                handler.command,
                self.origin + handler.path,
                data=body or None,
                headers=headers,
                timeout=60,
                stream=True,
            )
            raw = resp.raw.read(decode_content=False)
            resp.raw.release_conn()  # back to the pool (Response.close() would close the connection)
            status, reason = resp.status_code, resp.reason or ""
            reply = [(k, v) for k, v in resp.raw.headers.items() if k.lower() not in _HOP_BY_HOP]
        except requests.RequestException as exc:
            status, reason = 502, "Bad Gateway"
            raw = f"tap: upstream unreachable: {type(exc).__name__}\n".encode()
            reply = [("Content-Type", "text/plain")]
        if handler.command == "POST":
            if 200 <= status < 300:
                self._local.encoding = encoding
                self._account(body, time.monotonic())
                with self._lock:
                    self.requests_ok += 1
            else:
                with self._lock:
                    self.requests_failed += 1
        reply = [(k, v) for k, v in reply if k.lower() != "content-length"]
        if status >= 200 and status not in (204, 304):
            reply.append(("Content-Length", str(len(raw))))
        head = "".join(f"{k}: {v}\r\n" for k, v in reply)
        with contextlib.suppress(OSError):
            handler.wfile.write(f"HTTP/1.1 {status} {reason}\r\n{head}\r\n".encode("latin-1") + raw)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        tap = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                tap._relay(self, b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                tap._relay(self, self.rfile.read(length) if length > 0 else b"")

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler


def samples_stamped(tap: RemoteWriteTap, start_ms: int, end_ms: int | None = None) -> int:
    """Distinct exporter samples the tap saw accepted whose timestamp is in ``[start_ms, end_ms)``."""
    scrapes, _, _ = tap.scrapes()
    return sum(n for (_, t), n in scrapes.items() if t >= start_ms and (end_ms is None or t < end_ms))


def relay_schema_defaults(section: str) -> dict[str, Any]:
    """The product defaults of one section of the relay's config (``schemas/edge-relay-config``)."""
    from relay_common.config import load_schema

    props = load_schema("edge-relay-config.schema.json")["properties"][section]["properties"]
    return {key: prop["default"] for key, prop in props.items() if "default" in prop}


def check_relay_config(path: Path) -> str | None:
    """``edge-relay check-config``: None if the relay accepts the file, else its error message (one
    problem a line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "edge_relay.cli", "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode == 0:
        return None
    lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return "\n".join(lines) or f"exit status {proc.returncode}"


def write_budget(
    path: Path,
    *,
    bytes_per_second: int,
    burst_bytes: int | None,
    batch_window_seconds: float,
    classes: list[dict[str, Any]],
) -> Path:
    """A relay bandwidth-budget file (``budget_file``, ``schemas/bandwidth-budget.schema.json``
    version 1): the uplink's figures (``burst_bytes`` None: the file's default) and the classes."""
    uplink: dict[str, Any] = {"sustained_bytes_per_second": bytes_per_second}
    if burst_bytes is not None:
        uplink["burst_bytes"] = burst_bytes
    uplink["batch_window_seconds"] = batch_window_seconds
    budget = {"version": 1, "uplink": uplink, "classes": classes}
    path.write_text(yaml.safe_dump(budget, sort_keys=False))
    return path


def tool_version(argv: list[str], package: str | None = None) -> str:
    """First line a binary prints for its version flag, or its Debian package's version if it prints
    nothing (Debian's vmagent 1.79 prints an empty ``-version``)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        lines = [line.strip() for line in (out.stdout + out.stderr).splitlines() if line.strip()]
        if lines:
            return lines[0]
    if package is not None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["dpkg-query", "-W", "-f", "${Version}", package], capture_output=True, text=True, timeout=30
            )
            if out.returncode == 0 and out.stdout.strip():
                return f"(`{' '.join(argv)}` prints nothing; Debian package {package} {out.stdout.strip()})"
    return f"(`{' '.join(argv)}` prints nothing)"
